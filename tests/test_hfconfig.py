"""HF config.json import: every supported family maps to the right ModelConfig fields; bad files exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from sim.api import load_scenario
from sim.errors import InputError
from sim.inputs.hfconfig import SUPPORTED_MODEL_TYPES, model_fields_from_hf
from sim.inputs.scenario import ModelConfig

HF = ROOT / "tests" / "data" / "hf"


def model(name: str) -> ModelConfig:
    return ModelConfig(**model_fields_from_hf(HF / name / "config.json"))


def write_config(tmp_path: Path, data: dict | str, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_every_shipped_config_has_its_source_noted():
    folders = sorted(p for p in HF.iterdir() if p.is_dir())
    assert len(folders) >= 8
    for folder in folders:
        assert (folder / "config.json").is_file(), folder
        assert len((folder / "SOURCE.txt").read_text().strip()) > 80, folder


def test_mixtral():
    m = model("Mixtral-8x7B-v0.1")
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_heads) == (32, 4096, 32, 8)
    assert (m.num_experts, m.top_k, m.moe_ffn_hidden_size) == (8, 2, 14336)
    assert m.ffn_type == "gated" and m.num_shared_experts == 0 and m.num_moe_layers == 32
    assert (m.score_function, m.norm_topk_prob, m.tie_word_embeddings) == ("softmax", True, False)


def test_qwen2_moe_shared_expert_with_gate_and_qkv_bias():
    m = model("Qwen1.5-MoE-A2.7B")
    assert (m.num_experts, m.top_k, m.moe_ffn_hidden_size) == (60, 4, 1408)
    assert (m.num_shared_experts, m.shared_expert_ffn_hidden_size, m.shared_expert_gate) == (1, 5632, True)
    assert m.attention_bias and not m.norm_topk_prob and m.num_moe_layers == 24


def test_qwen3_moe_head_dim_and_gqa():
    m = model("Qwen3-30B-A3B")
    assert (m.num_layers, m.hidden_size, m.head_size, m.kv_heads) == (48, 2048, 128, 4)
    assert (m.num_experts, m.top_k, m.moe_ffn_hidden_size, m.norm_topk_prob) == (128, 8, 768, True)
    assert not m.attention_bias and m.num_moe_layers == 48
    assert m.qk_norm == "head"  # Qwen3MoeAttention.q_norm/k_norm: RMSNorm(head_dim)


def test_deepseek_v3_mla_shared_dense_mtp_sigmoid():
    m = model("DeepSeek-V3")
    assert m.attention == "mla"
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (
        1536,
        512,
        128,
        64,
        128,
    )
    assert (m.num_experts, m.top_k, m.num_shared_experts, m.shared_expert_ffn_hidden_size) == (
        256,
        8,
        1,
        2048,
    )
    assert (m.first_dense_layers, m.ffn_hidden_size, m.num_moe_layers) == (3, 18432, 58)
    assert (m.mtp_layers, m.score_function, m.router_bias, m.norm_topk_prob) == (1, "sigmoid", True, True)


def test_deepseek_v2_lite_full_rank_q_and_no_mtp():
    m = model("DeepSeek-V2-Lite")
    assert m.attention == "mla" and m.q_lora_rank is None and m.kv_lora_rank == 512
    assert (m.num_experts, m.top_k, m.num_shared_experts, m.first_dense_layers) == (64, 6, 2, 1)
    assert (m.mtp_layers, m.score_function, m.router_bias) == (0, "softmax", False)


def test_olmoe_and_granitemoe():
    olmoe = model("OLMoE-1B-7B-0924")
    assert (olmoe.num_experts, olmoe.top_k, olmoe.moe_ffn_hidden_size, olmoe.norm_topk_prob) == (
        64,
        8,
        1024,
        False,
    )
    assert olmoe.qk_norm == "full"  # OlmoeAttention.q_norm: RMSNorm(heads x head_dim)
    granite = model("granite-3.0-1b-a400m-base")
    assert (granite.num_experts, granite.top_k, granite.moe_ffn_hidden_size) == (32, 8, 512)
    assert granite.tie_word_embeddings and granite.kv_heads == 8
    assert granite.qk_norm == "none"


def test_dense_llama_is_one_expert():
    m = model("Llama-3.1-8B")
    assert (m.num_experts, m.top_k, m.ffn_hidden_size, m.num_moe_layers, m.is_moe) == (1, 1, 14336, 0, False)
    assert m.kv_heads == 8 and m.vocab_size == 128256


def test_null_optional_keys_take_the_transformers_default(tmp_path):
    data = json.loads((HF / "Llama-3.1-8B" / "config.json").read_text())
    data.update(num_key_value_heads=None, tie_word_embeddings=None, _name_or_path="meta-llama/x")
    m = ModelConfig(**model_fields_from_hf(write_config(tmp_path, data)))
    assert (m.kv_heads, m.tie_word_embeddings, m.name) == (32, False, "meta-llama/x")


def test_name_comes_from_the_folder_without_name_or_path():
    assert model("Qwen3-30B-A3B").name == "Qwen3-30B-A3B"


def test_qwen_sparse_step_places_moe_layers_where_hf_does(tmp_path):
    data = json.loads((HF / "Qwen1.5-MoE-A2.7B" / "config.json").read_text())
    data["decoder_sparse_step"] = 3
    m = ModelConfig(**model_fields_from_hf(write_config(tmp_path, data)))
    hf_rule = [(i + 1) % 3 == 0 for i in range(data["num_hidden_layers"])]  # Qwen2MoeDecoderLayer
    assert [m.is_moe_layer(i) for i in range(m.num_layers)] == hf_rule


def test_qwen_leading_mlp_only_layers_become_dense(tmp_path):
    data = json.loads((HF / "Qwen3-30B-A3B" / "config.json").read_text())
    data["mlp_only_layers"] = [0, 1]
    m = ModelConfig(**model_fields_from_hf(write_config(tmp_path, data)))
    assert m.first_dense_layers == 2 and m.num_moe_layers == 46 and m.ffn_hidden_size == 6144


def test_scenario_with_hf_config_and_inline_override(tmp_path):
    scenario = yaml.safe_load((ROOT / "scenarios" / "128gpu.yaml").read_text())
    scenario["model"] = {"hf_config": str(HF / "Qwen3-30B-A3B" / "config.json"), "num_layers": 24}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(scenario))
    s = load_scenario(path)
    assert (s.model.num_layers, s.model.num_experts, s.model.moe_ffn_hidden_size) == (24, 128, 768)


@pytest.mark.parametrize(
    ("content", "field", "words"),
    [
        (
            {"model_type": "gpt2", "n_layer": 2},
            "model_type",
            ["unsupported", "'gpt2'", "mixtral", "deepseek_v3"],
        ),
        ({"hidden_size": 8}, "model_type", ["missing", "qwen3_moe"]),
        (
            {"model_type": "mixtral", "hidden_size": 8, "num_attention_heads": 2},
            "num_hidden_layers",
            ["missing"],
        ),
        (
            {"model_type": "llama", "num_hidden_layers": "two", "num_attention_heads": 2},
            "num_hidden_layers",
            ["integer", "'two'"],
        ),
        (
            {"model_type": "llama", "num_hidden_layers": 0, "num_attention_heads": 2},
            "num_hidden_layers",
            [">= 1"],
        ),
        (
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": 8,
                "num_attention_heads": 2,
                "vocab_size": 9,
                "intermediate_size": 4,
                "tie_word_embeddings": "yes",
            },
            "tie_word_embeddings",
            ["true or false"],
        ),
    ],
)
def test_bad_keys_name_file_and_key(tmp_path, content, field, words):
    path = write_config(tmp_path, content)
    with pytest.raises(InputError) as err:
        model_fields_from_hf(path)
    assert err.value.file == str(path) and err.value.field == field
    for word in words:
        assert word in str(err.value)


def test_unsupported_message_lists_all_supported(tmp_path):
    with pytest.raises(InputError) as err:
        model_fields_from_hf(write_config(tmp_path, {"model_type": "bert"}))
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in str(err.value)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("", ["empty"]),
        ("   \n", ["empty"]),
        ('{"model_type": "mixtral",', ["not valid JSON", "line 1"]),
        ("[1, 2]", ["JSON object", "list"]),
        (b"\x00\x01binary", ["binary"]),
    ],
)
def test_bad_files(tmp_path, content, words):
    path = tmp_path / "config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(InputError) as err:
        model_fields_from_hf(path)
    assert err.value.file == str(path)
    for word in words:
        assert word in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(InputError, match="not found"):
        model_fields_from_hf(tmp_path / "nope.json")


def test_unrepresentable_layer_placement_is_refused(tmp_path):
    data = json.loads((HF / "DeepSeek-V2-Lite" / "config.json").read_text())
    data["moe_layer_freq"] = 2  # first_k_dense_replace = 1: HF puts MoE at even i >= 1
    with pytest.raises(InputError) as err:
        model_fields_from_hf(write_config(tmp_path, data))
    assert err.value.field == "moe_layer_freq"
    data = json.loads((HF / "Qwen3-30B-A3B" / "config.json").read_text())
    data["mlp_only_layers"] = [3, 7]
    with pytest.raises(InputError) as err:
        model_fields_from_hf(write_config(tmp_path, data))
    assert err.value.field == "mlp_only_layers"


def test_unknown_scoring_func_is_refused(tmp_path):
    data = json.loads((HF / "DeepSeek-V3" / "config.json").read_text())
    data["scoring_func"] = "sinkhorn"
    with pytest.raises(InputError) as err:
        model_fields_from_hf(write_config(tmp_path, data))
    assert err.value.field == "scoring_func" and "softmax, sigmoid" in str(err.value)


PUBLISHED = ROOT / "validation" / "published" / "models"


def published(name: str) -> ModelConfig:
    return ModelConfig(**model_fields_from_hf(PUBLISHED / name / "config.json"))


_GPT_OSS = dict(
    hidden_size=2880,
    num_attention_heads=64,
    kv_heads=8,
    head_size=64,
    vocab_size=201088,
    top_k=4,
    moe_ffn_hidden_size=2880,
    tie_word_embeddings=False,
    attention="mha",
    attention_bias=True,  # GptOssAttention: q/k/v/o all Linear(bias=config.attention_bias)
    attention_out_bias=True,
    attention_sinks=True,  # GptOssAttention.sinks: one logit per head
    sliding_window=128,
    sliding_window_pattern=2,  # layer_types: sliding, full, sliding, full, ...
    linear_bias=True,  # GptOssExperts.gate_up_proj_bias / down_proj_bias
    router_logit_bias=True,  # GptOssTopKRouter.bias
    router_bias=False,
    swiglu_limit=7.0,
    score_function="softmax",
    norm_topk_prob=True,  # softmax over the k selected logits
    qk_norm="none",
    num_shared_experts=0,
    first_dense_layers=0,
    mtp_layers=0,
)
_QWEN3 = dict(
    attention="mha",
    attention_bias=False,
    attention_out_bias=False,
    attention_sinks=False,
    sliding_window=None,  # use_sliding_window: false
    qk_norm="head",
    score_function="softmax",
    norm_topk_prob=True,
    tie_word_embeddings=False,
    swiglu_limit=None,
    router_logit_bias=False,
    linear_bias=False,
)
#: Every config.json under validation/published/models/ -> the ModelConfig fields it must give.
_LLAMA3 = dict(num_kv_heads=8, head_size=128, vocab_size=128256, num_experts=1, num_moe_layers=0,
               tie_word_embeddings=False)
_DSV3 = dict(
    attention="mla",
    num_layers=61,
    hidden_size=7168,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    num_experts=256,
    top_k=8,
    moe_ffn_hidden_size=2048,
    num_shared_experts=1,
    first_dense_layers=3,
    num_moe_layers=58,
    mtp_layers=1,
    score_function="sigmoid",
    router_bias=True,
    router_logit_bias=False,
    attention_sinks=False,
    sliding_window=None,
    swiglu_limit=None,
    vocab_size=129280,
)
_NANO = dict(  # model_type nemotron_h: 23 Mamba-2, 6 attention, 23 MoE blocks
    num_layers=52, hidden_size=2688, num_attention_heads=32, kv_heads=2, head_size=128, vocab_size=131072,
    num_experts=128, top_k=6, moe_ffn_hidden_size=1856, num_moe_layers=23, num_shared_experts=1,
    shared_expert_ffn_hidden_size=3712, ffn_type="plain", score_function="sigmoid", router_bias=True,
    mamba_num_heads=64, mamba_head_dim=64, mamba_state_dim=128, mamba_groups=8, mamba_d_inner=4096,
    mamba_in_proj_width=2 * 4096 + 2 * 8 * 128 + 64, hybrid_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
)
PUBLISHED_FIELDS = {
    "Llama-3-8B": {**_LLAMA3, "num_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "ffn_hidden_size": 14336},
    "Llama-3-70B": {**_LLAMA3, "num_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
                    "ffn_hidden_size": 28672},
    "Llama-3.1-405B": {**_LLAMA3, "num_layers": 126, "hidden_size": 16384, "num_attention_heads": 128,
                       "ffn_hidden_size": 53248},
    "GPT-OSS-120B": {**_GPT_OSS, "num_layers": 36, "num_experts": 128, "num_moe_layers": 36},
    "GPT-OSS-20B": {**_GPT_OSS, "num_layers": 24, "num_experts": 32, "num_moe_layers": 24},
    "Qwen3-235B-A22B": {
        **_QWEN3,
        **dict(num_layers=94, hidden_size=4096, num_attention_heads=64, kv_heads=4, head_size=128),
        **dict(vocab_size=151936, num_experts=128, top_k=8, moe_ffn_hidden_size=1536, num_moe_layers=94),
    },
    "Qwen3-30B-A3B": {
        **_QWEN3,
        **dict(num_layers=48, hidden_size=2048, num_attention_heads=32, kv_heads=4, head_size=128),
        **dict(vocab_size=151936, num_experts=128, top_k=8, moe_ffn_hidden_size=768, num_moe_layers=48),
    },
    "DeepSeek-V3": _DSV3,
    "Kimi-K2": {**_DSV3, **dict(num_attention_heads=64, num_experts=384, first_dense_layers=1, num_moe_layers=60,
                                mtp_layers=0, vocab_size=163840)},  # model_type kimi_k2: DeepSeek-V3's architecture
    "Nemotron-3-Nano-30B-A3B": _NANO,
    "Nemotron-3.5-Lightning-30B-A3B": {**_NANO, "mtp_layers": 1},  # layers_block_type: Nano's pattern, + *E MTP
    "Nemotron-3-Super-120B-A12B": dict(  # 40 Mamba-2, 8 attention, 40 MoE blocks; LatentMoE at 1024; *E MTP
        num_layers=88, hidden_size=4096, num_attention_heads=32, kv_heads=2, head_size=128, vocab_size=131072,
        num_experts=512, top_k=22, moe_ffn_hidden_size=2688, moe_latent_size=1024, moe_token_width=1024,
        num_moe_layers=40, num_shared_experts=1, shared_expert_ffn_hidden_size=5376, mtp_layers=1,
        mamba_num_heads=128, mamba_head_dim=64, mamba_groups=8, ffn_type="plain", router_bias=True,
    ),
    "Mixtral-8x7B-v0.1": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        kv_heads=8,
        num_experts=8,
        top_k=2,
        moe_ffn_hidden_size=14336,
        vocab_size=32000,
        sliding_window=None,  # "sliding_window": null
        attention_sinks=False,
        attention_out_bias=False,
        swiglu_limit=None,
    ),
}


def test_every_published_model_config_is_checked():
    assert {p.name for p in PUBLISHED.iterdir() if p.is_dir()} == set(PUBLISHED_FIELDS)


@pytest.mark.parametrize("name", sorted(PUBLISHED_FIELDS))
def test_published_model_configs_import_as_expected(name):
    m = published(name)
    expected = PUBLISHED_FIELDS[name]
    assert {key: getattr(m, key) for key in expected} == expected


@pytest.mark.parametrize("name", ["GPT-OSS-120B", "GPT-OSS-20B"])
def test_gpt_oss_windows_follow_layer_types(name):
    data = json.loads((PUBLISHED / name / "config.json").read_text())
    m = published(name)
    windows = [m.attention_window(i) for i in range(m.num_layers)]
    assert windows == [128 if t == "sliding_attention" else None for t in data["layer_types"]]
    assert windows[:4] == [128, None, 128, None]


def gpt_oss_variant(tmp_path: Path, **changes) -> ModelConfig:
    data = json.loads((PUBLISHED / "GPT-OSS-20B" / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key)
        else:
            data[key] = value
    return ModelConfig(**model_fields_from_hf(write_config(tmp_path, data)))


def test_gpt_oss_defaults_when_keys_are_absent(tmp_path):
    # GptOssConfig defaults: layer_types sliding where (i + 1) % 2, sliding_window 128, attention_bias
    # true, swiglu_limit 7.0.
    m = gpt_oss_variant(tmp_path, layer_types=..., sliding_window=..., attention_bias=..., swiglu_limit=...)
    assert (m.sliding_window, m.sliding_window_pattern, m.swiglu_limit) == (128, 2, 7.0)
    assert m.attention_bias and m.attention_out_bias


def test_gpt_oss_layer_types_variants(tmp_path):
    full = gpt_oss_variant(tmp_path, layer_types=["full_attention"] * 24)
    assert (full.sliding_window, full.sliding_window_pattern) == (None, None)
    windowed = gpt_oss_variant(tmp_path, layer_types=["sliding_attention"] * 24)
    assert (windowed.sliding_window, windowed.sliding_window_pattern) == (128, None)
    assert {windowed.attention_window(i) for i in range(24)} == {128}
    gemma_like = ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(24)]
    m = gpt_oss_variant(tmp_path, layer_types=gemma_like, sliding_window=512)
    assert m.sliding_window_pattern == 3
    expected = [None if t == "full_attention" else 512 for t in gemma_like]
    assert [m.attention_window(i) for i in range(24)] == expected
    unwindowed = gpt_oss_variant(tmp_path, sliding_window=None)  # GptOssAttention: no window anywhere
    assert (unwindowed.sliding_window, unwindowed.sliding_window_pattern) == (None, None)
    unbiased = gpt_oss_variant(tmp_path, attention_bias=False)
    assert not unbiased.attention_bias and not unbiased.attention_out_bias


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"layer_types": ["sliding_attention"] * 2 + ["full_attention"] * 22}, "layer_types", ["repeating"]),
        ({"layer_types": ["full_attention", "sliding_attention"] * 12}, "layer_types", ["repeating"]),
        ({"layer_types": ["sliding_attention"] * 23}, "layer_types", ["23 entries", "num_hidden_layers 24"]),
        ({"layer_types": "alternating"}, "layer_types", ["must be a list"]),
        ({"sliding_window": 0}, "sliding_window", [">= 1"]),
        ({"swiglu_limit": -1}, "swiglu_limit", ["positive number"]),
        ({"swiglu_limit": True}, "swiglu_limit", ["positive number"]),
        ({"attention_bias": "yes"}, "attention_bias", ["true or false"]),
    ],
)
def test_bad_gpt_oss_keys_name_the_key(tmp_path, changes, field, words):
    data = json.loads((PUBLISHED / "GPT-OSS-20B" / "config.json").read_text())
    data.update(changes)
    with pytest.raises(InputError) as err:
        model_fields_from_hf(write_config(tmp_path, data))
    assert err.value.field == field
    for word in words:
        assert word in str(err.value)


def test_mistral_and_mixtral_window_every_layer(tmp_path):
    # MistralModel / MixtralModel build a sliding-window causal mask for every layer when set.
    data = json.loads((HF / "Mixtral-8x7B-v0.1" / "config.json").read_text())
    data["sliding_window"] = 4096
    m = ModelConfig(**model_fields_from_hf(write_config(tmp_path, data)))
    assert (m.sliding_window, m.sliding_window_pattern) == (4096, None)
    assert {m.attention_window(i) for i in range(m.num_layers)} == {4096}
    data = json.loads((HF / "Llama-3.1-8B" / "config.json").read_text())
    data.update(model_type="mistral", sliding_window=4096)
    assert ModelConfig(**model_fields_from_hf(write_config(tmp_path, data))).sliding_window == 4096
    data["model_type"] = "llama"  # LlamaModel has no window: the key is not read
    assert ModelConfig(**model_fields_from_hf(write_config(tmp_path, data))).sliding_window is None
