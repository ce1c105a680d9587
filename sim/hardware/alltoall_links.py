"""The cluster as all-to-all traffic sees it.

A topology's ``node.intra.efficiency`` is the ring figure (NCCL's model, nccl-tests' all-reduce and
all-gather bus bandwidth): one peer at a time per direction. An all-to-all drives every peer of the
NVLink domain at once, and where a GPU kind has a measurement of that pattern it achieves less: the
kernel-only times of HybridEP's dispatch on one B200 node and on GB200 NVL72 (DeepEP
``docs/README_Hybrid-EP.md``; ``node.intra.alltoall_efficiency`` of those topologies names the figures).
:func:`for_all_to_all` gives the EP all-to-alls (NCCL's, DeepEP's and HybridEP's, and nccl-tests'
``alltoall_perf``) a view of the cluster whose NVLink links run at that figure; every other collective
keeps the ring figure. Without ``alltoall_efficiency`` the view is the cluster itself.
"""

from __future__ import annotations

from dataclasses import replace

from sim.hardware.cluster_paths import LINK_KINDS, Cluster

_INTRA = LINK_KINDS.index("intra")


def alltoall_ratio(cluster: Cluster) -> float:
    """All-to-all over ring bandwidth of the cluster's GPU <-> NVSwitch links (1 without a figure)."""
    intra = cluster.topology.node.intra
    if intra.alltoall_efficiency is None:
        return 1.0
    return intra.alltoall_efficiency / intra.efficiency


def for_all_to_all(cluster: Cluster) -> Cluster:
    """``cluster`` with its NVLink (``intra``) links at the all-to-all figure: the same paths, graph and
    path cache, only ``link_bw_Bps`` scaled by :func:`alltoall_ratio` (degraded links keep their
    degradation; a calibrated bandwidth is scaled alike). Made once per cluster and kept on it."""
    ratio = alltoall_ratio(cluster)
    if ratio == 1.0:
        return cluster
    if cluster._alltoall is None:
        bw = cluster.link_bw_Bps.copy()
        bw[cluster.link_kind_code == _INTRA] *= ratio
        view = replace(cluster, link_bw_Bps=bw)
        view._alltoall = view  # a view of a view is itself
        cluster._alltoall = view
    return cluster._alltoall


__all__ = ["alltoall_ratio", "for_all_to_all"]
