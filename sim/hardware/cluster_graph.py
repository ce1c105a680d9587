"""Building the cluster graph: devices, node switches, hosts, NICs, leaf and spine switches.

:func:`build_cluster` turns a :class:`~sim.inputs.topology.Topology` and a node count into a networkx
``DiGraph`` whose directed edges are links with ``bw_GBps`` (effective: line rate x efficiency),
``latency_us``, ``kind`` and ``index``, and returns it in a :class:`~sim.hardware.cluster_paths.Cluster`
that keeps the same links as numpy arrays and computes paths between ranks.

Graph (per node ``n``; ``G`` GPUs per node, rank ``r = n * G + local``; ``D`` nodes per NVLink domain,
``topology.nvlink_domain_gpus / G``, 1 unless the topology says otherwise; node ``n`` in domain ``n // D``):

* ``n{n}/gpu{l}`` <-> the domain's switch (kind ``intra``: NVLink to the NVSwitch, a PCIe switch or
  shared memory, per GPU and direction: ``node.intra``): ``n{n}/switch`` when a domain is one node,
  ``nvl{d}/switch`` when it joins several (a GB200 NVL72 rack: 18 trays of 4 GPUs, 9 NVLink switch
  trays acting as one non-blocking switch),
* ``n{n}/gpu{l}`` <-> ``n{n}/host`` (kind ``pcie_host``: CPU memory, for optimizer offload),
* ``n{n}/gpu{l}`` <-> ``n{n}/nic{k}`` (kind ``pcie_nic``: GPUDirect RDMA over the node's PCIe
  switch, ``node.pcie_host`` figures), GPU ``l`` on NIC ``k = l * nics // G`` (one each if equal),
* rail fat tree: ``n{n}/nic{k}`` <-> ``leaf/r{k}/{n // nodes_per_leaf}`` (kinds ``nic_tx``,
  ``nic_rx``: the NIC line x efficiency), every leaf <-> ``spine`` (kinds ``leaf_up``,
  ``leaf_down``) with the leaf's attached downlink bandwidth / oversubscription. The spine is one
  non-blocking core node: leaf uplinks, not spine ports, bound what crosses leaves;
* single switch: every NIC <-> ``switch`` (``nic_tx`` / ``nic_rx``); ``none``: one NVLink domain only.
"""

from __future__ import annotations

import networkx as nx
import numpy as np

from sim.errors import InputError
from sim.hardware.cluster_paths import LINK_KINDS, Cluster, CrossRail
from sim.inputs.topology import Topology


class _Builder:
    """Accumulates graph nodes and links in a fixed order (link index = insertion order)."""

    def __init__(self) -> None:
        self.graph = nx.DiGraph()
        self.names: list[tuple[str, str]] = []
        self.bw: list[float] = []
        self.lat: list[float] = []
        self.kind: list[int] = []

    def node(self, name: str, kind: str, **attrs) -> str:
        self.graph.add_node(name, kind=kind, **attrs)
        return name

    def link(self, u: str, v: str, bw_GBps: float, latency_us: float, kind: str) -> int:
        index = len(self.names)
        self.graph.add_edge(u, v, bw_GBps=bw_GBps, latency_us=latency_us, kind=kind, index=index)
        self.names.append((u, v))
        self.bw.append(bw_GBps * 1e9)
        self.lat.append(latency_us * 1e-6)
        self.kind.append(LINK_KINDS.index(kind))
        return index

    def pair(self, a: str, b: str, bw_GBps: float, latency_us: float, up: str, down: str) -> tuple[int, int]:
        return self.link(a, b, bw_GBps, latency_us, up), self.link(b, a, bw_GBps, latency_us, down)


def build_cluster(
    topology: Topology, nodes: int, gpus_per_node: int | None = None, cross_rail: CrossRail = "pxn"
) -> Cluster:
    """Build the cluster graph of ``nodes`` nodes of ``topology`` (see the module docstring)."""
    so, nd = topology.scaleout, topology.node
    g = int(gpus_per_node or nd.gpus_per_node)
    if nodes < 1:
        raise InputError(f"nodes must be >= 1, got {nodes}", field="cluster.nodes")
    if g < 1:
        raise InputError(f"gpus_per_node must be >= 1, got {g}", field="cluster.gpus_per_node")
    per_domain = nodes_per_domain(topology, g)
    if so.kind == "none" and nodes > per_domain:
        held = "one node" if per_domain == 1 else f"one NVLink domain of {per_domain} nodes"
        raise InputError(
            f"topology '{topology.name}' has no scale-out fabric (scaleout.kind: none): "
            f"it holds {held}, got {nodes}",
            field="cluster.nodes",
        )
    if cross_rail not in ("pxn", "spine"):
        raise InputError(f"cross_rail must be 'pxn' or 'spine', got '{cross_rail}'", field="cross_rail")
    nics = min(so.nics_per_node, g) if so.kind != "none" else 0
    nic_of_local = (np.arange(g) * nics // g) if nics else np.zeros(g, dtype=np.int64)
    per_leaf = so.nodes_per_leaf
    leaves = -(-nodes // per_leaf)
    world = nodes * g
    b = _Builder()
    idx = {k: np.full(world, -1, dtype=np.int64) for k in ("iu", "id", "hu", "hd", "gn", "ng")}
    nic_tx = np.full((nodes, max(nics, 1)), -1, dtype=np.int64)
    nic_rx = nic_tx.copy()
    switch = ""
    for n in range(nodes):
        if per_domain == 1:
            switch = b.node(f"n{n}/switch", nd.intra_kind, node=n, domain=n)
        elif n % per_domain == 0:
            switch = b.node(f"nvl{n // per_domain}/switch", nd.intra_kind, domain=n // per_domain)
        host = b.node(f"n{n}/host", "host", node=n)
        nic_names = [b.node(f"n{n}/nic{k}", "nic", node=n, rail=k) for k in range(nics)]
        for loc in range(g):
            r = n * g + loc
            gpu = b.node(f"n{n}/gpu{loc}", "gpu", node=n, local=loc, rank=r)
            idx["iu"][r], idx["id"][r] = b.pair(
                gpu, switch, nd.intra.bw_GBps, nd.intra.latency_us, "intra", "intra"
            )
            hb, hl = nd.pcie_host.bw_GBps, nd.pcie_host.latency_us
            idx["hu"][r], idx["hd"][r] = b.pair(gpu, host, hb, hl, "pcie_host", "pcie_host")
            if nics:
                nic = nic_names[nic_of_local[loc]]
                idx["gn"][r], idx["ng"][r] = b.pair(gpu, nic, hb, hl, "pcie_nic", "pcie_nic")
    leaf_up = np.full((max(nics, 1), leaves), -1, dtype=np.int64)
    leaf_down = leaf_up.copy()
    if so.kind == "single_switch":
        core = b.node("switch", "switch")
        for n in range(nodes):
            for k in range(nics):
                nic_tx[n, k], nic_rx[n, k] = b.pair(
                    f"n{n}/nic{k}", core, so.nic_bw_GBps, so.latency_us, "nic_tx", "nic_rx"
                )
    elif so.kind == "rail_fat_tree":
        spine = b.node("spine", "spine")
        for k in range(nics):
            for leaf in range(leaves):
                name = b.node(f"leaf/r{k}/{leaf}", "leaf", rail=k, leaf=leaf)
                attached = range(leaf * per_leaf, min(nodes, (leaf + 1) * per_leaf))
                for n in attached:
                    nic_tx[n, k], nic_rx[n, k] = b.pair(
                        f"n{n}/nic{k}", name, so.nic_bw_GBps, so.latency_us, "nic_tx", "nic_rx"
                    )
                up_GBps = len(attached) * so.nic_bw_GBps / so.oversubscription
                leaf_up[k, leaf], leaf_down[k, leaf] = b.pair(
                    name, spine, up_GBps, so.latency_us, "leaf_up", "leaf_down"
                )
    return Cluster(
        topology=topology,
        nodes=nodes,
        gpus_per_node=g,
        cross_rail=cross_rail,
        graph=b.graph,
        link_names=b.names,
        link_bw_Bps=np.asarray(b.bw, dtype=np.float64),
        link_latency_s=np.asarray(b.lat, dtype=np.float64),
        link_kind_code=np.asarray(b.kind, dtype=np.int8),
        nics_per_node=nics,
        nodes_per_leaf=per_leaf,
        nodes_per_domain=per_domain,
        _intra_up=idx["iu"],
        _intra_down=idx["id"],
        _host_up=idx["hu"],
        _host_down=idx["hd"],
        _gpu_nic=idx["gn"],
        _nic_gpu=idx["ng"],
        _nic_tx=nic_tx,
        _nic_rx=nic_rx,
        _leaf_up=leaf_up,
        _leaf_down=leaf_down,
        _nic_of_local=nic_of_local.astype(np.int64),
    )


def nodes_per_domain(topology: Topology, gpus_per_node: int | None = None) -> int:
    """Nodes one NVLink domain of ``topology`` joins with ``gpus_per_node`` GPUs each (default: the
    topology's): ``nvlink_domain_gpus / gpus_per_node``, 1 when the topology names no domain."""
    g = int(gpus_per_node or topology.node.gpus_per_node)
    domain = topology.nvlink_domain_gpus
    if domain is None:
        return 1
    if domain % g:
        raise InputError(
            f"the topology's NVLink domain of {domain} GPUs does not hold whole nodes of {g} GPUs",
            field="cluster.gpus_per_node",
        )
    return domain // g
