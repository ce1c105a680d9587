"""Memory per pipeline stage of a layout (tp, cp, pp with vpp or DualPipe, ep with etp, dp).

Each stage holds the parameters of its model chunks (:mod:`sim.inputs.stages`): dense layers split
over ``tp`` (column/row-parallel weights; norms, router and shared experts replicated), its ranks'
experts (``E / ep`` per rank, split over ``etp``), the embedding on the first stage and the LM head on
the last (both split over ``tp``); DualPipe keeps both of a rank's stages (two copies). Sharding by
framework (:mod:`sim.frameworks.policies`): DeepSpeed's ZeRO stage over dp (experts over edp);
Megatron's distributed optimizer keeps bf16 weights and a gradient buffer on every rank (fp32 with
``grad_reduce_dtype: fp32``, Megatron-LM's default under ``--bf16``; else the params' dtype, as
Megatron-Core's ``grad_reduce_in_fp32: false``) and shards the fp32 master weights and Adam moments
over dp (Megatron-Core ``DistributedOptimizer``);
FSDP2 shards weights, gradients and optimizer states over dp, and adds the unsharded copies its
all-gathers make: the root module's (embedding, final norm, LM head: not resharded after forward,
torch ``_fsdp_state._lazy_init``) and, with ``reshard_after_forward``, the block it computes on and
the next one it prefetches (the largest adjacent pair); without it every block's, kept from its
forward to its backward. Experts are gathered the same way over edp when edp > 1.

Activations (Korthikanti et al. 2022 sec. 4.2, as :mod:`sim.model.memory` counts a layer) scale with
the micro-batches a stage holds at once: 1F1B's stage r holds ``min(pp - r, m)`` (PipeDream-Flush),
interleaving's ``min((pp - r - 1) 2 + (vpp - 1) pp + 1, m vpp)`` model chunks of ``1 / vpp`` of its
layers (Narayanan et al. 2021 sec. 2.2; Megatron's warm-up count), DualPipe ``pp + 1`` micro-batches
(DeepSeek-V3 report, table 2). Under sequence parallelism a rank keeps ``1 / tp`` of a layer's
activations, under context parallelism ``1 / cp``.
"""

from __future__ import annotations

from sim.inputs.scenario import Scenario
from sim.inputs.stages import rank_chunks
from sim.model.dtypes import (
    BYTES_PER_ELEMENT,
    ceil_div,
    grad_reduce_bytes,
    saved_gemm_input_bytes,
    storage_dtype,
)
from sim.model.memory import (
    FP32_BYTES,
    GiB,
    MemoryBreakdown,
    ffn_activation_elements,
    ffn_gemm_input_elements,
    layer_activation_bytes,
    model_state_bytes,
    optimizer_bytes_per_param,
)
from sim.model.params import count_params, layer_params


def in_flight(s: Scenario, rank: int) -> float:
    """Micro-batches' worth of the rank's layers (all its chunks) whose activations the pipeline
    keeps alive at its peak."""
    p, m = s.parallelism, s.training.grad_accum_steps
    if p.pp == 1:
        if s.collectives.a2a_overlap and m >= 2:
            # Megatron's combined 1F1B runs layer i's forward of micro-batch j + 1 beside layer L - 1 - i's
            # backward of j and frees each backward layer's state as it goes
            # (model_chunk_schedule_plan.py, run()): one micro-batch's layers plus one layer alive
            layers = sum(len(vs.layers) for vs in rank_chunks(s)[rank])
            return 1.0 + 1.0 / max(layers, 1)
        return 1.0
    if p.schedule == "dualpipe":
        # DeepSeek-V3 table 2: PP + 1 micro-batches of one stage; a rank runs two stages (r, pp-1-r)
        return min(p.pp + 1, m) / 2
    if p.schedule == "interleaved" and p.vpp > 1:
        chunks = min((p.pp - rank - 1) * 2 + (p.vpp - 1) * p.pp + 1, m * p.vpp)
        return chunks / p.vpp
    return float(min(p.pp - rank, m))


def _block(s: Scenario, i: int) -> tuple[int, int]:
    """(non-expert, expert) parameters per rank of layer ``i``: dense weights over tp, its rank's experts over etp."""
    lp, p = layer_params(s.model, i), s.parallelism
    ne = lp.tp_sharded // p.tp + lp.shared_expert + lp.router + lp.norms
    return ne, ceil_div(lp.expert_each * s.experts_per_rank, p.etp)


def _root(s: Scenario, rank: int) -> int:
    """Non-expert parameters per rank of stage ``rank``'s embedding, LM head and final norm."""
    m, p = s.model, s.parallelism
    counts = count_params(m)
    output = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size
    final_norm = counts.norms - sum(layer_params(m, i).norms for i in range(m.num_layers))
    root = 0
    for vs in rank_chunks(s)[rank]:
        if vs.embedding:
            root += (counts.embedding - output) // p.tp
        if vs.head:
            root += output // p.tp + final_norm
    return root


def _stage_params(s: Scenario, rank: int) -> tuple[int, int, list[int]]:
    """(non-expert params, expert params, layers) on one rank of pipeline stage ``rank``."""
    counts = count_params(s.model)
    layers = [i for vs in rank_chunks(s)[rank] for i in vs.layers]
    blocks = [_block(s, i) for i in layers]
    ne, ex = sum(b[0] for b in blocks) + _root(s, rank), sum(b[1] for b in blocks)
    if any(vs.head for vs in rank_chunks(s)[rank]):
        ne += counts.mtp - counts.mtp_expert
        ex += ceil_div(counts.mtp_expert, s.ep * s.parallelism.etp)
    return ne, ex, layers


def fsdp2_gathered_bytes(s: Scenario, rank: int) -> int:
    """Bytes of the unsharded parameter copies FSDP2's all-gathers hold at stage ``rank``'s peak."""
    wb = BYTES_PER_ELEMENT[storage_dtype(s.training.dtype)]
    dense, experts = s.dp * s.parallelism.cp > 1, s.edp > 1
    pairs = [_block(s, i) for vs in rank_chunks(s)[rank] for i in vs.layers]
    blocks = [ne * dense + ex * experts for ne, ex in pairs]
    if s.training.reshard_after_forward:
        live = max((a + b for a, b in zip(blocks, blocks[1:], strict=False)), default=sum(blocks))
    else:
        live = sum(blocks)
    return (live + _root(s, rank) * dense) * wb


def _states(s: Scenario, ne: int, ex: int) -> tuple[int, int, int, int]:
    """(weights, gradients, optimizer states, host) bytes of ``ne`` dense and ``ex`` expert params."""
    t = s.training
    wb = BYTES_PER_ELEMENT[storage_dtype(t.dtype)]
    k = optimizer_bytes_per_param(storage_dtype(t.dtype), t.optimizer)
    offload = t.offload_optimizer == "cpu"
    dp_shard = s.dp * s.parallelism.cp
    if t.framework == "megatron":  # bf16 weights + main grads everywhere, fp32 states sharded
        w = (ne + ex) * wb
        # Megatron-Core's grad buffer: fp32 when gradients are reduced in fp32, else the params' dtype
        g = (ne + ex) * grad_reduce_bytes(t.dtype, t.grad_reduce_dtype)
        o = ceil_div(ne, dp_shard) * k + ceil_div(ex, s.edp) * k
        return w, g, o, 0
    stage = 3 if t.framework == "fsdp2" else s.parallelism.zero_stage
    a = model_state_bytes(ne, dp_shard, stage, wb, k, offload)
    b = model_state_bytes(ex, s.edp, stage, wb, k, offload)
    return a[0] + b[0], a[1] + b[1], a[2] + b[2], a[3] + b[3]


def _checkpointed(s: Scenario, rank: int, layers: list[int]) -> set[int]:
    """The layers whose backward recomputes their forward (all under full checkpointing, or the first
    ``recompute_num_layers`` of each of the rank's chunks)."""
    n = s.training.recompute_num_layers
    if n is None:
        return set(layers)
    return {i for vs in rank_chunks(s)[rank] for i in vs.layers[:n]}


def _not_kept(s: Scenario, tokens: int, rows: int, act: int, layer: int) -> float:
    """Bytes of one layer's activations that selective recompute's modules drop (their outputs are
    recomputed in backward; terms of :func:`~sim.model.memory.layer_activation_bytes`): ``layernorm`` the
    two norms' outputs, ``moe_act`` the experts' activation output, ``mla_up_proj`` MLA's Q, K and V,
    ``mlp`` / ``moe`` / ``shared_experts`` everything their block keeps but its input. ``core_attn``
    keeps its inputs and output: under FlashAttention nothing more is dropped."""
    m, mods, d = s.model, s.training.recompute_set, s.model.hidden_size
    gin = saved_gemm_input_bytes(s.training.dtype, s.training.fp8_recipe) or act

    def ffn(n: int, width: int, with_input: bool, din: int = d) -> float:  # an FFN's kept bytes, its fc1 input or not
        kept = ffn_activation_elements(n, din, width, m.ffn_type) * act
        kept -= ffn_gemm_input_elements(n, din, width, m.ffn_type) * (act - gin)
        return kept if with_input else kept - n * din * gin

    moe, ffn_kind = bool(layer_params(m, layer).num_experts), m.layer_ffn(layer)
    out = m.norms_per_layer * tokens * d * act if "layernorm" in mods and m.layer_mixer(layer) != "mamba" else 0
    if moe:
        width = m.moe_ffn_hidden_size or d
        shared = m.num_shared_experts * (m.shared_expert_ffn_hidden_size or width)
        if "moe" in mods:
            w, latent = m.moe_token_width, m.moe_latent_size or 0  # LatentMoE: experts and combine at the latent width
            out += ffn(rows, width, True, w)  # dispatched rows and all after them
            out += 2 * tokens * m.num_experts * FP32_BYTES + tokens * m.top_k * FP32_BYTES + (rows * w + tokens * latent) * act
            out += ffn(tokens, shared, False) if shared else 0
        else:
            out += rows * width * gin if "moe_act" in mods else 0  # the activation's output is fc2's input
            out += ffn(tokens, shared, False) if "shared_experts" in mods and shared else 0
    elif "mlp" in mods and ffn_kind == "dense":
        out += ffn(tokens, m.ffn_hidden_size or d, False)
    if "mla_up_proj" in mods and m.attention == "mla" and m.layer_mixer(layer) == "attention":
        qk = (m.qk_nope_head_dim or 0) + (m.qk_rope_head_dim or 0)
        out += tokens * m.num_attention_heads * (2 * qk + (m.v_head_dim or 0)) * act
    return out


def _activations(s: Scenario, layers: list[int], rank: int, head: bool) -> int:
    m, t, p = s.model, s.training, s.parallelism
    act = BYTES_PER_ELEMENT[storage_dtype(t.dtype)]
    split = p.cp * (p.tp if s.sequence_parallel else 1)
    tokens = t.micro_batch_size * t.seq_len // split
    rows = s.routed_tokens_per_rank * m.top_k
    gin = saved_gemm_input_bytes(t.dtype, t.fp8_recipe)  # FP8: GEMM inputs kept quantized
    per = [layer_activation_bytes(m, tokens, t.seq_len, t.micro_batch_size, act,
                                  rows if layer_params(m, i).num_experts else None, gemm_input_bytes=gin, layer=i)
           for i in layers]  # fmt: skip
    logits = tokens * m.vocab_size // p.tp * FP32_BYTES if head else 0
    if not per:
        return logits
    if t.activation_checkpointing == "full":
        ck = _checkpointed(s, rank, layers)
        kept = [a for i, a in zip(layers, per, strict=True) if i not in ck]
        one = len(ck) * tokens * m.hidden_size * act + sum(kept)
        return int(one * in_flight(s, rank)) + (max(per) if ck else 0) + logits
    if t.activation_checkpointing == "selective":  # what the recompute_modules no longer keep
        saved = [_not_kept(s, tokens, rows, act, i) for i in layers]
        per = [max(a - b, 0) for a, b in zip(per, saved, strict=True)]
    return int(sum(per) * in_flight(s, rank)) + logits


def memory_per_stage(s: Scenario) -> list[MemoryBreakdown]:
    """One :class:`MemoryBreakdown` per pipeline stage (its rank's peak estimate)."""
    out = []
    for rank in range(s.parallelism.pp):
        ne, ex, layers = _stage_params(s, rank)
        w, g, o, host = _states(s, ne, ex)
        if s.training.framework == "fsdp2":
            w += fsdp2_gathered_bytes(s, rank)
        head = any(vs.head for vs in rank_chunks(s)[rank])
        act = _activations(s, layers, rank, head)
        a2a = 2 * s.routed_tokens_per_rank * s.model.top_k * s.model.hidden_size * BYTES_PER_ELEMENT[
            storage_dtype(s.training.dtype)] if s.model.num_moe_layers and s.ep > 1 else 0  # fmt: skip
        out.append(MemoryBreakdown(w, g, o, act, a2a, host * s.gpus_per_node, s.topology.gpu.hbm_GiB))
    return out


def stage_memory_record(s: Scenario) -> dict:
    """The JSON ``memory`` section of a layout: the worst stage's figures and ``per_stage``."""
    stages = memory_per_stage(s)
    worst = max(stages, key=lambda b: b.total)
    rec = worst.as_dict()
    rec["per_stage"] = [{"stage": i, "peak_GiB_per_gpu": b.total / GiB, "fits": b.fits,
                         "in_flight_micro_batches": in_flight(s, i)} for i, b in enumerate(stages)]  # fmt: skip
    rec["fits"] = all(b.fits for b in stages)
    return rec


__all__ = ["fsdp2_gathered_bytes", "in_flight", "memory_per_stage", "stage_memory_record"]
