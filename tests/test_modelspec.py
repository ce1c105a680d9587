"""Parameter accounting against released models' published counts, exact safetensors totals,
a torchinfo print and hand-derived small models."""

from __future__ import annotations

import pytest
from conftest import ROOT

from sim.inputs.hfconfig import model_fields_from_hf
from sim.inputs.scenario import ModelConfig
from sim.model.params import attention_params, count_params, layer_params, layer_tensors

HF = ROOT / "tests" / "data" / "hf"
PUBLISHED = ROOT / "validation" / "published" / "models"


def hf_model(name: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**model_fields_from_hf(HF / name / "config.json"), **overrides})


def published_model(name: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**model_fields_from_hf(PUBLISHED / name / "config.json"), **overrides})


def rel(a: float, b: float) -> float:
    return abs(a - b) / b


# Model cards / papers (REFERENCES.md): total parameters, within 1%.
PUBLISHED_TOTAL = {
    "Mixtral-8x7B-v0.1": 46.7e9,
    "DeepSeek-V3": 671e9,
    "OLMoE-1B-7B-0924": 6.9e9,
    "Qwen3-30B-A3B": 30.5e9,
    "DeepSeek-V2-Lite": 15.7e9,
    "Qwen1.5-MoE-A2.7B": 14.3e9,
    "Llama-3.1-8B": 8.03e9,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTAL))
def test_total_matches_the_model_card_within_1_percent(name):
    assert rel(count_params(hf_model(name)).total, PUBLISHED_TOTAL[name]) < 0.01


def test_granite_total_at_the_cards_precision():
    # The Granite-3.0 card says "1.3B" (two significant digits); counted: 1,334,628,352.
    assert rel(count_params(hf_model("granite-3.0-1b-a400m-base")).total, 1.3e9) < 0.03


@pytest.mark.parametrize(
    ("name", "exact"),
    [
        # Parameter totals of the released safetensors (sum of tensor sizes).
        ("Mixtral-8x7B-v0.1", 46_702_792_704),
        ("DeepSeek-V2-Lite", 15_706_484_224),
        ("Llama-3.1-8B", 8_030_261_248),
    ],
)
def test_total_equals_the_released_checkpoint(name, exact):
    assert count_params(hf_model(name)).total == exact


@pytest.mark.parametrize(
    ("name", "exact", "qk_norm_weights"),
    [
        # Safetensors totals include q_norm/k_norm RMSNorm weights: OLMoE normalises the whole q
        # and k (16 layers x (2048 + 2048)), Qwen3 per head (48 layers x (128 + 128)).
        ("OLMoE-1B-7B-0924", 6_919_161_856, 16 * 2 * 2048),
        ("Qwen3-30B-A3B", 30_532_122_624, 48 * 2 * 128),
    ],
)
def test_qk_norms_close_the_gap_to_the_released_checkpoint(name, exact, qk_norm_weights):
    with_norms = count_params(hf_model(name))
    without = count_params(hf_model(name, qk_norm="none"))
    assert with_norms.total == exact
    assert with_norms.total - without.total == qk_norm_weights
    assert with_norms.active - without.active == qk_norm_weights  # non-expert: every token uses them
    assert with_norms.norms - without.norms == qk_norm_weights and with_norms.expert == without.expert


def test_qk_norm_widths_by_hand():
    base = dict(num_layers=3, hidden_size=16, num_attention_heads=4, num_kv_heads=2, head_dim=8)
    base.update(vocab_size=10, ffn_hidden_size=32)
    none, head, full = (count_params(ModelConfig(**base, qk_norm=q)).total for q in ("none", "head", "full"))
    assert head - none == 3 * (8 + 8)  # q_norm, k_norm of head_dim each
    assert full - none == 3 * (4 * 8 + 2 * 8)  # heads x head_dim for q, kv_heads x head_dim for k
    ln = count_params(ModelConfig(**base, qk_norm="head", norm_type="layernorm"))
    ln_none = count_params(ModelConfig(**base, norm_type="layernorm"))
    assert ln.total - ln_none.total == 3 * 2 * (8 + 8)  # LayerNorm: scale and bias


def test_qk_norm_needs_mha_attention():
    m = hf_model("DeepSeek-V2-Lite")
    with pytest.raises(ValueError, match="qk_norm"):
        ModelConfig(**{**m.model_dump(), "qk_norm": "head"})


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("Mixtral-8x7B-v0.1", 12.9e9),  # Mixtral card: 12.9B active, embedding and head included
        ("Qwen1.5-MoE-A2.7B", 2.7e9),  # Qwen1.5-MoE card: 2.7B activated
    ],
)
def test_active_matches_the_card_within_1_percent(name, published):
    assert rel(count_params(hf_model(name)).active, published) < 0.01


def test_deepseek_v3_active_and_mtp_match_deepseeks_weight_notes():
    # DeepSeek's README_WEIGHTS.md: 36.6B activated "including 0.9B for the output Head" (the
    # input embedding lookup is not counted); MTP: 11.5B unique parameters excluding the shared
    # embedding and head. The card rounds the former to 37B.
    m = hf_model("DeepSeek-V3")
    c = count_params(m)
    embedding_lookup = m.vocab_size * m.hidden_size
    assert rel(c.active - embedding_lookup, 36.6e9) < 0.01
    assert rel(c.active - embedding_lookup, 37e9) < 0.011
    assert rel(c.mtp, 11.5e9) < 0.01
    assert c.mtp not in (0, c.total) and c.total < 672e9  # MTP reported apart, not in total


@pytest.mark.parametrize(
    ("name", "published", "tolerance"),
    [
        # These cards round active to two significant digits (one for Granite's "A400M" name), so the
        # counted value is held to the card's precision: 3.353B -> "3.3B", 1.282B -> "1.3B",
        # 2.451B (no input embedding, DeepSeek's convention) -> "2.4B", 0.429B -> "400M".
        ("Qwen3-30B-A3B", 3.3e9, 0.02),
        ("OLMoE-1B-7B-0924", 1.3e9, 0.02),
        ("granite-3.0-1b-a400m-base", 0.4e9, 0.08),
    ],
)
def test_active_matches_rounded_cards(name, published, tolerance):
    assert rel(count_params(hf_model(name)).active, published) < tolerance


def test_deepseek_v2_lite_active_in_deepseeks_convention():
    m = hf_model("DeepSeek-V2-Lite")
    assert rel(count_params(m).active - m.vocab_size * m.hidden_size, 2.4e9) < 0.025


def test_qwen2_moe_layer_matches_a_torchinfo_print():
    # torchinfo of a 3-layer, 4-expert Qwen2-MoE with vocab 1519 (public write-up quoted in
    # tests/data/hf/Qwen1.5-MoE-A2.7B/SOURCE.txt): 86,003,712 per decoder layer, 264,235,008 in all.
    m = hf_model("Qwen1.5-MoE-A2.7B", num_layers=3, num_experts=4, vocab_size=1519)
    assert layer_params(m, 0).total == 86_003_712
    assert count_params(m).total == 264_235_008


def test_tiny_moe_from_first_principles():
    m = ModelConfig(
        num_layers=2,
        hidden_size=8,
        num_attention_heads=2,
        num_kv_heads=1,
        vocab_size=10,
        ffn_type="gated",
        moe_ffn_hidden_size=6,
        num_experts=4,
        top_k=2,
        num_shared_experts=1,
        shared_expert_ffn_hidden_size=5,
        shared_expert_gate=True,
    )
    head = 8 // 2
    attention = 8 * (2 * head) + 8 * head + 8 * head + (2 * head) * 8  # q, k, v (1 kv head), o = 192
    expert = 3 * 8 * 6  # gate, up: 8 -> 6; down: 6 -> 8 = 144
    shared = 3 * 8 * 5 + 8  # one 5-wide gated expert and its 8 -> 1 gate = 128
    router, norms = 4 * 8, 2 * 8
    layer = attention + 4 * expert + shared + router + norms  # 944
    embedding, final_norm = 2 * 10 * 8, 8  # untied input and output tables
    c = count_params(m)
    assert c.total == 2 * layer + embedding + final_norm == 2056
    assert c.active == 2 * (attention + 2 * expert + shared + router + norms) + embedding + final_norm == 1480
    assert (c.expert, c.expert_each, c.shared_expert, c.router) == (
        8 * expert,
        expert,
        2 * shared,
        2 * router,
    )
    assert c.non_expert == c.total - c.expert
    assert c.embedding == embedding and c.norms == 2 * norms + final_norm and c.attention == 2 * attention


def test_mla_block_from_first_principles():
    m = ModelConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        attention="mla",
        q_lora_rank=4,
        kv_lora_rank=6,
        qk_nope_head_dim=3,
        qk_rope_head_dim=2,
        v_head_dim=5,
        ffn_hidden_size=8,
    )
    q = 16 * 4 + 4 + 4 * 2 * (3 + 2)  # q_a_proj, q_a_layernorm, q_b_proj
    kv = 16 * (6 + 2) + 6 + 6 * 2 * (3 + 5)  # kv_a_proj_with_mqa (+ rope key), kv_a_layernorm, kv_b_proj
    o = 2 * 5 * 16
    assert attention_params(m) == q + kv + o == 498
    full_rank_q = m.model_copy(update={"q_lora_rank": None})
    assert attention_params(full_rank_q) == 16 * 2 * 5 + kv + o


def test_tied_embedding_is_counted_once_and_layernorm_has_bias():
    base = dict(num_layers=1, hidden_size=4, num_attention_heads=1, vocab_size=7, ffn_hidden_size=4)
    untied = count_params(ModelConfig(**base))
    tied = count_params(ModelConfig(**base, tie_word_embeddings=True))
    assert untied.total - tied.total == 7 * 4 == tied.embedding
    ln = count_params(ModelConfig(**base, norm_type="layernorm"))
    assert ln.norms == 2 * untied.norms == 2 * (3 * 4)


def test_plain_and_linear_ffns_with_biases():
    base = dict(num_layers=1, hidden_size=4, num_attention_heads=1, vocab_size=1, linear_bias=True)
    plain = ModelConfig(**base, ffn_type="plain", ffn_hidden_size=6)
    assert layer_params(plain, 0).dense_ffn == 2 * 4 * 6 + 6 + 4
    linear = ModelConfig(**base, ffn_type="linear", num_experts=8, top_k=2)  # seed example's experts
    assert layer_params(linear, 0).expert_each == 4 * 4 + 4


def test_dense_llama_upcycled_to_eight_experts():
    dense = hf_model("Llama-3.1-8B")
    ffn = layer_params(dense, 0).dense_ffn
    upcycled = dense.model_copy(
        update={"num_experts": 8, "top_k": 2, "moe_ffn_hidden_size": dense.ffn_hidden_size}
    )
    d, c = count_params(dense), count_params(upcycled)
    assert d.active == d.total and d.expert == 0 and d.moe_layers == 0
    assert c.expert == 8 * ffn * 32 and c.expert_each == ffn
    assert c.total == d.total + 7 * ffn * 32 + 8 * 4096 * 32  # 7 more FFNs and a router per layer
    assert c.active == d.active + ffn * 32 + 8 * 4096 * 32


def test_leading_dense_layers_use_the_dense_width():
    m = hf_model("DeepSeek-V3")
    assert layer_params(m, 2).dense_ffn == 3 * 7168 * 18432 and layer_params(m, 2).num_experts == 0
    moe = layer_params(m, 3)
    assert (moe.num_experts, moe.router) == (256, 256 * 7168 + 256)  # + e_score_correction_bias


def billions(n: int, digits: int) -> float:
    return round(n / 1e9, digits)


@pytest.mark.parametrize(
    ("name", "total", "active", "mlp", "attention", "embed_unembed"),
    [
        # gpt-oss model card (OpenAI, arXiv 2508.10925), Table 1 "Model parameter counts":
        # MLP / Attention / Embed + Unembed / Active / Total. "Unembedding parameters are counted
        # towards active, but not embeddings." Counted: 116,829,156,672 total, 5,132,849,472 active;
        # 20,914,757,184 and 3,608,307,264.
        ("GPT-OSS-120B", 116.83, 5.13, 114.71, 0.96, 1.16),
        ("GPT-OSS-20B", 20.91, 3.61, 19.12, 0.64, 1.16),
    ],
)
def test_gpt_oss_matches_table_1_of_its_model_card(name, total, active, mlp, attention, embed_unembed):
    m = published_model(name)
    c = count_params(m)
    embedding_lookup = m.vocab_size * m.hidden_size
    assert billions(c.total, 2) == total
    assert billions(c.active - embedding_lookup, 2) == active
    assert billions(c.expert + c.router, 2) == mlp  # the MoE block: experts (with biases) and router
    assert billions(c.attention, 2) == attention
    assert billions(c.embedding, 2) == embed_unembed


def test_qwen3_235b_matches_its_card():
    # Qwen/Qwen3-235B-A22B model card: "Number of Parameters: 235B in total and 22B activated",
    # "Number of Parameters (Non-Embedding): 234B". Counted: 235,093,634,560 total; 22,190,763,520
    # active (21.57B without the input embedding, also "22B"); 233.85B without embedding and head.
    m = published_model("Qwen3-235B-A22B")
    c = count_params(m)
    assert billions(c.total, 0) == 235
    assert billions(c.active, 0) == 22
    assert billions(c.active - m.vocab_size * m.hidden_size, 0) == 22
    assert billions(c.total - c.embedding, 0) == 234


def test_gpt_oss_layer_from_first_principles():
    # GptOssAttention: q/k/v/o Linear with bias, sinks (heads); GptOssExperts: gate_up (d x 2f) and
    # down (f x d) with biases; GptOssTopKRouter: weight E x d and bias E; two RMSNorms.
    m = published_model("GPT-OSS-20B")
    d, f, h, kv, hd, e = 2880, 2880, 64, 8, 64, 32
    attention = d * h * hd + h * hd + 2 * (d * kv * hd + kv * hd) + h * hd * d + d + h
    expert = d * 2 * f + 2 * f + f * d + d
    layer = layer_params(m, 0)
    assert attention == 26_550_144 and layer.attention == attention
    assert layer.expert_each == expert == 24_891_840 and layer.num_experts == e
    assert layer.router == e * d + e and layer.norms == 2 * d
    assert layer.active(4) == attention + 4 * expert + e * d + e + 2 * d
    plain = published_model(
        "GPT-OSS-20B", attention_out_bias=False, attention_sinks=False, router_logit_bias=False
    )
    assert count_params(m).total - count_params(plain).total == 24 * (d + h + e)
    # Tensors: q/k/v/o + 3 q/k/v biases + the o bias + sinks; two norms; router weight + bias.
    assert layer_tensors(m, 0) == (4 + 3 + 1 + 1 + 2 + 2, 6)
    assert layer_tensors(plain, 0) == (4 + 3 + 2 + 1, 6)


def test_sliding_window_and_swiglu_limit_do_not_change_parameters():
    m = published_model("GPT-OSS-20B")
    bare = published_model("GPT-OSS-20B", sliding_window=None, sliding_window_pattern=None, swiglu_limit=None)
    assert count_params(m) == count_params(bare)
