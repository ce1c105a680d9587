"""The cluster graph: devices, node switches, hosts, NICs, leaf and spine switches, and paths.

:func:`build_cluster` turns a :class:`~sim.inputs.topology.Topology` and a node count into a networkx
``DiGraph`` whose directed edges are links with ``bw_GBps`` (effective: line rate x efficiency),
``latency_us``, ``kind`` and ``index``; :class:`Cluster` keeps the same links as numpy arrays for
the flow-level network (:mod:`sim.network.flows`) and computes paths between ranks.

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

Path rules (:meth:`Cluster.path`): a rank to itself is the empty path; inside an NVLink domain
``gpu -> switch -> gpu`` (whatever the two GPUs' nodes); between domains on the same rail
``gpu -> nic -> leaf [-> spine -> leaf] -> nic -> gpu`` (the spine only when the two nodes hang off
different leaves). Between different rails, ``cross_rail="pxn"`` (default, NCCL's PXN,
NCCL_PXN_DISABLE=0) first moves the data over NVLink to the source-node GPU with the destination's
local index and sends it on that rail, so traffic never leaves its rail; ``cross_rail="spine"``
sends on the source's own NIC and crosses rails at the spine. Inter-node bytes are the bytes on
``nic_tx`` links (traffic between NVLink domains).

Faults (:mod:`sim.hardware.faults`): a degraded link keeps its path and loses bandwidth; a pair whose path
above crosses a failed link takes instead the shortest path (hops, then latency) over the links
left, host memory never a transit (:mod:`sim.hardware.reroute`): a GPU whose NIC failed reaches the fabric
over NVLink through another GPU of its node and that GPU's NIC, PXN-style.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import networkx as nx
import numpy as np

from sim.errors import InputError
from sim.inputs.topology import Topology

CrossRail = Literal["pxn", "spine"]

#: Link kinds, in the order of the integer codes in :attr:`Cluster.link_kind_code`.
LINK_KINDS: tuple[str, ...] = ("intra", "pcie_host", "pcie_nic", "nic_tx", "nic_rx", "leaf_up", "leaf_down")


@dataclass
class Cluster:
    """A built cluster: the graph, its links as arrays, and path lookups by rank."""

    topology: Topology
    nodes: int
    gpus_per_node: int
    cross_rail: CrossRail
    graph: nx.DiGraph
    link_names: list[tuple[str, str]]
    link_bw_Bps: np.ndarray
    link_latency_s: np.ndarray
    link_kind_code: np.ndarray
    nics_per_node: int
    nodes_per_leaf: int
    #: nodes one NVLink domain joins (``topology.nvlink_domain_gpus / gpus_per_node``; 1 by default)
    nodes_per_domain: int
    # index tables (link ids) used to compute paths without touching the graph
    _intra_up: np.ndarray
    _intra_down: np.ndarray
    _host_up: np.ndarray
    _host_down: np.ndarray
    _gpu_nic: np.ndarray
    _nic_gpu: np.ndarray
    _nic_tx: np.ndarray
    _nic_rx: np.ndarray
    _leaf_up: np.ndarray
    _leaf_down: np.ndarray
    _nic_of_local: np.ndarray
    _path_cache: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict, repr=False)
    #: Failed links (set by :func:`sim.hardware.faults.apply_faults`); a path over one is rerouted.
    link_failed: np.ndarray | None = field(default=None, repr=False)
    #: (src, dst) -> link indices avoiding failed links (:class:`sim.hardware.reroute.Rerouter`).
    _reroute: Callable[[int, int], tuple[int, ...]] | None = field(default=None, repr=False, compare=False)
    #: The healthy cluster a faulty one was made from (faults are applied to it, never stacked).
    healthy: Cluster | None = field(default=None, repr=False, compare=False)
    #: Calibrated bytes multiplier per collective kind (``Calibration.collective_bytes_factor``):
    #: a collective of ``nbytes`` moves ``nbytes x factor`` over the links (sim.network.collectives.reduction_dag)
    collective_bytes_factor: dict[str, float] = field(default_factory=dict, repr=False)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpus_per_domain(self) -> int:
        """GPUs one NVLink domain joins (the last domain may hold fewer when nodes do not fill it)."""
        return self.nodes_per_domain * self.gpus_per_node

    def domain_of(self, rank: int) -> int:
        """The NVLink domain of ``rank``: ranks of one domain talk over NVLink, others over the fabric."""
        return rank // self.gpus_per_domain

    @property
    def num_links(self) -> int:
        return len(self.link_names)

    @property
    def link_kind(self) -> np.ndarray:
        """Kind name of every link (``intra``, ``nic_tx``, ...)."""
        return np.asarray(LINK_KINDS)[self.link_kind_code]

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def gpu_name(self, rank: int) -> str:
        return f"n{rank // self.gpus_per_node}/gpu{rank % self.gpus_per_node}"

    def path(self, src_rank: int, dst_rank: int) -> tuple[int, ...]:
        """Link indices from ``src_rank`` to ``dst_rank`` (cached), per the module's path rules."""
        key = (int(src_rank), int(dst_rank))
        hit = self._path_cache.get(key)
        if hit is None:
            indptr, links = self.paths(np.array([key[0]]), np.array([key[1]]))
            hit = self._path_cache[key] = tuple(int(x) for x in links[indptr[0] : indptr[1]])
        return hit

    def host_path(self, rank: int, to_host: bool) -> tuple[int, ...]:
        """The PCIe link between ``rank`` and its node's host memory, in the asked direction."""
        self._check_ranks(np.array([rank]))
        return (int(self._host_up[rank] if to_host else self._host_down[rank]),)

    def host_paths(self, ranks: np.ndarray, to_host: bool) -> tuple[np.ndarray, np.ndarray]:
        """CSR (indptr, link indices) of the host links of many ranks."""
        ranks = np.asarray(ranks, dtype=np.int64)
        self._check_ranks(ranks)
        links = (self._host_up if to_host else self._host_down)[ranks]
        return np.arange(len(ranks) + 1, dtype=np.int64), links.astype(np.int64)

    def paths(self, srcs: np.ndarray, dsts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`path` for many pairs: CSR ``(indptr, link indices)``, paths in pair order."""
        src = np.asarray(srcs, dtype=np.int64)
        dst = np.asarray(dsts, dtype=np.int64)
        if src.shape != dst.shape or src.ndim != 1:
            raise ValueError("srcs and dsts must be 1-D arrays of the same length")
        self._check_ranks(src)
        self._check_ranks(dst)
        g = self.gpus_per_node
        node_s, loc_s, node_d, loc_d = src // g, src % g, dst // g, dst % g
        hops = np.full((len(src), 8), -1, dtype=np.int64)
        same_domain = (src // self.gpus_per_domain) == (dst // self.gpus_per_domain)
        near = same_domain & (src != dst)
        hops[near, 0] = self._intra_up[src[near]]
        hops[near, 1] = self._intra_down[dst[near]]
        far = np.flatnonzero(~same_domain)
        if len(far):
            hops[far] = self._inter_node_hops(
                src[far], dst[far], node_s[far], loc_s[far], node_d[far], loc_d[far]
            )
        used = hops >= 0  # row-major selection keeps every path's hops in order
        if self.link_failed is not None and self._reroute is not None:
            hit = (self.link_failed[np.where(used, hops, 0)] & used).any(axis=1)
            if hit.any():
                return self._with_reroutes(src, dst, hops, used, np.flatnonzero(hit))
        lengths = used.sum(axis=1)
        indptr = np.zeros(len(src) + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        return indptr, hops[used]

    def _with_reroutes(self, src, dst, hops, used, rows) -> tuple[np.ndarray, np.ndarray]:
        """CSR paths where ``rows`` (whose rule-based path crosses a failed link) take the rerouter's."""
        assert self._reroute is not None
        new = [self._reroute(int(src[r]), int(dst[r])) for r in rows]
        lengths = used.sum(axis=1)
        lengths[rows] = [len(p) for p in new]
        indptr = np.zeros(len(src) + 1, dtype=np.int64)
        np.cumsum(lengths, out=indptr[1:])
        out = np.empty(int(indptr[-1]), dtype=np.int64)
        keep = used.copy()
        keep[rows] = False
        r, c = np.nonzero(keep)
        out[indptr[r] + (np.cumsum(used, axis=1) - 1)[r, c]] = hops[r, c]
        for row, p in zip(rows, new, strict=True):
            out[indptr[row] : indptr[row + 1]] = p
        return indptr, out

    def _inter_node_hops(self, src, dst, node_s, loc_s, node_d, loc_d) -> np.ndarray:
        hops = np.full((len(src), 8), -1, dtype=np.int64)
        rail_s, rail_d = self._nic_of_local[loc_s], self._nic_of_local[loc_d]
        sender, rail_send, col = src.copy(), rail_s.copy(), 0
        if self.cross_rail == "pxn" and self.topology.scaleout.kind == "rail_fat_tree":
            pxn = rail_s != rail_d
            relay = node_s * self.gpus_per_node + loc_d
            hops[pxn, 0] = self._intra_up[src[pxn]]
            hops[pxn, 1] = self._intra_down[relay[pxn]]
            sender[pxn], rail_send[pxn] = relay[pxn], rail_d[pxn]
            col = 2  # rows without PXN keep -1 in columns 0-1; paths() drops unused slots in order
        hops[:, col] = self._gpu_nic[sender]
        hops[:, col + 1] = self._nic_tx[node_s, rail_send]
        nxt = col + 2
        if self.topology.scaleout.kind == "rail_fat_tree":
            leaf_s, leaf_d = node_s // self.nodes_per_leaf, node_d // self.nodes_per_leaf
            via_spine = (rail_send != rail_d) | (leaf_s != leaf_d)
            hops[via_spine, nxt] = self._leaf_up[rail_send[via_spine], leaf_s[via_spine]]
            hops[via_spine, nxt + 1] = self._leaf_down[rail_d[via_spine], leaf_d[via_spine]]
        hops[:, nxt + 2] = self._nic_rx[node_d, rail_d]
        hops[:, nxt + 3] = self._nic_gpu[dst]
        return hops

    def _check_ranks(self, ranks: np.ndarray) -> None:
        if len(ranks) and (ranks.min() < 0 or ranks.max() >= self.world_size):
            bad = int(ranks[(ranks < 0) | (ranks >= self.world_size)][0])
            raise ValueError(f"rank {bad} is outside the cluster's {self.world_size} ranks")

    def link_label(self, index: int) -> str:
        u, v = self.link_names[index]
        return f"{u} -> {v}"


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
