"""The ops of one training step, as a framework's builder emits them and the engine runs them.

A :class:`Schedule` is data a reader can print: per rank, a list of :class:`Compute` blocks (kernels
back to back on the compute stream, seconds per rank), collectives that are rendezvous of a group
(:class:`AllToAll`, :class:`CapacitySync`), hand-overs to the comm stream (:class:`GradReady`,
:class:`Gather`, :class:`WaitGather`) and the step's :class:`Tail` (gradient norm, optimizer,
parameter all-gather). Every rank runs the same op sequence; an op holds ``(world,)`` arrays of
per-rank seconds. Pure: no SimPy here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


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
    between the router and the permute (``sim.engine.des`` runs it on the comm stream and waits)."""

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
    #: CPU ranks (sim.frameworks.deepspeed.apply_wake_delay): seconds a rank resumes late after the gradient
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


__all__ = ["AllToAll", "CapacitySync", "Compute", "Gather", "GradReady", "Schedule", "Tail", "WaitGather",
           "apply_jitter"]
