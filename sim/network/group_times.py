"""Seconds of a ring collective over any process group without building its transfer DAG.

Linear in the size: ``latency + per_byte x S`` (nccl-tests' sizes: the per-rank buffer of an
all-reduce, the whole array of an all-gather or reduce-scatter). NCCL's ``k`` rings (one per group
member of a node, each rotated so that every ring leaves a node through a different GPU,
:func:`sim.network.collectives._rings`) carry chunks of ``S / (n k)`` for ``steps`` = 2(n-1)
(all-reduce) or n-1 ring steps. :func:`ring_model` gives exactly what
:func:`sim.network.comm.reduction_model` computes from the ``2 n (n-1) k`` transfers of the ring DAG
(tests check it to rounding), from one step's ``n k`` transfers: memory and time linear in the group.
"""

from __future__ import annotations

import numpy as np

from sim.hardware.cluster import Cluster
from sim.network.collectives import _rings


def ring_model(cluster: Cluster, kind: str, group: list[int], link_bytes: bool = False):
    """``(seconds per byte, latency s)`` of a ring ``kind`` over ``group``, the quantities of
    :func:`sim.network.comm.reduction_model` without its DAG: every ring step moves the same bytes
    over the same links, so the busiest link of one step (a step's ``n k`` transfers routed over the
    cluster, PXN relays and shared NICs included) times ``steps`` is the serialisation time; the
    latency chain is the slowest run of ``steps`` consecutive hops around a ring."""
    n = len(group)
    if n <= 1:
        return 0.0, 0.0
    steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
    factor = cluster.collective_bytes_factor.get(kind, 1.0)
    rings = _rings(cluster, group)  # (k, n)
    k = len(rings)
    src = rings.reshape(-1)
    dst = np.roll(rings, -1, axis=1).reshape(-1)
    indptr, links = cluster.paths(src, dst)
    owner = np.repeat(np.arange(len(src)), np.diff(indptr))
    chunk = factor / (n * k)
    load = np.bincount(links, minlength=cluster.num_links) * chunk
    per_step = float((load / cluster.link_bw_Bps).max())
    hop = np.bincount(owner, weights=cluster.link_latency_s[links], minlength=len(src)).reshape(k, n)
    laps, rem = divmod(steps, n)
    window = 0.0
    if rem:
        ext = np.concatenate([hop, hop], axis=1)
        csum = np.concatenate([np.zeros((k, 1)), np.cumsum(ext, axis=1)], axis=1)
        window = float((csum[:, rem : rem + n] - csum[:, :n]).max())
    latency = laps * float(hop.sum(axis=1).max()) + window
    if link_bytes:
        return steps * per_step, latency, steps * load
    return steps * per_step, latency


class GroupTimes:
    """Cached ``(per_byte, latency)`` of collectives over groups of one cluster."""

    def __init__(self, cluster: Cluster):
        self.cluster = cluster
        self._cache: dict[tuple, tuple[float, float]] = {}

    def model(self, kind: str, group: list[int] | tuple[int, ...]) -> tuple[float, float]:
        key = (kind, tuple(group))
        hit = self._cache.get(key)
        if hit is None:
            hit = ring_model(self.cluster, kind, list(group)) if len(group) > 1 else (0.0, 0.0)
            self._cache[key] = hit
        return hit

    def time_s(self, kind: str, group: list[int] | tuple[int, ...], nbytes: float) -> float:
        if nbytes <= 0 or len(group) <= 1:
            return 0.0
        per_byte, latency = self.model(kind, group)
        return latency + per_byte * nbytes


__all__ = ["GroupTimes", "ring_model"]
