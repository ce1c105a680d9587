"""``moesim route`` end to end: table, JSON keys of DESIGN.md, plot, errors (exit 2), determinism."""

import json

import pytest
from conftest import SCENARIOS

SUMMARY_KEYS = {
    "local_fraction",
    "inter_node_fraction",
    "max_over_mean_load",
    "dropped_fraction",
    "retained_gate_mass",
    "mean_nodes_per_token",
}


def test_route_json_has_the_contract_keys(cli):
    proc = cli("route", str(SCENARIOS / "cpu-2rank.yaml"), "--json", "-")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out["summary"]) >= SUMMARY_KEYS
    assert out["policy"] == "topk" and out["method"] == "exact"
    s = out["summary"]
    assert s["inter_node_fraction"] == 0.0  # both ranks on one host
    assert s["local_fraction"] + s["intra_node_fraction"] == pytest.approx(1.0)
    assert s["capacity_per_rank"] == 160  # ceil(256 / 4 * 1.25 * 2)
    assert [t["tokens"] for t in out["touched"]] == [1, 4, 16, 64, 256, 1024]
    assert {"tokens", "measured", "uniform"} <= set(out["touched"][0])
    assert out["touched"][0]["measured"] == out["touched"][0]["uniform"] == 2.0
    assert len(out["per_layer"]) == 2


def test_route_policy_override_and_table(cli):
    proc = cli(
        "route", str(SCENARIOS / "cpu-2rank.yaml"), "--policy", "device_limited:M=1", "--touched", "1,3"
    )
    assert proc.returncode == 0, proc.stderr
    assert "policy device_limited:M=1" in proc.stdout
    assert "max/mean load (ranks)" in proc.stdout and "n=3" in proc.stdout
    proc = cli("route", str(SCENARIOS / "cpu-2rank.yaml"), "--policy", "device_limited:M=1", "--json", "-")
    s = json.loads(proc.stdout)["summary"]
    assert s["mean_ranks_per_token"] == 1.0  # both experts of a token on one rank
    assert s["retained_gate_mass"] < 1.0


def test_route_output_is_deterministic(cli, tmp_path):
    for name in ("a.json", "b.json"):
        proc = cli(
            "route",
            str(SCENARIOS / "seed-4gpu.yaml"),
            "--set",
            "routing.generator=skewed",
            "--set",
            "routing.skew=1.0",
            "--json",
            str(tmp_path / name),
        )
        assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--touched", "1,x"], "--touched"),
        (["--touched", "0"], "--touched"),
        (["--policy", "node_limited:M=0"], "--policy"),
        (["--policy", "random"], "--policy"),
        (["--set", "routing.skew=-1"], "routing.skew"),
    ],
)
def test_bad_input_exits_2_naming_the_field(cli, args, field):
    proc = cli("route", str(SCENARIOS / "cpu-2rank.yaml"), *args)
    assert proc.returncode == 2, proc.stderr
    assert field in proc.stderr and "Traceback" not in proc.stderr


def test_an_m_that_limits_nothing_runs_as_topk_with_a_note(cli):
    """As compare does (sim.studies.compare.effective_policy): M at or above the groups one EP group
    spans runs with a note, and routes exactly as topk on the same seed."""
    scen = str(SCENARIOS / "cpu-2rank.yaml")
    proc = cli("route", scen, "--policy", "node_limited:M=9", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["policy"] == "node_limited:M=9" and out["ran_as"] == "node_limited:M=1"
    assert out["note"] == "M=9 >= the 1 node one EP group spans: no limit, run as M=1 (= topk)"
    topk = json.loads(cli("route", scen, "--policy", "topk", "--json", "-").stdout)
    assert out["summary"] == topk["summary"] and out["per_layer"] == topk["per_layer"]
    table = cli("route", scen, "--policy", "device_limited:M=3")
    assert table.returncode == 0, table.stderr
    assert "note: device_limited:M=3: M=3 >= the 2 devices one EP group spans" in table.stdout
    limited = json.loads(cli("route", scen, "--policy", "device_limited:M=1", "--json", "-").stdout)
    assert "note" not in limited and limited["policy"] == "device_limited:M=1"


def test_route_128gpu_node_limited_m4_runs_like_compare(cli):
    """The issue's command: EP16 spans 2 nodes, so M=4 limits nothing (exit 0 and a note)."""
    proc = cli("route", str(SCENARIOS / "128gpu.yaml"), "--policy", "node_limited:M=4", "--touched", "1")
    assert proc.returncode == 0, proc.stderr
    assert "note: node_limited:M=4: M=4 >= the 2 nodes one EP group spans: no limit, run as M=2 (= topk)" in proc.stdout


@pytest.mark.slow
def test_done_when_128gpu_node_limited_with_plot(cli, tmp_path):
    png, js = tmp_path / "traffic.png", tmp_path / "route.json"
    proc = cli(
        "route",
        str(SCENARIOS / "128gpu.yaml"),
        "--policy",
        "node_limited:M=2",
        "--plot",
        str(png),
        "--json",
        str(js),
    )
    assert proc.returncode == 0, proc.stderr
    assert "inter-node fraction" in proc.stdout and "mean nodes per token" in proc.stdout
    out = json.loads(js.read_text())
    assert out["method"] == "pooled" and out["policy"] == "node_limited:M=2"
    assert 1.0 < out["summary"]["mean_nodes_per_token"] <= 2.0
    assert out["summary"]["inter_node_fraction"] == pytest.approx(0.5, abs=0.01)  # EP16 spans 2 nodes
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
