"""Cluster graph: device counts, per-GPU bandwidth, hop counts, PXN paths, bisection."""

from __future__ import annotations

import networkx as nx
import numpy as np
import pytest

from sim.api import load_scenario
from sim.errors import InputError
from sim.hardware.cluster import bisection_closed_form_GBps, bisection_GBps, build_cluster
from sim.hardware.faults import cluster_for
from sim.inputs.topology import load_topology
from tests.conftest import SCENARIOS


@pytest.fixture(scope="module")
def h100():
    return load_topology("dgx-h100")


def kinds(cluster):
    return [d["kind"] for _, d in cluster.graph.nodes(data=True)]


def test_device_counts(h100):
    c = build_cluster(h100, 16)
    k = kinds(c)
    assert k.count("gpu") == 128
    assert k.count("nic") == 128
    assert k.count("nvswitch") == 16
    assert k.count("host") == 16
    assert k.count("leaf") == 8  # one leaf per rail: 16 nodes <= 32 per leaf
    assert k.count("spine") == 1
    # per GPU: 2 intra + 2 host + 2 NIC PCIe links; per NIC 2 fabric links; per leaf 2 uplinks
    assert c.num_links == 128 * 6 + 128 * 2 + 8 * 2
    big = build_cluster(h100, 70)
    assert kinds(big).count("leaf") == 8 * 3  # ceil(70 / 32) leaves per rail


def test_link_attributes_are_line_times_efficiency(h100):
    c = build_cluster(h100, 2)
    e = c.graph.edges["n0/gpu3", "n0/switch"]
    assert e["bw_GBps"] == pytest.approx(450 * 0.82)
    assert e["latency_us"] == 2.5 and e["kind"] == "intra"
    nic = c.graph.edges["n1/nic5", "leaf/r5/0"]
    assert nic["bw_GBps"] == pytest.approx(400 / 8 * 0.97)
    assert c.link_bw_Bps[nic["index"]] == pytest.approx(nic["bw_GBps"] * 1e9)
    assert c.link_kind[nic["index"]] == "nic_tx"


def test_per_gpu_bandwidth(h100):
    c = build_cluster(h100, 4)
    for r in range(c.world_size):
        out = [d for _, _, d in c.graph.out_edges(c.gpu_name(r), data=True)]
        by_kind = {d["kind"]: d["bw_GBps"] for d in out}
        assert by_kind["intra"] == pytest.approx(369.0)
        assert by_kind["pcie_host"] == pytest.approx(54.4)
        # the GPU's NIC then carries 48.5 GB/s onto its rail
        nic = next(v for _, v, d in c.graph.out_edges(c.gpu_name(r), data=True) if d["kind"] == "pcie_nic")
        assert c.graph.nodes[nic]["rail"] == r % 8
        (fabric,) = [d["bw_GBps"] for _, _, d in c.graph.out_edges(nic, data=True) if d["kind"] == "nic_tx"]
        assert fabric == pytest.approx(48.5)


def check_path(c, src, dst, path):
    """The links chain from src's GPU to dst's GPU in the graph."""
    if src == dst:
        assert path == ()
        return
    names = [c.link_names[i] for i in path]
    assert names[0][0] == c.gpu_name(src) and names[-1][1] == c.gpu_name(dst)
    for (_, v), (u, _) in zip(names, names[1:], strict=False):
        assert v == u
    for u, v in names:
        assert c.graph.has_edge(u, v)


def test_hop_counts_and_pxn(h100):
    c = build_cluster(h100, 64)  # 2 leaves per rail
    assert len(c.path(0, 0)) == 0
    assert len(c.path(0, 5)) == 2  # GPU -> NVSwitch -> GPU
    assert len(c.path(0, 8)) == 4  # same rail, same leaf
    assert len(c.path(0, 8 * 40)) == 6  # same rail, other leaf: via the spine
    pxn = c.path(3, 8 + 6)  # local 3 -> local 6 of the next node
    assert len(pxn) == 6
    first = [c.link_names[i] for i in pxn[:3]]
    assert first == [("n0/gpu3", "n0/switch"), ("n0/switch", "n0/gpu6"), ("n0/gpu6", "n0/nic6")]
    assert all(c.link_kind[i] != "leaf_up" for i in pxn)  # PXN never leaves rail 6
    spine = build_cluster(h100, 64, cross_rail="spine")
    alt = [spine.link_names[i] for i in spine.path(3, 8 + 6)]
    assert (
        alt[0] == ("n0/gpu3", "n0/nic3") and ("leaf/r3/0", "spine") in alt and ("spine", "leaf/r6/0") in alt
    )
    rng = np.random.default_rng(1)
    for cl in (c, spine):
        for s, d in rng.integers(0, cl.world_size, size=(300, 2)):
            check_path(cl, int(s), int(d), cl.path(int(s), int(d)))


def test_vectorised_paths_match_graph_shortest_hops(h100):
    """Same-rail paths are shortest paths of the graph (an independent computation)."""
    c = build_cluster(h100, 4)
    g = c.graph.subgraph([v for v, d in c.graph.nodes(data=True) if d["kind"] != "host"])
    for s, d in [(0, 1), (0, 8), (9, 25), (2, 2 + 16)]:
        assert len(c.path(s, d)) == nx.shortest_path_length(g, c.gpu_name(s), c.gpu_name(d))


def test_host_path(h100):
    c = build_cluster(h100, 2)
    (up,) = c.host_path(9, to_host=True)
    (down,) = c.host_path(9, to_host=False)
    assert c.link_names[up] == ("n1/gpu1", "n1/host") and c.link_names[down] == ("n1/host", "n1/gpu1")


@pytest.mark.parametrize("oversub", [1.0, 2.0])
@pytest.mark.parametrize("nodes", [1, 2, 16, 64])
def test_bisection_graph_vs_closed_form(h100, nodes, oversub):
    topo = h100.model_copy(
        update={"scaleout": h100.scaleout.model_copy(update={"oversubscription": oversub})}
    )
    c = build_cluster(topo, nodes)
    closed = bisection_closed_form_GBps(topo, nodes)
    assert bisection_GBps(c) == pytest.approx(closed)
    nic = 48.5
    expected = {1: 4 * 369.0, 2: 8 * nic, 16: 64 * nic, 64: 32 * 8 * nic / oversub}[nodes]
    assert closed == pytest.approx(expected)


def test_single_switch_and_shared_nics(h100):
    topo = h100.model_copy(
        update={"scaleout": h100.scaleout.model_copy(update={"kind": "single_switch", "nics_per_node": 2})}
    )
    c = build_cluster(topo, 2)
    assert kinds(c).count("nic") == 4 and kinds(c).count("switch") == 1
    assert len(c.path(0, 8 + 7)) == 4  # own NIC (0) -> switch -> NIC 1 of node 1 -> GPU 7
    check_path(c, 0, 15, c.path(0, 15))
    # 4 GPUs share each NIC: bisection = 2 NICs x 48.5 per node
    assert bisection_GBps(c) == pytest.approx(2 * 48.5)
    assert bisection_closed_form_GBps(topo, 2) == pytest.approx(2 * 48.5)


def test_none_scaleout_is_single_node():
    cpu = load_topology("cpu-host")
    c = build_cluster(cpu, 1)
    assert kinds(c).count("shared_memory") == 1 and kinds(c).count("nic") == 0
    assert len(c.path(0, 1)) == 2
    with pytest.raises(InputError, match="cluster.nodes"):
        build_cluster(cpu, 2)


def test_cluster_for_scenario():
    s = load_scenario(SCENARIOS / "128gpu.yaml")
    c = cluster_for(s)
    assert c.world_size == s.world_size == 128
    assert c.nodes == s.cluster.nodes


def test_bad_rank(h100):
    c = build_cluster(h100, 1)
    with pytest.raises(ValueError, match="rank 8"):
        c.path(0, 8)


# ---- NVLink domains larger than a node (GB200 NVL72) ----------------------------------------------
@pytest.fixture(scope="module")
def nvl72():
    return load_topology("gb200-nvl72")


def test_nvl72_domain_spans_trays(nvl72):
    """72 GPUs per NVLink domain, 4 per node (tray): one switch per domain, one NIC per GPU."""
    c = build_cluster(nvl72, 36)  # two racks
    k = kinds(c)
    assert (k.count("gpu"), k.count("nic"), k.count("nvswitch"), k.count("host")) == (144, 144, 2, 36)
    assert k.count("leaf") == 4 * 2  # 4 rails, a leaf per rail per rack (18 trays)
    assert c.gpus_per_node == 4 and c.nodes_per_domain == 18 and c.gpus_per_domain == 72
    assert [c.domain_of(r) for r in (0, 71, 72, 143)] == [0, 0, 1, 1]
    assert c.graph.edges["n17/gpu3", "nvl0/switch"]["bw_GBps"] == pytest.approx(900 * 0.80)
    # one rack: every pair of GPUs, whatever their trays, talks through the rack's NVLink switch
    names = [c.link_names[i] for i in c.path(0, 71)]
    assert names == [("n0/gpu0", "nvl0/switch"), ("nvl0/switch", "n17/gpu3")]
    # across racks on one rail: NIC, leaf, spine (another rack's leaf), NIC
    assert len(c.path(0, 72)) == 6 and c.link_kind[c.path(0, 72)[1]] == "nic_tx"
    # across racks and rails: PXN over the tray's NVLink first (through the rack switch), then rail 2
    pxn = [c.link_names[i] for i in c.path(1, 72 + 2)]
    assert pxn[:3] == [("n0/gpu1", "nvl0/switch"), ("nvl0/switch", "n0/gpu2"), ("n0/gpu2", "n0/nic2")]
    assert len(pxn) == 8


def test_nvl72_paths_use_the_fabric_only_between_domains(nvl72):
    c = build_cluster(nvl72, 36)
    g = c.graph.subgraph([v for v, d in c.graph.nodes(data=True) if d["kind"] != "host"])
    rng = np.random.default_rng(3)
    for s, d in rng.integers(0, c.world_size, size=(300, 2)):
        s, d = int(s), int(d)
        path = c.path(s, d)
        check_path(c, s, d, path)
        crosses = any(c.link_kind[i] == "nic_tx" for i in path)
        assert crosses == (c.domain_of(s) != c.domain_of(d))
        if s != d and (c.domain_of(s) == c.domain_of(d) or s % 4 == d % 4):  # NVLink, or one rail
            assert len(path) == nx.shortest_path_length(g, c.gpu_name(s), c.gpu_name(d))


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        (1, 2 * 720.0),  # one tray: floor(4 / 2) x NVLink
        (2, 4 * 720.0 + 194.0),  # one domain split 1 | 1 tray: 4 NVLinks, plus 1 tray's 4 NICs
        (10, 20 * 720.0 + 5 * 194.0),  # 5 | 5 trays of one domain
        (18, 36 * 720.0 + 9 * 194.0),  # a full rack split in two
        (36, 18 * 194.0),  # two racks: only the fabric crosses (18 trays x 4 NICs x 48.5)
        (54, None),  # 3 racks: the middle rack is split and the halves split a leaf
        (72, 36 * 194.0),
    ],
)
def test_nvl72_bisection_graph_vs_closed_form(nvl72, nodes, expected):
    """Closed form = min(GPUs of each domain on either side) x NVLink + the scale-out bisection."""
    closed = bisection_closed_form_GBps(nvl72, nodes)
    if expected is None:
        assert closed is None
        return
    assert closed == pytest.approx(expected)
    assert bisection_GBps(build_cluster(nvl72, nodes)) == pytest.approx(closed)


def test_nvl72_without_fabric_holds_one_rack_and_domain_sizes_must_divide(nvl72):
    rack = nvl72.model_copy(update={"scaleout": nvl72.scaleout.model_copy(update={"kind": "none"})})
    c = build_cluster(rack, 18)
    assert c.nics_per_node == 0 and len(c.path(0, 71)) == 2
    assert bisection_closed_form_GBps(rack, 18) == pytest.approx(36 * 720.0)
    assert bisection_GBps(c) == pytest.approx(36 * 720.0)
    with pytest.raises(InputError, match="one NVLink domain of 18 nodes"):
        build_cluster(rack, 19)
    assert build_cluster(nvl72, 2, gpus_per_node=8).nodes_per_domain == 9
    with pytest.raises(InputError) as exc:
        build_cluster(nvl72, 2, gpus_per_node=5)
    assert exc.value.field == "cluster.gpus_per_node"


def test_node_sized_domains_keep_their_graph(h100):
    """Topologies without nvlink_domain_gpus: one switch per node, named as before."""
    c = build_cluster(h100, 2)
    assert c.nodes_per_domain == 1 and c.domain_of(8) == 1 and "n1/switch" in c.graph


def test_a_job_placed_16_trays_a_rack_sees_64_gpu_domains():
    """cluster.nvlink_domain_nodes: Megatron-Bridge's GB200 jobs take Slurm --segment 16 (64 trays ->
    4 racks x 16 trays), so ranks 0-63 share an NVLink domain and rank 64 is in the next rack."""
    base = ["cluster.topology=gb200-nvl72", "cluster.nodes=64", "parallelism.ep=64"]
    s = load_scenario(SCENARIOS / "128gpu.yaml", [*base, "cluster.nvlink_domain_nodes=16"])
    assert s.topology.nvlink_domain_gpus == 64
    c = cluster_for(s)
    assert c.nodes_per_domain == 16 and [c.domain_of(r) for r in (0, 63, 64, 255)] == [0, 0, 1, 3]
    assert not any(c.link_kind[i] == "nic_tx" for i in c.path(0, 63))
    assert any(c.link_kind[i] == "nic_tx" for i in c.path(0, 64))
    packed = cluster_for(load_scenario(SCENARIOS / "128gpu.yaml", base))
    assert packed.nodes_per_domain == 18 and packed.domain_of(64) == 0  # 18 trays a rack: 72 GPUs
    with pytest.raises(InputError, match="cluster.nvlink_domain_nodes"):
        load_scenario(SCENARIOS / "128gpu.yaml", [*base, "cluster.nvlink_domain_nodes=19"])
