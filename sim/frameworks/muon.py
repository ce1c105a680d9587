"""Muon as Megatron-Core runs it (``optimizer: dist_muon``: ``LayerWiseDistributedOptimizer`` around
``emerging_optimizers``' Muon; ``megatron/core/optimizer/layer_wise_optimizer.py``, ``optimizer_config.py``).

- **Which parameters.** Every 2-D weight matrix but the embedding and the output layer
  (``is_managed_by_layer_wise_optimizer``); the rest (norms, biases, embeddings) take the scalar
  optimizer, Adam (``muon_scalar_optimizer``). ``muon_split_qkv`` (default on) orthogonalizes a fused
  QKV projection as its Q, K and V matrices.
- **The update.** Momentum SGD (``muon_momentum``), then the momentum matrix orthogonalized by
  ``muon_num_ns_steps`` = 5 quintic Newton-Schulz steps: for an ``m x n`` matrix (``m <= n``),
  ``A = X X^T``, ``B = b A + c A A``, ``X = a X + B X``: three GEMMs of ``m m n``, ``m m m`` and
  ``m n m``; ``muon_fp32_matmul_prec`` "medium" lets them run as BF16 GEMMs. With tensor parallelism
  the default ``muon_tp_mode`` "duplicated" orthogonalizes the whole matrix on every TP rank.
- **Who does it.** Each data-parallel rank owns whole layers' parameters (weights split into lists,
  one per rank) and updates only those: a rank runs ``1 / dp`` of its stage's dense matrices and
  ``1 / edp`` of its experts'. Gradients are all-reduced (every rank has the full gradient), and the
  updated parameters all-gathered after the step.
- **Memory.** fp32 master weights and one fp32 momentum: 8 bytes per parameter (Adam: 12;
  :func:`sim.model.memory.optimizer_bytes_per_param`).
"""

from __future__ import annotations

from sim.hardware.costs import CostModel
from sim.inputs.scenario import Scenario
from sim.model.flops import (
    Gemm,
    attention_gemms,
    dense_ffn_gemms,
    expert_gemms,
    router_gemm,
    shared_expert_gemms,
)

#: muon_num_ns_steps (Megatron-Core OptimizerConfig default)
NS_STEPS = 5
#: HBM bytes per parameter of Muon's elementwise part: read the gradient (4), read and write the fp32
#: momentum (8) and master weight (8), write the bf16 weight (2)
MUON_BYTES_PER_PARAM = 22.0


def _split_qkv(m, gemms: list[Gemm]) -> list[Gemm]:
    """``muon_split_qkv``: a fused QKV weight as its query, key and value matrices."""
    out = []
    for g in gemms:
        if g.name == "linear_qkv":
            hd = m.head_size
            out += [Gemm("q", m.num_attention_heads * hd, g.k), Gemm("k", m.kv_heads * hd, g.k),
                    Gemm("v", m.kv_heads * hd, g.k)]  # fmt: skip
        else:
            out.append(g)
    return out


def layer_matrices(s: Scenario, layer: int) -> tuple[list[Gemm], list[Gemm]]:
    """(dense, one routed expert's) weight matrices of ``layer`` Muon orthogonalizes, whole (not split
    by tensor parallelism: ``muon_tp_mode`` duplicated)."""
    m = s.model
    dense = _split_qkv(m, attention_gemms(m))
    if m.is_moe_layer(layer):
        return dense + shared_expert_gemms(m) + [router_gemm(m)], expert_gemms(m)
    return dense + dense_ffn_gemms(m), []


def newton_schulz_s(cost: CostModel, g: Gemm) -> float:
    """Seconds of the Newton-Schulz steps on one ``g.k x g.n`` matrix (BF16 GEMMs on the GPU's curve)."""
    a, b = min(g.n, g.k), max(g.n, g.k)
    step = cost.gemm_time(a, a, b, "bf16") + cost.gemm_time(a, a, a, "bf16") + cost.gemm_time(a, b, a, "bf16")
    return NS_STEPS * step


def muon_step_s(s: Scenario, cost: CostModel, layers: list[int], owned_params: float) -> float:
    """One rank's Muon step: the Newton-Schulz GEMMs of the matrices it owns (its stage's dense ones over
    ``dp x cp``, its experts' over ``edp``) and the elementwise update of its ``owned_params``."""
    dp_shard = s.dp * s.parallelism.cp
    ns = 0.0
    for i in layers:
        dense, expert = layer_matrices(s, i)
        ns += sum(newton_schulz_s(cost, g) for g in dense) / dp_shard
        ns += sum(newton_schulz_s(cost, g) for g in expert) * s.experts_per_rank / s.edp
    return ns + owned_params * MUON_BYTES_PER_PARAM / cost.hbm_Bps + cost.optimizer_overhead_s


__all__ = ["MUON_BYTES_PER_PARAM", "NS_STEPS", "layer_matrices", "muon_step_s", "newton_schulz_s"]
