"""Memory per GPU of a training scenario: model states under ZeRO, activations, communication buffers.

Model states (Rajbhandari et al. 2020, "ZeRO", sec. 3.1 and 5): with mixed precision (bf16/fp16)
a parameter costs 2 B weight + 2 B gradient + K = 12 B Adam state (fp32 master, momentum,
variance); with fp32 training 4 + 4 + 8 (no separate master copy), 16 B in all. SGD keeps only the
fp32 master (K = 4, mixed) or nothing (K = 0, fp32). Non-expert parameters are replicated over
``dp`` ranks, each rank's experts over ``edp`` ranks (DeepSpeed's expert-data-parallel group);
ZeRO stage 1 partitions optimizer states over that group, stage 2 also gradients, stage 3 also
weights. CPU offload (ZeRO-Offload, Ren et al. 2021, fig. 2) moves the optimizer states and an
fp32 gradient copy (K + 4 B per partitioned parameter) to the host.

Activations per micro-batch follow Korthikanti et al. 2022 ("Reducing Activation Recomputation",
sec. 4.1): a GPT layer stores ``sbh(34 + 5as/h)`` bytes with 16-bit activations and dropout. This
module generalises the terms to GQA/MLA widths, gated FFNs and MoE, and by default assumes what
current MoE training does: FlashAttention (the ``5as^2b`` softmax terms are recomputed, not stored)
and no dropout (no masks). ``layer_activation_bytes(..., flash=False, dropout=True)`` on a GPT
layer reproduces the paper's ``34 sbh + 5 a s^2 b`` exactly (tested). MoE layers store their
expert activations for the rows each rank's experts receive: ``top_k x tokens`` (dropless, even
routing) or ``E x C`` (capacity-padded dispatch, ``C = max(ceil(k S cf / E), min_capacity)``).
A sliding window or attention sinks change no stored tensor: FlashAttention keeps no ``s x s`` term
(only its per-row statistics), and an eager softmax (``flash=False``) masks a full ``s x s`` score
matrix per head whatever the window, so windowed layers store what full ones do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.inputs.scenario import ModelConfig, Scenario
from sim.model.dtypes import BYTES_PER_ELEMENT, ceil_div, is_quantized
from sim.model.params import count_params, layer_params

GiB = 1024**3
#: fp32 router logits and probabilities, top-k gate weights, CE logits (Megatron keeps them in fp32).
FP32_BYTES = 4


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU (and per node on the host). ``total`` is the peak estimate on the GPU."""

    weights: int
    gradients: int
    optimizer_states: int
    activations: int
    comm_buffers: int
    host_bytes_per_node: int
    capacity_GiB: float

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_states + self.activations + self.comm_buffers

    @property
    def total_GiB(self) -> float:
        return self.total / GiB

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity_GiB * GiB

    def as_dict(self) -> dict[str, float | bool]:
        """The ``memory`` section of ``moesim params`` / ``simulate`` JSON (GiB per GPU)."""
        return {
            "weights_GiB": self.weights / GiB,
            "gradients_GiB": self.gradients / GiB,
            "optimizer_GiB": self.optimizer_states / GiB,
            "activations_GiB": self.activations / GiB,
            "comm_buffers_GiB": self.comm_buffers / GiB,
            "peak_GiB_per_gpu": self.total_GiB,
            "capacity_GiB": self.capacity_GiB,
            "fits": self.fits,
            "host_GiB_per_node": self.host_bytes_per_node / GiB,
        }


def optimizer_bytes_per_param(dtype: str, optimizer: str) -> int:
    """ZeRO's K: Adam 12 (mixed) / 8 (fp32); Muon 8 / 4 (fp32 master and momentum); SGD 4 (fp32 master,
    mixed) / 0 (fp32)."""
    mixed = dtype != "fp32"
    if optimizer == "adam":
        return 12 if mixed else 8
    if optimizer == "muon":
        return 8 if mixed else 4
    return 4 if mixed else 0


def model_state_bytes(
    params: int, group: int, stage: int, weight_bytes: int, k: int, offload: bool
) -> tuple[int, int, int, int]:
    """(weights, gradients, optimizer on GPU, host) bytes on one rank for ``params`` replicated over
    ``group`` ranks at ZeRO ``stage`` (partitions rounded up, as DeepSpeed pads them)."""
    part = ceil_div(params, group)
    weights = weight_bytes * (part if stage >= 3 else params)
    grads = weight_bytes * (part if stage >= 2 else params)
    opt_params = part if stage >= 1 else params
    if offload:
        return weights, grads, 0, (k + FP32_BYTES) * opt_params
    return weights, grads, k * opt_params, 0


def capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float, min_capacity: int) -> int:
    """DeepSpeed/GShard expert capacity per rank: ``max(ceil(k S cf / E), min_capacity)``."""
    return max(math.ceil(top_k * tokens * capacity_factor / num_experts), min_capacity)


def ffn_activation_elements(rows: int, d: int, width: int, ffn_type: str) -> int:
    """Elements an FFN stores for backward over ``rows``: fc1 input, fc1 output, activation output."""
    if ffn_type == "linear":
        return rows * d * 2  # input and pre-activation (ReLU needs its input)
    fc1 = 2 * width if ffn_type == "gated" else width
    return rows * (d + fc1 + width)


def attention_activation_elements(m: ModelConfig, tokens: int) -> int:
    """Stored attention tensors without the softmax terms: QKV input, Q, K, V and the output
    projection's input; for GPT MHA 5 sbh elements, Korthikanti's 10 sbh bytes (of 11 sbh)."""
    d, h = m.hidden_size, m.num_attention_heads
    if m.attention == "none":
        return 0
    if m.attention == "mla":
        qk = (m.qk_nope_head_dim or 0) + (m.qk_rope_head_dim or 0)
        latent = (m.q_lora_rank or 0) + (m.kv_lora_rank or 0) + (m.qk_rope_head_dim or 0)
        return tokens * (d + latent + h * qk * 2 + h * (m.v_head_dim or 0) * 2)
    hd = m.head_size
    return tokens * (d + h * hd + 2 * m.kv_heads * hd + h * hd)


def attention_gemm_input_elements(m: ModelConfig, tokens: int) -> int:
    """The part of :func:`attention_activation_elements` that GEMMs keep as their input for the weight
    gradient: the QKV (MLA: down) projection's input, MLA's latents, the output projection's input."""
    d, h = m.hidden_size, m.num_attention_heads
    if m.attention == "none":
        return 0
    if m.attention == "mla":
        latent = (m.q_lora_rank or 0) + (m.kv_lora_rank or 0) + (m.qk_rope_head_dim or 0)
        return tokens * (d + latent + h * (m.v_head_dim or 0))
    return tokens * (d + h * m.head_size)


def ffn_gemm_input_elements(rows: int, d: int, width: int, ffn_type: str) -> int:
    """The part of :func:`ffn_activation_elements` that is GEMM input: fc1's input and fc2's."""
    return rows * d if ffn_type == "linear" else rows * (d + width)


def layer_activation_bytes(
    m: ModelConfig,
    tokens: int,
    seq_len: int,
    micro_batch: int,
    act_bytes: int,
    moe_rows: int | None,
    flash: bool = True,
    dropout: bool = False,
    gemm_input_bytes: float | None = None,
    layer: int | None = None,
) -> int:
    """Bytes one layer keeps for backward (Korthikanti et al. 2022 sec. 4.1, generalised).

    ``moe_rows``: rows the rank's experts receive in an MoE layer (None for a dense layer).
    Paper terms for a GPT layer (h = d, f = 4h, plain GeLU FFN, MHA): attention 11sbh + 5as^2b,
    MLP 19sbh, layer norms 4sbh; the 1-byte dropout masks are sbh each after attention, after the
    MLP and on the attention probabilities (as^2b). ``gemm_input_bytes``: bytes per element of the GEMM
    inputs kept for the weight gradients when they are kept quantized (FP8 training:
    :data:`~sim.model.dtypes.SAVED_GEMM_INPUT_BYTES`), else ``act_bytes``. ``layer``: which layer of a
    hybrid pattern (its mixer and FFN, :meth:`ModelConfig.layer_mixer`); None = attention + FFN."""
    mixer, ffn = ("attention", True) if layer is None else (m.layer_mixer(layer), m.layer_ffn(layer) is not None)
    full = _layer_activation_bytes(m, tokens, seq_len, micro_batch, act_bytes, moe_rows, flash, dropout, mixer, ffn)
    if gemm_input_bytes is None:
        return full
    return full - int(layer_gemm_input_elements(m, tokens, moe_rows, mixer, ffn) * (act_bytes - gemm_input_bytes))


def mamba_activation_elements(m: ModelConfig, tokens: int) -> tuple[int, int]:
    """(kept, of which GEMM inputs) elements of one Mamba-2 mixer under Megatron's memory-efficient path
    (mamba_ssm ``mamba_split_conv1d_scan_combined``): in_proj's input, its output (z, x, B, C, dt, from
    which backward recomputes the conv and the SSD states), the SSD output before the gated norm and
    out_proj's input."""
    d_in = m.mamba_d_inner
    gemm_in = tokens * (m.hidden_size + d_in)
    return gemm_in + tokens * (m.mamba_in_proj_width + d_in), gemm_in


def layer_gemm_input_elements(m: ModelConfig, tokens: int, moe_rows: int | None, mixer: str | None = "attention",
                              ffn: bool = True) -> int:  # fmt: skip
    """GEMM inputs among a layer's kept activations (attention or Mamba-2, FFN or experts and shared experts)."""
    d = m.hidden_size
    out = attention_gemm_input_elements(m, tokens) if mixer == "attention" else 0
    out += mamba_activation_elements(m, tokens)[1] if mixer == "mamba" else 0
    if not ffn:
        return out
    if moe_rows is None:
        return out + ffn_gemm_input_elements(tokens, d, m.ffn_hidden_size or d, m.ffn_type)
    out += ffn_gemm_input_elements(moe_rows, m.moe_token_width, m.moe_ffn_hidden_size or d, m.ffn_type)
    out += tokens * (m.moe_latent_size or 0)  # fc2_latent_proj's input (fc1's is the norm output)
    if m.num_shared_experts:
        width = m.num_shared_experts * (m.shared_expert_ffn_hidden_size or m.moe_ffn_hidden_size or d)
        out += ffn_gemm_input_elements(tokens, d, width, m.ffn_type)
    return out


def _layer_activation_bytes(m: ModelConfig, tokens: int, seq_len: int, micro_batch: int, act_bytes: int,
                            moe_rows: int | None, flash: bool, dropout: bool, mixer: str | None = "attention",
                            ffn: bool = True) -> int:  # fmt: skip
    d, a = m.hidden_size, m.num_attention_heads
    norms = m.norms_per_layer * tokens * d * act_bytes
    attn = attention_activation_elements(m, tokens) * act_bytes if mixer == "attention" else 0
    if not flash and mixer == "attention":
        attn += 2 * a * seq_len * seq_len * micro_batch * act_bytes  # softmax output and PV input
    attn += mamba_activation_elements(m, tokens)[0] * act_bytes if mixer == "mamba" else 0
    masks = 0
    if dropout:
        masks = 2 * tokens * d + (0 if flash else a * seq_len * seq_len * micro_batch)
    if not ffn:
        return norms + attn + masks
    if moe_rows is None:
        ffn = ffn_activation_elements(tokens, d, m.ffn_hidden_size or d, m.ffn_type) * act_bytes
        return norms + attn + ffn + masks
    w = m.moe_token_width  # latent under LatentMoE: the experts and the combine at it, plus fc2_latent_proj's input
    experts = ffn_activation_elements(moe_rows, w, m.moe_ffn_hidden_size or d, m.ffn_type) * act_bytes
    router = 2 * tokens * m.num_experts * FP32_BYTES + tokens * m.top_k * FP32_BYTES
    combine = (moe_rows * w + tokens * (m.moe_latent_size or 0)) * act_bytes  # expert outputs kept to weight and sum
    shared = 0
    if m.num_shared_experts:
        width = m.num_shared_experts * (m.shared_expert_ffn_hidden_size or m.moe_ffn_hidden_size or d)
        shared = ffn_activation_elements(tokens, d, width, m.ffn_type) * act_bytes
    return norms + attn + experts + router + combine + shared + masks


def moe_rows_per_rank(s: Scenario) -> int:
    """Rows one rank's experts process per MoE layer and micro-batch (even routing)."""
    m, r, tokens = s.model, s.routing, s.tokens_per_micro_batch
    if r.dispatch == "capacity_padded" and r.capacity_factor is not None:
        return m.num_experts * capacity(tokens, m.num_experts, m.top_k, r.capacity_factor, r.min_capacity)
    return tokens * m.top_k


def activation_bytes(s: Scenario) -> int:
    """Activations of one micro-batch on one rank, all layers, plus the fp32 logits of the loss.
    With activation checkpointing only each layer's input is kept, plus one layer recomputed."""
    m, t = s.model, s.training
    tokens, act = s.tokens_per_micro_batch, BYTES_PER_ELEMENT[t.dtype]
    rows = moe_rows_per_rank(s)
    per_layer = [
        layer_activation_bytes(
            m, tokens, t.seq_len, t.micro_batch_size, act, rows if layer_params(m, i).num_experts else None, layer=i
        )
        for i in range(m.num_layers)
    ]
    per_layer += [per_layer[-1]] * m.mtp_layers
    logits = tokens * m.vocab_size * FP32_BYTES * (1 + m.mtp_layers)
    if t.recompute:
        return len(per_layer) * tokens * m.hidden_size * act + max(per_layer) + logits
    return sum(per_layer) + logits


def comm_buffer_bytes(s: Scenario, params_on_rank: int) -> int:
    """All-to-all send + receive buffers of the MoE layer in flight (``rows x d`` each) and the
    gradient-reduction bucket (``reduce_bucket_elements``, or all local gradients if fewer)."""
    m, act = s.model, BYTES_PER_ELEMENT[s.training.dtype]
    a2a = 2 * moe_rows_per_rank(s) * m.moe_token_width * act if m.num_moe_layers and s.ep > 1 else 0
    bucket = min(s.collectives.reduce_bucket_elements, params_on_rank) * act
    return a2a + bucket


def zero_memory_applies(s: Scenario) -> bool:
    """Whether :func:`memory_per_gpu` (DeepSpeed ZeRO on plain data + expert parallelism, no FP8-family
    precision) describes ``s``; every other layout takes the per-stage model (:mod:`sim.model.stage_memory`)."""
    p, t = s.parallelism, s.training
    return p.tp == p.cp == p.pp == p.etp == 1 and t.framework == "deepspeed" and not is_quantized(t.dtype)


def memory_per_gpu(s: Scenario) -> MemoryBreakdown:
    """Peak memory estimate of one GPU of scenario ``s`` (see the module docstring)."""
    m, t = s.model, s.training
    counts = count_params(m)
    expert = counts.expert + counts.mtp_expert
    non_expert = counts.total + counts.mtp - expert
    expert_local = ceil_div(expert, s.ep)
    weight_bytes = BYTES_PER_ELEMENT[t.dtype]
    k = optimizer_bytes_per_param(t.dtype, t.optimizer)
    offload = t.offload_optimizer == "cpu"
    stage = s.parallelism.zero_stage
    ne = model_state_bytes(non_expert, s.dp, stage, weight_bytes, k, offload)
    ex = model_state_bytes(expert_local, s.edp, stage, weight_bytes, k, offload)
    return MemoryBreakdown(
        weights=ne[0] + ex[0],
        gradients=ne[1] + ex[1],
        optimizer_states=ne[2] + ex[2],
        activations=activation_bytes(s),
        comm_buffers=comm_buffer_bytes(s, non_expert + expert_local),
        host_bytes_per_node=(ne[3] + ex[3]) * s.gpus_per_node,
        capacity_GiB=s.topology.gpu.hbm_GiB,
    )


__all__ = [
    "GiB",
    "MemoryBreakdown",
    "activation_bytes",
    "capacity",
    "comm_buffer_bytes",
    "attention_gemm_input_elements",
    "ffn_gemm_input_elements",
    "layer_activation_bytes",
    "layer_gemm_input_elements",
    "zero_memory_applies",
    "memory_per_gpu",
    "model_state_bytes",
    "moe_rows_per_rank",
    "optimizer_bytes_per_param",
]
