"""Each rank's comm stream (a mixin of :class:`sim.engine.des.Engine`): DeepSpeed's NCCL stream for
gradient buckets over the data-parallel and expert-data-parallel groups, ZeRO's parameter gathers,
the drop-free gate's capacity all-reduce and the gradient norm's all-reduces. A collective starts
when every member has enqueued it; the stream runs its items in order.
"""

from __future__ import annotations

import simpy

from sim.engine.spans import Span
from sim.frameworks.ops import CapacitySync, GradReady
from sim.network.comm import event_at


class CommStream:
    """Per-rank queues of collectives, and the blocking calls of the step's tail."""

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


__all__ = ["CommStream"]
