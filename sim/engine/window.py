"""The steady-state micro-batch window: simulate a shorter step, insert the missing micro-batches.

A step of ``m`` micro-batches under 1F1B, interleaved 1F1B or DualPipe is a warm-up, a steady state
in which every pipeline rank repeats the same passes once per micro-batch, and a cool-down
(:mod:`sim.frameworks.pipeline`). Steady-state micro-batches differ only by their routing draws
(and kernel jitter). The default fidelity therefore runs the step with ``m_sim < m`` micro-batches
and inserts the ``k = m - m_sim`` others into its steady state:

1. **The cut.** Progress ``x`` of a micro-batch is its index (DualPipe: its index within its
   direction, ``k / 2`` micro-batches being inserted into each). On every pipeline rank the cut at
   ``x`` lies just before the rank's first forward of progress >= ``x``. Inserting micro-batches
   there relabels every later pass and none before, so a message between stages is either sent
   and received before both ranks' cuts, or after both, or sent before and received after (the
   receiver's wait is then zero, as in the longer step); never the reverse.
2. **The window.** Between the cuts at ``x0`` and ``c = x0 + W`` each rank runs exactly ``W``
   micro-batches' passes of the steady state (``x0`` is past every rank's warm-up; for interleaving
   both are multiples of ``pp``, Megatron's micro-batch groups). Each rank's clock, every breakdown
   category, every kernel's seconds, its comm stream's busy time and its all-to-all bytes advance by
   their window increment / ``W`` per micro-batch; so does the time its comm stream frees up (a
   stream slower than compute falls further behind with every micro-batch).
3. **The jump.** At the cut at ``c`` each rank adds ``k`` times those per-micro-batch increments,
   shifts its comm stream and its pending parameter gathers by ``k`` times the stream's increment, and runs on: the
   remaining steady passes, the cool-down, the gradient synchronisation and the optimizer are
   simulated, so the data-parallel rendezvous at the end see the extrapolated clocks.

**The error.** With identical micro-batches (balanced routing, no jitter) the jump is exact. With
random routing the inserted micro-batches are ``k`` fresh draws: per rank, from the window's samples
of one micro-batch's duration (``s``), the two-sigma bound of the extrapolated time is
``2 s sqrt(k + k^2 / W)`` (the draws' own spread plus the error of the window's mean, micro-batches
taken as independent); ``bound_s`` is its largest value over the simulated ranks. ``--fidelity full``
simulates every micro-batch, and ``benchmarks/bench_scale.py`` records both.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field

import numpy as np

from sim.frameworks import pipeline

#: Steady-state micro-batches (per direction under DualPipe) the window spans at least.
WINDOW = 8
#: Samples of one micro-batch's (group's, when interleaving) duration the window gives at least.
MIN_SAMPLES = 4


@dataclass(frozen=True)
class MicroWindow:
    """Where the shortened step of ``m_sim`` micro-batches is cut and how much is inserted there."""

    schedule: str
    m: int  # micro-batches of the step
    m_sim: int  # micro-batches simulated
    x0: int  # progress at the window's start
    cut: int  # progress at the cut (the window's end)
    group: int  # progress units per sample: pp when interleaving (its micro-batch groups), else 1
    directions: int  # 2 under DualPipe (k / 2 micro-batches inserted into each), else 1
    points: tuple[
        tuple[int, ...], ...
    ]  # per rank, instruction indices of the cuts at x0, x0 + group, ..., cut

    @property
    def width(self) -> int:
        """Progress units (micro-batches per direction) the window spans."""
        return self.cut - self.x0

    @property
    def inserted(self) -> int:
        """Micro-batches inserted at the cut, per direction."""
        return (self.m - self.m_sim) // self.directions

    def describe(self) -> str:
        per = " per direction" if self.directions == 2 else ""
        return (
            f"{self.m_sim} of {self.m} micro-batches simulated; {self.inserted}{per} inserted at the steady "
            f"state's micro-batch {self.cut}{per}, each as the mean of the {self.width}{per} before it"
        )


def _align(x: int, g: int) -> int:
    return -(-x // g) * g


def _direction(schedule: str, m: int, micro: int) -> int:
    return 1 if schedule == "dualpipe" and micro >= m // 2 else 0


def _progress(schedule: str, m: int, micro: int) -> int:
    """A micro-batch's index within its direction (DualPipe's second half counts from 0 again)."""
    return micro - m // 2 if _direction(schedule, m, micro) else micro


def unit_starts(
    schedule: str, pp: int, vpp: int, m: int, seqs: list[list[pipeline.Instr]]
) -> list[list[float]]:
    """Start of every instruction when each rank runs its list in order, as soon as its inputs are
    there, a forward taking 1, a backward 2 (1 for a zero-bubble B and for a W), messages free. Any
    positive durations order the passes of the real run the same way at a cut: an instruction that
    starts at or after ``T`` only sends to instructions that start after ``T``."""
    paths = {}
    for micro in (0, m - 1):
        p = pipeline.path(schedule, pp, vpp, m, micro)
        paths[_direction(schedule, m, micro)] = (p, {rc: v for v, rc in enumerate(p)})
    end: dict[tuple, float] = {}
    starts: list[list[float]] = [[] for _ in range(pp)]
    clock, heads = [0.0] * pp, [0] * pp
    progressed = True
    while progressed:
        progressed = False
        for r, seq in enumerate(seqs):
            while heads[r] < len(seq):
                ins = seq[heads[r]]
                dep = 0.0
                if ins.kind != "W":
                    p, index = paths[_direction(schedule, m, ins.micro)]
                    v = index[(r, ins.chunk)]
                    need = None
                    if ins.kind == "F" and v > 0:
                        need = ("F", *p[v - 1], ins.micro)
                    elif ins.kind == "B":
                        need = (
                            ("F", r, ins.chunk, ins.micro) if v == len(p) - 1 else ("B", *p[v + 1], ins.micro)
                        )
                    if need is not None:
                        if need not in end:
                            break
                        dep = end[need]
                start = max(clock[r], dep)
                clock[r] = start + (1.0 if ins.kind != "B" or ins.zb else 2.0)
                end[(ins.kind, r, ins.chunk, ins.micro)] = clock[r]
                starts[r].append(start)
                heads[r] += 1
                progressed = True
    return starts


@functools.lru_cache(maxsize=64)
def plan_window(schedule: str, pp: int, vpp: int, m: int, window: int = WINDOW,
                overlap: bool = False) -> MicroWindow | None:  # fmt: skip
    """The window of a step of ``m`` micro-batches, or None when simulating all of them is as cheap
    (or the schedule shows no steady state the window can span); ``overlap``: the schedule's
    ``collectives.a2a_overlap`` variant (:func:`sim.frameworks.pipeline.build`)."""
    directions = 2 if schedule == "dualpipe" else 1
    group = pp if schedule == "interleaved" and vpp > 1 else 1
    per_dir = m // directions
    seqs = pipeline.build(schedule, pp, vpp, m, overlap)
    f_per_unit = sum(ins.kind == "F" for ins in seqs[0]) / per_dir  # forwards per unit of progress
    warm = 0
    for seq in seqs:  # forwards before the first backward, and backwards after the last forward
        first_b = next(i for i, ins in enumerate(seq) if ins.kind == "B")
        last_f = max(i for i, ins in enumerate(seq) if ins.kind == "F")
        tail_b = sum(ins.kind == "B" for ins in seq[last_f:])
        warm = max(warm, first_b, tail_b)
    lead = math.ceil(warm / f_per_unit) + 1
    width = _align(max(window, MIN_SAMPLES * group), group)
    x0 = _align(lead, group)
    while (
        True
    ):  # the first window past every rank's warm-up (DualPipe's first rank runs ahead in one direction)
        cut = x0 + width
        sim_per_dir = _align(cut + lead, group)
        if sim_per_dir >= per_dir:
            return None
        m_sim = sim_per_dir * directions
        points = _points(schedule, pp, vpp, m_sim, x0, cut, group, directions, overlap)
        if points is not None:
            return MicroWindow(schedule, m, m_sim, x0, cut, group, directions, points)
        x0 += group


def _points(schedule: str, pp: int, vpp: int, m_sim: int, x0: int, cut: int, group: int,
            directions: int, overlap: bool) -> tuple[tuple[int, ...], ...] | None:  # fmt: skip
    """Per rank, the indices of the cuts at progress x0, x0 + group, ..., cut: rank 0's first
    forward of progress >= x starts at ``T`` (unit durations, :func:`unit_starts`) and every rank
    cuts before its first instruction starting at or after ``T``. None unless every stretch is steady."""
    seqs = pipeline.build(schedule, pp, vpp, m_sim, overlap)
    starts = unit_starts(schedule, pp, vpp, m_sim, seqs)
    times = []
    for x in range(x0, cut + 1, group):
        first = next(i for i, ins in enumerate(seqs[0]) if ins.kind == "F" and _progress(schedule, m_sim, ins.micro) >= x)
        times.append(starts[0][first])
    points = []
    for r, seq in enumerate(seqs):
        idx = [bisect.bisect_left(starts[r], t) for t in times]
        if not _steady(seq, idx, m_sim, schedule, group, directions):
            return None
        points.append(tuple(idx))
    return tuple(points)


def _steady(seq, idx: list[int], m: int, schedule: str, group: int, directions: int) -> bool:
    """Whether every stretch between two cuts runs the same passes: ``group`` micro-batches' F and B
    of each direction, no deferred weight-gradient pass."""
    per_dir = m // directions
    want = {}
    for ins in seq:
        if ins.kind == "F":
            d = _direction(schedule, m, ins.micro)
            want[d] = want.get(d, 0) + 1
    want = {d: group * n / per_dir for d, n in want.items()}
    for a, b in zip(idx, idx[1:], strict=False):
        got: dict[tuple[str, int], int] = {}
        for ins in seq[a:b]:
            if ins.kind == "W":
                return False
            key = (ins.kind, _direction(schedule, m, ins.micro))
            got[key] = got.get(key, 0) + 1
        if any(got.get((k, d), 0) != n for d, n in want.items() for k in "FB"):
            return False
    return True


def window_of(s, fidelity: str) -> MicroWindow | None:
    """The window of scenario ``s`` at ``fidelity``: none at ``full``, and none on a cluster with
    stragglers or degraded links (a lane that is slower every micro-batch drifts further behind the
    others with each one, and what its peers wait for at the data-parallel rendezvous grows with it:
    no steady state to extrapolate)."""
    if fidelity == "full" or s.faults.stragglers or s.faults.links:
        return None
    p = s.parallelism
    return plan_window(p.schedule, p.pp, p.vpp, s.training.grad_accum_steps, overlap=s.collectives.a2a_overlap)


@dataclass
class _Snap:
    t: list[np.ndarray] = field(default_factory=list)  # clocks at x0, x0 + group, ..., cut
    key: dict = field(default_factory=dict)
    names: dict = field(default_factory=dict)
    busy: np.ndarray | None = None
    sent: np.ndarray | None = None
    inter: np.ndarray | None = None
    free: np.ndarray | None = None  # the comm stream's free time


class WindowRun:
    """The window's bookkeeping inside one :class:`~sim.engine.lanes.LaneEngine` run."""

    def __init__(self, win: MicroWindow, program):
        self.win = win
        self.at = [{idx: j for j, idx in enumerate(pts)} for pts in win.points]
        self.n_points = len(range(win.x0, win.cut + 1, win.group))
        self.snaps = [_Snap() for _ in program.stages]
        self.jumped = [False] * len(program.stages)
        self.shift: list[np.ndarray | None] = [None] * len(program.stages)
        self.done: list = [None] * len(program.stages)  # per stage, an event its jump triggers
        self.bound_s: np.ndarray | None = None
        self.period_s: np.ndarray | None = None

    def step(self, eng, r: int, idx: int, t: np.ndarray) -> np.ndarray:
        """Called before instruction ``idx`` of stage ``r``: snapshot at the window's points, jump at the cut."""
        j = self.at[r].get(idx)
        if j is None:
            return t
        snap = self.snaps[r]
        snap.t.append(t.copy())
        if j == 0:
            snap.key = {k: v[r].copy() for k, v in eng.key.items()}
            snap.names = {k: v[r].copy() for k, v in eng.by_name.items()}
            snap.busy, snap.sent, snap.inter = (
                eng.streams.busy[r].copy(),
                eng.sent[r].copy(),
                eng.inter[r].copy(),
            )
            snap.free = eng.streams.free[r].copy()
            return t
        if j < self.n_points - 1:
            return t
        return self._jump(eng, r, t)

    def arrival(self, eng, r: int, src: int, sent_after_jump: bool, arrive: np.ndarray):
        """When a message from stage ``src`` reaches stage ``r``. Sent before the sender's cut and
        received after the receiver's, it stands for the one the sender sends ``k`` micro-batches
        later (in the inserted stretch): it arrives the sender's jump later."""
        if not self.jumped[r] or sent_after_jump:
            if sent_after_jump and not self.jumped[r]:
                raise RuntimeError(
                    f"micro-batch window: stage {r} received a message from after stage {src}'s cut"
                )
            return arrive
        if not self.jumped[src]:
            if self.done[src] is None:
                self.done[src] = eng.env.event()
            yield self.done[src]
        return arrive + self.shift[src]

    def _jump(self, eng, r: int, t: np.ndarray) -> np.ndarray:
        win, snap = self.win, self.snaps[r]
        k = win.inserted
        scale = k / win.width
        for name, v in eng.key.items():
            v[r] += scale * (v[r] - snap.key[name])
        for name, v in eng.by_name.items():
            v[r] += scale * (v[r] - snap.names.get(name, 0.0))
        eng.streams.busy[r] += scale * (eng.streams.busy[r] - snap.busy)
        eng.sent[r] += scale * (eng.sent[r] - snap.sent)
        eng.inter[r] += scale * (eng.inter[r] - snap.inter)
        shift = scale * (t - snap.t[0])
        eng.streams.shift(r, scale * (eng.streams.free[r] - snap.free))  # the comm stream at its own pace
        eng._span(r, "extrapolated_micro_batches", t, t + shift, micro_batches=k * win.directions)
        per_sample = np.diff(np.stack(snap.t), axis=0) / win.group  # (samples, n): one micro-batch's duration
        spread = per_sample.std(axis=0, ddof=1) * math.sqrt(win.group) if len(per_sample) > 1 else 0.0 * t
        bound = 2.0 * spread * math.sqrt(k + k * k / win.width)
        period = shift / k
        if self.bound_s is None:
            self.bound_s, self.period_s = (
                np.zeros((len(self.snaps), len(t))),
                np.zeros((len(self.snaps), len(t))),
            )
        self.bound_s[r], self.period_s[r] = bound, period
        self.jumped[r], self.shift[r] = True, shift
        if self.done[r] is not None:
            self.done[r].succeed()
        return t + shift

    def report(self, step_s: float) -> dict:
        win = self.win
        bound = 0.0 if self.bound_s is None else float(self.bound_s.max())
        return {
            "micro_batches": win.m,
            "simulated": win.m_sim,
            "inserted": win.m - win.m_sim,
            "window": win.width * win.directions,
            "micro_batch_s": None if self.period_s is None else float(self.period_s.max()),
            "bound_s": bound,
            "bound_fraction": bound / step_s if step_s > 0 else 0.0,
            "what": win.describe(),
        }


__all__ = ["MIN_SAMPLES", "WINDOW", "MicroWindow", "WindowRun", "plan_window", "unit_starts", "window_of"]
