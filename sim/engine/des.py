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
from dataclasses import dataclass, field

import numpy as np
import simpy

from sim.frameworks.ops import AllToAll, CapacitySync, Compute, Gather, GradReady, Schedule, WaitGather
from sim.hardware.cluster import Cluster
from sim.host.cpu_ranks import WAKE_KERNEL
from sim.inputs.scenario import Scenario
from sim.network.comm import Comm, event_at, fire_at, group_node_bytes
from sim.routing.plan import RoutingPlan

#: Breakdown categories of the compute stream; on every rank they tile [0, rank's end].
STREAM_KEYS = ("compute", "a2a", "imbalance_wait", "exposed_comm", "optimizer")


@dataclass
class Span:
    rank: int
    stream: str  # compute | comm
    name: str
    start: float
    end: float
    args: dict = field(default_factory=dict)


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


class Engine:
    def __init__(self, s: Scenario, sched: Schedule, plan: RoutingPlan | None, cluster: Cluster,
                 comm_model: str, trace_ranks: set[int] | None = None, per_rank: bool = False):  # fmt: skip
        self.s, self.sched, self.plan, self.cluster = s, sched, plan, cluster
        self.env = simpy.Environment()
        self.comm = Comm(self.env, cluster, comm_model)
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

    # ---- all-to-all ---------------------------------------------------------------------------
    def _block_bytes(self, op: AllToAll) -> list[tuple[np.ndarray, np.ndarray | None]]:
        key = (op.moe, op.micro)
        if key not in self._blocks:
            assert self.plan is not None
            d, bpe = self.s.model.hidden_size, self.sched.grad_bytes_per_param
            pair = self.plan.dispatch_bytes(op.moe, op.micro, d, bpe).astype(np.float64)
            hier = self.s.collectives.all_to_all == "hierarchical" and self.plan.padded is None
            node_m = self.plan.dispatch_node_tokens(op.moe, op.micro) * float(d * bpe) if hier else None
            out = []
            e = self.ep
            for k, g in enumerate(self.groups):
                nb = group_node_bytes(self.cluster, g, node_m) if node_m is not None else None
                out.append((pair[k * e : (k + 1) * e, k * e : (k + 1) * e], nb))  # EP groups are contiguous
            self._blocks[key] = out
            if node_m is None:  # per-rank sent / inter-node bytes of both directions, all groups at once
                off = pair.copy()
                np.fill_diagonal(off, 0.0)
                cross = off * self._cross
                self._sent_cache[key] = {
                    "dispatch": (off.sum(axis=1), cross.sum(axis=1)),
                    "combine": (off.sum(axis=0), cross.sum(axis=0)),
                }
        return self._blocks[key]

    def _account_a2a(self, g: list[int], pair: np.ndarray, nb: np.ndarray | None, direction: str) -> None:
        idx = np.asarray(g)
        node = idx // self.cluster.gpus_per_node
        off = pair.copy()
        np.fill_diagonal(off, 0.0)
        cross = node[:, None] != node[None, :]
        if direction == "combine":
            off, cross = off.T, cross.T
        self.sent[idx] += off.sum(axis=1)
        if nb is not None:
            nodes = np.unique(node)
            remote = nodes[None, :] != node[:, None]
            inter = (nb * remote).sum(axis=1)
            if direction == "combine":  # the node bytes come back from each destination node's relay
                inter = np.zeros(len(idx))
                recv = (nb * remote).sum(axis=0)
                for j, n in enumerate(nodes):
                    first = np.flatnonzero(node == n)
                    inter[first] += recv[j] / len(first)
            self.inter[idx] += inter
        else:
            self.inter[idx] += (off * cross).sum(axis=1)

    def _flush(self, op_idx: int, op: AllToAll, when: float) -> None:
        gids = self._pending.pop((op_idx, when))
        blocks = self._block_bytes(op)
        groups = [self.groups[g] for g in gids]
        algo = self.s.collectives.all_to_all
        cached = self._sent_cache.get((op.moe, op.micro))
        for gid in gids:
            pair, nb = blocks[gid]
            if cached is not None:
                sent, inter = cached[op.direction]
                lo, hi = gid * self.ep, (gid + 1) * self.ep
                self.sent[lo:hi] += sent[lo:hi]
                self.inter[lo:hi] += inter[lo:hi]
            else:
                self._account_a2a(self.groups[gid], pair, nb, op.direction)
        if self.comm.model == "ps" and algo == "direct":
            done = self.comm.direct_a2a(tuple(gids), groups, [blocks[g][0] for g in gids], op.direction)
        else:
            dags = [self.comm.a2a_dag(self.groups[g], blocks[g][0], algo, blocks[g][1], op.direction) for g in gids]
            done = self.comm.run(groups, dags)
        for gid in gids:
            self._launched[(op_idx, gid)] = self.env.now
            gev = self._group_waiters.pop((op_idx, gid), None)
            if gev is not None:
                gev.succeed(np.array([done[r] for r in self.groups[gid]], dtype=np.float64))
                continue
            for r, ev in self._waiters.pop((op_idx, gid)):
                x = done[r]
                if isinstance(x, float):
                    fire_at(self.env, ev, x)
                else:
                    x.callbacks.append(lambda _e, ev=ev: ev.succeed())

    def _arrive_group(self, op_idx: int, op: AllToAll, gid: int, t: np.ndarray) -> simpy.Event:
        """EP group ``gid`` (vectorised clocks ``t``) reaches all-to-all ``op_idx``; the event fires at
        the launch with the array of its ranks' seconds until their parts are done."""
        when = float(t.max())
        ev = self.env.event()
        if self.wait_on is not None:
            self.wait_on[self.groups[gid], gid * self.ep + int(np.argmax(t))] += 1
        self._group_waiters[(op_idx, gid)] = ev
        pkey = (op_idx, when)
        first = pkey not in self._pending
        self._pending.setdefault(pkey, []).append(gid)
        if first:
            self.env.timeout(when - self.env.now).callbacks.append(lambda _e: self._flush(op_idx, op, when))
        return ev

    def _arrive_a2a(self, op_idx: int, op: AllToAll, rank: int, t: float) -> simpy.Event:
        """Rank ``rank`` reaches all-to-all ``op_idx`` at time ``t`` (>= now); the event fires when
        its part is done. The group launches at its last member's arrival."""
        gid = rank // self.ep
        key = (op_idx, gid)
        ev = self.env.event()
        slot = self._arrive.get(key)
        if slot is None:
            slot = self._arrive[key] = [0, t, rank]
            self._waiters[key] = []
        slot[0] += 1
        if t > slot[1]:
            slot[1], slot[2] = t, rank
        self._waiters[key].append((rank, ev))
        if slot[0] == self.ep:
            del self._arrive[key]
            when, last = slot[1], slot[2]
            if self.wait_on is not None:
                self.wait_on[self.groups[gid], last] += 1
            pkey = (op_idx, when)
            first = pkey not in self._pending
            self._pending.setdefault(pkey, []).append(gid)
            if first:
                self.env.timeout(when - self.env.now).callbacks.append(
                    lambda _e: self._flush(op_idx, op, when)
                )
        return ev

    # ---- comm stream ------------------------------------------------------------------------
    def _enqueue(self, rank: int, item: tuple) -> simpy.Event:
        ev = self.env.event()
        self.queues[rank].put((item, ev))
        self.comm_idle[rank] = ev
        return ev

    def _comm_proc(self, rank: int):
        arrivals: dict[tuple, list] = self._comm_arrivals
        while True:
            (kind, key, group, nbytes, name), ev = yield self.queues[rank].get()
            slot = arrivals.setdefault(key, [0, self.env.event()])
            slot[0] += 1
            if slot[0] == len(group):
                del arrivals[key]
                slot[1].succeed(self.comm.reduction(kind, group, nbytes, self._ring_algo))
            t0 = self.env.now
            done = yield slot[1]
            yield done[rank]
            self.grad_sync[rank] += self.env.now - t0
            if rank in self.trace:
                self.spans.append(Span(rank, "comm", name, t0, self.env.now, {"bytes": nbytes, "kind": kind}))
            ev.succeed()

    def _grads(self, rank: int, op: GradReady, acc: list[float], seq: list[int]) -> list[simpy.Event]:
        out = []
        s, bpe = self, self.sched.grad_bytes_per_param
        kind = self.sched.grad_kind
        acc[0] += op.nonexpert * bpe
        acc[1] += op.expert * bpe
        for which, group, size in (
            (0, self.dp_group, s.dp),
            (1, self.edp_groups[rank % s.ep], s.edp),
        ):
            if size <= 1:
                acc[which] = 0.0
                continue
            if acc[which] >= self.bucket_bytes or (op.flush and acc[which] > 0):
                seq[which] += 1
                gid = 0 if which == 0 else rank % s.ep
                key = ("grad", which, gid, seq[which])
                out.append(self._enqueue(rank, (kind, key, group, acc[which], "grad_sync")))
                acc[which] = 0.0
        return out

    def _over_dp_edp(self, rank: int, kind: str, key: tuple, ne_bytes: float, ex_bytes: float,
                     name: str) -> simpy.Event | None:  # fmt: skip
        """``kind`` over the data-parallel group (``ne_bytes``) and ``rank``'s expert-data-parallel
        group (``ex_bytes``), where the group has peers and there are bytes; the last event or None."""
        ev = None
        if self.dp > 1 and ne_bytes:
            ev = self._enqueue(rank, (kind, key + ("ne",), self.dp_group, ne_bytes, name))
        if self.edp > 1 and ex_bytes:
            group = self.edp_groups[rank % self.ep]
            ev = self._enqueue(rank, (kind, key + ("ex", rank % self.ep), group, ex_bytes, name))
        return ev

    def _gather(self, rank: int, key: tuple, nonexpert: int, expert: int) -> simpy.Event:
        bpe = self.sched.param_bytes_per_param
        ev = self._over_dp_edp(rank, "all_gather", key, nonexpert * bpe, expert * bpe, "param_gather")
        return ev if ev is not None else event_at(self.env, 0.0)

    def _capacity_sync(self, idx: int, op: CapacitySync, rank: int) -> simpy.Event:
        """The drop-free gate's capacity all-reduce over ``rank``'s EP group, on the comm stream."""
        group = self.groups[rank // self.ep]
        return self._enqueue(rank, ("all_reduce", ("capacity", idx, rank // self.ep), group, op.nbytes,
                                    "capacity_sync"))  # fmt: skip

    def _grad_norm(self, rank: int):
        """ZeRO's gradient norm (sim.frameworks.deepspeed.Tail.norm_s): per parameter group the rank's partial
        norm, then an fp32 all-reduce over the data-parallel group; then the expert group's over
        its expert-data-parallel group. The partial norms count as the optimizer's compute."""
        env, key, tail = self.env, self.key, self.sched.tail
        for g, part in enumerate(tail.norm_s):
            t0 = env.now
            if part[rank] > 0:
                yield env.timeout(float(part[rank]))
                key["optimizer"][rank] += env.now - t0
                self._span(rank, "optimizer", t0, env.now, part="grad_norm")
            calls = [(("grad_norm", g), 4.0, 0.0)]
            if g == len(tail.norm_s) - 1 and g > 0:  # the expert group: DeepSpeed's _average_expert_grad_norms
                calls.append((("grad_norm", "ex"), 0.0, 4.0))
            for call_key, ne_bytes, ex_bytes in calls:  # one after the other, as DeepSpeed calls them
                ev = self._over_dp_edp(rank, "all_reduce", call_key, ne_bytes, ex_bytes, "grad_norm")
                if ev is not None:
                    t0 = env.now
                    yield ev
                    key["exposed_comm"][rank] += env.now - t0
                    self._span(rank, "grad_norm_wait", t0, env.now)
                    yield from self._late(rank, tail.call_overhead_s)

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
            link_bytes=self.comm.total_link_bytes(),
            spans=sorted(self.spans, key=lambda x: (x.rank, x.stream, x.start)),
            events=next(self.env._eid),  # SimPy's event counter: events scheduled so far
            comm_model=self.comm.model,
            waited_on=waited,
        )


__all__ = ["STREAM_KEYS", "Engine", "EngineResult", "Span"]
