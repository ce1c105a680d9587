"""GEMM shapes and FLOPs: shapes cover exactly the matrix parameters; attention and MFU formulas
against hand calculations and PaLM appendix B."""

from __future__ import annotations

import pytest
from conftest import ROOT

from sim.inputs.hfconfig import model_fields_from_hf
from sim.inputs.scenario import ModelConfig
from sim.model.flops import (
    attention_core_flops,
    attention_gemms,
    dense_ffn_gemms,
    expert_gemms,
    forward_flops_per_token,
    lm_head_gemm,
    matmul_active_params,
    model_flops_per_token,
    mtp_gemms,
    router_gemm,
    shared_expert_gemms,
)
from sim.model.params import count_params, layer_params

HF = ROOT / "tests" / "data" / "hf"
MODELS = sorted(p.name for p in HF.iterdir() if p.is_dir())


def hf_model(name: str) -> ModelConfig:
    return ModelConfig(**model_fields_from_hf(HF / name / "config.json"))


def matrix_weights(m: ModelConfig) -> int:
    """Parameters in weight matrices: the total less norms, biases, router selection bias, the MLA
    low-rank norms and the input-embedding table (a lookup, not a GEMM)."""
    c = count_params(m)
    not_matrix = c.norms
    if m.attention == "mla":
        not_matrix += m.num_layers * ((m.q_lora_rank or 0) + (m.kv_lora_rank or 0))
    if m.attention_bias:
        not_matrix += m.num_layers * (m.num_attention_heads + 2 * m.kv_heads) * m.head_size
    if m.router_bias:
        not_matrix += c.moe_layers * m.num_experts
    if not m.tie_word_embeddings:
        not_matrix += m.vocab_size * m.hidden_size
    return c.total - not_matrix


def gemm_weights(m: ModelConfig) -> int:
    """Sum of n*k over the GEMMs every layer runs, routed experts counted E times."""
    total = lm_head_gemm(m).n * lm_head_gemm(m).k
    for i in range(m.num_layers):
        gemms = list(attention_gemms(m))
        if layer_params(m, i).num_experts:
            gemms += [router_gemm(m)] + expert_gemms(m) * m.num_experts + shared_expert_gemms(m)
        else:
            gemms += dense_ffn_gemms(m)
        total += sum(g.n * g.k for g in gemms)
    return total


@pytest.mark.parametrize("name", MODELS)
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
