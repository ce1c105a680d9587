"""One training step as ops per rank, the way DeepSpeed runs expert parallelism with data parallelism
and ZeRO (pure: no SimPy here; :mod:`sim.engine` runs the ops).

Every rank runs the same op sequence; only durations differ from rank to rank (its experts' token
counts, stragglers), so an op holds a ``(world,)`` array of seconds. Per micro-batch and layer:

forward   ``attention`` (norm, QKV/out GEMMs, attention core) | MoE: ``route`` (norm, router GEMM,
          top-k), ``permute`` (DeepSpeed's sparse routes: a gather of S
          tokens into E x C slots, memory bound; or the dropless gather), all-to-all ``dispatch``, ``experts`` (grouped GEMMs over the rows each
          local expert really receives), all-to-all ``combine``, ``unpermute`` (gather of the k S
          routes back and their gate-weighted sum, or the weighted scatter), ``shared_experts`` | dense: ``mlp``.
backward  mirrored in reverse: GEMMs cost their input-gradient plus weight-gradient GEMMs (about
          twice the forward FLOPs), the attention core 2.5x forward (FlashAttention-2's backward),
          the all-to-alls again (gradient of combine runs in the dispatch direction, gradient of
          dispatch in the combine direction). Activation checkpointing recomputes each layer's
          forward, all-to-alls included, before its backward.
gradients ``GradReady`` hands a layer's gradients to the comm stream (bucketed by the engine):
          non-expert over the data-parallel group, expert over the expert-data-parallel group;
          ZeRO-0 all-reduces after the last backward, ZeRO-1 during the last micro-batch's
          backward, ZeRO-2 during every backward: DeepSpeed 0.19's ZeRO-1/2 all-reduce each
          gradient bucket and keep the rank's partition (``average_tensor`` ->
          ``allreduce_and_scatter``, ``use_multi_rank_bucket_allreduce`` true by default), twice a
          reduce-scatter's bytes; ZeRO-3 reduce-scatters, and all-gathers each layer's parameters
          before its forward and backward (one layer of prefetch).
tail      wait for the comm stream, the optimizer (fused Adam on the GPU, or offloaded: gradients
          over PCIe, DeepSpeedCPUAdam, parameters back), then ZeRO-1/2's parameter all-gather.

Span names are Megatron-Core's (``attention``, ``route``, ``dispatch``, ``experts``, ``combine``,
``grad_sync``, ``optimizer``) so that simulated spans and hw_validate's timed regions match.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sim.costs import BYTES_PER_ELEMENT, CostModel, ceil_div, cpu_adam_time
from sim.flops import (
    attention_core_flops,
    attention_gemms,
    dense_ffn_gemms,
    expert_gemms,
    lm_head_gemm,
    router_gemm,
    shared_expert_gemms,
)
from sim.modelspec import count_params, layer_params, layer_tensors, outer_tensors
from sim.routing import RoutingPlan
from sim.scenario import Scenario

#: Eager ops (forward, backward) of DeepSpeed's (0.19.x) sparse-route encode and decode
#: (``_route_slots`` + ``_sparse_encode``; ``_sparse_decode``), counted from the code.
PERMUTE_OPS = (10, 4)
UNPERMUTE_OPS = (6, 8)
#: Eager ops (forward, backward) of DeepSpeed's (0.19.8) ``TopKGate.forward`` with sparse routes,
#: less the router GEMM (priced as one) and view-only ops (view, permute, t, detach, unsqueeze, ...):
#: aten ops dispatched by the real gate (``top1gating`` / ``top2gating`` / ``topkgating``), counted with
#: a TorchDispatchMode at 256 tokens, 8 experts (the counts do not depend on the sizes). Keyed by
#: (k if k <= 2 else "k", drop_tokens): the dropless gate skips the capacity masks.
GATE_OPS = {(1, True): (48, 7), (1, False): (49, 7), (2, True): (91, 39), (2, False): (71, 39),
            ("k", True): (43, 22), ("k", False): (35, 22)}  # fmt: skip
DISPATCHER_PIECES = ("gate", "encode", "decode")


def dispatcher_work(piece: str, tokens: int, d: int, experts: int, k: int, slots: float | np.ndarray,
                    drop: bool, bpe: int) -> tuple[int, float | np.ndarray, int, float | np.ndarray]:  # fmt: skip
    """(forward ops, forward bytes, backward ops, backward bytes) of one piece of DeepSpeed's
    (0.19.x) token dispatcher for ``tokens`` tokens of width ``d`` into ``slots`` = E x C rows:

    ``gate``   ``TopKGate`` less its router GEMM: softmax, top-k, masks, cumsum, aux loss over
               [S, E] fp32 (:data:`GATE_OPS`);
    ``encode`` ``_route_slots`` + ``_sparse_encode``: slot map (scatter), cat of a zero pad row,
               index_select of E C rows; backward: index_add of E C rows into zeros, slice of the pad;
    ``decode`` ``_sparse_decode``: cat a pad row, index_select k S rows, multiply by the gates, sum
               over the k routes; backward: the mirror plus the gate gradient (mul + sum).

    The simulator prices them as ``ops x dispatcher_op_s + bytes / dispatcher_Bps``
    (:meth:`sim.costs.CostModel.dispatcher_time`); ``moesim calibrate`` times the real pieces and
    fits the two constants through this same function."""
    if piece == "gate":
        ops_f, ops_b = GATE_OPS[(k if k <= 2 else "k", drop)]
        nb = 3.0 * tokens * experts * 4
        return ops_f, nb, ops_b, nb
    if piece == "encode":
        return (PERMUTE_OPS[0], (2 * tokens + 2 * slots) * d * bpe,
                PERMUTE_OPS[1], (2 * tokens + 3 * slots) * d * bpe)  # fmt: skip
    if piece == "decode":
        return (UNPERMUTE_OPS[0], (2 * slots + 5 * k * tokens + tokens) * d * bpe,
                UNPERMUTE_OPS[1], (3 * slots + 7 * k * tokens) * d * bpe)  # fmt: skip
    raise ValueError(f"unknown dispatcher piece {piece!r}; one of {DISPATCHER_PIECES}")


#: FlashAttention-2 backward: 5 matmuls against the forward's 2, i.e. 2.5x the forward FLOPs.
ATTENTION_BWD_FACTOR = 2.5
COMPUTE_NAMES = (
    "embedding", "attention", "route", "permute", "experts", "unpermute", "shared_experts", "mlp", "output", "grad_hooks",
)  # fmt: skip


@dataclass
class Compute:
    """Kernels run back to back on the compute stream: ``durs[i, r]`` seconds of ``names[i]`` on rank r."""

    names: list[str]
    durs: np.ndarray
    flops: np.ndarray
    phase: str
    layer: int
    micro: int

    @property
    def total(self) -> np.ndarray:
        return self.durs.sum(axis=0)


@dataclass
class AllToAll:
    """An all-to-all over every EP group at once; ``direction`` picks the DAG's direction."""

    name: str  # dispatch | combine
    direction: str  # dispatch | combine (the data's direction)
    moe: int
    layer: int
    micro: int
    phase: str


@dataclass
class CapacitySync:
    """DeepSpeed's drop-free gate (``drop_tokens=False``): the capacity (the largest expert load) is
    all-reduced (MAX, int64) over the EP group in every MoE layer's forward, a blocking rendezvous
    between the router and the permute (``sim.engine`` runs it on the comm stream and waits)."""

    moe: int
    layer: int
    micro: int
    phase: str
    nbytes: float = 8.0


@dataclass
class GradReady:
    """Gradients of ``layer`` are ready for reduction: parameters per rank (non-expert, local expert)."""

    layer: int
    nonexpert: int
    expert: int
    flush: bool = False  # the last gradients of this backward: reduce what is left in the buckets
    blocking: bool = False  # overlap_comm off: the compute stream waits until the reduction ends


@dataclass
class Gather:
    """ZeRO-3: start the all-gather of ``layer``'s parameters on the comm stream (prefetch)."""

    key: tuple
    nonexpert: int
    expert: int


@dataclass
class WaitGather:
    key: tuple


@dataclass
class Tail:
    """End of the step: optimizer and parameter all-gathers (seconds / parameters per rank)."""

    optimizer_s: np.ndarray
    offload_bytes: float  # each way over PCIe per rank (0 without offload)
    cpu_adam_s: float
    gather_nonexpert: int  # ZeRO-1/2 post-step all-gather, parameters per rank's partition x group
    gather_expert: int
    #: ZeRO-1/2/3 compute the global gradient norm before the update (DeepSpeed's
    #: ``scaled_global_norm``): per parameter group (non-expert, then the experts') the norm of the
    #: rank's partition (``norm_s[g]``, seconds per rank) and an fp32 all-reduce over the
    #: data-parallel group (``get_grad_norm_direct``), then the expert group's norm again over the
    #: expert-data-parallel group (``_average_expert_grad_norms``); blocking the step
    norm_reduce: bool = False
    norm_s: list = field(default_factory=list)
    #: CPU ranks (sim.schedule.apply_wake_delay): seconds a rank resumes late after the gradient
    #: norm's all-reduce (before the optimizer) and after the post-step parameter all-gather
    wake_norm_s: np.ndarray | None = None
    wake_gather_s: np.ndarray | None = None
    #: CPU ranks: seconds every rank resumes late after each of the tail's blocking calls
    #: (calibration ``call_overhead_us``)
    call_overhead_s: float = 0.0


@dataclass
class Schedule:
    ops: list
    tail: Tail
    world: int
    grad_kind: str  # all_reduce | reduce_scatter
    grad_bytes_per_param: int
    param_bytes_per_param: int
    model_flops: float  # useful training FLOPs of the step, all ranks (6N + attention, for MFU)
    stats: dict = field(default_factory=dict)


class _Builder:
    def __init__(self, s: Scenario, plan: RoutingPlan | None, cost: CostModel, factor: np.ndarray):
        self.s, self.plan, self.cost, self.factor = s, plan, cost, factor
        self.kernel_factor = factor * cost.compute_scale  # stragglers x the calibrated in-job factor
        m, t = s.model, s.training
        self.m, self.dt, self.bpe = m, t.dtype, BYTES_PER_ELEMENT[t.dtype]
        self.world = s.world_size
        self.T = s.tokens_per_micro_batch
        self.ops: list = []
        self._cache: dict = {}

    # ---- kernel blocks (forward, backward) as (world,) arrays --------------------------------
    def _full(self, x: float) -> np.ndarray:
        return np.full(self.world, float(x))

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

    def grad_hooks(self, params: int, layer: int, micro: int, epilogue: bool = False) -> None:
        """ZeRO-1/2's backward beyond autograd, when the calibration measured it
        (``zero_grad_hook_*``): DeepSpeed's gradient hooks copying each of the rank's ``params``
        gradients into the reduce bucket; ``epilogue``: instead its fixed cost, the backward's
        epilogue after the last bucket's reduction (``independent_gradient_partition_epilogue``:
        gradients copied into the rank's partition, buckets released), ``zero_epilogue``."""
        cal = self.cost.calibration
        if cal is None or cal.zero_grad_hook_ns_per_param is None or self.s.parallelism.zero_stage not in (1, 2):
            return
        if epilogue:
            dur, name = (cal.zero_grad_hook_overhead_us or 0.0) * 1e-6, "zero_epilogue"
        else:
            dur, name = params * cal.zero_grad_hook_ns_per_param * 1e-9, "grad_hooks"
        if dur > 0:
            d = np.full((1, self.world), dur) * self.factor
            self.ops.append(Compute([name], d, np.zeros((1, self.world)), "bwd", layer, micro))

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
            ce = self._mem(2 * T * m.vocab_size * 4, kernels=2)
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
        copies = plan.kept[moe, micro].sum(axis=1).astype(np.float64)  # token copies this rank sends
        gathered = self.cost.dispatcher_time(2 * copies * d * bpe, 1)  # permute: gather; unpermute: weighted scatter
        return gathered, gathered, np.zeros(self.world)

    def _gemm_rows(self, rows: np.ndarray, n: float, k: np.ndarray | float) -> np.ndarray:
        out = np.zeros(self.world)
        kk = np.broadcast_to(np.asarray(k, dtype=np.float64), (self.world,))
        for val in np.unique(kk):
            sel = kk == val
            out[sel] = self.cost.gemm_times(rows[sel], n, float(val), self.dt)
        return out

    # ---- op emission ------------------------------------------------------------------------
    def compute(self, parts: list[tuple[str, int | None]], phase: str, layer: int, micro: int) -> None:
        names, durs, flops = [], [], []
        for name, moe in parts:
            f, b, fl = self.block(name, moe, micro)
            if not np.any(f if phase != "bwd" else b) and name not in ("embedding",):
                continue
            names.append(name)
            durs.append((b if phase == "bwd" else f) * self.kernel_factor)
            flops.append(fl * (2.0 if phase == "bwd" else 1.0))
        if names:
            self.ops.append(Compute(names, np.stack(durs), np.stack(flops), phase, layer, micro))

    def layer_forward(self, i: int, moe: int | None, micro: int, phase: str) -> None:
        m = self.m
        if moe is None:
            self.compute([("attention", None), ("mlp", None)], phase, i, micro)
            return
        r = self.s.routing
        if r.dispatch == "capacity_padded" and r.capacity_factor is None and self.s.ep > 1:
            # DeepSpeed's drop_tokens=False gate: all-reduce (MAX) of the capacity over the EP group
            self.compute([("attention", None), ("route", None)], phase, i, micro)
            self.ops.append(CapacitySync(moe, i, micro, phase))
            self.compute([("permute", moe)], phase, i, micro)
        else:
            self.compute([("attention", None), ("route", None), ("permute", moe)], phase, i, micro)
        self.ops.append(AllToAll("dispatch", "dispatch", moe, i, micro, phase))
        self.compute([("experts", moe)], phase, i, micro)
        self.ops.append(AllToAll("combine", "combine", moe, i, micro, phase))
        tail = [("unpermute", moe)] + ([("shared_experts", None)] if m.num_shared_experts else [])
        self.compute(tail, phase, i, micro)

    def layer_backward(self, i: int, moe: int | None, micro: int) -> None:
        m = self.m
        if moe is None:
            self.compute([("mlp", None), ("attention", None)], "bwd", i, micro)
            return
        head = [("unpermute", moe)] + ([("shared_experts", None)] if m.num_shared_experts else [])
        self.compute(head, "bwd", i, micro)
        self.ops.append(AllToAll("combine", "dispatch", moe, i, micro, "bwd"))
        self.compute([("experts", moe)], "bwd", i, micro)
        self.ops.append(AllToAll("dispatch", "combine", moe, i, micro, "bwd"))
        self.compute([("permute", moe), ("route", None), ("attention", None)], "bwd", i, micro)


def apply_jitter(ops: list, jitter) -> None:
    """Multiply every kernel of every rank by its own draw of ``jitter(rank, n)`` (in op order, so a
    rank's draws do not depend on other ranks)."""
    computes = [op for op in ops if isinstance(op, Compute)]
    n = sum(len(op.names) for op in computes)
    if not n:
        return
    world = computes[0].durs.shape[1]
    factors = np.stack([np.asarray(jitter(r, n), dtype=np.float64) for r in range(world)], axis=1)
    at = 0
    for op in computes:
        k = len(op.names)
        op.durs = op.durs * factors[at : at + k]
        at += k


def apply_segment_noise(ops: list, tail_s: np.ndarray, noise) -> np.ndarray:
    """Scale every compute segment (one :class:`Compute` op: the kernels between two collectives)
    of every rank by its own draw of ``noise(rank, n)`` -- all kernels of a segment by the same
    factor, since the spread measured between ranks is of whole segments (a slower core, a
    preemption), not of independent kernels -- and each of the tail's segments (``tail_s``: (world,)
    or (segments, world), the optimizer step and the gradient norm's parts) by one more draw each;
    returns the scaled ``tail_s``. Draws are in op order per rank, as in :func:`apply_jitter`."""
    computes = [op for op in ops if isinstance(op, Compute)]
    tail = np.atleast_2d(np.asarray(tail_s, dtype=np.float64))
    world = tail.shape[1]
    factors = np.stack([np.asarray(noise(r, len(computes) + len(tail)), dtype=np.float64) for r in range(world)], axis=1)
    for i, op in enumerate(computes):
        op.durs = op.durs * factors[i][None, :]
    return (tail * factors[len(computes) :]).reshape(np.shape(tail_s))


def apply_pauses(ops: list, tail_s: np.ndarray, rate_per_s: float, mean_s: float, seed: int) -> np.ndarray:
    """Rank-local stalls of CPU ranks (calibration ``pause_rate_per_s``, ``pause_mean_s``): while a
    rank computes, the OS may run another thread on its core or Python's garbage collector may run,
    and the rank stops for a few milliseconds. Model: a Poisson process over each rank's compute
    time -- a segment (one :class:`Compute` op) of ``d`` seconds on rank ``r`` gets
    ``N ~ Poisson(rate_per_s d)`` stalls, each of exponential length with mean ``mean_s`` -- so the
    segment takes ``d + sum``; its kernels are stretched by the same factor (the stall lands inside
    the segment's phases, as in the job's timers). The tail's segments (``tail_s``: (world,) or
    (segments, world)) draw the same way; returns the stretched ``tail_s``. Rank ``r`` draws from its own stream
    ``SeedSequence(seed, spawn_key=(r,))``, in op order: the same scenario gives the same schedule,
    and what a rank draws does not depend on the others."""
    if rate_per_s <= 0 or mean_s <= 0:
        return tail_s
    computes = [op for op in ops if isinstance(op, Compute)]
    out = np.atleast_2d(np.array(tail_s, dtype=np.float64))
    for r in range(out.shape[1]):
        rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(r,)))
        for op in computes:
            d = float(op.durs[:, r].sum())
            n = int(rng.poisson(rate_per_s * d)) if d > 0 else 0
            if n:
                op.durs[:, r] = op.durs[:, r] * (1.0 + float(rng.gamma(n, mean_s)) / d)
        for row in out:
            d = float(row[r])
            n = int(rng.poisson(rate_per_s * d)) if d > 0 else 0
            if n:
                row[r] = d + float(rng.gamma(n, mean_s))
    return out.reshape(np.shape(tail_s))


#: seed offsets of the calibrated noise streams, and the stride between independent draws of them
NOISE_SEED, WAKE_SEED, PAUSE_SEED, DRAW_STRIDE = 7919, 104729, 15485863, 1_000_003

WAKE_KERNEL = "wake_wait"


def apply_wake_delay(ops: list, tail: Tail, p: float, cap_s: float, seed: int, groups: list[list[int]],
                     overhead_s: float = 0.0) -> None:  # fmt: skip
    """Late wake-ups of CPU ranks after blocking collectives (calibration ``wake_delay_p``,
    ``wake_delay_cap_s``; measured in a real reference job's per-call spans by
    :mod:`hw_validate.desync`, or by the :func:`hw_validate.microbench.bench_wake` loop).

    On a CPU host the ranks' compute threads and gloo's helper threads share the cores. When a
    blocking collective completes, the thread that wakes a rank is often placed on the core where
    the peer has just resumed computing, so that rank resumes only when the peer's compute yields
    the core (its next segment ends) or the scheduler's load balancer moves it (``cap_s``). Model:
    after every all-to-all and capacity all-reduce, each group draws once; with probability ``p``
    one of its ranks (drawn uniformly) starts its next compute segment late by
    ``min(the group's longest next segment, cap_s)``, a ``wake_wait`` kernel at the head of that
    segment. The tail's two blocking calls (the gradient norm's all-reduce before the optimizer,
    the parameter all-gather after it) draw the same way over the whole world (the step ends with
    the gather; its late rank pays ``cap_s`` at most, a full next step's first segment being longer).
    Draws come from one stream seeded by ``seed``, in op order: the same scenario gives the same
    schedule. ``overhead_s`` (calibration ``call_overhead_us``): every rank also resumes that much
    later after each blocking call, the flushing gradient all-reduce's included (no draw), and
    after each of the tail's calls (``tail.call_overhead_s``)."""
    tail.call_overhead_s = max(0.0, float(overhead_s))
    if (p <= 0 or cap_s <= 0) and tail.call_overhead_s <= 0:
        return
    if p <= 0 or cap_s <= 0:
        p = 0.0
    rng = np.random.default_rng(np.random.SeedSequence([int(seed), 0x57A4E]))
    world = len(tail.optimizer_s)

    def draw(group: list[int], seg_s: float, out: np.ndarray) -> None:
        """One draw for ``group``: maybe one of its ranks late by min(seg_s, cap_s), into ``out``."""
        if len(group) > 1 and rng.random() < p:
            out[group[int(rng.integers(len(group)))]] = min(seg_s, cap_s)

    pending = drawn = False
    for op in ops:
        if isinstance(op, AllToAll | CapacitySync):
            pending = drawn = True
        elif isinstance(op, GradReady) and op.blocking and op.flush:
            pending = True
        elif isinstance(op, Compute) and pending:
            pending = False
            seg = op.total
            delay = np.full(world, tail.call_overhead_s)
            if drawn:
                late = np.zeros(world)
                for g in groups:
                    draw(g, float(seg[g].max()), late)
                delay += late
            drawn = False
            if delay.any():
                op.names = [WAKE_KERNEL, *op.names]
                op.durs = np.vstack([delay[None, :], op.durs])
                op.flops = np.vstack([np.zeros((1, world)), op.flops])

    def tail_draw(seg_s: float) -> np.ndarray | None:
        out = np.zeros(world)
        draw(list(range(world)), seg_s, out)
        return out if out.any() else None

    if tail.norm_reduce:
        tail.wake_norm_s = tail_draw(float(np.max(tail.optimizer_s)))
    if tail.gather_nonexpert or tail.gather_expert:
        tail.wake_gather_s = tail_draw(cap_s)


def build_schedule(
    s: Scenario, plan: RoutingPlan | None, cost: CostModel, compute_factor: np.ndarray, jitter=None, draw: int = 0
) -> Schedule:
    """The ops of one step of scenario ``s`` (see the module docstring); ``compute_factor`` (world,)
    slows every kernel of a rank (stragglers), ``jitter(rank, n)`` draws per-kernel noise factors;
    ``draw`` picks an independent draw of the calibrated noise (segment noise, stalls, late
    wake-ups), as one step of a job is one draw of its ranks' noise (default 0)."""
    b = _Builder(s, plan, cost, compute_factor)
    m, t = s.model, s.training
    stage, micros = s.parallelism.zero_stage, t.grad_accum_steps
    moe_index, k = [], 0
    for i in range(m.num_layers):
        moe_index.append(k if m.is_moe_layer(i) else None)
        k += int(m.is_moe_layer(i))
    lp = [layer_params(m, i) for i in range(m.num_layers)]
    epr = s.experts_per_rank
    ne = [p.non_expert for p in lp]
    ex = [p.expert_each * epr for p in lp]
    counts = count_params(m)
    head = (0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size) + counts.norms - sum(p.norms for p in lp)
    emb = counts.embedding + counts.norms - sum(p.norms for p in lp) - head  # input table (+ tied head)
    overlap = s.collectives.overlap_comm and s.topology.gpu.async_comm  # CPU ranks: no comm stream
    for micro in range(micros):
        reduce_now = (stage >= 2) or (stage == 1 and micro == micros - 1)
        layer_keys = [("layer", micro, "fwd", i) for i in range(m.num_layers)]
        if stage == 3:
            b.ops.append(Gather(layer_keys[0], ne[0] + emb + head, ex[0]))  # embeddings and head too
        b.compute([("embedding", None)], "fwd", -1, micro)
        for i in range(m.num_layers):
            if stage == 3:
                if i + 1 < m.num_layers:
                    b.ops.append(Gather(layer_keys[i + 1], ne[i + 1], ex[i + 1]))
                b.ops.append(WaitGather(layer_keys[i]))
            b.layer_forward(i, moe_index[i], micro, "fwd")
        b.compute([("output", None)], "fwd", m.num_layers, micro)
        b.compute([("output", None)], "bwd", m.num_layers, micro)
        if reduce_now and head:
            b.grad_hooks(head, m.num_layers, micro)
            b.ops.append(GradReady(m.num_layers, head, 0, blocking=not overlap))
        bkeys = [("layer", micro, "bwd", i) for i in range(m.num_layers)]
        if stage == 3:
            b.ops.append(Gather(bkeys[-1], ne[-1] + head, ex[-1]))
        for i in reversed(range(m.num_layers)):
            if stage == 3:
                if i > 0:
                    b.ops.append(Gather(bkeys[i - 1], ne[i - 1], ex[i - 1]))
                b.ops.append(WaitGather(bkeys[i]))
            if t.activation_checkpointing:
                b.layer_forward(i, moe_index[i], micro, "recompute")
            b.layer_backward(i, moe_index[i], micro)
            if reduce_now:
                b.grad_hooks(ne[i] + ex[i], i, micro)
                b.ops.append(GradReady(i, ne[i], ex[i], blocking=not overlap))
        b.compute([("embedding", None)], "bwd", -1, micro)
        if reduce_now:
            b.grad_hooks(emb, -1, micro)
            b.ops.append(GradReady(-1, emb, 0, flush=True, blocking=not overlap))
            b.grad_hooks(0, -1, micro, epilogue=True)
    if stage == 0:
        b.ops.append(GradReady(-1, sum(ne) + emb + head, sum(ex), flush=True))
    if jitter is not None:
        apply_jitter(b.ops, jitter)
    dp, edp = s.dp, s.edp
    ne_total, ex_total = sum(ne) + emb + head + counts.mtp, sum(ex)
    opt_params = (-(-ne_total // dp) + -(-ex_total // edp)) if stage >= 1 else ne_total + ex_total
    offload = t.offload_optimizer == "cpu"
    cal = cost.calibration
    rate = (
        cal.cpu_adam_Gparams_per_s
        if cal is not None and cal.cpu_adam_Gparams_per_s is not None
        else s.topology.node.cpu.adam_Gparams_per_s
    )
    optimizer_s = np.zeros(s.world_size) if offload else np.full(s.world_size, cost.optimizer_time(opt_params))
    norm_s = []
    if stage >= 1:  # the gradient norm of each parameter group's partition, non-expert then expert
        tensors = [layer_tensors(m, i) for i in range(m.num_layers)]
        ne_tensors = outer_tensors(m) + sum(t[0] for t in tensors)
        norm_s.append(cost.grad_norm_time(ceil_div(ne_tensors, dp), ceil_div(ne_total, dp)))
        if ex_total:
            ex_tensors = sum(t[1] * epr for i, t in enumerate(tensors) if moe_index[i] is not None)
            norm_s.append(cost.grad_norm_time(ceil_div(ex_tensors, edp), ceil_div(ex_total, edp)))
    tail_s = np.vstack([optimizer_s, *(np.full(s.world_size, x) for x in norm_s)])
    base_seed = s.routing.seed + DRAW_STRIDE * int(draw)
    if cal is not None and cal.compute_noise_cv and s.world_size > 1:
        from sim.faults import KernelJitter

        # the calibrated rank-to-rank spread of compute; its own streams (seed: the routing seed)
        tail_s = apply_segment_noise(b.ops, tail_s, KernelJitter(cal.compute_noise_cv, base_seed + NOISE_SEED))
    if cal is not None and cal.pause_rate_per_s and cal.pause_mean_s and s.world_size > 1:
        tail_s = apply_pauses(b.ops, tail_s, cal.pause_rate_per_s, cal.pause_mean_s, base_seed + PAUSE_SEED)
    tail = Tail(
        optimizer_s=tail_s[0],
        offload_bytes=float(opt_params * b.bpe) if offload else 0.0,
        cpu_adam_s=cpu_adam_time(opt_params, s.gpus_per_node, rate) if offload else 0.0,
        gather_nonexpert=ne_total if stage in (1, 2) else 0,
        gather_expert=ex_total if stage in (1, 2) else 0,
        norm_reduce=stage >= 1,
        norm_s=list(tail_s[1:]),
    )
    overhead = (cal.call_overhead_us or 0.0) * 1e-6 if cal is not None else 0.0
    if cal is not None and ((cal.wake_delay_p and cal.wake_delay_cap_s) or overhead) and s.world_size > 1:
        apply_wake_delay(b.ops, tail, cal.wake_delay_p or 0.0, cal.wake_delay_cap_s or 0.0, base_seed + WAKE_SEED,
                         s.ep_groups(), overhead)  # fmt: skip
    from sim.flops import model_flops_per_token

    tokens = s.global_batch_size * t.seq_len
    return Schedule(
        ops=b.ops,
        tail=tail,
        world=s.world_size,
        grad_kind="reduce_scatter" if stage == 3 else "all_reduce",
        grad_bytes_per_param=b.bpe,
        param_bytes_per_param=b.bpe,
        model_flops=model_flops_per_token(m, t.seq_len) * tokens,
        stats={"optimizer_params_per_rank": int(opt_params)},
    )


__all__ = ["AllToAll", "CapacitySync", "Compute", "Gather", "GradReady", "Schedule", "Tail", "WaitGather", "apply_pauses", "apply_segment_noise", "apply_wake_delay",
           "build_schedule"]
