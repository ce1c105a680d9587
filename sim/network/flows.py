"""Flow-level network: transfers share every directed link max-min fairly, in SimPy time.

A transfer's bytes start to flow when it is submitted; rates (:func:`sim.network.maxmin.max_min_rates`)
are recomputed whenever transfers start or drain, once per simulated instant however many arrive
in it (the recompute runs after every normal-priority event of that instant). A transfer is
delivered one path latency (sum of its links' ``latency_us``) after its last byte is sent, so a
lone transfer takes exactly ``sum(latency) + bytes / min(bw)`` and n equal transfers on one link
take n times the serialisation time. Zero-byte and same-rank transfers take only the latency.

Speed: rates are vectorised over a flat flow x link incidence; drains at the same instant are
handled together; transfers of one call with the same path and size are merged into one weighted
flow (exact: max-min gives identical flows identical rates). ``rel_tol`` (default 0, exact) also
drains a flow early when its remaining time is within ``rel_tol`` x its age, bounding each flow's
time error by that fraction; it trades accuracy for fewer rate recomputations in uneven loads.

Instead of a driver process the network keeps one pending timer (next drain) and one late wake
(recompute): SimPy callbacks, no interrupts, and stale timers are ignored by a generation count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import simpy

from sim.hardware.cluster import LINK_KINDS, Cluster
from sim.network.maxmin import max_min_rates

#: Drain threshold in seconds of remaining time, relative to the current time (float rounding).
_TIME_EPS = 1e-12
_LATE = 2  # SimPy priority after URGENT (0) and NORMAL (1): runs after the instant's other events


class _LateWake(simpy.Event):
    """An event that fires at the current instant after all normal-priority events (cf. Timeout)."""

    def __init__(self, env: simpy.Environment):
        self.env = env
        self.callbacks = []
        self._value = None
        self._ok = True
        env.schedule(self, _LATE)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for every (s, n), vectorised."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(total)


class Transfers:
    """Handle of the transfers of one submission: completion events and delivery times per flow."""

    def __init__(self, env: simpy.Environment, nbytes: np.ndarray, slot_of_flow: np.ndarray, n_slots: int):
        self.env = env
        self.nbytes = nbytes
        #: Delivery time of every flow (NaN until delivered).
        self.finish_time_s = np.full(len(nbytes), np.nan)
        #: Fires when every flow of the submission is delivered.
        self.done = env.event()
        self.start_s = env.now
        self._order = np.argsort(slot_of_flow, kind="stable")
        self._slot_count = np.bincount(slot_of_flow, minlength=n_slots)
        self._slot_start = np.cumsum(self._slot_count) - self._slot_count
        self._left = len(nbytes)
        self._subscribers: list[Callable[[np.ndarray], None]] = []
        self._slot_links: tuple[np.ndarray, np.ndarray] | None = None
        if self._left == 0:
            self.done.succeed(self)

    def subscribe(self, fn: Callable[[np.ndarray], None]) -> None:
        """Call ``fn(flow_indices)`` at every instant some flows of this submission are delivered."""
        self._subscribers.append(fn)

    def when_all(self, groups: Sequence[Sequence[int] | np.ndarray]) -> list[simpy.Event]:
        """One event per group of flow indices, firing when all flows of the group are delivered."""
        events = [self.env.event() for _ in groups]
        sizes = np.array([len(g) for g in groups], dtype=np.int64)
        flows = (
            np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])
            if len(groups)
            else np.zeros(0, np.int64)
        )
        group_of = np.repeat(np.arange(len(groups)), sizes)
        left = np.bincount(group_of[np.isnan(self.finish_time_s[flows])], minlength=len(groups))

        def on_deliver(delivered: np.ndarray) -> None:
            hit = np.zeros(len(self.nbytes), dtype=bool)
            hit[delivered] = True
            dec = np.bincount(group_of[hit[flows]], minlength=len(groups))
            before = left.copy()
            left[:] -= dec
            for g in np.flatnonzero((before > 0) & (left == 0)):
                events[g].succeed()

        for g in np.flatnonzero(left == 0):
            events[g].succeed()
        if left.any():
            self.subscribe(on_deliver)
        return events

    def link_bytes(self) -> np.ndarray:
        """Bytes this submission puts on every link (exact, from its paths)."""
        if self._slot_links is None:
            return np.zeros(0)
        e_slot, e_link, slot_bytes, n_links = self._slot_links
        return np.bincount(e_link, weights=slot_bytes[e_slot], minlength=n_links)

    def _deliver(self, slots: np.ndarray, now: float) -> None:
        flows = self._order[_ranges(self._slot_start[slots], self._slot_count[slots])]
        self.finish_time_s[flows] = now
        self._left -= len(flows)
        for fn in self._subscribers:
            fn(flows)
        if self._left == 0:
            self.done.succeed(self)


class Network:
    """Max-min fair, flow-level transfers over a :class:`~sim.hardware.cluster.Cluster`'s links."""

    def __init__(self, env: simpy.Environment, cluster: Cluster, *, rel_tol: float = 0.0):
        if rel_tol < 0:
            raise ValueError("rel_tol must be >= 0")
        self.env, self.cluster, self.rel_tol = env, cluster, rel_tol
        self.capacity_Bps = cluster.link_bw_Bps
        n_links = cluster.num_links
        #: Bytes carried by every link so far (integrated rate x time).
        self.link_bytes = np.zeros(n_links)
        #: Time every link carried at least one flow, seconds.
        self.link_busy_s = np.zeros(n_links)
        #: Rate recomputations so far (a cost counter for benchmarks).
        self.recomputes = 0
        self._batches: dict[int, Transfers] = {}
        self._next_batch = 0
        self._pending: list[tuple] = []
        self._wake_pending = False
        self._gen = 0
        self._last_s = env.now
        self._link_rate = np.zeros(n_links)
        self._set_active(*self._empty_state())

    # ---- public API -------------------------------------------------------------------------
    def transfer(self, src: int, dst: int, nbytes: float) -> simpy.Event:
        """Send ``nbytes`` from rank ``src`` to rank ``dst``; the event fires on delivery."""
        return self.transfer_many([src], [dst], [nbytes]).done

    def transfer_many(self, srcs, dsts, nbytes) -> Transfers:
        """Many transfers at once (e.g. a whole all-to-all): one handle, per-flow delivery times."""
        src = np.asarray(srcs, dtype=np.int64)
        dst = np.asarray(dsts, dtype=np.int64)
        size = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), src.shape)
        indptr, links = self.cluster.paths(src, dst)
        return self._submit(src * self.cluster.world_size + dst, indptr, links, size)

    def to_host(self, rank: int, nbytes: float) -> simpy.Event:
        """Copy ``nbytes`` from GPU ``rank`` to its host memory over PCIe (optimizer offload)."""
        return self.host_many([rank], [nbytes], to_host=True).done

    def from_host(self, rank: int, nbytes: float) -> simpy.Event:
        """Copy ``nbytes`` from host memory to GPU ``rank`` over PCIe."""
        return self.host_many([rank], [nbytes], to_host=False).done

    def host_many(self, ranks, nbytes, to_host: bool) -> Transfers:
        """Batched host copies, one per rank entry."""
        rank = np.asarray(ranks, dtype=np.int64)
        size = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), rank.shape)
        indptr, links = self.cluster.host_paths(rank, to_host)
        return self._submit(-(1 + 2 * rank + int(to_host)), indptr, links, size)

    def bytes_by_kind(self) -> dict[str, float]:
        """Bytes carried so far, summed per link kind (``nic_tx`` = bytes that left a node)."""
        per = np.bincount(self.cluster.link_kind_code, weights=self.link_bytes, minlength=len(LINK_KINDS))
        return {k: float(v) for k, v in zip(LINK_KINDS, per, strict=True)}

    @property
    def inter_node_bytes(self) -> float:
        return self.bytes_by_kind()["nic_tx"]

    @property
    def active_flows(self) -> int:
        return int(self._w.sum())

    # ---- submission -------------------------------------------------------------------------
    def _submit(self, key: np.ndarray, indptr: np.ndarray, links: np.ndarray, size: np.ndarray) -> Transfers:
        if len(size) and (not np.all(np.isfinite(size)) or size.min() < 0):
            raise ValueError("transfer sizes must be finite and >= 0")
        n = len(size)
        if n > 1 and not np.all(key[1:] > key[:-1]):
            order = np.lexsort((size, key))
            new = np.ones(n, dtype=bool)
            new[1:] = (key[order][1:] != key[order][:-1]) | (size[order][1:] != size[order][:-1])
            slot_of_flow = np.empty(n, dtype=np.int64)
            slot_of_flow[order] = np.cumsum(new) - 1
            rep = order[new]
        else:
            slot_of_flow, rep = np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)
        batch = Transfers(self.env, np.array(size), slot_of_flow, len(rep))
        if n == 0:
            return batch
        lengths = indptr[rep + 1] - indptr[rep]
        e_link = links[_ranges(indptr[rep], lengths)]
        e_slot = np.repeat(np.arange(len(rep)), lengths)
        weight = np.bincount(slot_of_flow, minlength=len(rep)).astype(np.float64)
        latency = np.bincount(e_slot, weights=self.cluster.link_latency_s[e_link], minlength=len(rep))
        slot_bytes = size[rep]
        batch._slot_links = (e_slot, e_link, slot_bytes * weight, len(self.capacity_Bps))
        bid = self._next_batch
        self._next_batch += 1
        self._batches[bid] = batch
        instant = (slot_bytes == 0) | (lengths == 0)
        if instant.any():
            self._schedule_delivery(
                np.full(int(instant.sum()), bid), np.flatnonzero(instant), latency[instant]
            )
        moving = ~instant
        if moving.any():
            keep = moving[e_slot]
            new_index = np.cumsum(moving) - 1
            self._pending.append(
                (
                    slot_bytes[moving],
                    weight[moving],
                    latency[moving],
                    np.full(int(moving.sum()), bid),
                    np.flatnonzero(moving),
                    new_index[e_slot[keep]],
                    e_link[keep],
                )
            )
            self._request_recompute()
        return batch

    # ---- state ------------------------------------------------------------------------------
    @staticmethod
    def _empty_state():
        f, i = np.zeros(0), np.zeros(0, dtype=np.int64)
        return f, f, f, i, i, f, i, i

    def _set_active(self, rem, w, lat, bid, local, start, e_slot, e_link) -> None:
        self._rem, self._w, self._lat, self._bid, self._local = rem, w, lat, bid, local
        self._start, self._e_slot, self._e_link = start, e_slot, e_link
        self._rate = np.zeros(len(rem))

    def _advance(self, now: float) -> None:
        dt = now - self._last_s
        if dt > 0 and len(self._rem):
            self._rem -= self._rate * dt
            self.link_bytes += self._link_rate * dt
            self.link_busy_s += (self._link_rate > 0) * dt
        self._last_s = now

    def _request_recompute(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            _LateWake(self.env).callbacks.append(self._on_wake)

    def _on_wake(self, _event) -> None:
        self._wake_pending = False
        now = self.env.now
        self._advance(now)
        if self._pending:
            parts = list(zip(*self._pending, strict=True))
            self._pending = []
            offset = len(self._rem)
            shifted, base = [], offset
            for sizes, slots in zip(parts[0], parts[5], strict=True):
                shifted.append(slots + base)
                base += len(sizes)
            n_new = base - offset
            self._set_active(
                np.concatenate([self._rem, *parts[0]]),
                np.concatenate([self._w, *parts[1]]),
                np.concatenate([self._lat, *parts[2]]),
                np.concatenate([self._bid, *parts[3]]),
                np.concatenate([self._local, *parts[4]]),
                np.concatenate([self._start, np.full(n_new, now)]),
                np.concatenate([self._e_slot, *shifted]),
                np.concatenate([self._e_link, *parts[6]]),
            )
        self._recompute()

    def _recompute(self) -> None:
        self._gen += 1
        if not len(self._rem):
            self._rate = np.zeros(0)
            self._link_rate[:] = 0
            return
        self.recomputes += 1
        self._rate = max_min_rates(self._e_slot, self._e_link, self._w, self.capacity_Bps)
        self._link_rate = np.bincount(
            self._e_link, weights=(self._w * self._rate)[self._e_slot], minlength=len(self.capacity_Bps)
        )
        dt = float((self._rem / self._rate).min())
        self.env.timeout(max(dt, 0.0), value=self._gen).callbacks.append(self._on_timer)

    def _on_timer(self, event) -> None:
        if event.value != self._gen:
            return  # superseded by a recompute after this timer was set
        now = self.env.now
        self._advance(now)
        left_s = self._rem / self._rate
        drained = left_s <= _TIME_EPS * max(now, 1e-6)
        if self.rel_tol:
            drained |= left_s <= self.rel_tol * (now - self._start)
        if not drained.any():  # rounding pushed the earliest drain past its timer: take it now
            drained[np.argmin(left_s)] = True
        idx = np.flatnonzero(drained)
        # bytes a drain threshold leaves unsent still count as carried (exact conservation)
        rest = np.maximum(self._rem, 0.0) * self._w * drained
        self.link_bytes += np.bincount(
            self._e_link, weights=rest[self._e_slot], minlength=len(self.capacity_Bps)
        )
        self._schedule_delivery(self._bid[idx], self._local[idx], self._lat[idx])
        keep = ~drained
        new_index = np.cumsum(keep) - 1
        e_keep = keep[self._e_slot]
        self._set_active(
            self._rem[keep],
            self._w[keep],
            self._lat[keep],
            self._bid[keep],
            self._local[keep],
            self._start[keep],
            new_index[self._e_slot[e_keep]],
            self._e_link[e_keep],
        )
        self._link_rate[:] = 0
        self._request_recompute()

    # ---- delivery ---------------------------------------------------------------------------
    def _schedule_delivery(self, bids: np.ndarray, slots: np.ndarray, latency: np.ndarray) -> None:
        lat_values, lat_group = np.unique(latency, return_inverse=True)
        for g, lat in enumerate(lat_values):
            sel = lat_group == g
            ev = self.env.timeout(float(lat), value=(bids[sel], slots[sel]))
            ev.callbacks.append(self._on_delivery)

    def _on_delivery(self, event) -> None:
        bids, slots = event.value
        now = self.env.now
        for bid in np.unique(bids):
            batch = self._batches[int(bid)]
            batch._deliver(slots[bids == bid], now)
            if batch._left == 0:
                del self._batches[int(bid)]
