"""Simulated faults (the scenario's ``faults:`` section, schema in :mod:`sim.inputs.faults`).

* :func:`apply_faults` -> a new :class:`~sim.hardware.cluster.Cluster`: degraded links keep their paths at
  ``bw x bw_factor`` (factors of several entries on one link multiply); failed links leave the
  graph and the pairs whose path crossed one are rerouted (:mod:`sim.hardware.reroute`); failures that cut
  some GPU off from the rest are an :class:`~sim.errors.InputError` (exit 2).
* :func:`compute_factors` -> per-rank kernel-time multipliers (stragglers), shape ``(world,)``.
* :func:`jitter_sampler` -> :class:`KernelJitter` (lognormal per-kernel factors with mean 1 and
  coefficient of variation ``kernel_cv``, one random stream per rank from ``seed``) or None.

Targets: ``nic {node, rail}`` = the NIC's fabric port, both directions (failed: its PCIe links to
its GPUs too); ``nvlink {rank}`` = the GPU's link to the node switch, both directions; ``pcie
{rank}`` = its PCIe link to host memory; ``leaf {rail, leaf}`` = that leaf's uplink and downlink
to the spine; ``link: "u -> v"`` = one directed link by the names ``moesim topo`` and
``Cluster.link_label`` use (``"u <-> v"``: both directions).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np

from sim.errors import InputError, did_you_mean
from sim.hardware.cluster import Cluster, CrossRail, build_cluster
from sim.hardware.reroute import Rerouter, partitioned_ranks
from sim.inputs.faults import FaultsConfig, LinkFault

_LINK_RE = re.compile(r"^\s*(\S+)\s*(<->|->)\s*(\S+)\s*$")


def _span(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``'0-2, 5'``."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


def _faults_of(scenario_or_faults) -> FaultsConfig:
    return scenario_or_faults if isinstance(scenario_or_faults, FaultsConfig) else scenario_or_faults.faults


def _check_index(value: int, count: int, what: str, field: str, where: str = "the cluster has") -> None:
    if value >= count:
        raise InputError(f"{what} {value} does not exist: {where} {what}s 0-{count - 1}", field=field)


def _nic_links(c: Cluster, f: LinkFault, field: str) -> list[int]:
    assert f.nic is not None
    if c.nics_per_node == 0:
        raise InputError(
            f"this cluster has no NICs (topology '{c.topology.name}' has scaleout.kind: none)", field=field
        )
    n, k = f.nic.node, f.nic.rail
    _check_index(n, c.nodes, "node", f"{field}.node")
    _check_index(k, c.nics_per_node, "rail", f"{field}.rail", f"node {n} has NICs on")
    links = [int(c._nic_tx[n, k]), int(c._nic_rx[n, k])]
    if f.failed:  # a dead NIC: its GPUs cannot reach it over PCIe either
        ranks = n * c.gpus_per_node + np.flatnonzero(c._nic_of_local == k)
        links += [int(x) for x in c._gpu_nic[ranks]] + [int(x) for x in c._nic_gpu[ranks]]
    return links


def _leaf_links(c: Cluster, f: LinkFault, field: str) -> list[int]:
    assert f.leaf is not None
    if c.topology.scaleout.kind != "rail_fat_tree":
        raise InputError(
            f"leaf needs a rail fat tree; topology '{c.topology.name}' has scaleout.kind: "
            f"{c.topology.scaleout.kind} (use nic or link)",
            field=field,
        )
    _check_index(f.leaf.rail, c.nics_per_node, "rail", f"{field}.rail")
    leaves = c._leaf_up.shape[1]
    _check_index(f.leaf.leaf, leaves, "leaf", f"{field}.leaf", f"rail {f.leaf.rail} has")
    return [int(c._leaf_up[f.leaf.rail, f.leaf.leaf]), int(c._leaf_down[f.leaf.rail, f.leaf.leaf])]


def _named_links(c: Cluster, text: str, field: str, index: dict[tuple[str, str], int]) -> list[int]:
    m = _LINK_RE.match(text)
    if not m:
        raise InputError(
            f"write a link as 'u -> v' (one direction) or 'u <-> v' (both), with node names as in "
            f"`moesim topo`, e.g. 'n0/nic0 -> leaf/r0/0'; got {text!r}",
            field=field,
        )
    u, arrow, v = m.groups()
    nodes = {a for pair in index for a in pair}
    for name in (u, v):
        if name not in nodes:
            kinds = (
                "n<node>/gpu<local>, n<node>/switch, n<node>/nic<rail>, leaf/r<rail>/<leaf>, spine, switch"
            )
            raise InputError(
                f"no device or switch named '{name}' in this cluster{did_you_mean(name, sorted(nodes))}; "
                f"names look like {kinds}",
                field=field,
            )
    pairs = [(u, v), (v, u)] if arrow == "<->" else [(u, v)]
    out = []
    for a, b in pairs:
        if (a, b) not in index:
            ends = sorted(y for x, y in index if x == a)
            raise InputError(f"no link {a} -> {b}; links from {a} go to: {', '.join(ends)}", field=field)
        out.append(index[(a, b)])
    return out


def resolve_link_faults(
    cluster: Cluster, scenario_or_faults
) -> tuple[np.ndarray, np.ndarray, list[list[int]]]:
    """(bandwidth factor per link, failed mask per link, link indices of every ``faults.links`` entry)."""
    faults = _faults_of(scenario_or_faults)
    factor = np.ones(cluster.num_links)
    failed = np.zeros(cluster.num_links, dtype=bool)
    owners: list[list[int]] = []
    index: dict[tuple[str, str], int] | None = None
    for i, f in enumerate(faults.links):
        field = f"faults.links.{i}.{f.target}"
        if f.nic is not None:
            links = _nic_links(cluster, f, field)
        elif f.leaf is not None:
            links = _leaf_links(cluster, f, field)
        elif f.link is not None:
            if index is None:
                index = {pair: j for j, pair in enumerate(cluster.link_names)}
            links = _named_links(cluster, f.link, field, index)
        else:
            ref = f.nvlink if f.nvlink is not None else f.pcie
            assert ref is not None
            _check_index(ref.rank, cluster.world_size, "rank", f"{field}.rank")
            if f.nvlink is not None:
                links = [int(cluster._intra_up[ref.rank]), int(cluster._intra_down[ref.rank])]
            else:
                links = [int(cluster._host_up[ref.rank]), int(cluster._host_down[ref.rank])]
        if f.failed:
            failed[links] = True
        else:
            factor[links] *= f.bw_factor
        owners.append(links)
    return factor, failed, owners


def apply_faults(cluster: Cluster, scenario_or_faults) -> Cluster:
    """A copy of ``cluster`` with the degraded and failed links of a scenario (or a FaultsConfig).

    Applied to the healthy cluster (``cluster.healthy`` when given a faulty one), so applying the
    same faults twice gives the same cluster, and ``apply_faults(c, FaultsConfig())`` the healthy one."""
    faults = _faults_of(scenario_or_faults)
    cluster = cluster.healthy or cluster  # idempotent: faults replace earlier ones, never stack
    if not faults.links:
        return cluster
    factor, failed, _ = resolve_link_faults(cluster, faults)
    graph = cluster.graph.copy()
    bw = cluster.link_bw_Bps * factor
    for i in np.flatnonzero(factor != 1.0):
        u, v = cluster.link_names[i]
        if graph.has_edge(u, v):
            graph.edges[u, v]["bw_GBps"] = float(bw[i]) / 1e9
    for i in np.flatnonzero(failed):
        u, v = cluster.link_names[i]
        if graph.has_edge(u, v):
            graph.remove_edge(u, v)
    new = replace(
        cluster,
        graph=graph,
        link_bw_Bps=bw,
        link_failed=failed if failed.any() else None,
        _path_cache={},
        _reroute=None,
        _alltoall=None,
        healthy=cluster,
    )
    if failed.any():
        lost = partitioned_ranks(new)
        if lost:
            which = [f"faults.links.{i} ({f.target})" for i, f in enumerate(faults.links) if f.failed]
            raise InputError(
                f"the failed links partition the cluster: rank(s) {_span(lost)} cannot reach the other "
                f"{cluster.world_size - len(lost)} ranks or be reached from them (failed: {', '.join(which)}); "
                "fail fewer links, or degrade them with bw_factor instead",
                field="faults.links",
            )
        new._reroute = Rerouter(new)
    return new


def compute_factors(scenario) -> np.ndarray:
    """Kernel-time multiplier of every rank, shape ``(world,)``: 1, or a straggler's compute_factor."""
    world = scenario.world_size
    factors = np.ones(world)
    for i, s in enumerate(scenario.faults.stragglers):
        _check_index(s.rank, world, "rank", f"faults.stragglers.{i}.rank")
        factors[s.rank] = s.compute_factor
    return factors


class KernelJitter:
    """Lognormal kernel-time factors: ``exp(N(mu, sigma^2))`` with ``sigma^2 = ln(1 + cv^2)``,
    ``mu = -sigma^2 / 2`` (mean 1, std ``cv``). Rank ``r`` draws from its own stream
    ``SeedSequence(seed, spawn_key=(r,))``, so what a rank draws does not depend on the others."""

    def __init__(self, kernel_cv: float, seed: int = 0):
        if not (kernel_cv >= 0 and math.isfinite(kernel_cv)):
            raise ValueError("kernel_cv must be finite and >= 0")
        self.cv, self.seed = float(kernel_cv), int(seed)
        self.sigma = math.sqrt(math.log1p(self.cv**2))
        self.mu = -0.5 * self.sigma**2
        self._streams: dict[int, np.random.Generator] = {}

    def _stream(self, rank: int) -> np.random.Generator:
        g = self._streams.get(rank)
        if g is None:
            g = self._streams[rank] = np.random.default_rng(
                np.random.SeedSequence(self.seed, spawn_key=(rank,))
            )
        return g

    def __call__(self, rank: int, size: int | None = None) -> float | np.ndarray:
        """The next factor (or ``size`` factors) for a kernel of ``rank``."""
        draw = self._stream(int(rank)).lognormal(self.mu, self.sigma, size)
        return float(draw) if size is None else draw


def jitter_sampler(scenario) -> KernelJitter | None:
    """The scenario's kernel-time jitter, or None when it has none (or ``kernel_cv: 0``)."""
    j = scenario.faults.jitter
    if j is None or j.kernel_cv == 0:
        return None
    return KernelJitter(j.kernel_cv, j.seed)


def without_faults(scenario):
    """The same scenario on a healthy cluster (for step-time impact against the faulty one)."""
    healthy = scenario.model_copy(update={"faults": FaultsConfig()})
    return healthy


def describe_faults(cluster: Cluster, scenario) -> list[dict]:
    """One record per ``faults.links`` entry: field, target, links hit (labels), bw_factor or failed.
    ``cluster`` is the healthy one (names resolve the same way on either)."""
    faults = _faults_of(scenario)
    _, _, owners = resolve_link_faults(cluster, faults)
    return [
        {
            "field": f"faults.links.{i}",
            "target": f.target,
            "links": [cluster.link_label(j) for j in links],
            "bw_factor": None if f.failed else f.bw_factor,
            "failed": f.failed,
        }
        for i, (f, links) in enumerate(zip(faults.links, owners, strict=True))
    ]


def check_faults(scenario) -> None:
    """Every fault target exists in the scenario's cluster and failures leave it connected
    (:class:`InputError` otherwise). Builds the cluster only when there are link faults."""
    compute_factors(scenario)
    if scenario.faults.links:
        healthy = build_cluster(scenario.topology, scenario.cluster.nodes, scenario.gpus_per_node)
        apply_faults(healthy, scenario)


def cluster_for(scenario, cross_rail: CrossRail = "pxn", faults: bool = True) -> Cluster:
    """The cluster of a loaded :class:`~sim.inputs.scenario.Scenario` (its topology, nodes, GPUs per node),
    with the scenario's degraded and failed links applied unless ``faults=False`` (the healthy one)."""
    cluster = build_cluster(scenario.topology, scenario.cluster.nodes, scenario.gpus_per_node, cross_rail)
    if faults and scenario.faults.links:
        cluster = apply_faults(cluster, scenario)
    return cluster


__all__ = [
    "cluster_for",
    "KernelJitter",
    "apply_faults",
    "check_faults",
    "compute_factors",
    "describe_faults",
    "jitter_sampler",
    "resolve_link_faults",
    "without_faults",
]
