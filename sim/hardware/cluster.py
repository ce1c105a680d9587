"""The cluster: its graph, its links as arrays, and the paths between ranks, imported from one place.

The code lives in three modules, each readable on its own:

* :mod:`sim.hardware.cluster_graph`: :func:`build_cluster` turns a topology and a node count into
  the networkx graph of devices, node switches, hosts, NICs, leaf and spine switches (its layout is
  described there), and :func:`nodes_per_domain`;
* :mod:`sim.hardware.cluster_paths`: the built :class:`Cluster`, its links as numpy arrays for the
  flow-level network, and the path rules (NVLink domain, rails, PXN, the spine, reroutes around
  failed links);
* :mod:`sim.hardware.cluster_bisection`: bisection bandwidth by max flow and in closed form.
"""

from __future__ import annotations

from sim.hardware.cluster_bisection import bisection_closed_form_GBps, bisection_GBps
from sim.hardware.cluster_graph import build_cluster, nodes_per_domain
from sim.hardware.cluster_paths import LINK_KINDS, Cluster, CrossRail

__all__ = [
    "LINK_KINDS",
    "Cluster",
    "CrossRail",
    "bisection_GBps",
    "bisection_closed_form_GBps",
    "build_cluster",
    "nodes_per_domain",
]
