"""Bisection bandwidth of a cluster, two ways that check each other (``moesim topo`` prints both):
:func:`bisection_GBps` by max flow (= min cut) over the cluster graph, and
:func:`bisection_closed_form_GBps` from the topology alone, for the same two halves."""

from __future__ import annotations

import networkx as nx
import numpy as np

from sim.hardware.cluster_graph import nodes_per_domain
from sim.hardware.cluster_paths import Cluster
from sim.inputs.topology import Topology


def bisection_GBps(cluster: Cluster) -> float:
    """Bisection bandwidth from the graph: max flow (= min cut) from one half of the GPUs to the other.

    With two or more nodes the halves are the first ``nodes // 2`` nodes and the rest (an NVLink
    domain may span both); with one node, the first ``G // 2`` GPUs and the rest over the node switch
    only. Host memory is not a transit switch and is left out. One direction (GB/s per direction, like
    every link figure).
    """
    g = cluster.gpus_per_node
    keep = [v for v, d in cluster.graph.nodes(data=True) if d["kind"] != "host"]
    if cluster.nodes == 1:
        keep = [
            v for v in keep if cluster.graph.nodes[v]["kind"] in ("gpu", cluster.topology.node.intra_kind)
        ]
        half = g // 2
    else:
        half = (cluster.nodes // 2) * g
    sub = nx.DiGraph()
    for u, v, d in cluster.graph.subgraph(keep).edges(data=True):
        sub.add_edge(u, v, capacity=d["bw_GBps"])
    for r in range(cluster.world_size):
        side = ("_src", cluster.gpu_name(r)) if r < half else (cluster.gpu_name(r), "_dst")
        sub.add_edge(*side)  # no capacity attribute: unbounded in networkx
    if half == 0:
        return 0.0
    return float(nx.maximum_flow_value(sub, "_src", "_dst"))


def bisection_closed_form_GBps(
    topology: Topology, nodes: int, gpus_per_node: int | None = None
) -> float | None:
    """Closed-form bisection for the halves of :func:`bisection_GBps`; None where none applies.

    One node: ``floor(G/2) x intra``. Several: the NVLink part plus the scale-out part, which share
    no link. NVLink: each domain's switch is cut on its smaller side, ``min(GPUs of the domain in
    half A, in half B) x intra`` (0 when domains are nodes). Scale-out: ``h = nodes // 2`` nodes,
    each pushing out at most ``sum over NICs of min(NIC, GPUs on it x PCIe)``; a fat tree whose
    halves split at leaf boundaries also caps it at ``h x NICs x NIC / oversubscription`` (leaf
    uplinks). A half that splits a leaf has no simple closed form (returns None).
    """
    so, nd = topology.scaleout, topology.node
    g = int(gpus_per_node or nd.gpus_per_node)
    if nodes == 1:
        return (g // 2) * nd.intra.bw_GBps
    h, per_domain = nodes // 2, nodes_per_domain(topology, g)
    domain = np.arange(nodes) // per_domain
    in_a = np.bincount(domain[:h], minlength=domain[-1] + 1)
    in_b = np.bincount(domain[h:], minlength=domain[-1] + 1)
    nvlink = float(np.minimum(in_a, in_b).sum()) * g * nd.intra.bw_GBps
    if so.kind == "none":
        return nvlink
    nics = min(so.nics_per_node, g)
    gpus_on_nic = np.bincount(np.arange(g) * nics // g, minlength=nics)
    egress = float(np.minimum(so.nic_bw_GBps, gpus_on_nic * nd.pcie_host.bw_GBps).sum())
    if so.kind == "single_switch" or nodes <= so.nodes_per_leaf:
        return nvlink + h * egress
    if h % so.nodes_per_leaf:
        return None
    return nvlink + h * min(egress, nics * so.nic_bw_GBps / so.oversubscription)
