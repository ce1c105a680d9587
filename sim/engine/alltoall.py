"""All-to-all rendezvous of the engine's EP groups (a mixin of :class:`sim.engine.des.Engine`).

A group's all-to-all launches when its last member arrives (NCCL's grouped send/recv needs every
peer). Groups that launch at the same instant are timed together, so those that share links see
each other (:mod:`sim.network.comm`); each rank's sent and inter-node bytes are counted here.
"""

from __future__ import annotations

import numpy as np
import simpy

from sim.frameworks.ops import AllToAll
from sim.network.comm import fire_at, group_node_bytes


class AllToAllRendezvous:
    """Arrivals, launches and byte accounting of the EP groups' all-to-alls."""

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
        comm = self.a2a_comm  # NVLink at the GPU's all-to-all figure (sim.hardware.alltoall_links)
        if comm.model == "ps" and algo == "direct":
            done = comm.direct_a2a(tuple(gids), groups, [blocks[g][0] for g in gids], op.direction)
        else:
            dags = [comm.a2a_dag(self.groups[g], blocks[g][0], algo, blocks[g][1], op.direction) for g in gids]
            done = comm.run(groups, dags)
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


__all__ = ["AllToAllRendezvous"]
