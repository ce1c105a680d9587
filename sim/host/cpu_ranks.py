"""CPU ranks' host effects, applied to a built :class:`~sim.frameworks.ops.Schedule` by one entry,
:func:`apply_host_effects`: the calibrated rank-to-rank spread of compute segments, Poisson stalls,
late wake-ups after blocking collectives and the in-job cost of each blocking call. They exist on
CPU ranks sharing a few cores (``moesim calibrate`` measures them on this kind of host); a GPU
scenario never passes through this module.
"""

from __future__ import annotations

import numpy as np

from sim.frameworks.ops import AllToAll, CapacitySync, Compute, GradReady, Schedule, Tail
from sim.inputs.calibration import Calibration
from sim.inputs.scenario import Scenario


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


def applies_to(s: Scenario, cal: Calibration | None) -> bool:
    """Whether ``s`` runs on CPU ranks whose calibration measured host effects (and has peers)."""
    if cal is None or s.world_size <= 1 or not s.topology.gpu.is_cpu_host:
        return False
    return bool(cal.compute_noise_cv or (cal.pause_rate_per_s and cal.pause_mean_s)
                or (cal.wake_delay_p and cal.wake_delay_cap_s) or cal.call_overhead_us)  # fmt: skip


def apply_host_effects(sched: Schedule, s: Scenario, cal: Calibration, draw: int = 0) -> None:
    """Perturb ``sched`` in place with the calibrated host effects of ``s``'s CPU ranks: segment noise
    (``compute_noise_cv``), stalls (``pause_rate_per_s``, ``pause_mean_s``), then late wake-ups and
    the call overhead (``wake_delay_p``, ``wake_delay_cap_s``, ``call_overhead_us``). ``draw`` picks
    an independent draw of them, as one step of a job is one draw of its ranks' noise."""
    tail = sched.tail
    tail_s = np.vstack([tail.optimizer_s, *tail.norm_s])
    base_seed = s.routing.seed + DRAW_STRIDE * int(draw)
    if cal.compute_noise_cv:
        from sim.hardware.faults import KernelJitter

        # the calibrated rank-to-rank spread of compute; its own streams (seed: the routing seed)
        tail_s = apply_segment_noise(sched.ops, tail_s, KernelJitter(cal.compute_noise_cv, base_seed + NOISE_SEED))
    if cal.pause_rate_per_s and cal.pause_mean_s:
        tail_s = apply_pauses(sched.ops, tail_s, cal.pause_rate_per_s, cal.pause_mean_s, base_seed + PAUSE_SEED)
    tail.optimizer_s, tail.norm_s = tail_s[0], list(tail_s[1:])
    overhead = (cal.call_overhead_us or 0.0) * 1e-6
    if (cal.wake_delay_p and cal.wake_delay_cap_s) or overhead:
        apply_wake_delay(sched.ops, tail, cal.wake_delay_p or 0.0, cal.wake_delay_cap_s or 0.0, base_seed + WAKE_SEED,
                         s.ep_groups(), overhead)  # fmt: skip


__all__ = ["DRAW_STRIDE", "WAKE_KERNEL", "applies_to", "apply_host_effects", "apply_pauses", "apply_segment_noise",
           "apply_wake_delay"]
