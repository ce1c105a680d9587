"""Paths around failed links: the shortest path over the links left, looked up per rank pair.

:class:`Rerouter` answers ``(src_rank, dst_rank) -> link indices`` for the pairs whose rule-based
path (:meth:`sim.hardware.cluster.Cluster.paths`) crosses a failed link. Search: Dijkstra on the cluster
graph without its failed edges and without host-memory nodes (host memory is never a transit),
edge weight ``1 + latency_us * 1e-6``: fewest hops, then lowest latency, ties broken by the graph's
insertion order (deterministic; ``src == dst`` never asks). The search first runs on the part of the graph that can matter
to the pair: the two nodes' GPUs, switches and NICs, every rail's leaf of the two nodes' leaves,
the spine and the core switch; only if that holds no path does it search the whole graph.

So a GPU whose NIC failed sends over NVLink to another GPU of its node and out of that GPU's NIC
(PXN-style), and traffic to it arrives on another NIC of its node and crosses NVLink last.
Partitions are found up front by :func:`partitioned_ranks`.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict

import networkx as nx

_CORE_KINDS = ("spine", "switch")


def _weight(_u: str, _v: str, d: dict) -> float:
    return 1.0 + d["latency_us"] * 1e-6


def routing_graph(graph: nx.DiGraph) -> nx.DiGraph:
    """A view of ``graph`` without host-memory nodes (failed edges are already removed)."""
    return nx.subgraph_view(graph, filter_node=lambda v: graph.nodes[v]["kind"] != "host")


def partitioned_ranks(cluster) -> list[int]:
    """Ranks outside the strongly connected part of the links left that holds the most GPUs
    (ties: the one with the lowest rank); empty when every GPU reaches every other."""
    view = routing_graph(cluster.graph)
    rank_of = {cluster.gpu_name(r): r for r in range(cluster.world_size)}
    best: tuple[int, int] | None = None  # (-gpus, lowest rank)
    best_ranks: set[int] = set()
    for comp in nx.strongly_connected_components(view):
        ranks = {rank_of[v] for v in comp if v in rank_of}
        if not ranks:
            continue
        key = (-len(ranks), min(ranks))
        if best is None or key < best:
            best, best_ranks = key, ranks
    return [r for r in range(cluster.world_size) if r not in best_ranks]


class Rerouter:
    """Cached shortest paths avoiding failed links, for a cluster built by :func:`sim.hardware.faults.apply_faults`."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.graph: nx.DiGraph = cluster.graph
        self.cache: dict[tuple[int, int], tuple[int, ...]] = {}
        self._members: dict[int, list[str]] = defaultdict(list)  # cluster node -> its GPUs, switch, NICs
        self._leaves: dict[int, list[str]] = defaultdict(list)  # leaf index -> that leaf on every rail
        self._core: list[str] = []
        hosts = set()
        for name, d in self.graph.nodes(data=True):
            kind = d["kind"]
            if kind == "host":
                hosts.add(name)
            elif "node" in d:
                self._members[d["node"]].append(name)
            elif kind == "leaf":
                self._leaves[d["leaf"]].append(name)
            elif kind in _CORE_KINDS:
                self._core.append(name)
        # adjacency without host memory: u -> [(v, weight, link index)] in the graph's insertion order
        self._adj: dict[str, list[tuple[str, float, int]]] = {
            u: [(v, _weight(u, v, d), int(d["index"])) for v, d in nbrs.items() if v not in hosts]
            for u, nbrs in self.graph.adjacency()
            if u not in hosts
        }

    def _local_nodes(self, src: int, dst: int) -> set[str]:
        c = self.cluster
        ns, nd = c.node_of(src), c.node_of(dst)
        keep = set(self._members[ns]) | set(self._members[nd]) | set(self._core)
        per_leaf = max(c.nodes_per_leaf, 1)
        for n in (ns, nd):
            keep.update(self._leaves.get(n // per_leaf, ()))
        return keep

    def _dijkstra(self, a: str, b: str, keep: set[str] | None) -> tuple[int, ...] | None:
        """Link indices of the lightest path a -> b over nodes in ``keep`` (all if None); ties go to
        the first path found (heap entries ordered by insertion)."""
        dist = {a: 0.0}
        prev: dict[str, tuple[str, int]] = {}
        heap = [(0.0, 0, a)]
        pushed = 1
        while heap:
            d, _, u = heapq.heappop(heap)
            if u == b:
                break
            if d > dist[u]:
                continue
            for v, w, index in self._adj.get(u, ()):
                if keep is not None and v not in keep:
                    continue
                nd = d + w
                if nd < dist.get(v, math.inf):
                    dist[v] = nd
                    prev[v] = (u, index)
                    heapq.heappush(heap, (nd, pushed, v))
                    pushed += 1
        if b not in prev:
            return None
        links = []
        v = b
        while v != a:
            v, index = prev[v]
            links.append(index)
        return tuple(reversed(links))

    def __call__(self, src: int, dst: int) -> tuple[int, ...]:
        key = (src, dst)
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        a, b = self.cluster.gpu_name(src), self.cluster.gpu_name(dst)
        links = self._dijkstra(a, b, self._local_nodes(src, dst))
        if links is None:
            links = self._dijkstra(a, b, None)
        if links is None:
            raise RuntimeError(f"no path from rank {src} to rank {dst}: a partition was not caught")
        self.cache[key] = links
        return links


__all__ = ["Rerouter", "partitioned_ranks", "routing_graph"]
