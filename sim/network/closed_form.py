"""Closed forms for collectives: nccl-tests bandwidth definitions, alpha-beta times, link bounds.

nccl-tests doc/PERFORMANCE.md: ``algbw = S / t``; ``busbw = algbw x factor`` with factor
``2(n-1)/n`` for all-reduce and ``(n-1)/n`` for reduce-scatter, all-gather and all-to-all.
Ring times are the alpha-beta model (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009):
``steps x (alpha + S / (n C B))`` with ``C`` parallel rings of per-ring bandwidth ``B``.
:func:`estimate_time_s` is what an analytic engine uses on any cluster and group: the busiest
link's serialisation time plus the longest chain of dependent path latencies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from sim.hardware.cluster import Cluster

if TYPE_CHECKING:
    from sim.network.dag import TransferDag


def busbw_factor(kind: str, n: int) -> float:
    """nccl-tests' bus-bandwidth correction factor for ``kind`` over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n


def bandwidths_GBps(kind: str, n: int, nbytes: float, time_s: float) -> tuple[float, float]:
    """``(algbw, busbw)`` in GB/s (1e9 B/s) of a collective of size ``nbytes`` that took ``time_s``."""
    if time_s <= 0:
        return 0.0, 0.0
    algbw = nbytes / time_s / 1e9
    return algbw, algbw * busbw_factor(kind, n)


def ring_steps(kind: str, n: int) -> int:
    """Dependent steps of a ring collective: 2(n-1) for all-reduce, n-1 otherwise."""
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def ring_time_s(
    kind: str, n: int, nbytes: float, bw_Bps: float, latency_s: float, channels: int = 1
) -> float:
    """Alpha-beta time of a ring collective: ``steps x (latency + S / (n x channels x bw))``."""
    if n <= 1:
        return 0.0
    return ring_steps(kind, n) * (latency_s + nbytes / (n * channels * bw_Bps))


def all_to_all_time_s(n: int, nbytes: float, bw_Bps: float, latency_s: float) -> float:
    """Uniform all-to-all of an ``nbytes`` buffer per rank: ``latency + (n-1)/n x S / bw``."""
    return latency_s + (n - 1) / n * nbytes / bw_Bps if n > 1 else 0.0


def dag_link_bytes(cluster: Cluster, dag: TransferDag, by_phase: bool = False) -> np.ndarray:
    """Bytes every link carries over the whole DAG (from the cluster's paths); with ``by_phase``
    a (phases x links) array."""
    indptr, links = cluster.paths(dag.src, dag.dst)
    owner = np.repeat(np.arange(len(dag.src)), np.diff(indptr))
    n_links = cluster.num_links
    if not by_phase:
        return np.bincount(links, weights=dag.nbytes[owner], minlength=n_links)
    phases = int(dag.phase.max()) + 1 if len(dag.phase) else 1
    flat = np.bincount(
        dag.phase[owner] * n_links + links, weights=dag.nbytes[owner], minlength=phases * n_links
    )
    return flat.reshape(phases, n_links)


def dag_lower_bound_s(cluster: Cluster, dag: TransferDag) -> float:
    """No schedule beats the busiest link: ``max over links of bytes / bandwidth``."""
    if not len(dag.src):
        return 0.0
    return float((dag_link_bytes(cluster, dag) / cluster.link_bw_Bps).max())


def dag_critical_latency_s(cluster: Cluster, dag: TransferDag) -> float:
    """Longest chain of dependent transfers counting only path latencies (a bound: no byte is free).

    Kahn's topological order, one vectorised relaxation per level over the frontier's dependents
    only (a CSR of who waits on whom), so the cost is linear in the DAG's edges.
    """
    n = len(dag.src)
    if not n:
        return 0.0
    indptr, links = cluster.paths(dag.src, dag.dst)
    owner = np.repeat(np.arange(n), np.diff(indptr))
    lat = np.bincount(owner, weights=cluster.link_latency_s[links], minlength=n)
    counts = np.diff(dag.prereq_indptr).astype(np.int64)
    waiter = np.repeat(np.arange(n), counts)  # waiter[e] waits for dag.prereq[e]
    order = np.argsort(dag.prereq, kind="stable")
    dep_of = waiter[order]
    dep_start = np.searchsorted(dag.prereq[order], np.arange(n + 1))
    ready_at = np.zeros(n)  # latest end among the prerequisites seen so far
    end = np.zeros(n)
    left = counts.copy()
    frontier = np.flatnonzero(counts == 0)
    while len(frontier):
        end[frontier] = ready_at[frontier] + lat[frontier]
        lengths = dep_start[frontier + 1] - dep_start[frontier]
        total = int(lengths.sum())
        if not total:
            break
        offsets = np.cumsum(lengths) - lengths
        idx = np.repeat(dep_start[frontier] - offsets, lengths) + np.arange(total)
        w = dep_of[idx]
        np.maximum.at(ready_at, w, np.repeat(end[frontier], lengths))
        np.subtract.at(left, w, 1)
        frontier = np.unique(w[left[w] == 0])
    return float(end.max())


def estimate_time_s(cluster: Cluster, dag: TransferDag) -> float:
    """Analytic estimate: per sequential phase the busiest link's serialisation, summed, plus the
    DAG's latency chain. Exact for a lone symmetric phase; phases that overlap make it pessimistic."""
    if not len(dag.src):
        return 0.0
    per_link = dag_link_bytes(cluster, dag, by_phase=True) / cluster.link_bw_Bps
    return float(per_link.max(axis=1).sum()) + dag_critical_latency_s(cluster, dag)


def ps_flow_times_s(cluster: Cluster, dag: TransferDag) -> np.ndarray:
    """Per transfer, all starting together: the latest processor-sharing finish over its links.

    On one link of capacity C shared equally, a flow of size s finishes once every flow k on the
    link has been served ``min(s_k, s)``: at ``sum_k min(s_k, s) / C`` (Kleinrock's PS queue with
    simultaneous arrivals). Taking the max over the path and adding the path latency is exact when
    every flow is held back by one link (the direct all-to-alls of the tests and the benchmark:
    equal to the max-min simulation to rounding on 2 nodes, within 4% per rank on 4).
    """
    n = len(dag.src)
    indptr, links = cluster.paths(dag.src, dag.dst)
    owner = np.repeat(np.arange(n), np.diff(indptr))
    size = dag.nbytes[owner]
    order = np.lexsort((size, links))
    link, s = links[order], size[order]
    starts = np.flatnonzero(np.r_[True, link[1:] != link[:-1]])
    seg_len = np.diff(np.r_[starts, len(link)])
    seg_start = np.repeat(starts, seg_len)
    seg_end = seg_start + np.repeat(seg_len, seg_len)
    csum = np.cumsum(s)
    served_smaller = csum - np.r_[0.0, csum][seg_start]  # sizes up to this one (ties included)
    larger = seg_end - np.arange(len(link)) - 1
    finish = (served_smaller + s * larger) / cluster.link_bw_Bps[link]
    per_flow = np.zeros(n)
    np.maximum.at(per_flow, owner[order], finish)
    return per_flow + np.bincount(owner, weights=cluster.link_latency_s[links], minlength=n)


def estimate_rank_times_s(cluster: Cluster, dag: TransferDag, group: list[int]) -> np.ndarray:
    """Per group rank, the end of its last transfer by :func:`ps_flow_times_s` (one-phase DAGs)."""
    flow_time = ps_flow_times_s(cluster, dag)
    lut = np.full(cluster.world_size, -1, dtype=np.int64)
    lut[np.asarray(group, dtype=np.int64)] = np.arange(len(group))
    out = np.zeros(len(group))
    for end in (dag.src, dag.dst):
        pos = lut[end]
        np.maximum.at(out, pos[pos >= 0], flow_time[pos >= 0])
    return out
