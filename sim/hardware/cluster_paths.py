"""The built cluster (:class:`Cluster`): its links as numpy arrays and the path between any two ranks.

:func:`~sim.hardware.cluster_graph.build_cluster` makes one from the networkx graph
(:mod:`sim.hardware.cluster_graph` describes the nodes and links); :class:`Cluster` keeps the same
links as arrays (``link_bw_Bps``, ``link_latency_s``, ``link_kind_code``, indexed by the graph
edges' ``index``) for the flow-level network (:mod:`sim.network.flows`), and index tables from
which :meth:`Cluster.paths` computes the links between ranks without touching the graph.

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
    #: The same cluster as all-to-all traffic sees it (:func:`sim.hardware.alltoall_links.for_all_to_all`)
    _alltoall: Cluster | None = field(default=None, repr=False, compare=False)

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
