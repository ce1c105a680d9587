"""The layout-aware engine: runs a :class:`~sim.frameworks.program.Program` on a set of lanes.

A *lane* is a block of consecutive ranks of a pipeline stage that meet in tensor, context and
expert collectives (:attr:`sim.inputs.layout.Layout.lane_size`); lanes of a stage meet only in
data-parallel collectives, and a lane's ranks of stage r talk to the same positions of stages r +- 1
through pipeline sends. One SimPy process per pipeline stage carries the clocks of every rank of the
simulated lanes as one array and runs the stage's instruction list
(:mod:`sim.frameworks.pipeline`): a forward waits for its activations, a backward for its
gradients (the wait is the *pipeline bubble*), and each pass sends its output on. Within a pass:

- :class:`Kernels` advance the clocks by the priced kernels (:class:`~sim.frameworks.pricing.Pricer`);
- an EP all-to-all launches per EP group at its last member's arrival (the others' wait is the
  *imbalance wait*); each rank's part ends per the comm model (:mod:`sim.engine.a2a_timing`);
- a TP / ETP / CP collective launches at its group's last arrival and lasts the ring's time
  (:class:`~sim.network.group_times.GroupTimes`) (*tp_comm*); with TP communication overlap it runs
  beside the next kernels instead of before them;
- gradient hand-overs and parameter gathers go to each rank's comm stream (:mod:`sim.engine.streams`):
  a data-parallel collective starts when every member of its group (in every lane) is ready and its
  stream is free; what the compute stream waits for there is *exposed comm*.

SimPy orders the stages' processes (a receive waits for its send); clocks are absolute times
carried by the arrays, so a process never sleeps through compute. Every rank's timeline is tiled
by compute + a2a + imbalance_wait + tp_comm + pipeline_bubble + exposed_comm + optimizer.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import simpy

from sim.engine.a2a_timing import A2ATiming, overlap_saved_s, sm_slowdown
from sim.engine.lane_parts import Jitter, waited_on
from sim.engine.rank_groups import gmax, group_ids, group_members
from sim.engine.spans import Span
from sim.engine.streams import Streams
from sim.engine.window import WindowRun
from sim.frameworks import pipeline
from sim.frameworks.pricing import Pricer
from sim.frameworks.program import (
    CapacitySync,
    EPAllToAll,
    Grads,
    GroupComm,
    Kernels,
    ParamGather,
    Program,
    WaitParams,
)
from sim.hardware.cluster import Cluster
from sim.host.cpu_ranks import WAKE_KERNEL, applies_to
from sim.host.lane_host import LaneHost
from sim.inputs.scenario import Scenario
from sim.network.group_times import GroupTimes
from sim.routing.plan import RoutingPlan

KEYS = ("compute", "a2a", "imbalance_wait", "tp_comm", "pipeline_bubble", "exposed_comm", "optimizer")


@dataclass
class LaneResult:
    """Per (stage, simulated rank) seconds of each :data:`KEYS` category and the rest of the record."""

    lanes: np.ndarray
    positions: np.ndarray  # (n,) stage positions of the simulated ranks
    end_s: np.ndarray  # (pp, n)
    by_key: dict[str, np.ndarray]  # (pp, n)
    by_name: dict[str, np.ndarray]  # (pp, n) compute seconds per span name
    grad_sync_s: np.ndarray  # (pp, n) comm-stream busy time
    a2a_sent_bytes: np.ndarray  # (pp, n)
    a2a_inter_node_bytes: np.ndarray  # (pp, n)
    events: int
    link_bytes: np.ndarray  # bytes every link carried for the simulated lanes' all-to-alls
    waited_on: dict[int, int]  # global rank -> the rank it most often waited for at all-to-alls
    spans: list[Span] = field(default_factory=list)
    record: dict = field(default_factory=dict)  # rendezvous arrivals per lane (the estimate pass)
    window: WindowRun | None = None  # the steady-state window, when the step was shortened


class LaneEngine:
    def __init__(self, s: Scenario, program: Program, plan: RoutingPlan | None, cluster: Cluster,
                 pricer: Pricer, lanes: np.ndarray, exact: bool = True, virtual=None,
                 trace_ranks: set[int] | None = None, record: bool = False, jitter=None, window=None):  # fmt: skip
        self.s, self.program, self.plan, self.cluster, self.pricer = s, program, plan, cluster, pricer
        lay = s.layout
        self.S, self.L, self.pp = lay.stage_size, lay.lane_size, lay.pp
        self.lanes = np.asarray(lanes, dtype=np.int64)
        self.q = (self.lanes[:, None] * self.L + np.arange(self.L)[None, :]).reshape(-1)
        n = self.n = len(self.q)
        self.env = simpy.Environment()
        self.times = GroupTimes(cluster)
        self.a2a = A2ATiming(s, plan, cluster, self.env, exact)
        self.streams = Streams(self, virtual, record)
        self.key = {k: np.zeros((self.pp, n)) for k in KEYS}
        self.by_name: dict[str, np.ndarray] = defaultdict(lambda: np.zeros((self.pp, n)))
        self.end = np.zeros((self.pp, n))
        self.sent = np.zeros((self.pp, n))
        self.inter = np.zeros((self.pp, n))
        self.mail: dict[tuple, list] = {}
        self.trace = trace_ranks or set()
        self.spans: list[Span] = []
        self._ids = {k: group_ids(s, self.q, k) for k in ("tp", "etp", "cp", "ep")}
        self._traced: np.ndarray = np.zeros(0, np.int64)
        self.jitter = Jitter(self, jitter) if jitter is not None and exact else None
        cal = pricer.cost.calibration  # CPU ranks: the calibrated host effects (sim.host.lane_host)
        self.host = LaneHost(s, cal, self.q, self.S, self.pp) if exact and applies_to(s, cal) else None
        #: per rank, how often each member of its lane arrived last at its all-to-alls
        self.wait_on = np.zeros((self.pp, n, self.L), dtype=np.int32) if exact else None
        self._group_time: dict[tuple, np.ndarray] = {}
        self._p2p: dict[tuple[int, int], np.ndarray] = {}
        #: per stage, the kernel and all-to-all seconds of the overlapped pair it is running, if any
        self._pair: dict[int, list[np.ndarray]] = {}
        #: per stage, each instruction's end on every simulated rank (``moesim layer`` reads them)
        self.marks: list[list[np.ndarray]] = [[] for _ in range(self.pp)]
        #: the steady-state micro-batch window (:mod:`sim.engine.window`): ``program`` is the short step
        self.win = WindowRun(window, program) if window is not None else None

    # ---- helpers --------------------------------------------------------------------------------
    def ranks(self, r: int) -> np.ndarray:
        return self.q + r * self.S

    def _span(self, r: int, name: str, start: np.ndarray, end: np.ndarray, stream: str = "compute",
              per_rank: dict | None = None, **args) -> None:  # fmt: skip
        """Spans of the traced ranks; ``per_rank``: args with one value per rank (FLOPs)."""
        if not self.trace:
            return
        for i in self._traced:
            if end[i] > start[i]:
                a = dict(args)
                for k, v in (per_rank or {}).items():
                    a[k] = float(v[i])
                self.spans.append(Span(int(self.q[i] + r * self.S), stream, name, float(start[i]), float(end[i]), a))

    def _group_comm_time(self, kind: str, group: str, nbytes: float, r: int) -> np.ndarray:
        """(n,) seconds of a ``kind`` of ``nbytes`` on each rank's ``group`` (tp, etp, cp)."""
        key = (kind, group, nbytes, r)
        hit = self._group_time.get(key)
        if hit is None:
            ids = self._ids[group]
            per_group = {int(g): self.times.time_s(kind, group_members(self.s, group, int(g), r), nbytes)
                         for g in np.unique(ids)}  # fmt: skip
            hit = self._group_time[key] = np.array([per_group[int(g)] for g in ids])
        return hit

    def host_copy_s(self, r: int, nbytes: float) -> np.ndarray:
        """(n,) seconds to copy ``nbytes`` over each rank's PCIe link to host memory (ZeRO-Offload)."""
        indptr, links = self.cluster.host_paths(self.ranks(r), True)
        bw = np.minimum.reduceat(self.cluster.link_bw_Bps[links], indptr[:-1])
        lat = np.add.reduceat(self.cluster.link_latency_s[links], indptr[:-1])
        return lat + nbytes / bw

    def p2p_time(self, r_src: int, r_dst: int, nbytes: float) -> np.ndarray:
        """(n,) seconds to send ``nbytes`` from each rank of stage ``r_src`` to its peer in ``r_dst``."""
        key = (r_src, r_dst)
        hit = self._p2p.get(key)
        if hit is None:
            src, dst = self.ranks(r_src), self.ranks(r_dst)
            indptr, links = self.cluster.paths(src, dst)
            bw = np.minimum.reduceat(self.cluster.link_bw_Bps[links], indptr[:-1])
            lat = np.add.reduceat(self.cluster.link_latency_s[links], indptr[:-1])
            hit = self._p2p[key] = np.stack([bw, lat])
        bw, lat = hit
        return lat + nbytes / bw

    # ---- passes -----------------------------------------------------------------------------------
    def _recv(self, key: tuple, r: int, t: np.ndarray):
        box = self.mail.setdefault(key, [self.env.event(), None, None, False])
        if box[1] is None:
            yield box[0]
        arrive = box[1]
        if self.win is not None:
            arrive = yield from self.win.arrival(self, r, box[2], box[3], arrive)
        wait = np.maximum(arrive - t, 0.0)
        self.key["pipeline_bubble"][r] += wait
        self._span(r, "pipeline_bubble", t, t + wait)
        return t + wait

    def _send(self, key: tuple, times: np.ndarray, src: int) -> None:
        box = self.mail.setdefault(key, [self.env.event(), None, None, False])
        box[1], box[2] = times, src
        box[3] = self.win is not None and self.win.jumped[src]  # sent after the sender's cut: carries its jump
        box[0].succeed()

    def _kernels(self, r: int, op: Kernels, part: str, micro: int, t: np.ndarray, pending) -> np.ndarray:
        priced = []
        for k in op.kernels:
            if k.name == "selective_recompute":
                secs, flops = self.pricer.selective_recompute(k.layer, k.moe, micro, self.q, r), None
            else:
                secs, flops = self.pricer.price(k.name, k.layer, k.moe, micro, part, self.q, r)
            priced.append((k, secs * self.jitter.next(r) if self.jitter is not None else secs, flops))
        total = np.zeros(self.n)
        if self.host is not None:  # noise and stalls stretch the segment's kernels; a late wake-up at its head
            raw = sum((secs for _, secs, _ in priced), np.zeros(self.n))
            noisy, total = self.host.segment(r, raw)
            stretch = np.divide(noisy, raw, out=np.ones(self.n), where=raw > 0)
            priced = [(k, secs * stretch, flops) for k, secs, flops in priced]
            self._span(r, WAKE_KERNEL, t, t + total)
        for k, secs, flops in priced:
            self.by_name[k.name][r] += secs
            if self.trace:
                self._span(r, k.name, t + total, t + total + secs, layer=k.layer, micro=micro, phase=part,
                           per_rank={"flops": flops if flops is not None else np.zeros(self.n)})
            total = total + secs
        self.key["compute"][r] += total
        if r in self._pair:
            self._pair[r][0] += total
        t = t + total
        if pending is not None:  # an overlapped TP collective runs beside these kernels
            extra = np.maximum(pending - t, 0.0)
            self.key["tp_comm"][r] += extra
            self._span(r, "tp_overlap_wait", t, t + extra)  # category tp_comm
            t = t + extra
        return t

    def _a2a(self, r: int, op: EPAllToAll, micro: int, t: np.ndarray) -> np.ndarray:
        ids = self._ids["ep"]
        launch = gmax(t, ids, int(ids.max()) + 1)[ids]
        if self.wait_on is not None:  # who arrived last in each group (ties: the lowest rank)
            order = np.lexsort((np.arange(self.n), -t, ids))
            first = np.r_[True, ids[order][1:] != ids[order][:-1]]
            last_of = np.empty(int(ids.max()) + 1, dtype=np.int64)
            last_of[ids[order][first]] = order[first]
            np.add.at(self.wait_on[r], (np.arange(self.n), last_of[ids] % self.L), 1)
        fin, sent, inter = self.a2a.run(r, op, micro, self.q, self.ranks(r), launch)
        self.key["imbalance_wait"][r] += launch - t
        self.key["a2a"][r] += fin
        if r in self._pair:
            self._pair[r][1] += fin
        self.sent[r] += sent
        self.inter[r] += inter
        self._span(r, "imbalance_wait", t, launch)
        self._span(r, op.name, launch, launch + fin, micro=micro, layer=op.layer)
        if self.host is not None:
            self.host.blocking_call(r, ids)
        return launch + fin

    def _group_comm(self, r: int, op: GroupComm, t: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        ids = self._ids[op.group]
        launch = gmax(t, ids, int(ids.max()) + 1)[ids]
        dur = self._group_comm_time(op.kind, op.group, op.nbytes, r)
        self.key["tp_comm"][r] += launch - t
        self._span(r, op.name, t, launch + dur)
        if op.overlap:
            return launch, launch + dur
        self.key["tp_comm"][r] += dur
        if self.host is not None:
            self.host.blocking_call(r, ids)
        return launch + dur, None

    def _ops(self, r: int, chunk, ops: list, part: str, micro: int, t: np.ndarray):
        """Run one pass's ops (``part``: fwd, bwd or bwd_input) of micro-batch ``micro``."""
        pending = None
        last = self.program.stages[r].last_micro.get(chunk.chunk, micro)
        for op in ops:
            if isinstance(op, Kernels):
                t = self._kernels(r, op, op.phase or part, micro, t, pending)
                pending = None
            elif isinstance(op, EPAllToAll):
                t = self._a2a(r, op, micro, t)
            elif isinstance(op, GroupComm):
                t, pending = self._group_comm(r, op, t)
            elif isinstance(op, Grads):
                if op.every_micro or micro == last:
                    self.streams.grads(r, op, t)
            elif isinstance(op, ParamGather):
                if op.at_step_start:  # issued when the stage's process started
                    continue
                if not op.first_micro_only:
                    self.streams.gather(r, (op.key, micro), op.nonexpert, op.expert, t)
                elif micro == self._first_micro(r, chunk.chunk):  # once per step: keyed by -1
                    self.streams.gather(r, (op.key, -1), op.nonexpert, op.expert, t)
            elif isinstance(op, WaitParams):
                if not op.first_micro_only or micro == self._first_micro(r, chunk.chunk):
                    done = self.streams.gathered(r, (op.key, -1 if op.first_micro_only else micro))
                    wait = np.maximum(done - t, 0.0)
                    self.key["exposed_comm"][r] += wait
                    self._span(r, "param_gather_wait", t, t + wait)
                    t = t + wait
            elif isinstance(op, CapacitySync):
                ids = self._ids["ep"]
                launch = gmax(t, ids, int(ids.max()) + 1)[ids]
                end = launch + self.a2a.small_all_reduce_s(r, op.nbytes)
                self.key["exposed_comm"][r] += end - t
                self._span(r, "capacity_sync_wait", t, end)
                t = end
                if self.host is not None:
                    self.host.blocking_call(r, ids)
        return t
        yield  # a generator like the other steps of a stage's process

    def _first_micro(self, r: int, chunk: int) -> int:
        cache = getattr(self, "_first", None)
        if cache is None:
            cache = self._first = {}
            for rr, st in enumerate(self.program.stages):
                for ins in st.instructions:
                    if ins.kind == "F" and (rr, ins.chunk) not in cache:
                        cache[(rr, ins.chunk)] = ins.micro
        return cache[(r, chunk)]

    def _overlap(self, r: int, t: np.ndarray) -> np.ndarray:
        """End of an overlapped forward-backward pair (``collectives.a2a_overlap``: Megatron's
        ``overlap_moe_expert_parallel_comm`` in 1F1B's steady state, DualPipe's paired chunks): one
        micro-batch's all-to-alls run while the other computes; compute slows only while an all-to-all
        runs, by the SMs a DeepEP/HybridEP kernel holds (:func:`~sim.engine.a2a_timing.overlap_saved_s`).
        What the pair still costs beyond its kernels stays in the a2a share."""
        kernels, comm = self._pair.pop(r)
        saved = overlap_saved_s(kernels, comm, sm_slowdown(self.s))
        self.key["a2a"][r] -= saved
        return t - saved  # (traced spans of the pair stay drawn one after the other)

    def _weights(self, r: int, chunk, micro: int, t: np.ndarray) -> np.ndarray:
        total = np.zeros(self.n)
        for k in chunk.weight_kernels:
            secs, _ = self.pricer.price(k.name, k.layer, k.moe, micro, "bwd_weight", self.q, r)
            if self.jitter is not None:
                secs = secs * self.jitter.next(r)
            total = total + secs
        self._span(r, "weight_grad", t, t + total, micro=micro)
        self.key["compute"][r] += total
        self.by_name["weight_grad"][r] += total
        return t + total

    def _stage(self, r: int):
        prog = self.program
        st = prog.stages[r]
        sched = prog.schedule
        p = self.s.parallelism
        t = np.zeros(self.n)
        seq = st.instructions
        overlap = self.s.collectives.a2a_overlap
        for chunk in st.chunks:  # gathers the step starts with, before any input arrives
            for op in chunk.fwd:
                if isinstance(op, ParamGather) and op.at_step_start:
                    self.streams.gather(r, (op.key, -1), op.nonexpert, op.expert, t)
        for idx, ins in enumerate(seq):
            if self.win is not None:
                t = self.win.step(self, r, idx, t)
            chunk = st.chunks[ins.chunk]
            if overlap and ins.kind == "F" and idx + 1 < len(seq) and seq[idx + 1].kind == "B" and (
                    ins.paired or sched != "dualpipe"):  # fmt: skip
                self._pair[r] = [np.zeros(self.n), np.zeros(self.n)]  # this F and the next B overlap
            if ins.kind == "W":
                t = self._weights(r, chunk, ins.micro, t)
                self.marks[r].append(t)
                continue
            path = pipeline.path(sched, p.pp, p.vpp, prog.micro_batches, ins.micro)
            v = path.index((r, ins.chunk))
            if ins.kind == "F":
                if v > 0:
                    t = yield from self._recv(("F", v, ins.micro), r, t)
                t = yield from self._ops(r, chunk, chunk.fwd, "fwd", ins.micro, t)
                if v + 1 < len(path):
                    self._send(("F", v + 1, ins.micro), t + self.p2p_time(r, path[v + 1][0], chunk.send_bytes), r)
            else:
                if v + 1 < len(path):
                    t = yield from self._recv(("B", v, ins.micro), r, t)
                part = "bwd_input" if ins.zb else "bwd"
                t = yield from self._ops(r, chunk, chunk.bwd, part, ins.micro, t)
                if r in self._pair:
                    t = self._overlap(r, t)
                if v > 0:
                    self._send(("B", v - 1, ins.micro), t + self.p2p_time(r, path[v - 1][0], chunk.send_bytes), r)
            self.marks[r].append(t)
        t = yield from self.streams.tail(r, t)
        self.end[r] = t

    def run(self) -> LaneResult:
        if self.trace:
            self._traced = np.flatnonzero(np.isin(self.q, [x % self.S for x in self.trace]))
        procs = [self.env.process(self._stage(r)) for r in range(self.pp)]
        self.env.run(until=self.env.all_of(procs))
        if self.pp > 1:  # a stage that ends early idles until the last one: the next step's first
            step = float(self.end.max())  # forward cannot reach it sooner (the pipeline bubble)
            for r in range(self.pp):
                self.key["pipeline_bubble"][r] += step - self.end[r]
                self._span(r, "pipeline_bubble", self.end[r], np.full(self.n, step))
            self.end[:] = step
        return LaneResult(
            lanes=self.lanes, positions=self.q, end_s=self.end, by_key=self.key, by_name=dict(self.by_name),
            grad_sync_s=self.streams.busy, a2a_sent_bytes=self.sent, a2a_inter_node_bytes=self.inter,
            events=next(self.env._eid), link_bytes=self.a2a.comm.total_link_bytes() * self._a2a_scale(), waited_on=waited_on(self), spans=sorted(self.spans, key=lambda x: (x.rank, x.stream, x.start)),
            record=self.streams.recorded(), window=self.win,
        )  # fmt: skip

    def _a2a_scale(self) -> float:
        """Micro-batches of the step per simulated one: every micro-batch moves the same all-to-all bytes."""
        return 1.0 if self.win is None else self.win.win.m / self.win.win.m_sim


__all__ = ["KEYS", "LaneEngine", "LaneResult"]
