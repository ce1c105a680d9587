"""The SimPy engine: runs a :class:`~sim.frameworks.deepspeed.Schedule` on every rank of the cluster.

Each rank has two SimPy processes, a compute stream and a comm stream (DeepSpeed's NCCL stream for
gradient buckets and ZeRO gathers). The compute stream runs the schedule's ops in order: a
:class:`~sim.frameworks.deepspeed.Compute` is a timeout; an :class:`~sim.frameworks.deepspeed.AllToAll` is a rendezvous of
the rank's EP group: the collective starts when the last member arrives (NCCL's grouped send/recv
needs every peer), and the rank's part ends when its own sends and receives are delivered. The time
from a rank's arrival to the start is its *imbalance wait*: it sat at the barrier because a peer was
slower (more tokens for its experts, a straggler). Gradients handed over by ``GradReady`` fill
buckets (``collectives.reduce_bucket_elements``) that the comm stream reduces over the
data-parallel group (non-expert) or the expert-data-parallel group (experts, strided ranks) while
backward goes on; at the end of the step the compute stream waits for the comm stream (*exposed
communication*), runs the optimizer and ZeRO-1/2's parameter all-gathers.

Every rank is simulated; all EP groups run at once on one network, so groups that share links
slow each other down (see :mod:`sim.network.comm` for what each comm model sees).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import simpy

from sim.engine.alltoall import AllToAllRendezvous
from sim.engine.comm_stream import CommStream
from sim.engine.spans import Span
from sim.frameworks.ops import AllToAll, CapacitySync, Compute, Gather, GradReady, Schedule, WaitGather
from sim.hardware.alltoall_links import for_all_to_all
from sim.hardware.cluster import Cluster
from sim.host.cpu_ranks import WAKE_KERNEL
from sim.inputs.scenario import Scenario
from sim.network.comm import Comm
from sim.routing.plan import RoutingPlan

#: Breakdown categories of the compute stream; on every rank they tile [0, rank's end].
STREAM_KEYS = ("compute", "a2a", "imbalance_wait", "exposed_comm", "optimizer")


@dataclass
class EngineResult:
    step_time_s: float
    rank_end_s: np.ndarray
    critical_rank: int
    by_key: dict[str, np.ndarray]  # STREAM_KEYS -> (world,) seconds
    by_name: dict[str, np.ndarray]  # span name -> (world,) seconds on the compute stream
    grad_sync_s: np.ndarray  # comm-stream busy time per rank (reductions and gathers)
    a2a_sent_bytes: np.ndarray  # (world,) bytes each rank put on the wire for all-to-alls
    a2a_inter_node_bytes: np.ndarray  # (world,) of which crossed nodes
    link_bytes: np.ndarray
    spans: list[Span]
    events: int
    comm_model: str
    waited_on: dict[int, int]  # rank -> rank it most often waited for at all-to-all barriers


class Engine(AllToAllRendezvous, CommStream):
    """Compute and comm streams of every rank (see the module docstring)."""

    def __init__(self, s: Scenario, sched: Schedule, plan: RoutingPlan | None, cluster: Cluster,
                 comm_model: str, trace_ranks: set[int] | None = None, per_rank: bool = False):  # fmt: skip
        self.s, self.sched, self.plan, self.cluster = s, sched, plan, cluster
        self.env = simpy.Environment()
        self.comm = Comm(self.env, cluster, comm_model)
        # all-to-alls on the GPU's all-to-all figure for NVLink where it has one (sim.hardware.alltoall_links):
        # then on their own network, so that under the flow model they no longer share links with the
        # gradient collectives (a GPU without the figure keeps one network, as before)
        view = for_all_to_all(cluster)
        self.a2a_comm = self.comm if view is cluster else Comm(self.env, view, comm_model)
        self.world = s.world_size
        self.trace = trace_ranks or set()
        self.per_rank = per_rank  # one process per rank even where the vectorised group process is exact
        self.spans: list[Span] = []
        w = self.world
        self.key = {k: np.zeros(w) for k in STREAM_KEYS}
        self.grad_sync = np.zeros(w)
        self.end = np.zeros(w)
        self.sent = np.zeros(w)
        self.inter = np.zeros(w)
        self.groups = s.ep_groups()
        self.edp_groups = s.edp_groups()
        self.ep, self.dp, self.edp = s.ep, s.dp, s.edp
        self.dp_group = list(range(self.world))  # the data-parallel group: every rank (no TP/PP)
        self._arrive: dict[tuple, list] = {}
        self._waiters: dict[tuple, list] = {}
        self._group_waiters: dict[tuple, simpy.Event] = {}
        self._sent_cache: dict[tuple, dict] = {}
        node = np.arange(w) // cluster.gpus_per_node
        self._cross = node[:, None] != node[None, :] if w <= 8192 else None
        self._launched: dict[tuple, float] = {}
        self._pending: dict[tuple, list[int]] = {}
        self._blocks: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray | None]]] = {}
        self._last_arrival: dict[tuple, int] = {}
        self.wait_on = np.zeros((w, w), dtype=np.int32) if w <= 4096 else None
        self.queues = [simpy.Store(self.env) for _ in range(w)]
        self.comm_idle = [self.env.event().succeed() for _ in range(w)]
        self._gather_done: dict[tuple, dict[int, simpy.Event]] = {}
        self.by_name: dict[str, np.ndarray] = defaultdict(lambda: np.zeros(w))
        self._totals: dict[int, list[float]] = {}
        self._total_arr: dict[int, np.ndarray] = {}
        self._compute_total = np.zeros(w)
        self._wake_total = np.zeros(w)
        for i_op, op in enumerate(sched.ops):
            if isinstance(op, Compute):
                for i, name in enumerate(op.names):
                    self.by_name[name] += op.durs[i]
                tot = op.total
                self._compute_total += tot
                if op.names[0] == WAKE_KERNEL:  # a late wake-up: waiting, not compute
                    self._compute_total -= op.durs[0]
                    self._wake_total += op.durs[0]
                self._totals[i_op] = tot.tolist()
                self._total_arr[i_op] = tot
        bpe = sched.grad_bytes_per_param
        self.bucket_bytes = s.collectives.reduce_bucket_elements * bpe

    # ---- compute stream -----------------------------------------------------------------------
    def _span(self, rank: int, name: str, start: float, end: float, **args) -> None:
        if rank in self.trace and end > start:
            self.spans.append(Span(rank, "compute", name, start, end, args))

    def _at(self, t: float, fn) -> None:
        """Run ``fn`` at simulated time ``t`` (now, or later through one timeout)."""
        if t <= self.env.now:
            fn()
        else:
            self.env.timeout(t - self.env.now).callbacks.append(lambda _e: fn())

    def _rank_proc(self, rank: int):
        """The compute stream of ``rank``. It keeps its own clock ``t`` ahead of SimPy's and yields
        only where it must wait for others (all-to-alls, gathers, the comm stream), so a run of
        kernels costs no events."""
        env, key = self.env, self.key
        acc, seq = [0.0, 0.0], [0, 0]
        gathers: dict[tuple, simpy.Event] = {}
        t = env.now
        traced = rank in self.trace
        totals = self._totals
        for idx, op in enumerate(self.sched.ops):
            if isinstance(op, Compute):
                dur = totals[idx][rank]
                if traced:
                    tt = t
                    for i, name in enumerate(op.names):
                        d = float(op.durs[i, rank])
                        self._span(rank, name, tt, tt + d, phase=op.phase, layer=op.layer, micro=op.micro,
                                   flops=float(op.flops[i, rank]))  # fmt: skip
                        tt += d
                t += dur
            elif isinstance(op, AllToAll):
                yield self._arrive_a2a(idx, op, rank, t)
                start = self._launched[(idx, rank // self.ep)]
                key["imbalance_wait"][rank] += start - t
                key["a2a"][rank] += env.now - start
                if traced:
                    self._span(rank, "imbalance_wait", t, start, layer=op.layer, micro=op.micro)
                    self._span(rank, op.name, start, env.now, phase=op.phase, layer=op.layer, micro=op.micro)
                t = env.now
            elif isinstance(op, CapacitySync):
                if t > env.now:
                    yield env.timeout(t - env.now)
                yield self._capacity_sync(idx, op, rank)
                key["exposed_comm"][rank] += env.now - t
                self._span(rank, "capacity_sync_wait", t, env.now, phase=op.phase, layer=op.layer, micro=op.micro)
                t = env.now
            elif isinstance(op, GradReady):
                if op.blocking:
                    if t > env.now:
                        yield env.timeout(t - env.now)
                    evs = self._grads(rank, op, acc, seq)
                    if evs:
                        yield env.all_of(evs)
                        key["exposed_comm"][rank] += env.now - t
                        self._span(rank, "grad_sync_wait", t, env.now)
                    t = env.now
                else:
                    self._at(t, lambda op=op: self._grads(rank, op, acc, seq))
            elif isinstance(op, Gather):
                holder = gathers[op.key] = env.event()

                def start(op=op, holder=holder):
                    self._gather(rank, op.key, op.nonexpert, op.expert).callbacks.append(
                        lambda _e: holder.succeed()
                    )

                self._at(t, start)
            elif isinstance(op, WaitGather):
                if t > env.now:
                    yield env.timeout(t - env.now)
                yield gathers.pop(op.key)
                key["exposed_comm"][rank] += env.now - t
                self._span(rank, "param_gather_wait", t, env.now)
                t = env.now
        key["compute"][rank] = float(self._compute_total[rank])
        key["exposed_comm"][rank] += float(self._wake_total[rank])
        if t > env.now:
            yield env.timeout(t - env.now)
        yield from self._tail(rank)
        self.end[rank] = env.now

    def _tail(self, rank: int):
        env, key, tail = self.env, self.key, self.sched.tail
        t0 = env.now
        yield self.comm_idle[rank]
        key["exposed_comm"][rank] += env.now - t0
        self._span(rank, "grad_sync_wait", t0, env.now)
        if tail.norm_reduce:
            yield from self._grad_norm(rank)
            yield from self._wake(rank, tail.wake_norm_s)
        t0 = env.now
        if tail.offload_bytes:
            yield self.comm.host_copy([rank], tail.offload_bytes, to_host=True)[rank]
            yield env.timeout(tail.cpu_adam_s)
            yield self.comm.host_copy([rank], tail.offload_bytes, to_host=False)[rank]
        else:
            yield env.timeout(float(tail.optimizer_s[rank]))
        key["optimizer"][rank] += env.now - t0
        self._span(rank, "optimizer", t0, env.now, offload=bool(tail.offload_bytes))
        if tail.gather_nonexpert or tail.gather_expert:
            t0 = env.now
            ev = self._gather(rank, ("post_step",), tail.gather_nonexpert, tail.gather_expert)
            yield ev
            key["exposed_comm"][rank] += env.now - t0
            self._span(rank, "param_gather", t0, env.now)
            if self.dp > 1 or self.edp > 1:
                yield from self._late(rank, tail.call_overhead_s)
            yield from self._wake(rank, tail.wake_gather_s)

    def _wake(self, rank: int, late: np.ndarray | None):
        """A late wake-up after a blocking call of the tail (sim.frameworks.deepspeed.apply_wake_delay)."""
        if late is not None:
            yield from self._late(rank, float(late[rank]))

    def _late(self, rank: int, seconds: float):
        """``rank`` resumes ``seconds`` late after a blocking call of the tail (a late wake-up, or the
        in-job call overhead): waiting, booked as exposed comm."""
        if seconds > 0:
            t0 = self.env.now
            yield self.env.timeout(seconds)
            self.key["exposed_comm"][rank] += self.env.now - t0
            self._span(rank, WAKE_KERNEL, t0, self.env.now)

    def run(self) -> EngineResult:
        self._comm_arrivals: dict[tuple, list] = {}
        self._ring_algo = "ring"
        if self.comm.model == "ps" and not self.per_rank:  # end times known at launch: one vectorised process per EP group
            from sim.engine.groups import group_proc

            procs = [self.env.process(group_proc(self, g)) for g in range(len(self.groups))]
        else:
            procs = [self.env.process(self._rank_proc(r)) for r in range(self.world)]
        for r in range(self.world):
            self.env.process(self._comm_proc(r))
        self.env.run(until=self.env.all_of(procs))
        step = float(self.end.max())
        crit = int(np.argmax(self.end))
        waited = {}
        if self.wait_on is not None:
            np.fill_diagonal(self.wait_on, 0)
            for r in range(self.world):
                if self.wait_on[r].any():
                    waited[r] = int(np.argmax(self.wait_on[r]))
        return EngineResult(
            step_time_s=step,
            rank_end_s=self.end.copy(),
            critical_rank=crit,
            by_key=self.key,
            by_name=dict(self.by_name),
            grad_sync_s=self.grad_sync,
            a2a_sent_bytes=self.sent,
            a2a_inter_node_bytes=self.inter,
            link_bytes=self.comm.total_link_bytes() + (0.0 if self.a2a_comm is self.comm else self.a2a_comm.total_link_bytes()),
            spans=sorted(self.spans, key=lambda x: (x.rank, x.stream, x.start)),
            events=next(self.env._eid),  # SimPy's event counter: events scheduled so far
            comm_model=self.comm.model,
            waited_on=waited,
        )


__all__ = ["STREAM_KEYS", "Engine", "EngineResult", "Span"]
