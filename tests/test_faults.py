"""Faults: degraded and failed links change paths and flow times as closed forms say; partitions,
bad targets and bad values exit 2 naming the field; stragglers and jitter are as specified."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import simpy
import yaml

from sim.api import load_scenario, scenario_from_dict
from sim.errors import InputError
from sim.hardware.cluster import build_cluster
from sim.hardware.faults import (
    KernelJitter,
    apply_faults,
    cluster_for,
    compute_factors,
    describe_faults,
    jitter_sampler,
    without_faults,
)
from sim.inputs.faults import FaultsConfig
from sim.inputs.topology import load_topology
from sim.network.flows import Network

S = 1e9

BASE = {
    "name": "faults",
    "cluster": {"topology": "dgx-h100", "nodes": 2},
    "model": {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "moe_ffn_hidden_size": 32,
        "num_experts": 16,
        "top_k": 2,
    },
    "parallelism": {"ep": 16},
    "training": {"micro_batch_size": 1, "seq_len": 128},
}


def scenario(faults: dict, ep: int = 16, **cluster):
    data = json.loads(json.dumps(BASE))
    data["cluster"].update(cluster)
    data["parallelism"]["ep"] = ep
    data["faults"] = faults
    return scenario_from_dict(data, source="faults.yaml")


def bad(faults: dict, ep: int = 16, **cluster) -> InputError:
    with pytest.raises(InputError) as info:
        scenario(faults, ep, **cluster)
    return info.value


@pytest.fixture(scope="module")
def healthy():
    return build_cluster(load_topology("dgx-h100"), 2)


def lone_transfer_time(cluster, src, dst, nbytes=S):
    env = simpy.Environment()
    net = Network(env, cluster)
    h = net.transfer_many([src], [dst], [nbytes])
    env.run()
    return float(h.finish_time_s[0]), net


def check_path(cluster, src, dst, links):
    """Links chain from src's GPU to dst's GPU, none failed, no host memory on the way."""
    names = [cluster.link_names[i] for i in links]
    assert names[0][0] == cluster.gpu_name(src) and names[-1][1] == cluster.gpu_name(dst)
    assert all(a[1] == b[0] for a, b in zip(names, names[1:], strict=False))
    assert not any("host" in u or "host" in v for u, v in names)
    assert not cluster.link_failed[list(links)].any()


def test_degraded_nic_halves_a_lone_flows_bandwidth(healthy):
    s = scenario({"links": [{"nic": {"node": 1, "rail": 0}, "bw_factor": 0.5}]})
    c = cluster_for(s)
    path = list(c.path(0, 8))  # n0/gpu0 -> rail 0 -> n1/gpu0: ends on the degraded NIC
    assert path == list(healthy.path(0, 8))
    nic_rx = healthy.link_names.index(("leaf/r0/0", "n1/nic0"))
    assert nic_rx in path
    assert c.link_bw_Bps[nic_rx] == healthy.link_bw_Bps[nic_rx] * 0.5
    others = [i for i in path if i != nic_rx]
    expected = healthy.link_latency_s[path].sum() + S / min(
        healthy.link_bw_Bps[nic_rx] * 0.5, healthy.link_bw_Bps[others].min()
    )
    t, _ = lone_transfer_time(c, 0, 8)
    assert t == pytest.approx(expected, rel=1e-12)
    # 24.25 GB/s NIC, below PCIe's 54.4: the NIC is the bottleneck, twice the healthy serialisation
    t0, _ = lone_transfer_time(healthy, 0, 8)
    lat = healthy.link_latency_s[path].sum()
    assert (t - lat) == pytest.approx(2 * (t0 - lat), rel=1e-12)
    # a flow that avoids the NIC is untouched
    assert lone_transfer_time(c, 1, 9)[0] == lone_transfer_time(healthy, 1, 9)[0]


def test_factors_multiply_and_every_target_kind_resolves(healthy):
    faults = FaultsConfig(
        links=[
            {"nvlink": {"rank": 5}, "bw_factor": 0.5},
            {"link": "n0/gpu5 -> n0/switch", "bw_factor": 0.5},
            {"pcie": {"rank": 2}, "bw_factor": 0.25},
            {"leaf": {"rail": 1, "leaf": 0}, "bw_factor": 0.1},
            {"link": "n1/nic3 <-> leaf/r3/0", "bw_factor": 0.8},
        ]
    )
    c = apply_faults(healthy, faults)
    ratio = c.link_bw_Bps / healthy.link_bw_Bps

    def r(u, v):
        return ratio[healthy.link_names.index((u, v))]

    assert r("n0/gpu5", "n0/switch") == 0.25 and r("n0/switch", "n0/gpu5") == 0.5
    assert r("n0/gpu2", "n0/host") == r("n0/host", "n0/gpu2") == 0.25
    assert r("leaf/r1/0", "spine") == r("spine", "leaf/r1/0") == pytest.approx(0.1)
    assert r("n1/nic3", "leaf/r3/0") == r("leaf/r3/0", "n1/nic3") == 0.8
    assert np.count_nonzero(ratio != 1) == 8
    assert c.link_failed is None and healthy.link_bw_Bps.min() > 0  # the input cluster is not changed
    assert c.graph.edges["n0/gpu5", "n0/switch"]["bw_GBps"] == pytest.approx(
        0.25 * healthy.graph.edges["n0/gpu5", "n0/switch"]["bw_GBps"]
    )


def test_applying_faults_twice_does_not_stack(healthy):
    s = scenario(
        {
            "links": [
                {"nic": {"node": 1, "rail": 0}, "bw_factor": 0.5},
                {"nvlink": {"rank": 2}, "failed": True},
            ]
        }
    )
    once = cluster_for(s)
    twice = apply_faults(once, s)
    assert twice.link_bw_Bps.tolist() == once.link_bw_Bps.tolist()
    assert twice.link_failed.tolist() == once.link_failed.tolist()
    assert twice.healthy is once.healthy and once.healthy.link_failed is None
    back = apply_faults(once, FaultsConfig())
    assert back.link_bw_Bps.tolist() == healthy.link_bw_Bps.tolist() and back.link_failed is None


def test_failed_nic_reroutes_through_another_gpu_of_the_node(healthy):
    s = scenario({"links": [{"nic": {"node": 0, "rail": 3}, "failed": True}]})
    c = cluster_for(s)
    dead = {healthy.link_names.index(p) for p in [("n0/nic3", "leaf/r3/0"), ("leaf/r3/0", "n0/nic3")]}
    for src, dst in [(3, 11), (11, 3), (3, 8), (12, 3)]:
        links = c.path(src, dst)
        check_path(c, src, dst, links)
        assert not dead & set(links)
        names = [c.link_names[i] for i in links]
        on_node0 = [u for u, v in names if u.startswith("n0/gpu") and v.startswith("n0/nic")]
        on_node0 += [v for u, v in names if v.startswith("n0/gpu") and u.startswith("n0/nic")]
        assert on_node0 and "n0/gpu3" not in on_node0  # the NIC part is another GPU's
        assert ("n0/gpu3", "n0/switch") in names or ("n0/switch", "n0/gpu3") in names  # NVLink hop
    # pairs that never touched the NIC keep their rule-based paths
    for src, dst in [(0, 8), (2, 10), (3, 4), (9, 1)]:
        assert c.path(src, dst) == healthy.path(src, dst)
    # vectorised and single-pair lookups agree, in pair order
    srcs, dsts = np.repeat(np.arange(16), 16), np.tile(np.arange(16), 16)
    indptr, links = c.paths(srcs, dsts)
    for k, (a, b) in enumerate(zip(srcs, dsts, strict=True)):
        assert tuple(links[indptr[k] : indptr[k + 1]]) == c.path(int(a), int(b))


def test_all_to_all_over_a_failed_nic_conserves_bytes(healthy):
    s = scenario({"links": [{"nic": {"node": 1, "rail": 5}, "failed": True}]})
    c = cluster_for(s)
    srcs, dsts = np.repeat(np.arange(16), 16), np.tile(np.arange(16), 16)
    sizes = 1e6 * (1 + (srcs * 7 + dsts * 3) % 5)
    env = simpy.Environment()
    net = Network(env, c)
    h = net.transfer_many(srcs, dsts, sizes)
    env.run()
    assert np.isfinite(h.finish_time_s).all()
    indptr, _ = c.paths(srcs, dsts)
    hops = np.diff(indptr)
    assert net.link_bytes.sum() == pytest.approx(float((sizes * hops).sum()), rel=1e-9)
    assert net.link_bytes[c.link_failed].sum() == 0
    # every byte that leaves a node arrives at one: nic_tx and nic_rx totals agree, and each
    # inter-node pair sends its bytes out exactly once
    by_kind = net.bytes_by_kind()
    inter = sizes[(srcs // 8) != (dsts // 8)].sum()
    assert by_kind["nic_tx"] == pytest.approx(inter, rel=1e-9)
    assert by_kind["nic_rx"] == pytest.approx(inter, rel=1e-9)


def test_failed_nvlink_sends_node_local_traffic_over_the_fabric(healthy):
    s = scenario({"links": [{"nvlink": {"rank": 2}, "failed": True}]})
    c = cluster_for(s)
    links = c.path(2, 5)
    check_path(c, 2, 5, links)
    kinds = [str(c.link_kind[i]) for i in links]
    assert "intra" not in kinds[:1] and "nic_tx" in kinds  # out of its NIC, back in through another


def test_one_node_fat_tree_survives_a_failed_nvlink_over_its_rails():
    s = scenario({"links": [{"nvlink": {"rank": 1}, "failed": True}]}, ep=8, nodes=1)
    c = cluster_for(s)
    check_path(c, 1, 0, c.path(1, 0))
    assert [c.link_names[i][1] for i in c.path(1, 0)][:3] == ["n0/nic1", "leaf/r1/0", "spine"]


def test_partition_is_an_input_error_naming_the_faults():
    # cpu-host: two ranks on shared memory, no fabric: the shared-memory link is the only path
    e = bad({"links": [{"nvlink": {"rank": 1}, "failed": True}]}, ep=2, nodes=1, topology="cpu-host")
    assert e.field == "faults.links" and "partition" in e.message and "rank(s) 1 " in e.message
    assert e.file == "faults.yaml"


def single_nic_topology(tmp_path):
    topo = yaml.safe_load((load_topology.__globals__["TOPOLOGY_DIR"] / "dgx-h100.yaml").read_text())
    topo["name"] = "one-nic"
    topo["scaleout"].update(kind="single_switch", nics_per_node=1)
    path = tmp_path / "one-nic.yaml"
    path.write_text(yaml.safe_dump(topo))
    return path


def test_single_nic_node_whose_nic_failed_partitions_the_cluster(tmp_path, cli):
    topo = single_nic_topology(tmp_path)
    data = json.loads(json.dumps(BASE))
    data["cluster"].update(topology=str(topo), nodes=2)
    data["faults"] = {"links": [{"nic": {"node": 1, "rail": 0}, "failed": True}]}
    scen = tmp_path / "scen.yaml"
    scen.write_text(yaml.safe_dump(data))
    proc = cli("check", str(scen))
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert str(scen) in proc.stderr and "faults.links" in proc.stderr
    assert "rank(s) 8-15 cannot reach" in proc.stderr
    # the same NIC at half speed is fine, and check reports it
    data["faults"] = {"links": [{"nic": {"node": 1, "rail": 0}, "bw_factor": 0.5}]}
    scen.write_text(yaml.safe_dump(data))
    ok = cli("check", str(scen))
    assert ok.returncode == 0, ok.stderr
    assert "1 degraded, 0 failed link(s)" in ok.stdout


@pytest.mark.parametrize(
    ("faults", "field", "words"),
    [
        ({"links": [{"nic": {"node": 2, "rail": 0}, "bw_factor": 0.5}]}, "faults.links.0.nic.node", ["0-1"]),
        ({"links": [{"nic": {"node": 0, "rail": 8}, "bw_factor": 0.5}]}, "faults.links.0.nic.rail", ["0-7"]),
        ({"links": [{"nvlink": {"rank": 16}, "failed": True}]}, "faults.links.0.nvlink.rank", ["0-15"]),
        ({"links": [{"leaf": {"rail": 0, "leaf": 1}, "failed": True}]}, "faults.links.0.leaf.leaf", ["0-0"]),
        ({"links": [{"link": "n0/gpu0 -> n0/nic1", "bw_factor": 0.5}]}, "faults.links.0.link", ["n0/nic0"]),
        ({"links": [{"link": "n0/nic9 -> leaf/r0/0", "bw_factor": 0.5}]}, "faults.links.0.link", ["n0/nic9"]),
        ({"links": [{"link": "n0/gpu0 to n0/switch", "bw_factor": 0.5}]}, "faults.links.0.link", ["u -> v"]),
        ({"stragglers": [{"rank": 99, "compute_factor": 2}]}, "faults.stragglers.0.rank", ["0-15"]),
    ],
)
def test_targets_outside_the_cluster_name_the_field_and_what_exists(faults, field, words):
    e = bad(faults)
    assert e.field == field and e.file == "faults.yaml"
    for w in words:
        assert w in e.message


def test_misspelt_link_node_gets_a_suggestion():
    e = bad({"links": [{"link": "n0/nic0 -> leaf/r0/1", "bw_factor": 0.5}]})
    assert "leaf/r0/0" in e.message


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"nic": {"node": 0, "rail": 0}, "bw_factor": 0}, ["faults.links.0.bw_factor", "greater than 0"]),
        ({"nic": {"node": 0, "rail": 0}, "bw_factor": 1.5}, ["faults.links.0.bw_factor", "1"]),
        ({"nic": {"node": 0, "rail": 0}}, ["faults.links.0.bw_factor", "failed: true"]),
        ({"nic": {"node": 0, "rail": 0}, "bw_factor": 0.5, "failed": True}, ["bw_factor", "failed"]),
        ({"bw_factor": 0.5}, ["faults.links.0.target", "exactly one"]),
        ({"nic": {"node": 0, "rail": 0}, "nvlink": {"rank": 1}, "bw_factor": 0.5}, ["nic, nvlink"]),
        ({"pcie": {"rank": 0}, "failed": True}, ["faults.links.0.failed", "bw_factor"]),
        (
            {"nic": {"node": 0, "raill": 0}, "bw_factor": 0.5},
            ["did you mean 'rail'", "allowed keys: node, rail"],
        ),
        ({"nic": {"node": -1, "rail": 0}, "bw_factor": 0.5}, ["faults.links.0.nic.node"]),
    ],
)
def test_bad_link_entries_name_the_field(entry, words):
    e = bad({"links": [entry]})
    for w in words:
        assert w in str(e)


def test_bad_stragglers_and_jitter_name_the_field():
    assert "faults.stragglers.0.compute_factor" in str(
        bad({"stragglers": [{"rank": 0, "compute_factor": 0.5}]})
    )
    twice = bad({"stragglers": [{"rank": 1, "compute_factor": 2}, {"rank": 1, "compute_factor": 3}]})
    assert "faults.stragglers.1.rank" in str(twice) and "twice" in str(twice)
    assert "faults.jitter.kernel_cv" in str(bad({"jitter": {"kernel_cv": -0.1}}))
    assert "did you mean 'stragglers'" in str(bad({"straglers": []}))


def test_stragglers_array():
    s = scenario({"stragglers": [{"rank": 3, "compute_factor": 1.5}, {"rank": 15, "compute_factor": 4}]})
    f = compute_factors(s)
    assert f.shape == (16,)
    expected = np.ones(16)
    expected[3], expected[15] = 1.5, 4
    assert f.tolist() == expected.tolist()
    assert compute_factors(without_faults(s)).tolist() == [1.0] * 16
    assert jitter_sampler(s) is None


def test_jitter_is_lognormal_with_the_asked_mean_and_cv_and_deterministic():
    s = scenario({"jitter": {"kernel_cv": 0.2, "seed": 7}})
    j = jitter_sampler(s)
    assert isinstance(j, KernelJitter)
    x = j(0, 200_000)
    assert x.min() > 0
    assert x.mean() == pytest.approx(1.0, abs=0.003)
    assert x.std() / x.mean() == pytest.approx(0.2, rel=0.02)
    logs = np.log(x)
    assert logs.var() == pytest.approx(math.log1p(0.04), rel=0.02)  # lognormal: log is normal
    again = jitter_sampler(s)
    assert again(0, 200_000).tolist() == x.tolist()
    # a rank's stream does not depend on the other ranks' draws
    a, b = KernelJitter(0.2, 7), KernelJitter(0.2, 7)
    b(1, 10)
    assert a(0) == b(0) and a(0) != a(1)
    assert jitter_sampler(scenario({"jitter": {"kernel_cv": 0}})) is None


def test_without_faults_keeps_the_topology_and_describe_lists_the_links(healthy):
    s = scenario({"links": [{"nic": {"node": 1, "rail": 2}, "failed": True}]})
    h = without_faults(s)
    assert not h.faults.any and h.topology is s.topology and h.world_size == 16
    assert cluster_for(h).link_failed is None and cluster_for(s).link_failed.sum() == 4
    (rec,) = describe_faults(healthy, s)
    assert rec["failed"] and rec["links"][:2] == ["n1/nic2 -> leaf/r2/0", "leaf/r2/0 -> n1/nic2"]


def test_faults_can_be_set_from_the_command_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(BASE))
    s = load_scenario(path, ["faults.stragglers=[{rank: 2, compute_factor: 3}]"])
    assert compute_factors(s)[2] == 3
    with pytest.raises(InputError, match="faults.links.0.nic.rail"):
        load_scenario(path, ["faults.links=[{nic: {node: 0, rail: 12}, failed: true}]"])
