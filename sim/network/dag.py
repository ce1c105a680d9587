"""Run a collective as a DAG of transfers: each transfer starts when its prerequisites are delivered.

Every algorithm in :mod:`sim.network.collectives` is a list of transfers ``(src, dst, nbytes)`` plus, for
each, the transfers it waits for (a ring step waits for the rank's previous send and for the
chunk it receives; an NVLink forward waits for the inter-node hop it relays). The executor issues
all transfers that become ready at one instant with one :meth:`Network.transfer_many` call, so a
step of a ring over every rank is one submission, not one per rank.

A rank's part of the collective ends when every transfer it sends or receives is delivered: the
barrier is where the data dependencies put it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import simpy

from sim.network.flows import Network


@dataclass
class TransferDag:
    """Transfers with dependencies. ``prereq_indptr``/``prereq`` is a CSR: transfer t waits for
    ``prereq[prereq_indptr[t]:prereq_indptr[t + 1]]``; ``steps`` counts the dependent hops on the
    longest chain (the latency terms of a closed form); ``phase`` numbers the algorithm's
    sequential stages (an intra-node reduce-scatter, then an inter-node all-reduce, ...)."""

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    prereq_indptr: np.ndarray
    prereq: np.ndarray
    phase: np.ndarray
    steps: int = 1


class DagBuilder:
    """Appends transfers in vectorised blocks; each block may wait on transfers added before."""

    def __init__(self) -> None:
        self._blocks: list[tuple[np.ndarray, ...]] = []
        self._n = 0
        self.steps = 0
        self.phase = 0

    @property
    def next_id(self) -> int:
        """Id the next added transfer will get."""
        return self._n

    def add(self, src, dst, nbytes, wait_counts=None, wait_idx=None) -> np.ndarray:
        """Add transfers; transfer k waits for the next ``wait_counts[k]`` ids of ``wait_idx``."""
        src = np.asarray(src, dtype=np.int64)
        n = len(src)
        counts = np.zeros(n, np.int64) if wait_counts is None else np.asarray(wait_counts, dtype=np.int64)
        idx = np.zeros(0, np.int64) if wait_idx is None else np.asarray(wait_idx, dtype=np.int64)
        nbytes = np.broadcast_to(np.asarray(nbytes, dtype=np.float64), (n,))
        phase = np.full(n, self.phase, dtype=np.int64)
        self._blocks.append((src, np.asarray(dst, dtype=np.int64), nbytes, counts, idx, phase))
        ids = np.arange(self._n, self._n + n)
        self._n += n
        return ids

    def build(self) -> TransferDag:
        if not self._blocks:
            z = np.zeros(0, np.int64)
            return TransferDag(z, z, np.zeros(0), np.zeros(1, np.int64), z, z, 0)
        src, dst, nbytes, counts, idx, phase = (np.concatenate(c) for c in zip(*self._blocks, strict=True))
        indptr = np.zeros(len(src) + 1, dtype=np.int64)
        np.cumsum(counts, out=indptr[1:])
        return TransferDag(src, dst, nbytes, indptr, idx, phase, self.steps)


@dataclass
class CollectiveHandle:
    """A running collective: per-rank completion events (aligned with ``group``) and a whole-op event."""

    group: list[int]
    dag: TransferDag
    rank_done: list[simpy.Event]
    done: simpy.Event
    start_s: float
    #: Delivery time of every transfer of the DAG (NaN until delivered).
    finish_time_s: np.ndarray = field(repr=False)
    #: Group positions of every transfer's (src, dst), -1 for a rank outside the group (a relay).
    member: np.ndarray = field(repr=False)

    @property
    def rank_time_s(self) -> np.ndarray:
        """Time each group rank's part took, from the collective's start (valid once ``done`` fired)."""
        t = np.full(len(self.group), float(self.start_s))
        for col in (0, 1):
            m = self.member[:, col] >= 0
            np.maximum.at(t, self.member[m, col], self.finish_time_s[m])
        return t - self.start_s

    @property
    def time_s(self) -> float:
        """Duration of the whole collective (valid once ``done`` has fired)."""
        return float(np.nanmax(self.finish_time_s) - self.start_s) if len(self.finish_time_s) else 0.0


def run_dag(net: Network, group: list[int], dag: TransferDag, model: str = "flow") -> CollectiveHandle:
    """Start ``dag`` on ``net`` now; returns its handle (events fire as the simulation runs).

    ``model="flow"`` (default) sends every transfer through the max-min network. ``model="ps"``
    times a DAG without dependencies (a direct all-to-all) in one vectorised pass by
    :func:`~sim.network.closed_form.ps_flow_times_s`, about a millisecond for thousands of
    flows: it sees contention inside the collective but none with other traffic on ``net``
    (its bytes still count in ``net.link_bytes``).
    """
    if model == "ps":
        return _run_ps(net, group, dag)
    if model != "flow":
        raise ValueError(f"model must be 'flow' or 'ps', got '{model}'")
    env = net.env
    n_t = len(dag.src)
    finish = np.full(n_t, np.nan)
    counts = np.diff(dag.prereq_indptr).astype(np.int64)
    waiter = np.repeat(np.arange(n_t), counts)  # waiter[e] waits for dag.prereq[e]
    order = np.argsort(dag.prereq, kind="stable")
    dep_of = waiter[order]
    dep_start = np.searchsorted(dag.prereq[order], np.arange(n_t + 1))
    lut = np.full(net.cluster.world_size, -1, dtype=np.int64)
    lut[np.asarray(group, dtype=np.int64)] = np.arange(len(group))
    member = np.stack([lut[dag.src], lut[dag.dst]], axis=1)
    rank_left = np.bincount(member[member >= 0], minlength=len(group))
    rank_done = [env.event() for _ in group]
    done = env.event()
    left = [n_t]

    def issue(ids: np.ndarray) -> None:
        batch = net.transfer_many(dag.src[ids], dag.dst[ids], dag.nbytes[ids])
        batch.subscribe(lambda flows: delivered(ids[flows]))

    def delivered(ids: np.ndarray) -> None:
        finish[ids] = env.now
        left[0] -= len(ids)
        m = member[ids]
        dec = np.bincount(m[m >= 0], minlength=len(group))
        before = rank_left.copy()
        rank_left[:] -= dec
        for i in np.flatnonzero((before > 0) & (rank_left == 0)):
            rank_done[i].succeed()
        lengths = dep_start[ids + 1] - dep_start[ids]
        if lengths.any():
            starts = dep_start[ids]
            idx = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths) + np.arange(int(lengths.sum()))
            waiting = dep_of[idx]
            np.subtract.at(counts, waiting, 1)
            ready = np.unique(waiting[counts[waiting] == 0])
            if len(ready):
                issue(ready)
        if left[0] == 0:
            done.succeed()

    for i in np.flatnonzero(rank_left == 0):
        rank_done[i].succeed()
    if n_t == 0:
        done.succeed()
    else:
        roots = np.flatnonzero(counts == 0)
        issue(roots)
    return CollectiveHandle(list(group), dag, rank_done, done, float(env.now), finish, member)


def _run_ps(net: Network, group: list[int], dag: TransferDag) -> CollectiveHandle:
    from sim.network.closed_form import dag_link_bytes, ps_flow_times_s

    if len(dag.prereq):
        raise ValueError("model='ps' times one-phase DAGs only (no prerequisites), e.g. a direct all-to-all")
    env, now = net.env, float(net.env.now)
    finish = now + ps_flow_times_s(net.cluster, dag) if len(dag.src) else np.zeros(0)
    net.link_bytes += dag_link_bytes(net.cluster, dag)
    lut = np.full(net.cluster.world_size, -1, dtype=np.int64)
    lut[np.asarray(group, dtype=np.int64)] = np.arange(len(group))
    member = np.stack([lut[dag.src], lut[dag.dst]], axis=1)
    rank_end = np.full(len(group), now)
    for col in (0, 1):
        m = member[:, col] >= 0
        np.maximum.at(rank_end, member[m, col], finish[m])
    rank_done = [_event_at(env, t - now) for t in rank_end.tolist()]
    done = _event_at(env, float(rank_end.max(initial=now)) - now)
    return CollectiveHandle(list(group), dag, rank_done, done, now, finish, member)


def _event_at(env: simpy.Environment, delay: float) -> simpy.Event:
    """An untriggered event that succeeds ``delay`` from now (unlike a Timeout, which counts as
    triggered from its creation)."""
    event = env.event()
    env.timeout(delay).callbacks.append(lambda _t: event.succeed())
    return event
