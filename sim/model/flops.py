"""GEMM shapes and FLOP counts of a model, for timing kernels and for MFU. Pure functions.

A :class:`Gemm` is ``(name, n, k)``: each token row is multiplied by a ``k x n`` weight, so a batch
of ``M`` tokens costs ``2 M n k`` FLOPs (one multiply-add = 2 FLOPs). Names follow Megatron-Core
(``linear_qkv``, ``linear_proj``, ``linear_fc1``/``linear_fc2``; gated FFNs fuse gate and up into
one ``fc1`` of width ``2f``). Attention core (scores and weighted sum, causal):
``2 * heads * (d_qk + d_v) * s(s+1)/2`` per sequence and layer; without the causal mask ``s^2``
pairs, which with ``d_qk = d_v = Q`` and forward+backward = 3x forward gives PaLM's
``12 L H Q T`` per token (Chowdhery et al. 2022, appendix B). A sliding window of ``w`` keys scores
``sum_i min(i + 1, w)`` pairs instead (counted exactly, layer by layer); an attention sink adds a few
softmax FLOPs per query and head. Model FLOPs per token for MFU:
``6 N + 3 x attention`` with ``N`` the active parameters that sit in matrix multiplies
(``ParamCounts.active`` less the input-embedding lookup), as in PaLM appendix B and Megatron-LM's
``num_floating_point_operations`` (which halves the attention term for causal masks).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.inputs.scenario import ModelConfig
from sim.model.params import count_params


@dataclass(frozen=True)
class Gemm:
    """One weight matrix applied to every token row: ``[M, k] @ [k, n]``."""

    name: str
    n: int
    k: int

    @property
    def flops_per_row(self) -> int:
        return 2 * self.n * self.k

    def flops(self, rows: int) -> int:
        return rows * self.flops_per_row


def attention_gemms(m: ModelConfig) -> list[Gemm]:
    """Projections of one attention block: fused QKV + output for MHA/GQA; MLA's low-rank down/up."""
    d, h = m.hidden_size, m.num_attention_heads
    if m.attention == "none":
        return []
    if m.attention == "mla":
        nope, rope = m.qk_nope_head_dim or 0, m.qk_rope_head_dim or 0
        kv_rank, v = m.kv_lora_rank or 0, m.v_head_dim or 0
        if m.q_lora_rank:
            q = [
                Gemm("linear_q_down", m.q_lora_rank, d),
                Gemm("linear_q_up", h * (nope + rope), m.q_lora_rank),
            ]
        else:
            q = [Gemm("linear_q", h * (nope + rope), d)]
        return [
            *q,
            Gemm("linear_kv_down", kv_rank + rope, d),
            Gemm("linear_kv_up", h * (nope + v), kv_rank),
            Gemm("linear_proj", d, h * v),
        ]
    hd = m.head_size
    return [Gemm("linear_qkv", (h + 2 * m.kv_heads) * hd, d), Gemm("linear_proj", d, h * hd)]


def mla_up_gemms(m: ModelConfig) -> list[Gemm]:
    """MLA's up projections (query and key-value), what Megatron's ``mla_up_proj`` recompute runs again."""
    return [g for g in attention_gemms(m) if g.name in ("linear_q_up", "linear_kv_up")]


def mla_rope_bytes(m: ModelConfig, tokens: float, heads: float, bytes_per_element: float) -> float:
    """HBM bytes of MLA's RoPE on ``tokens``: read and write the rotary part of ``heads`` query heads and
    of the one shared key head."""
    return 2 * tokens * (heads + 1) * (m.qk_rope_head_dim or 0) * bytes_per_element


def ffn_gemms(d: int, width: int | None, ffn_type: str, prefix: str) -> list[Gemm]:
    """One FFN: gated -> fc1 (2w) + fc2; plain -> fc1 (w) + fc2; linear -> one d x d."""
    if ffn_type == "linear":
        return [Gemm(f"{prefix}linear_fc1", d, d)]
    assert width is not None, "ffn width is validated by ModelConfig"
    fc1 = 2 * width if ffn_type == "gated" else width
    return [Gemm(f"{prefix}linear_fc1", fc1, d), Gemm(f"{prefix}linear_fc2", d, width)]


def dense_ffn_gemms(m: ModelConfig) -> list[Gemm]:
    return ffn_gemms(m.hidden_size, m.ffn_hidden_size, m.ffn_type, "")


def expert_gemms(m: ModelConfig) -> list[Gemm]:
    """One routed expert; rows = tokens routed to it (at ``moe_latent_size`` under LatentMoE)."""
    return ffn_gemms(m.moe_token_width, m.moe_ffn_hidden_size, m.ffn_type, "expert.")


def latent_gemms(m: ModelConfig) -> list[Gemm]:
    """LatentMoE's projections (Megatron ``MoELayer.fc1_latent_proj`` / ``fc2_latent_proj``, duplicated
    over TP): hidden -> latent before the dispatch, latent -> hidden after the combine; none without."""
    if not m.moe_latent_size:
        return []
    return [Gemm("moe.fc1_latent_proj", m.moe_latent_size, m.hidden_size),
            Gemm("moe.fc2_latent_proj", m.hidden_size, m.moe_latent_size)]  # fmt: skip


def shared_expert_gemms(m: ModelConfig) -> list[Gemm]:
    """All shared experts of a layer as one FFN of width ``n_shared * w`` (+ the Qwen2-MoE gate)."""
    if not m.num_shared_experts:
        return []
    if m.ffn_type == "linear":  # d x d experts do not fuse along n: one GEMM each
        gemms = [Gemm("shared_expert.linear_fc1", m.hidden_size, m.hidden_size)] * m.num_shared_experts
    else:
        width = m.num_shared_experts * (m.shared_expert_ffn_hidden_size or m.moe_ffn_hidden_size or 0)
        gemms = ffn_gemms(m.hidden_size, width, m.ffn_type, "shared_expert.")
    if m.shared_expert_gate:
        gemms.append(Gemm("shared_expert.gate", 1, m.hidden_size))
    return gemms


def router_gemm(m: ModelConfig) -> Gemm:
    return Gemm("router", m.num_experts, m.hidden_size)


def lm_head_gemm(m: ModelConfig) -> Gemm:
    return Gemm("output_layer", m.vocab_size, m.hidden_size)


def mtp_gemms(m: ModelConfig) -> list[Gemm]:
    """DeepSeek-V3 MTP module projection ``eh_proj`` (2d -> d); its layer reuses the shapes above."""
    return [Gemm("mtp.eh_proj", m.hidden_size, 2 * m.hidden_size)] if m.mtp_layers else []


#: FLOPs a learned attention sink adds per query and head: its logit joins the softmax's running max
#: and denominator (max, subtract, exp, add); it has no QK^T product and no value row.
SINK_FLOPS_PER_QUERY_HEAD = 4
#: Elementwise operations GPT-OSS's clamped SwiGLU adds to SwiGLU (HF ``GptOssExperts``): clamp the
#: gate, clamp the linear half, scale the gate by alpha inside the sigmoid, add 1 to the linear half.
CLAMPED_SWIGLU_EXTRA_PASSES = 4


def attention_pairs(seq_len: int, window: int | None = None, causal: bool = True) -> int:
    """(query, key) pairs one sequence scores: causal ``sum_i min(i + 1, w)`` (query ``i`` sees keys
    ``i - w + 1 .. i``; ``s(s+1)/2`` without a window); not causal, the band ``|i - j| < w`` (``s^2``)."""
    w = seq_len if window is None else min(window, seq_len)
    causal_pairs = w * (w + 1) // 2 + (seq_len - w) * w
    return causal_pairs if causal else 2 * causal_pairs - seq_len


def attention_core_flops_layer(m: ModelConfig, seq_len: int, layer: int, causal: bool = True) -> int:
    """Forward FLOPs of scores (QK^T), weighted sum (PV) and sinks for one sequence in layer ``layer``
    (its window per ``ModelConfig.attention_window``)."""
    if m.attention == "none" or m.layer_mixer(layer) != "attention":
        return 0
    if m.attention == "mla":
        d_qk = (m.qk_nope_head_dim or 0) + (m.qk_rope_head_dim or 0)
        d_v = m.v_head_dim or 0
    else:
        d_qk = d_v = m.head_size
    pairs = attention_pairs(seq_len, m.attention_window(layer), causal)
    sinks = SINK_FLOPS_PER_QUERY_HEAD * m.num_attention_heads * seq_len if m.attention_sinks else 0
    return 2 * m.num_attention_heads * (d_qk + d_v) * pairs + sinks


def attention_core_flops_sum(m: ModelConfig, seq_len: int, causal: bool = True) -> int:
    """Forward attention-core FLOPs of one sequence through all ``num_layers`` layers."""
    if m.sliding_window is None and m.hybrid_pattern is None:
        return m.num_layers * attention_core_flops_layer(m, seq_len, 0, causal)
    return sum(attention_core_flops_layer(m, seq_len, i, causal) for i in range(m.num_layers))


def attention_core_flops(m: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Forward FLOPs of the attention core for one sequence in one layer; the mean over layers where
    windowed and full layers differ (an integer whenever the layers agree)."""
    total = attention_core_flops_sum(m, seq_len, causal)
    mean, rest = divmod(total, m.num_layers)
    return mean if rest == 0 else total / m.num_layers


def mamba_gemms(m: ModelConfig) -> list[Gemm]:
    """Projections of one Mamba-2 mixer (Megatron ``MambaMixer``): ``in_proj`` (column parallel: z, x, B,
    C, dt) and ``out_proj`` (row parallel)."""
    return [Gemm("mamba.in_proj", m.mamba_in_proj_width, m.hidden_size), Gemm("mamba.out_proj", m.hidden_size, m.mamba_d_inner)]


def ssd_flops_per_token(m: ModelConfig, heads: int | None = None) -> int:
    """Forward FLOPs per token of Mamba-2's chunked SSD (Dao & Gu 2024, sec. 6; mamba_ssm ``ssd_combined``)
    over ``heads`` heads (default all): per chunk of Q tokens ``C B^T`` (2 Q Q N per group), the chunk
    states ``x^T B`` (2 Q P N per head), the intra-chunk output ``(C B^T o L) x`` (2 Q Q P per head) and
    the inter-chunk output ``C h`` (2 Q N P per head); per token divide by Q. Groups follow the heads
    (``G h / H``) when a TP rank holds ``h`` of ``H`` heads."""
    H = m.mamba_num_heads or 0
    h = H if heads is None else heads
    q, n, p = m.mamba_chunk_size, m.mamba_state_dim, m.mamba_head_dim
    groups = max(1, m.mamba_groups * h // H) if H else 0
    return 2 * q * n * groups + h * (2 * p * n + 2 * q * p + 2 * n * p)


def ssd_core_flops_sum(m: ModelConfig) -> int:
    """Forward SSD FLOPs per token through all Mamba-2 layers."""
    return sum(ssd_flops_per_token(m) for i in range(m.num_layers) if m.layer_mixer(i) == "mamba")


def expert_activation_passes(m: ModelConfig) -> int:
    """Elementwise passes the expert activation makes beyond plain SwiGLU, each reading and writing
    ``rows x moe_ffn_hidden_size`` elements when unfused (HF ``GptOssExperts``): 0 for SwiGLU, plain or
    linear FFNs; :data:`CLAMPED_SWIGLU_EXTRA_PASSES` with ``swiglu_limit``. A fused kernel does them in
    registers, so the kernel model decides what they cost."""
    return CLAMPED_SWIGLU_EXTRA_PASSES if m.swiglu_limit is not None else 0


def matmul_active_params(m: ModelConfig) -> int:
    """Active parameters that sit in matrix multiplies: ``active`` less the input-embedding lookup
    (a tied table stays, as the LM head). The ``N`` of ``6N``."""
    counts = count_params(m)
    lookup = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size
    return counts.active - lookup


def forward_flops_per_token(m: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Forward FLOPs per token: ``2 N`` (matrix multiplies, biases/norms/sinks included as 1 FMA each,
    a <0.1% overcount) plus the attention core of every attention layer (windowed or full) averaged
    over the sequence, plus the SSD core of every Mamba-2 layer."""
    attention = attention_core_flops_sum(m, seq_len, causal) / seq_len
    return 2.0 * matmul_active_params(m) + attention + ssd_core_flops_sum(m)


def model_flops_per_token(m: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs per token for MFU: forward + backward = 3 x forward (PaLM appendix B)."""
    return 3.0 * forward_flops_per_token(m, seq_len, causal)


__all__ = [
    "CLAMPED_SWIGLU_EXTRA_PASSES",
    "Gemm",
    "SINK_FLOPS_PER_QUERY_HEAD",
    "attention_core_flops",
    "attention_core_flops_layer",
    "attention_core_flops_sum",
    "attention_gemms",
    "attention_pairs",
    "dense_ffn_gemms",
    "expert_activation_passes",
    "expert_gemms",
    "ffn_gemms",
    "forward_flops_per_token",
    "latent_gemms",
    "lm_head_gemm",
    "mamba_gemms",
    "matmul_active_params",
    "mla_rope_bytes",
    "mla_up_gemms",
    "model_flops_per_token",
    "mtp_gemms",
    "router_gemm",
    "shared_expert_gemms",
    "ssd_core_flops_sum",
    "ssd_flops_per_token",
]
