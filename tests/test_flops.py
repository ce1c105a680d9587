"""GEMM shapes and FLOPs: shapes cover exactly the matrix parameters; attention and MFU formulas
against hand calculations and PaLM appendix B."""

from __future__ import annotations

import pytest
from conftest import ROOT

from sim.inputs.hfconfig import model_fields_from_hf
from sim.inputs.scenario import ModelConfig
from sim.model.flops import (
    CLAMPED_SWIGLU_EXTRA_PASSES,
    SINK_FLOPS_PER_QUERY_HEAD,
    attention_core_flops,
    attention_core_flops_layer,
    attention_gemms,
    attention_pairs,
    dense_ffn_gemms,
    expert_activation_passes,
    expert_gemms,
    forward_flops_per_token,
    latent_gemms,
    lm_head_gemm,
    mamba_gemms,
    matmul_active_params,
    model_flops_per_token,
    mtp_gemms,
    router_gemm,
    shared_expert_gemms,
)
from sim.model.params import count_params, layer_params

HF = ROOT / "tests" / "data" / "hf"
PUBLISHED = ROOT / "validation" / "published" / "models"
MODELS = sorted(p.name for p in HF.iterdir() if p.is_dir())
CONFIGS = {name: HF / name / "config.json" for name in MODELS} | {
    f"published/{p.name}": p / "config.json" for p in PUBLISHED.iterdir() if p.is_dir()
}


def hf_model(name: str) -> ModelConfig:
    return ModelConfig(**model_fields_from_hf(CONFIGS[name]))


def matrix_weights(m: ModelConfig) -> int:
    """Parameters in weight matrices: the total less norms, biases, sinks, router selection and logit
    biases, the MLA low-rank norms and the input-embedding table (a lookup, not a GEMM)."""
    c = count_params(m)
    not_matrix = c.norms
    attn_layers = sum(m.layer_mixer(i) == "attention" for i in range(m.num_layers))
    mamba_layers = sum(m.layer_mixer(i) == "mamba" for i in range(m.num_layers))
    # a Mamba-2 mixer's conv1d (width 4 + bias) over x, B, C, its dt_bias / A_log / D and gated norm
    conv = m.mamba_d_inner + 2 * m.mamba_groups * m.mamba_state_dim
    not_matrix += mamba_layers * (conv * 5 + 3 * (m.mamba_num_heads or 0) + m.mamba_d_inner)
    if m.attention == "mla":
        not_matrix += m.num_layers * ((m.q_lora_rank or 0) + (m.kv_lora_rank or 0))
    if m.attention_bias:
        not_matrix += attn_layers * (m.num_attention_heads + 2 * m.kv_heads) * m.head_size
    not_matrix += attn_layers * (
        m.hidden_size * m.attention_out_bias + m.num_attention_heads * m.attention_sinks
    )
    not_matrix += c.moe_layers * m.num_experts * (int(m.router_bias) + int(m.router_logit_bias))
    if m.linear_bias:  # gated FFNs: fc1 bias 2w, fc2 bias d
        assert m.ffn_type == "gated" and not m.num_shared_experts and not c.dense_ffn
        not_matrix += c.moe_layers * m.num_experts * (2 * (m.moe_ffn_hidden_size or 0) + m.hidden_size)
    if not m.tie_word_embeddings:
        not_matrix += m.vocab_size * m.hidden_size
    return c.total - not_matrix


def gemm_weights(m: ModelConfig) -> int:
    """Sum of n*k over the GEMMs every layer runs, routed experts counted E times."""
    total = lm_head_gemm(m).n * lm_head_gemm(m).k
    for i in range(m.num_layers):
        gemms = {"attention": attention_gemms(m), "mamba": mamba_gemms(m), None: []}[m.layer_mixer(i)]
        if layer_params(m, i).num_experts:
            gemms += [router_gemm(m)] + expert_gemms(m) * m.num_experts + shared_expert_gemms(m) + latent_gemms(m)
        elif m.layer_ffn(i):
            gemms += dense_ffn_gemms(m)
        total += sum(g.n * g.k for g in gemms)
    return total


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gemms_times_tokens_are_two_flops_per_matrix_parameter(name):
    m = hf_model(name)
    assert gemm_weights(m) == matrix_weights(m)
    tokens = 3
    flops = tokens * 2 * gemm_weights(m)
    assert flops == 2 * tokens * matrix_weights(m)


def test_gqa_shapes():
    m = hf_model("Qwen3-30B-A3B")
    qkv, proj = attention_gemms(m)
    assert (qkv.name, qkv.n, qkv.k) == ("linear_qkv", (32 + 2 * 4) * 128, 2048)
    assert (proj.n, proj.k) == (2048, 32 * 128)
    fc1, fc2 = expert_gemms(m)
    assert (fc1.n, fc1.k, fc2.n, fc2.k) == (2 * 768, 2048, 2048, 768)
    assert (router_gemm(m).n, router_gemm(m).k) == (128, 2048)
    assert fc1.flops(10) == 10 * 2 * 1536 * 2048


def test_mla_shapes_deepseek_v3():
    m = hf_model("DeepSeek-V3")
    shapes = [(g.name, g.n, g.k) for g in attention_gemms(m)]
    assert shapes == [
        ("linear_q_down", 1536, 7168),
        ("linear_q_up", 128 * 192, 1536),
        ("linear_kv_down", 512 + 64, 7168),
        ("linear_kv_up", 128 * (128 + 128), 512),
        ("linear_proj", 7168, 128 * 128),
    ]
    assert [(g.n, g.k) for g in shared_expert_gemms(m)] == [(2 * 2048, 7168), (7168, 2048)]
    assert [(g.n, g.k) for g in mtp_gemms(m)] == [(7168, 2 * 7168)]


def test_qwen2_moe_shared_gate_and_linear_experts():
    m = hf_model("Qwen1.5-MoE-A2.7B")
    assert [(g.name, g.n) for g in shared_expert_gemms(m)][-1] == ("shared_expert.gate", 1)
    seed = ModelConfig(
        num_layers=1, hidden_size=512, num_attention_heads=8, ffn_type="linear", num_experts=8, top_k=2
    )
    assert [(g.n, g.k) for g in expert_gemms(seed)] == [(512, 512)]


def test_attention_core_hand_case():
    m = ModelConfig(num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8)  # head 4
    # QK^T: 2 heads x 4 x pairs x 2 FLOPs, PV the same; causal pairs for s = 3: 1 + 2 + 3 = 6.
    assert attention_core_flops(m, 3) == 2 * 2 * (4 + 4) * 6 == 192
    assert attention_core_flops(m, 3, causal=False) == 2 * 2 * (4 + 4) * 9


def test_mla_attention_core_uses_qk_and_v_widths():
    m = hf_model("DeepSeek-V3")
    assert attention_core_flops(m, 4, causal=False) == 2 * 128 * (192 + 128) * 16


def test_model_flops_reproduce_palm_appendix_b():
    m = hf_model("Llama-3.1-8B")
    seq = 4096
    n = count_params(m).total - m.vocab_size * m.hidden_size  # untied: the LM head stays in N
    assert matmul_active_params(m) == n
    palm = 6 * n + 12 * m.num_layers * m.num_attention_heads * m.head_size * seq
    assert model_flops_per_token(m, seq, causal=False) == pytest.approx(palm, rel=1e-12)
    causal_attention = 12 * m.num_layers * m.num_attention_heads * m.head_size * (seq + 1) / 2
    assert model_flops_per_token(m, seq) == pytest.approx(6 * n + causal_attention, rel=1e-12)
    assert forward_flops_per_token(m, seq) * 3 == pytest.approx(model_flops_per_token(m, seq))


def test_moe_model_flops_use_active_not_total():
    m = hf_model("Mixtral-8x7B-v0.1")
    c = count_params(m)
    n = matmul_active_params(m)
    assert n == c.active - 32000 * 4096
    attention = 12 * 32 * 32 * 128 * 2048
    assert model_flops_per_token(m, 2048, causal=False) == pytest.approx(6 * n + attention, rel=1e-12)
    assert model_flops_per_token(m, 2048) < 6 * c.total / 3


def brute_force_pairs(seq_len: int, window: int | None, causal: bool) -> int:
    """(query, key) pairs a masked attention scores, counted one by one."""
    w = seq_len if window is None else window
    return sum(
        1 for i in range(seq_len) for j in range(seq_len) if (j <= i if causal else True) and abs(i - j) < w
    )


@pytest.mark.parametrize("seq_len", [1, 2, 7, 64, 129])
@pytest.mark.parametrize("window", [None, 1, 2, 8, 128, 129, 1000])
@pytest.mark.parametrize("causal", [True, False])
def test_window_pairs_equal_a_brute_force_count(seq_len, window, causal):
    assert attention_pairs(seq_len, window, causal) == brute_force_pairs(seq_len, window, causal)


def test_window_pairs_closed_form():
    # Query i sees min(i + 1, w) keys: w(w+1)/2 over the first w queries, then w each.
    assert attention_pairs(4096, 128) == 128 * 129 // 2 + (4096 - 128) * 128 == 516_160
    assert attention_pairs(4096, None) == attention_pairs(4096, 4096) == 4096 * 4097 // 2


def test_gpt_oss_attention_core_per_layer():
    m = hf_model("published/GPT-OSS-120B")
    h, hd, s = 64, 64, 4096
    sinks = SINK_FLOPS_PER_QUERY_HEAD * h * s
    windowed = 2 * h * (hd + hd) * attention_pairs(s, 128) + sinks
    full = 2 * h * (hd + hd) * s * (s + 1) // 2 + sinks
    assert attention_core_flops_layer(m, s, 0) == windowed  # layer_types[0] = sliding_attention
    assert attention_core_flops_layer(m, s, 1) == full
    assert [attention_core_flops_layer(m, s, i) for i in range(4)] == [windowed, full, windowed, full]
    assert attention_core_flops(m, s) == (18 * windowed + 18 * full) / 36
    assert windowed < full / 7  # 128 of up to 4096 keys per query
    # A window as long as the sequence is full attention.
    assert attention_core_flops_layer(m, 128, 0) == attention_core_flops_layer(m, 128, 1)


def test_sinks_are_counted_and_small():
    m = hf_model("published/GPT-OSS-20B")
    no_sinks = m.model_copy(update={"attention_sinks": False})
    for layer in (0, 1):
        extra = attention_core_flops_layer(m, 4096, layer) - attention_core_flops_layer(no_sinks, 4096, layer)
        assert extra == SINK_FLOPS_PER_QUERY_HEAD * 64 * 4096
        assert extra < 1e-3 * attention_core_flops_layer(m, 4096, layer)


def test_unwindowed_models_keep_the_single_layer_integer():
    for name in MODELS:
        m = hf_model(name)
        core = attention_core_flops(m, 2048)
        assert isinstance(core, int) and core == attention_core_flops_layer(m, 2048, 0)
        assert {attention_core_flops_layer(m, 2048, i) for i in range(m.num_layers)} == {core}


def test_windowed_model_flops_count_every_layer():
    m = hf_model("published/GPT-OSS-20B")
    s = 4096
    per_layer = [attention_core_flops_layer(m, s, i) for i in range(m.num_layers)]
    n = matmul_active_params(m)
    assert model_flops_per_token(m, s) == pytest.approx(6 * n + 3 * sum(per_layer) / s, rel=1e-12)
    full = m.model_copy(update={"sliding_window": None, "sliding_window_pattern": None})
    saved = model_flops_per_token(full, s) - model_flops_per_token(m, s)
    one_full, one_windowed = per_layer[1], per_layer[0]
    assert saved == pytest.approx(3 * 12 * (one_full - one_windowed) / s, rel=1e-9)


def test_clamped_swiglu_extra_passes():
    assert expert_activation_passes(hf_model("published/GPT-OSS-120B")) == CLAMPED_SWIGLU_EXTRA_PASSES == 4
    for name in MODELS:
        assert expert_activation_passes(hf_model(name)) == 0
