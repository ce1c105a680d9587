"""Collectives: one checker over every algorithm on 1, 2 and 4 nodes, plus closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from sim.hardware.cluster import build_cluster
from sim.inputs.topology import load_topology
from sim.network.closed_form import (
    all_to_all_time_s,
    bandwidths_GBps,
    dag_critical_latency_s,
    dag_link_bytes,
    dag_lower_bound_s,
    estimate_rank_times_s,
    estimate_time_s,
    ring_time_s,
)
from sim.network.collectives import (
    ALGOS,
    KINDS,
    a2a_traffic,
    all_reduce,
    all_to_all,
    all_to_all_dag,
    collective_dag,
    group_nodes,
    uniform_pairs,
)
from sim.network.dag import run_dag
from sim.network.flows import Network

MB, GB = 2**20, 2**30


@pytest.fixture(scope="module")
def topo():
    return load_topology("dgx-h100")


def run(cluster, group, dag):
    env = simpy.Environment()
    net = Network(env, cluster)
    h = run_dag(net, group, dag)
    env.run()
    return net, h


def expected_sent_per_rank(kind, algo, n, nbytes):
    """What each rank must send by the algorithm's definition (nccl-tests sizes)."""
    if kind == "all_reduce" and algo == "ring":
        return 2 * (n - 1) / n * nbytes
    if kind in ("reduce_scatter", "all_gather"):
        return (n - 1) / n * nbytes
    return None


def check(cluster, group, dag, net, h, kind=None, algo=None, nbytes=None):
    """The checker every collective passes (cf. networkx's validate_flows)."""
    assert h.done.triggered and all(e.triggered for e in h.rank_done)
    assert not np.isnan(h.finish_time_s).any()
    # bytes conserved: the links carried exactly what the transfers put on their paths
    assert net.link_bytes == pytest.approx(dag_link_bytes(cluster, dag), rel=1e-9, abs=1.0)
    sent = np.bincount(np.searchsorted(np.sort(group), dag.src), weights=dag.nbytes, minlength=len(group))
    want = expected_sent_per_rank(kind, algo, len(group), nbytes) if kind else None
    if want is not None:
        assert sent == pytest.approx(np.full(len(group), want), rel=1e-12)
    # no schedule beats the busiest link or the latency chain
    bound = max(dag_lower_bound_s(cluster, dag), dag_critical_latency_s(cluster, dag))
    assert h.time_s >= bound * (1 - 1e-9)
    assert h.rank_time_s.max() == pytest.approx(h.time_s, rel=1e-12)
    assert (h.rank_time_s <= h.time_s * (1 + 1e-12)).all()


CASES = [(kind, algo) for kind in KINDS for algo in ALGOS[kind]]


@pytest.mark.parametrize("nodes", [1, 2, 4])
@pytest.mark.parametrize(("kind", "algo"), CASES)
@pytest.mark.parametrize("nbytes", [64 * 1024, 256 * MB])
def test_checker_over_every_collective(topo, nodes, kind, algo, nbytes):
    cluster = build_cluster(topo, nodes)
    group = list(range(cluster.world_size))
    dag = collective_dag(cluster, kind, group, nbytes, algo)
    net, h = run(cluster, group, dag)
    check(cluster, group, dag, net, h, kind, algo, nbytes)
    # the analytic estimate (serialisation + latency chain, no overlap) is an upper estimate, and
    # within 25% on these symmetric cases (pipelined multi-node rings overlap latency and bytes)
    estimate = estimate_time_s(cluster, dag)
    assert h.time_s <= estimate * (1 + 1e-9)
    assert h.time_s == pytest.approx(estimate, rel=0.25)


@pytest.mark.parametrize(("kind", "algo"), CASES)
def test_checker_on_strided_and_partial_groups(topo, kind, algo):
    cluster = build_cluster(topo, 4)
    for group in ([1, 9, 17, 25], [0, 1, 2, 3, 8, 9, 10, 11]):  # EDP-like, and half nodes
        dag = collective_dag(cluster, kind, group, 8 * MB, algo)
        net, h = run(cluster, group, dag)
        check(cluster, group, dag, net, h, kind, algo, 8 * MB)


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("nbytes", [4096, 64 * MB, GB])
def test_ring_closed_form_inside_one_node(topo, kind, nbytes):
    cluster = build_cluster(topo, 1)
    dag = collective_dag(cluster, kind, list(range(8)), nbytes)
    _, h = run(cluster, list(range(8)), dag)
    nvlink = topo.node.intra
    expected = ring_time_s(kind, 8, nbytes, nvlink.bw_GBps * 1e9, 2 * nvlink.latency_us * 1e-6)
    assert h.time_s == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather"])
def test_ring_closed_form_one_rank_per_node(topo, kind):
    """An expert-data-parallel group (one rank per node) rings over one rail: NIC-bound."""
    cluster = build_cluster(topo, 4)
    group = [2, 10, 18, 26]
    dag = collective_dag(cluster, kind, group, 256 * MB)
    _, h = run(cluster, group, dag)
    path = list(cluster.path(2, 10))
    alpha, nic = cluster.link_latency_s[path].sum(), topo.scaleout.nic_bw_GBps * 1e9
    assert h.time_s == pytest.approx(ring_time_s(kind, 4, 256 * MB, nic, alpha), rel=1e-9)


@pytest.mark.parametrize("nbytes", [1024, 64 * MB, GB])
def test_uniform_all_to_all_closed_forms(topo, nbytes):
    one = build_cluster(topo, 1)
    _, h = run(one, list(range(8)), collective_dag(one, "all_to_all", list(range(8)), nbytes))
    nv = topo.node.intra
    assert h.time_s == pytest.approx(all_to_all_time_s(8, nbytes, nv.bw_GBps * 1e9, 2 * nv.latency_us * 1e-6))
    for nodes in (2, 4):
        c = build_cluster(topo, nodes)
        group = list(range(c.world_size))
        _, h = run(c, group, collective_dag(c, "all_to_all", group, nbytes))
        # NIC-bound: each rail NIC carries (m-1)/m of S; the PXN path is the slowest latency
        alpha = c.link_latency_s[list(c.path(0, 9))].sum()
        nic = topo.scaleout.nic_bw_GBps * 1e9
        assert h.time_s == pytest.approx(alpha + (nodes - 1) / nodes * nbytes / nic, rel=1e-9)
        if nbytes == GB:  # nccl-tests #130: busbw ~ N/(N-1) x NIC bandwidth, times (n-1)/n
            _, busbw = bandwidths_GBps("all_to_all", len(group), nbytes, h.time_s)
            n = len(group)
            assert busbw == pytest.approx(
                nodes / (nodes - 1) * topo.scaleout.nic_bw_GBps * (n - 1) / n, rel=0.01
            )


def test_multi_node_ring_all_reduce_reaches_the_rail_bound(topo):
    """k channels: every NVLink carries k flows, so the per-ring rate is min(NVLink/k, NIC)."""
    c = build_cluster(topo, 2)
    group = list(range(16))
    dag = collective_dag(c, "all_reduce", group, GB)
    _, h = run(c, group, dag)
    per_ring = min(topo.node.intra.bw_GBps / 8, topo.scaleout.nic_bw_GBps) * 1e9
    bw_only = ring_time_s("all_reduce", 16, GB, per_ring, 0.0, channels=8)
    assert bw_only <= h.time_s <= bw_only + dag_critical_latency_s(c, dag) * 1.01


def test_hierarchical_all_to_all_dedups_inter_node_bytes(topo):
    """Tokens hitting several experts on one node cross the fabric once per node, not per rank."""
    c = build_cluster(topo, 2)
    group = list(range(16))
    rng = np.random.default_rng(0)
    tokens = 4096
    src = rng.integers(0, 16, tokens)
    # top-4 among 4 experts per rank: ranks drawn so that most tokens hit 2+ ranks of node 1
    dst = rng.integers(8, 16, (tokens, 4))
    pair, node = a2a_traffic(c, group, src, dst, token_bytes=7168 * 2)
    results = {}
    for algo in ("direct", "hierarchical"):
        env = simpy.Environment()
        net = Network(env, c)
        h = all_to_all(net, group, pair, algo=algo, node_bytes=node if algo == "hierarchical" else None)
        env.run()
        check(c, group, h.dag, net, h)
        results[algo] = (net.inter_node_bytes, h.time_s)
    cross = pair[:8, 8:].sum()
    assert results["direct"][0] == pytest.approx(cross)
    assert results["hierarchical"][0] == pytest.approx(node[:8, 1].sum())
    assert results["hierarchical"][0] < 0.6 * results["direct"][0]
    assert results["hierarchical"][1] < results["direct"][1]


def test_a2a_traffic_counts(topo):
    c = build_cluster(topo, 2)
    group = list(range(16))
    # token 0 from rank 0 to ranks 9, 9, 12 (node 1) and 3 (node 0); token 1 from 5 to 5
    pair, node = a2a_traffic(c, group, np.array([0, 5]), np.array([[9, 9, 12, 3], [5, 5, 5, 5]]), 10.0)
    assert pair[0, 9] == pair[0, 12] == pair[0, 3] == 10.0 and pair.sum() == 40.0
    assert node[0].tolist() == [10.0, 10.0] and node[5].tolist() == [10.0, 0.0]


def test_combine_mirrors_dispatch(topo):
    c = build_cluster(topo, 2)
    group = list(range(16))
    rng = np.random.default_rng(4)
    pair = rng.uniform(0, 4 * MB, (16, 16))
    for algo in ("direct", "hierarchical"):
        d = all_to_all_dag(c, group, pair, algo)
        k = all_to_all_dag(c, group, pair, algo, direction="combine")
        assert dag_link_bytes(c, d)[c.link_kind == "nic_tx"].sum() == pytest.approx(
            dag_link_bytes(c, k)[c.link_kind == "nic_tx"].sum()
        )
        net, h = run(c, group, k)
        check(c, group, k, net, h)
    # direct combine is the transpose of dispatch
    d, k = all_to_all_dag(c, group, pair), all_to_all_dag(c, group, pair, direction="combine")
    assert sorted(zip(d.src, d.dst, d.nbytes, strict=True)) == sorted(
        zip(k.dst, k.src, k.nbytes, strict=True)
    )


def test_rank_parts_end_where_their_data_ends(topo):
    """Only ranks 0 and 9 exchange a large buffer: the others finish early (no global barrier)."""
    c = build_cluster(topo, 2)
    group = list(range(16))
    pair = np.full((16, 16), 1024.0)
    pair[0, 9] = pair[9, 0] = GB
    env = simpy.Environment()
    h = all_to_all(Network(env, c), group, pair)
    env.run()
    t = h.rank_time_s
    assert t[0] == pytest.approx(h.time_s) and t[9] == pytest.approx(h.time_s)
    others = np.delete(t, [0, 9])
    assert others.max() < 0.01 * h.time_s


def test_determinism(topo):
    c = build_cluster(topo, 4)
    group = list(range(32))
    rng = np.random.default_rng(7)
    pair = rng.uniform(0, 8 * MB, (32, 32))
    runs = []
    for _ in range(2):
        env = simpy.Environment()
        net = Network(env, c)
        a = all_to_all(net, group, pair, algo="hierarchical")
        b = all_reduce(net, group[::2], 32 * MB)
        env.run()
        runs.append((a.finish_time_s.copy(), b.finish_time_s.copy(), net.link_bytes.copy()))
    for x, y in zip(*runs, strict=True):
        assert np.array_equal(x, y)


def test_group_nodes_and_bad_input(topo):
    c = build_cluster(topo, 2)
    nodes, members = group_nodes(c, [9, 1, 8])
    assert nodes.tolist() == [0, 1] and [m.tolist() for m in members] == [[1], [2, 0]]
    with pytest.raises(ValueError, match="twice"):
        group_nodes(c, [1, 1])
    with pytest.raises(ValueError, match="no algorithm 'tree'"):
        collective_dag(c, "all_reduce", [0, 1], 10, "tree")
    with pytest.raises(ValueError, match="4x4"):
        all_to_all_dag(c, [0, 1, 2, 3], uniform_pairs(3, 10))
    with pytest.raises(ValueError, match="same number"):
        collective_dag(c, "all_reduce", [0, 1, 8], 10, "hierarchical")


@pytest.mark.parametrize("nodes", [2, 4])
def test_processor_sharing_estimate_tracks_the_simulation(topo, nodes):
    c = build_cluster(topo, nodes)
    group = list(range(c.world_size))
    rng = np.random.default_rng(11)
    pair = rng.uniform(0.2, 1.8, (len(group), len(group))) * 4 * MB
    dag = all_to_all_dag(c, group, pair)
    _, h = run(c, group, dag)
    est = estimate_rank_times_s(c, dag, group)
    assert est.max() == pytest.approx(h.time_s, rel=1e-9)
    assert est == pytest.approx(h.rank_time_s, rel=1e-9 if nodes == 2 else 0.05)
    env = simpy.Environment()
    net = Network(env, c)
    fast = run_dag(net, group, dag, model="ps")
    assert not fast.done.triggered
    env.run()
    assert fast.done.triggered and env.now == pytest.approx(h.time_s, rel=1e-9)
    assert fast.rank_time_s == pytest.approx(est, rel=1e-12)
    assert net.link_bytes == pytest.approx(dag_link_bytes(c, dag))
    with pytest.raises(ValueError, match="one-phase"):
        run_dag(net, group, collective_dag(c, "all_reduce", group, MB), model="ps")


def test_single_link_processor_sharing_closed_form(topo):
    """Three flows into one GPU: finish at sum_k min(s_k, s) / C (ties included)."""
    c = build_cluster(topo, 1)
    group = list(range(8))
    pair = np.zeros((8, 8))
    pair[1, 0], pair[2, 0], pair[3, 0], pair[4, 0] = 1 * MB, 3 * MB, 3 * MB, 5 * MB
    dag = all_to_all_dag(c, group, pair)
    bw, lat = topo.node.intra.bw_GBps * 1e9, 2 * topo.node.intra.latency_us * 1e-6
    want = np.array([4 * MB, 10 * MB, 10 * MB, 12 * MB]) / bw + lat
    from sim.network.closed_form import ps_flow_times_s

    assert ps_flow_times_s(c, dag) == pytest.approx(want, rel=1e-12)
    _, h = run(c, group, dag)
    assert h.finish_time_s == pytest.approx(want, rel=1e-12)
