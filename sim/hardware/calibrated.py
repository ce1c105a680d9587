"""Calibrated link figures (a calibration file's ``links``) applied to a cluster graph."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from sim.hardware.cluster import LINK_KINDS, Cluster
from sim.inputs.calibration import Calibration

#: calibration link class -> cluster link kinds it sets (``sim.hardware.cluster.LINK_KINDS``)
LINK_CLASS_KINDS: dict[str, tuple[str, ...]] = {
    "intra": ("intra",),
    "inter": ("nic_tx", "nic_rx", "leaf_up", "leaf_down"),
    "host": ("pcie_host",),
}


def apply_link_calibration(cluster: Cluster, calib: Calibration | None) -> Cluster:
    """A copy of ``cluster`` whose links take the calibrated alpha (per link) and bandwidth of their
    class; classes the calibration lacks keep the topology's figures. Leaf up/down links (whose
    bandwidth is the attached NICs' sum / oversubscription) scale by the NIC's factor. Apply it to
    the healthy cluster, before faults (``sim.hardware.faults.apply_faults`` degrades what this sets)."""
    if calib is None or not calib.links:
        return cluster
    factor = {k: float(v) for k, v in (calib.collective_bytes_factor or {}).items()}
    bw = cluster.link_bw_Bps.copy()
    lat = cluster.link_latency_s.copy()
    kind = cluster.link_kind_code
    for cls, fit in calib.links.items():
        kinds = LINK_CLASS_KINDS[cls]
        target = fit.bw_GBps * 1e9
        ref_code = LINK_KINDS.index(kinds[0])
        ref = cluster.link_bw_Bps[kind == ref_code]
        scale = target / float(ref.mean()) if len(ref) else 1.0
        for k in kinds:
            sel = kind == LINK_KINDS.index(k)
            if not sel.any():
                continue
            bw[sel] = cluster.link_bw_Bps[sel] * scale if k in ("leaf_up", "leaf_down") else target
            lat[sel] = fit.alpha_us * 1e-6
    graph = cluster.graph.copy()
    for i in np.flatnonzero((bw != cluster.link_bw_Bps) | (lat != cluster.link_latency_s)):
        u, v = cluster.link_names[i]
        graph.edges[u, v]["bw_GBps"] = float(bw[i]) / 1e9
        graph.edges[u, v]["latency_us"] = float(lat[i]) * 1e6
    return replace(
        cluster, graph=graph, link_bw_Bps=bw, link_latency_s=lat, _path_cache={}, _reroute=None, _alltoall=None, healthy=None,
        collective_bytes_factor=factor,
    )


__all__ = ["LINK_CLASS_KINDS", "apply_link_calibration"]
