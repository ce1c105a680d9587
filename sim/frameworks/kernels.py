"""Kernel time of every block of a transformer layer on every rank (framework-independent).

Per micro-batch and layer: ``attention`` (norm, QKV/out GEMMs, attention core, rope, residual),
MoE: ``route`` (norm, router GEMM, top-k), ``permute`` / ``unpermute`` (the token dispatcher's
gathers), ``experts`` (grouped GEMMs over the rows each local expert really receives),
``shared_experts``; dense: ``mlp``; and ``embedding``, ``output`` (LM head and loss). Backward:
GEMMs cost their input-gradient plus weight-gradient GEMMs (about twice the forward FLOPs), the
attention core 2.5x forward (FlashAttention-2's backward).
"""

from __future__ import annotations

import numpy as np

from sim.frameworks.dispatcher import dispatcher_work
from sim.hardware.costs import CostModel
from sim.inputs.scenario import Scenario
from sim.model.dtypes import BYTES_PER_ELEMENT
from sim.model.flops import (
    attention_core_flops,
    attention_gemms,
    dense_ffn_gemms,
    expert_gemms,
    lm_head_gemm,
    router_gemm,
    shared_expert_gemms,
)
from sim.routing.plan import RoutingPlan

#: FlashAttention-2 backward: 5 matmuls against the forward's 2, i.e. 2.5x the forward FLOPs.
ATTENTION_BWD_FACTOR = 2.5
#: HBM bytes per logit of a fused cross entropy, each way: read the fp32 logits once (forward: loss and
#: softmax; backward: the gradient) and write once.
FUSED_CE_BYTES = 8.0
COMPUTE_NAMES = (
    "embedding", "attention", "route", "permute", "experts", "unpermute", "shared_experts", "mlp", "output", "grad_hooks",
)  # fmt: skip


class KernelBlocks:
    """(forward s, backward s, forward FLOPs) of each named block of a layer on every rank: GEMMs
    through the cost model's roofline, memory-bound kernels at HBM speed, the token dispatcher's
    pieces, the experts' grouped GEMMs over the rows each local expert receives."""

    def __init__(self, s: Scenario, plan: RoutingPlan | None, cost: CostModel, factor: np.ndarray):
        self.s, self.plan, self.cost, self.factor = s, plan, cost, factor
        self.kernel_factor = factor * cost.compute_scale  # stragglers x the calibrated in-job factor
        m, t = s.model, s.training
        self.m, self.dt, self.bpe = m, t.dtype, BYTES_PER_ELEMENT[t.dtype]
        self.world = s.world_size
        self.T = s.tokens_per_micro_batch
        self._cache: dict = {}

    # ---- kernel blocks (forward, backward) as (world,) arrays --------------------------------
    def _gemms(self, gemms, rows: float | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        fwd, bwd, fl = np.zeros(self.world), np.zeros(self.world), np.zeros(self.world)
        r = np.broadcast_to(np.asarray(rows, dtype=np.float64), (self.world,))
        for g in gemms:
            f, b = self.cost.gemm_train_times(r, g.n, g.k, self.dt)
            fwd, bwd, fl = fwd + f, bwd + b, fl + 2.0 * r * g.n * g.k
        return fwd, bwd, fl

    def _dispatcher(self, piece: str, tokens: int, slots: float | np.ndarray, drop: bool = True):
        """(forward s, backward s) of one piece of DeepSpeed's token dispatcher on every rank."""
        m = self.m
        ops_f, bytes_f, ops_b, bytes_b = dispatcher_work(
            piece, tokens, m.hidden_size, m.num_experts, m.top_k, slots, drop, self.bpe
        )
        full = np.ones(self.world)
        return self.cost.dispatcher_time(bytes_f * full, ops_f), self.cost.dispatcher_time(bytes_b * full, ops_b)

    def _mem(self, nbytes: float | np.ndarray, kernels: int = 1) -> np.ndarray:
        nb = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), (self.world,))
        return np.where(nb > 0, nb / self.cost.hbm_Bps + kernels * self.cost.launch_s, 0.0)

    def block(self, name: str, moe: int | None, micro: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(forward s, backward s, forward FLOPs) of one named block on every rank."""
        key = (name, moe if name in ("permute", "experts", "unpermute") else None, micro)
        if key[1] is None:
            key = (name, None, 0)
        if key not in self._cache:
            self._cache[key] = self._block(name, moe, micro)
        return self._cache[key]

    def _block(self, name: str, moe: int | None, micro: int):
        m, T, bpe, d = self.m, self.T, self.bpe, self.m.hidden_size
        norm = self._mem(2 * T * d * bpe)
        if name == "embedding":
            e = self._mem(2 * T * d * bpe)
            return e, e, np.zeros(self.world)
        if name == "attention":
            f, b, fl = self._gemms(attention_gemms(m), T)
            core = attention_core_flops(m, self.s.training.seq_len) * self.s.training.micro_batch_size
            io = 4 * T * m.num_attention_heads * m.head_size * bpe
            cf = self.cost.attention_time(core, io, self.dt)
            cb = self.cost.attention_time(ATTENTION_BWD_FACTOR * core, 2 * io, self.dt)
            extra = norm + self._mem(3 * T * d * bpe, kernels=2)  # rope, residual
            return f + cf + extra, b + cb + 2 * extra, fl + core
        if name == "mlp":
            f, b, fl = self._gemms(dense_ffn_gemms(m), T)
            return f + norm, b + 2 * norm, fl
        if name == "shared_experts":
            f, b, fl = self._gemms(shared_expert_gemms(m), T)
            return f, b, fl
        if name == "route":
            f, b, fl = self._gemms([router_gemm(m)], T)
            r = self.s.routing
            drop = not (r.dispatch == "dropless" or r.capacity_factor is None)
            topk_f, topk_b = self._dispatcher("gate", T, 0.0, drop)
            return f + norm + topk_f, b + 2 * norm + topk_b, fl
        if name == "output":
            f, b, fl = self._gemms([lm_head_gemm(m)], T)
            ce = self._mem(T * m.vocab_size * FUSED_CE_BYTES, kernels=2)
            return f + norm + ce, b + norm + ce, fl
        assert self.plan is not None and moe is not None
        plan = self.plan
        if name == "experts":
            rows = plan.expert_load(moe, micro)  # (world, experts_per_rank)
            f, b, fl = np.zeros(self.world), np.zeros(self.world), np.zeros(self.world)
            width = m.moe_ffn_hidden_size or d
            for e in range(rows.shape[1]):
                fe, be, fle = self._gemms(expert_gemms(m), rows[:, e])
                act = self._mem(rows[:, e] * width * bpe * (3 if m.ffn_type == "gated" else 2))
                f, b, fl = f + fe + act, b + be + 2 * act, fl + fle
            return f, b, fl
        if plan.padded is not None:  # DeepSpeed's sparse routes into / out of E x C slots
            c = np.repeat(plan.padded[moe, micro].astype(np.float64), self.s.ep)
            f, b = self._dispatcher("encode" if name == "permute" else "decode", T, m.num_experts * c)
            return f, b, np.zeros(self.world)
        copies = plan.pair_copies(moe, micro).sum(axis=1).astype(np.float64)  # token copies this rank sends
        gathered = self.cost.dispatcher_time(2 * copies * d * bpe, 1)  # permute: gather; unpermute: weighted scatter
        return gathered, gathered, np.zeros(self.world)


__all__ = ["ATTENTION_BWD_FACTOR", "COMPUTE_NAMES", "FUSED_CE_BYTES", "KernelBlocks"]
