"""``moesim topo`` through a real subprocess: figures, JSON, PNG, exit codes."""

from __future__ import annotations

import json

import pytest

from sim.cli.topo import summarize
from sim.hardware.cluster import build_cluster
from sim.inputs.topology import load_topology


def test_topo_dgx_h100_16_nodes(cli, tmp_path):
    png, js = tmp_path / "topo.png", tmp_path / "topo.json"
    r = cli("topo", "dgx-h100", "--nodes", "16", "--plot", str(png), "--json", str(js))
    assert r.returncode == 0, r.stderr
    assert "16 x 8 = 128 H100-SXM" in r.stdout
    assert "3104.0 GB/s from the graph" in r.stdout  # 8 nodes x 8 NICs x 48.5 GB/s
    data = json.loads(js.read_text())
    assert data["num_gpus"] == 128 and data["devices"]["nic"] == 128 and data["devices"]["leaf"] == 8
    assert data["bisection_GBps"] == pytest.approx(data["bisection_closed_form_GBps"])
    assert data["per_gpu"]["intra_GBps"] == pytest.approx(369.0)
    assert data["hops"] == {"same_node": 2, "same_rail": 4, "cross_rail": 6, "farthest_node_same_rail": 4}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_topo_json_stdout_and_spine_crossing(cli):
    r = cli("topo", "h800-cluster", "--nodes", "2", "--cross-rail", "spine", "--json", "-")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["hops"]["cross_rail"] == 6 and data["cross_rail"] == "spine"
    assert data["per_gpu"]["intra_GBps"] == pytest.approx(160.0)  # DeepSeek-V3's measured NVLink


def test_summary_under_oversubscription():
    topo = load_topology("dgx-h100")
    topo = topo.model_copy(update={"scaleout": topo.scaleout.model_copy(update={"oversubscription": 2.0})})
    s = summarize(build_cluster(topo, 64))
    assert s["bisection_GBps"] == pytest.approx(32 * 8 * 48.5 / 2)
    assert s["devices"]["leaf"] == 16


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["dgx-h10", "--nodes", "2"], "topology: unknown topology 'dgx-h10' (did you mean 'dgx-h100'?)"),
        (["cpu-host", "--nodes", "2"], "--nodes: topology 'cpu-host' has no scale-out fabric"),
        (["dgx-h100", "--nodes", "0"], "--nodes: must be >= 1"),
    ],
)
def test_topo_bad_input_exits_2(cli, args, field):
    r = cli("topo", *args)
    assert r.returncode == 2
    assert field in r.stderr and "Traceback" not in r.stderr


def test_topo_gb200_nvl72_one_rack(cli):
    """18 trays of 4 GPUs: one 72-GPU NVLink domain, so every pair talks over NVLink (2 hops) and the
    bisection is the rack switch's 36 x 720 GB/s plus 9 trays' NICs."""
    r = cli("topo", "gb200-nvl72", "--nodes", "18")
    assert r.returncode == 0, r.stderr
    assert "18 x 4 = 72 GB200" in r.stdout
    # 36 GPUs x 720 GB/s through the rack switch + 9 trays x 4 NICs x 48.5
    assert "27666.0 GB/s from the graph (max flow), closed form 27666.0" in r.stdout
    data = summarize(build_cluster(load_topology("gb200-nvl72"), 18))
    assert data["devices"]["nvswitch"] == 1 and data["devices"]["nic"] == 72
    assert set(data["hops"].values()) == {2}  # same tray, other trays, other rails: all NVLink
    assert data["per_gpu"]["intra_GBps"] == pytest.approx(720.0)
    assert data["per_gpu"]["intra_alltoall_GBps"] == pytest.approx(900 * 0.7428)
    assert "in all-to-alls    668.5 GB/s" in r.stdout
    assert data["per_gpu"]["nic_GBps"] == pytest.approx(48.5)
    two = summarize(build_cluster(load_topology("gb200-nvl72"), 36))
    assert two["hops"]["farthest_node_same_rail"] == 6  # the other rack: NIC, leaf, spine, leaf, NIC


def test_topo_dgx_b200(cli):
    r = cli("topo", "dgx-b200", "--nodes", "2", "--json", "-")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["gpu"] == "B200-SXM" and data["num_gpus"] == 16
    assert data["per_gpu"]["intra_GBps"] == pytest.approx(720.0)
    assert data["per_gpu"]["intra_alltoall_GBps"] == pytest.approx(900 * 0.7146)  # HybridEP's kernel-only dispatch
    assert data["bisection_GBps"] == pytest.approx(8 * 48.5)
    assert data["bisection_closed_form_GBps"] == pytest.approx(8 * 48.5)
