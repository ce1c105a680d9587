"""How the engine times communication: all-to-alls of the EP groups and gradient/parameter
collectives, either through the flow-level max-min network or with the processor-sharing model.

``flow``: every transfer of every collective goes through :class:`sim.network.flows.Network`; all-to-alls,
gradient reductions and parameter gathers share links max-min fairly, whatever starts when. Exact
(to the flow-level model) and slow for big clusters.

``ps``: one vectorised pass per launch (:func:`~sim.network.closed_form.ps_flow_times_s`). The
all-to-alls of the EP groups that launch at the same instant are timed together, so groups that
share a rail or a leaf uplink see each other; a two-phase (hierarchical) all-to-all is timed phase
after phase. Reductions and gathers take the alpha-beta estimate of their ring
(:func:`~sim.network.closed_form.estimate_time_s`). What ``ps`` does not see: contention between
traffic launched at different instants (an all-to-all and a gradient bucket in flight together).

``auto`` picks ``flow`` up to :data:`FLOW_AUTO_MAX_RANKS` ranks and ``ps`` above.
"""

from __future__ import annotations

import numpy as np
import simpy

from sim.hardware.cluster import Cluster
from sim.network.closed_form import dag_link_bytes
from sim.network.collectives import all_to_all_dag, group_nodes, reduction_dag
from sim.network.dag import TransferDag, run_dag
from sim.network.flows import Network

FLOW_AUTO_MAX_RANKS = 8


def event_at(env: simpy.Environment, delay: float) -> simpy.Event:
    """An untriggered event that succeeds ``delay`` from now."""
    ev = env.event()
    env.timeout(max(delay, 0.0)).callbacks.append(lambda _t: ev.succeed())
    return ev


def fire_at(env: simpy.Environment, ev: simpy.Event, delay: float) -> None:
    """Trigger the pending event ``ev`` ``delay`` seconds from now (what a Timeout does at creation),
    so a waiting process resumes then without a second event."""
    ev._ok = True
    ev._value = None
    env.schedule(ev, delay=max(delay, 0.0))


def _concat(dags: list[TransferDag]) -> TransferDag:
    z = np.zeros(0, np.int64)
    if not dags:
        return TransferDag(z, z, np.zeros(0), np.zeros(1, np.int64), z, z)
    offs = np.cumsum([0] + [len(d.src) for d in dags])
    indptr = [np.zeros(1, np.int64)]
    prereq, base = [], 0
    for off, d in zip(offs[:-1], dags, strict=True):
        indptr.append(d.prereq_indptr[1:] + base)
        prereq.append(d.prereq + off)
        base += len(d.prereq)
    return TransferDag(
        np.concatenate([d.src for d in dags]),
        np.concatenate([d.dst for d in dags]),
        np.concatenate([d.nbytes for d in dags]),
        np.concatenate(indptr),
        np.concatenate(prereq) if prereq else z,
        np.concatenate([d.phase for d in dags]),
        max(d.steps for d in dags),
    )


class _Paths:
    """Paths of a fixed list of (src, dst) pairs, cached: an EP group's all-to-all reuses them, and
    so does everything about them that does not depend on the sizes."""

    def __init__(self, cluster: Cluster, src: np.ndarray, dst: np.ndarray):
        indptr, links = cluster.paths(src, dst)
        self.src, self.dst, self.n = src, dst, len(src)
        owner = np.repeat(np.arange(self.n), np.diff(indptr))
        self.latency = np.bincount(owner, weights=cluster.link_latency_s[links], minlength=self.n)
        by_link = np.argsort(links, kind="stable")
        self.links, self.owner = links[by_link], owner[by_link]
        self.bw = cluster.link_bw_Bps[self.links]
        _, inv = np.unique(self.links, return_inverse=True)
        self.link_rank = inv.astype(np.float64)
        starts = np.flatnonzero(np.r_[True, self.links[1:] != self.links[:-1]])
        seg_len = np.diff(np.r_[starts, len(self.links)])
        self.seg_start = np.repeat(starts, seg_len)
        self.larger = self.seg_start + np.repeat(seg_len, seg_len) - np.arange(len(self.links)) - 1
        self._csum0 = np.zeros(len(self.links) + 1)
        self.by_owner = np.argsort(self.owner, kind="stable")
        counts = np.bincount(self.owner, minlength=self.n)
        self.owner_starts = np.r_[0, np.cumsum(counts)[:-1]]
        # flows that cross links (a flow to the own rank, or no flows at all -- ep = 1 -- cross none)
        self.routed = np.flatnonzero(counts > 0)
        self.flow_bytes = np.zeros(self.n)  # bytes each flow carried so far (for link totals)
        self.cluster = cluster

    def ps_times(self, nbytes: np.ndarray) -> np.ndarray:
        """:func:`~sim.network.closed_form.ps_flow_times_s` on the cached paths: on every link the
        flows sorted by size; a flow ends once each flow on the link got ``min(its size, own)``."""
        size = nbytes[self.owner]
        # sort by (link, size) in one argsort: sizes scaled into [0, 1) ride on the link's rank
        top = float(size.max()) if len(size) else 0.0
        key = self.link_rank + (size / (top * (1 + 1e-9)) if top > 0 else 0.0)
        order = np.argsort(key, kind="stable")
        sz = size[order]
        csum = self._csum0
        np.cumsum(sz, out=csum[1:])
        served = csum[1:] - csum[self.seg_start]
        finish = np.empty(len(sz))
        finish[order] = (served + sz * self.larger) / self.bw[order]  # back to by-link order
        per_flow = np.zeros(self.n)
        if len(self.routed):
            per_flow[self.routed] = np.maximum.reduceat(finish[self.by_owner], self.owner_starts[self.routed])
        self.flow_bytes += nbytes
        return np.where(nbytes > 0, per_flow + self.latency, 0.0)

    def link_bytes(self) -> np.ndarray:
        return np.bincount(self.links, weights=self.flow_bytes[self.owner], minlength=self.cluster.num_links)


class Comm:
    """Starts collectives on behalf of the engine; returns per-rank completion events."""

    def __init__(self, env: simpy.Environment, cluster: Cluster, model: str):
        if model not in ("flow", "ps"):
            raise ValueError(f"comm model must be flow or ps, got {model!r}")
        self.env, self.cluster, self.model = env, cluster, model
        self.net = Network(env, cluster)
        self.link_bytes = np.zeros(cluster.num_links)
        self._est: dict[tuple, tuple] = {}
        self._path_cache: dict[tuple, _Paths] = {}
        self._direct_paths: list[_Paths] = []

    def run(self, groups: list[list[int]], dags: list[TransferDag]) -> dict[int, simpy.Event | float]:
        """Start ``dags`` (one per group) now; rank -> event when its part is done (flow), or the
        seconds from now until then (ps)."""
        done: dict[int, simpy.Event] = {}
        if self.model == "flow":
            for g, d in zip(groups, dags, strict=True):
                h = run_dag(self.net, g, d)
                done.update(zip(g, h.rank_done, strict=True))
            return done
        fin = self.ps_rank_finish(_concat(dags))
        for g in groups:
            for r in g:
                done[r] = 0.0 if np.isnan(fin[r]) else float(fin[r])
        return done

    def direct_a2a(self, gids: tuple[int, ...], groups: list[list[int]], pairs: list[np.ndarray],
                   direction: str) -> dict[int, float]:  # fmt: skip
        """ps timing of direct all-to-alls of several EP groups launched together: every off-diagonal
        pair of each group is one flow (the byte matrices only change sizes, so paths are cached)."""
        hit = self._path_cache.get(("direct", gids))
        if hit is None:
            src, dst, sel = [], [], []
            for g in groups:
                r = np.asarray(g, dtype=np.int64)
                i, j = np.nonzero(~np.eye(len(r), dtype=bool))
                src.append(r[i])
                dst.append(r[j])
                sel.append((i, j))
            paths = _Paths(self.cluster, np.concatenate(src), np.concatenate(dst))
            ranks = np.concatenate([np.asarray(g, dtype=np.int64) for g in groups])
            # per rank, the flows it sends or receives, as reduceat segments
            ends = np.concatenate([paths.src, paths.dst])
            by_rank = np.argsort(ends, kind="stable")
            starts = np.searchsorted(ends[by_rank], ranks)
            hit = self._path_cache[("direct", gids)] = (paths, sel, ranks, by_rank % paths.n, starts)
            self._direct_paths.append(paths)
        paths, sel, ranks, flow_of, starts = hit
        nb = np.concatenate([
            (p[i, j] if direction == "dispatch" else p[j, i]) for p, (i, j) in zip(pairs, sel, strict=True)
        ])  # fmt: skip
        t = paths.ps_times(nb)
        fin = np.maximum.reduceat(t[flow_of], starts) if len(t) else np.zeros(len(ranks))
        return dict(zip(ranks.tolist(), fin.tolist(), strict=True))

    def _paths(self, src: np.ndarray, dst: np.ndarray) -> _Paths:
        key = (src.tobytes(), dst.tobytes())
        hit = self._path_cache.get(key)
        if hit is None:
            if len(self._path_cache) > 4096:
                self._path_cache.clear()
            hit = self._path_cache[key] = _Paths(self.cluster, src, dst)
        return hit

    def ps_rank_finish(self, dag: TransferDag, pipelined: bool = False) -> np.ndarray:
        """(world,) seconds from launch until each rank's last transfer of ``dag`` ends (NaN: not in
        it), phases in sequence, each phase starting when the previous one has ended everywhere; with
        ``pipelined`` the phases run at once, sharing links (a kernel that forwards chunks as they
        arrive, as DeepEP's RDMA and NVLink stages do)."""
        out = np.full(self.cluster.world_size, np.nan)
        start = 0.0
        phases = np.unique(dag.phase) if len(dag.phase) else np.zeros(0, np.int64)
        if pipelined:
            phases = phases[:1]
            dag = TransferDag(dag.src, dag.dst, dag.nbytes, dag.prereq_indptr, dag.prereq,
                              np.full(len(dag.phase), phases[0] if len(phases) else 0, dtype=dag.phase.dtype), dag.steps)  # fmt: skip
        for p in phases:
            sel = dag.phase == p if len(phases) > 1 else slice(None)
            src, dst, nb = dag.src[sel], dag.dst[sel], dag.nbytes[sel]
            paths = self._paths(src, dst)
            np.add.at(self.link_bytes, paths.links, nb[paths.owner])
            t = start + paths.ps_times(nb)
            np.fmax.at(out, src, t)
            np.fmax.at(out, dst, t)
            start = float(t.max())
        return out

    def a2a_dag(self, group: list[int], pair: np.ndarray, algo: str, node_bytes, direction: str) -> TransferDag:
        return all_to_all_dag(self.cluster, group, pair, algo, node_bytes, direction)

    def reduction(self, kind: str, group: list[int], nbytes: float, algo: str) -> dict[int, simpy.Event]:
        """All-reduce / reduce-scatter / all-gather of ``nbytes`` (nccl-tests sizes) over ``group``."""
        if len(group) <= 1 or nbytes <= 0:
            return {r: event_at(self.env, 0.0) for r in group}
        if self.model == "flow":
            h = run_dag(self.net, group, reduction_dag(self.cluster, kind, group, nbytes, algo))
            return dict(zip(group, h.rank_done, strict=True))
        key = (kind, tuple(group), algo)
        if key not in self._est:
            self._est[key] = reduction_model(self.cluster, kind, group, algo)
        per_byte, latency, link_per_byte = self._est[key]
        self.link_bytes += link_per_byte * nbytes
        ev = event_at(self.env, latency + per_byte * nbytes)
        return dict.fromkeys(group, ev)

    def host_copy(self, ranks: list[int], nbytes: float, to_host: bool) -> dict[int, simpy.Event]:
        """Every rank in ``ranks`` copies ``nbytes`` over its PCIe link to (or from) the host."""
        if nbytes <= 0:
            return {r: event_at(self.env, 0.0) for r in ranks}
        if self.model == "flow":
            tr = self.net.host_many(np.asarray(ranks), np.full(len(ranks), nbytes), to_host)
            evs = tr.when_all([[i] for i in range(len(ranks))])
            return dict(zip(ranks, evs, strict=True))
        indptr, links = self.cluster.host_paths(np.asarray(ranks), to_host)
        bw = np.minimum.reduceat(self.cluster.link_bw_Bps[links], indptr[:-1])
        lat = np.add.reduceat(self.cluster.link_latency_s[links], indptr[:-1])
        np.add.at(self.link_bytes, links, nbytes)
        return {r: event_at(self.env, float(lat[i] + nbytes / bw[i])) for i, r in enumerate(ranks)}

    def total_link_bytes(self) -> np.ndarray:
        direct = sum((p.link_bytes() for p in self._direct_paths), np.zeros(self.cluster.num_links))
        return self.link_bytes + self.net.link_bytes + direct


def reduction_model(cluster: Cluster, kind: str, group: list[int], algo: str) -> tuple[float, float, np.ndarray]:
    """``(seconds per byte, latency s, link bytes per byte)`` of a ``kind`` over ``group``: the sum over
    the DAG's phases of the busiest link's bytes / bandwidth (linear in the size: every chunk is a fixed
    fraction of it) plus the latency chain, as :func:`~sim.network.closed_form.estimate_time_s`. A ring
    takes :func:`sim.network.group_times.ring_model` (the same figures from one ring step); the
    hierarchical all-reduce its DAG at a reference size."""
    if algo == "ring":
        from sim.network.group_times import ring_model

        return ring_model(cluster, kind, group, link_bytes=True)
    from sim.network.closed_form import dag_critical_latency_s

    ref = float(1 << 30)
    dag = reduction_dag(cluster, kind, group, ref, algo)
    latency = dag_critical_latency_s(cluster, dag)
    by_phase = dag_link_bytes(cluster, dag, by_phase=True)
    serial = float((by_phase / cluster.link_bw_Bps).max(axis=1).sum())  # as in estimate_time_s
    return serial / ref, latency, by_phase.sum(axis=0) / ref


def group_node_bytes(cluster: Cluster, group: list[int], node_matrix: np.ndarray) -> np.ndarray:
    """The (group, group's nodes) block of a (world, nodes) matrix."""
    nodes, _ = group_nodes(cluster, group)
    return node_matrix[np.ix_(np.asarray(group), nodes)]


__all__ = ["FLOW_AUTO_MAX_RANKS", "Comm", "event_at", "fire_at", "group_node_bytes", "reduction_model"]
