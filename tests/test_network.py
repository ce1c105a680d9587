"""Flow-level network: exact tiny cases against hand-computed max-min answers."""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from sim.hardware.cluster import build_cluster
from sim.inputs.topology import load_topology
from sim.network.flows import Network
from sim.network.maxmin import max_min_rates

S = 1e9  # bytes


@pytest.fixture(scope="module")
def cluster():
    return build_cluster(load_topology("dgx-h100"), 2)


def lat(c, s, d):
    return float(c.link_latency_s[list(c.path(s, d))].sum())


def test_maxmin_classic_three_flows_two_links():
    # f0 crosses links 0 and 1, f1 only link 0, f2 only link 1; capacities 1 and 2
    rates = max_min_rates(np.array([0, 0, 1, 2]), np.array([0, 1, 0, 1]), np.ones(3), np.array([1.0, 2.0]))
    assert rates.tolist() == [0.5, 0.5, 1.5]
    # equal capacities: everybody gets half
    rates = max_min_rates(np.array([0, 0, 1, 2]), np.array([0, 1, 0, 1]), np.ones(3), np.array([1.0, 1.0]))
    assert rates.tolist() == [0.5, 0.5, 0.5]


def test_maxmin_weights_count_merged_flows():
    # row 0 stands for 3 identical flows on link 0 with one other flow: 4 equal shares
    rates = max_min_rates(np.array([0, 1]), np.array([0, 0]), np.array([3.0, 1.0]), np.array([8.0]))
    assert rates.tolist() == [2.0, 2.0]


def test_lone_transfer_is_latency_plus_size_over_bottleneck(cluster):
    env = simpy.Environment()
    net = Network(env, cluster)
    h = net.transfer_many([0], [9], [S])  # PXN: NVLink to GPU 1, then rail 1
    env.run()
    path = list(cluster.path(0, 9))
    expected = cluster.link_latency_s[path].sum() + S / cluster.link_bw_Bps[path].min()
    assert h.finish_time_s[0] == pytest.approx(expected, rel=1e-12)
    assert net.link_busy_s[path] == pytest.approx(S / cluster.link_bw_Bps[path].min())
    assert net.inter_node_bytes == pytest.approx(S)


@pytest.mark.parametrize("n", [2, 5])
@pytest.mark.parametrize("same_source", [True, False])
def test_n_equal_flows_on_one_link_take_n_times_longer(cluster, n, same_source):
    env = simpy.Environment()
    net = Network(env, cluster)
    srcs = [0] * n if same_source else list(range(1, n + 1))
    h = net.transfer_many(srcs, [7 if not same_source else 1] * n, [S] * n)
    env.run()
    bw = cluster.link_bw_Bps[cluster.path(0, 1)[0]]
    assert h.finish_time_s == pytest.approx(lat(cluster, 0, 1) + n * S / bw, rel=1e-12)


def test_rates_rise_when_a_flow_drains(cluster):
    """Link B (into GPU 1) holds f1, f3, f4; link A (out of GPU 0) holds f1, f2 (3x larger).

    Max-min: f1 = f3 = f4 = C/3 on B, f2 = 2C/3 until the B flows end at 3S/C, then f2 alone at C.
    """
    env = simpy.Environment()
    net = Network(env, cluster)
    h = net.transfer_many([0, 0, 2, 3], [1, 4, 1, 1], [S, 3 * S, S, S])
    env.run()
    c = cluster.link_bw_Bps[cluster.path(0, 1)[0]]
    a = lat(cluster, 0, 1)
    assert h.finish_time_s == pytest.approx(
        [a + 3 * S / c, a + 4 * S / c, a + 3 * S / c, a + 3 * S / c], rel=1e-12
    )
    assert net.recomputes == 2


def test_arrival_mid_flight_shares_the_link(cluster):
    env = simpy.Environment()
    net = Network(env, cluster)
    c = cluster.link_bw_Bps[cluster.path(0, 1)[0]]
    done = {}

    def late_sender():
        yield env.timeout(S / (2 * c))
        yield net.transfer(2, 1, S)
        done["b"] = env.now

    def first():
        yield net.transfer(0, 1, S)
        done["a"] = env.now

    env.process(first())
    env.process(late_sender())
    env.run()
    a = lat(cluster, 0, 1)
    assert done["a"] == pytest.approx(a + 1.5 * S / c, rel=1e-12)
    assert done["b"] == pytest.approx(a + 2.0 * S / c, rel=1e-12)


def test_same_instant_submissions_share_one_recompute(cluster):
    env = simpy.Environment()
    net = Network(env, cluster)

    ends = []

    def sender(s):
        yield net.transfer(s, 15, S)
        ends.append(env.now)

    for s in range(8):
        env.process(sender(s))
    env.run()
    assert net.recomputes == 1  # 8 processes, one rate computation; all drain on NIC 7 together
    bw = cluster.link_bw_Bps[list(cluster.path(0, 15))].min()
    pxn, same_rail = lat(cluster, 0, 15) + 8 * S / bw, lat(cluster, 7, 15) + 8 * S / bw
    assert ends == pytest.approx([same_rail] + [pxn] * 7, rel=1e-12)


def test_zero_bytes_and_self_transfers_take_latency_only(cluster):
    env = simpy.Environment()
    net = Network(env, cluster)
    h = net.transfer_many([0, 3, 0], [8, 3, 1], [0.0, S, 0.0])
    env.run()
    assert h.finish_time_s.tolist() == [lat(cluster, 0, 8), 0.0, lat(cluster, 0, 1)]
    assert net.recomputes == 0


def test_host_transfers(cluster):
    env = simpy.Environment()
    net = Network(env, cluster)
    up = net.to_host(3, S)
    env.run(up)
    bw = cluster.link_bw_Bps[cluster.host_path(3, to_host=True)[0]]
    assert env.now == pytest.approx(cluster.topology.node.pcie_host.latency_us * 1e-6 + S / bw)
    assert net.bytes_by_kind()["pcie_host"] == pytest.approx(S)
    env.run(net.from_host(3, S))


def test_when_all_and_subscribe(cluster):
    env = simpy.Environment()
    net = Network(env, cluster)
    h = net.transfer_many([0, 1, 2], [9, 10, 3], [S, 2 * S, S / 4])
    seen = []
    h.subscribe(lambda flows: seen.append(sorted(flows.tolist())))
    first, both, none = h.when_all([[2], [0, 1], []])
    assert none.triggered
    env.run(first)
    assert env.now == h.finish_time_s[2] and not both.triggered
    env.run(both)
    assert env.now == np.nanmax(h.finish_time_s) == h.finish_time_s[1]
    assert sorted(sum(seen, [])) == [0, 1, 2]


def random_workload(cluster, rel_tol=0.0, seed=3):
    rng = np.random.default_rng(seed)
    env = simpy.Environment()
    net = Network(env, cluster, rel_tol=rel_tol)
    handles = []

    def wave(k):
        yield env.timeout(k * 1e-4)
        n = 60
        src, dst = rng.integers(0, 16, n), rng.integers(0, 16, n)
        handles.append(net.transfer_many(src, dst, rng.uniform(0, 2e7, n)))

    for k in range(4):
        env.process(wave(k))
    env.run()
    return net, handles


def test_determinism_and_conservation(cluster):
    net1, h1 = random_workload(cluster)
    net2, h2 = random_workload(cluster)
    for a, b in zip(h1, h2, strict=True):
        assert np.array_equal(a.finish_time_s, b.finish_time_s)
    submitted = sum(h.link_bytes() for h in h1)
    assert net1.link_bytes == pytest.approx(submitted, rel=1e-9, abs=1e-3)
    # no link carried more than its capacity x busy time
    assert np.all(net1.link_bytes <= cluster.link_bw_Bps * net1.link_busy_s * (1 + 1e-9) + 1e-3)


def test_rel_tol_bounds_the_error_and_saves_recomputes(cluster):
    exact, he = random_workload(cluster)
    approx, ha = random_workload(cluster, rel_tol=0.05)
    assert approx.recomputes < exact.recomputes
    for a, b in zip(he, ha, strict=True):
        assert b.finish_time_s == pytest.approx(a.finish_time_s, rel=0.10)
