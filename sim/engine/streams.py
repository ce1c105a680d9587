"""Comm streams of the lane engine: gradient buckets, parameter gathers and the step's tail.

Each rank has one comm stream running its collectives in order (DeepSpeed's and Megatron's NCCL
stream). A data-parallel collective (``dp``: the dense parameters' group, ranks with the same tp and
cp coordinates; ``edp``: the experts' group) starts when every member in every lane is ready and
its stream is free, and lasts the ring's time (:class:`~sim.network.group_times.GroupTimes`). In one
engine run every simulated lane of a stage is in one array, so such a rendezvous resolves at once;
lanes the run does not simulate (the folded mode, :mod:`sim.engine.fold`) join through
``virtual``: their arrivals from the estimate pass, shifted by how far the simulated lanes' arrivals
moved between the estimate and this run. The estimate pass records every lane's arrivals for that.

The tail: wait for the stream (exposed comm), the gradient norm's all-reduces (DeepSpeed: per
parameter group over dp, the experts' also over edp; Megatron and FSDP2: one over every rank), the
optimizer (or ZeRO-Offload's PCIe copies and CPU Adam), then ZeRO-1/2's parameter all-gather.
"""

from __future__ import annotations

import numpy as np

from sim.engine.rank_groups import gmax, group_ids, group_members
from sim.frameworks.policies import policy_of
from sim.frameworks.program import Grads


class Streams:
    def __init__(self, eng, virtual=None, record: bool = False):
        self.eng, self.virtual, self.record = eng, virtual, record
        s = self.s = eng.s
        pp, n = eng.pp, eng.n
        self.free = np.zeros((pp, n))
        self.busy = np.zeros((pp, n))
        self.acc = np.zeros((pp, 2))
        self.seq = [0] * pp
        self.ids = {k: group_ids(s, eng.q, k) for k in ("dp", "edp")}
        self.size = {"dp": s.dp, "edp": s.edp}
        self.count = {"dp": s.parallelism.tp * s.parallelism.cp, "edp": s.parallelism.etp * s.ep}
        self.lane_of = np.arange(n) // eng.L
        self.gathers: dict[tuple, np.ndarray] = {}
        self._dur: dict[tuple, np.ndarray] = {}
        pol = policy_of(s)
        self.bucket = pol.bucket_elements * eng.program.grad_bytes_per_param
        self.rec: dict[tuple, np.ndarray] = {}
        self.world_box: dict[tuple, list] = {}
        self.world_seq = [0] * pp

    # ---- data-parallel collectives -------------------------------------------------------------
    def _duration(self, r: int, kind: str, group: str, nbytes: float) -> np.ndarray:
        key = (r, kind, group, nbytes)
        hit = self._dur.get(key)
        if hit is None:
            times = self.eng.times
            hit = self._dur[key] = np.array([
                times.time_s(kind, group_members(self.s, group, g, r), nbytes) for g in range(self.count[group])
            ])  # fmt: skip
        return hit

    def _launch(self, key: tuple, ids: np.ndarray, count: int, start: np.ndarray) -> np.ndarray:
        """Per group, the launch: the last member's start over the simulated lanes and the others."""
        per_lane = gmax(start, self.lane_of * count + ids, len(self.eng.lanes) * count).reshape(-1, count)
        if self.record:
            self.rec[key] = per_lane
        launch = per_lane.max(axis=0)
        if self.virtual is not None:
            launch = np.maximum(launch, self.virtual.others(key, per_lane))
        return launch

    def collective(self, r: int, kind: str, group: str, nbytes: float, ready: np.ndarray,
                   name: str = "grad_sync") -> np.ndarray:  # fmt: skip
        """Enqueue ``kind`` of ``nbytes`` over each rank's ``group`` on stage ``r``'s comm streams;
        returns when each rank's part ends."""
        k = self.seq[r]
        self.seq[r] += 1
        if self.size[group] <= 1 or nbytes <= 0:
            return np.maximum(ready, self.free[r])
        ids, count = self.ids[group], self.count[group]
        start = np.maximum(ready, self.free[r])
        launch = self._launch(("c", r, k), ids, count, start)
        finish = (launch + self._duration(r, kind, group, nbytes))[ids]
        self.busy[r] += finish - start
        self.free[r] = finish
        self.eng._span(r, name, start, finish, stream="comm", bytes=float(nbytes), kind=kind)
        return finish

    def grads(self, r: int, op: Grads, t: np.ndarray) -> None:
        bpe = self.eng.program.grad_bytes_per_param
        self.acc[r, 0] += op.nonexpert * bpe
        self.acc[r, 1] += op.expert * bpe
        kind = self.eng.program.grad_kind
        for which, group in ((0, "dp"), (1, "edp")):
            if self.size[group] <= 1:
                self.acc[r, which] = 0.0
                continue
            fill = self.acc[r, which]
            if fill > 0 and (self.bucket == 0 or fill >= self.bucket or op.flush):
                self.collective(r, kind, group, fill, t, "grad_sync")
                self.acc[r, which] = 0.0

    def gather(self, r: int, key: tuple, nonexpert: int, expert: int, t: np.ndarray) -> None:
        bpe = self.eng.program.param_bytes_per_param
        done = np.array(t)
        for group, params in (("dp", nonexpert), ("edp", expert)):
            if params and self.size[group] > 1:
                done = self.collective(r, "all_gather", group, params * bpe, t, "param_gather")
        self.gathers[(r, key)] = done

    def gathered(self, r: int, key: tuple) -> np.ndarray:
        return self.gathers.pop((r, key))

    def shift(self, r: int, by: np.ndarray) -> None:
        """Stage ``r``'s stream and pending gathers ``by`` seconds later (the micro-batch window's jump)."""
        self.free[r] += by
        for key in [k for k in self.gathers if k[0] == r]:
            self.gathers[key] = self.gathers[key] + by

    # ---- the tail -------------------------------------------------------------------------------
    def _world(self, r: int, t: np.ndarray):
        """An all-reduce over every rank of every stage (the gradient norm): waits for all stages."""
        eng = self.eng
        k = self.world_seq[r]
        self.world_seq[r] += 1
        box = self.world_box.setdefault(("w", k, r), [None])
        box[0] = t
        boxes = [self.world_box.get(("w", k, rr)) for rr in range(eng.pp)]
        ev = self.world_box.setdefault(("ev", k), [eng.env.event(), None])
        if all(b is not None and b[0] is not None for b in boxes):
            per_lane = np.stack([gmax(b[0], self.lane_of, len(eng.lanes)) for b in boxes]).max(axis=0)
            if self.record:
                self.rec[("w", k)] = per_lane[:, None]
            launch = float(per_lane.max())
            if self.virtual is not None:
                launch = max(launch, float(self.virtual.others(("w", k), per_lane[:, None]).max()))
            group = list(range(self.s.world_size))
            ev[1] = (launch, launch + eng.times.time_s("all_reduce", group, 4.0))
            ev[0].succeed()
        yield ev[0]
        launch, end = ev[1]
        return np.full(eng.n, end), np.maximum(np.full(eng.n, launch), t)

    def tail(self, r: int, t: np.ndarray):
        eng = self.eng
        key = eng.key
        tail = eng.program.stages[r].tail
        done = np.maximum(t, self.free[r])
        key["exposed_comm"][r] += done - t
        eng._span(r, "grad_sync_wait", t, done)
        t = done
        for secs, groups in zip(tail.norm_s, tail.norm_groups, strict=True):
            key["optimizer"][r] += secs
            eng._span(r, "optimizer", t, t + secs, part="grad_norm")
            t = t + secs
            for group in groups:
                start = t
                if group == "world":
                    t, launch = yield from self._world(r, t)
                    if eng.pp > 1:  # waiting for the other stages to finish their backwards: the bubble
                        key["pipeline_bubble"][r] += launch - start
                        eng._span(r, "pipeline_bubble", start, launch)
                        start = launch
                else:
                    t = self.collective(r, "all_reduce", group, 4.0, t, "grad_norm")
                key["exposed_comm"][r] += t - start
                eng._span(r, "grad_norm_wait", start, t)
        start = t
        if tail.offload_bytes:
            t = t + eng.host_copy_s(r, tail.offload_bytes) * 2 + tail.cpu_adam_s
        else:
            t = t + tail.optimizer_s
        key["optimizer"][r] += t - start
        eng._span(r, "optimizer", start, t)
        if tail.gather_nonexpert or tail.gather_expert:
            start = t
            self.gather(r, ("post_step",), tail.gather_nonexpert, tail.gather_expert, t)
            t = self.gathered(r, ("post_step",))
            key["exposed_comm"][r] += t - start
            eng._span(r, "param_gather", start, t)
        return t

    def recorded(self) -> dict:
        return self.rec


__all__ = ["Streams"]
