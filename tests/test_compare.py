"""``moesim compare``: same gate scores for every policy, DESIGN.md's JSON rows, --vary cases,
--healthy rows, the plot, and bad input (exit 2)."""

from __future__ import annotations

import json
import struct

import pytest
from conftest import SCENARIOS

from sim.api import load_scenario
from sim.cli.main import main
from sim.engine.simulate import simulate
from sim.hardware.faults import without_faults
from sim.studies.compare import build_cases, run_compare
from sim.studies.sweep import parse_varies

BIG = str(SCENARIOS / "128gpu.yaml")
# 16 GPUs on 2 nodes, EP16 over both: node_limited:M=2 may use every node = topk
SMALL = ["cluster.nodes=2", "model.num_layers=2", "training.grad_accum_steps=1", "training.seq_len=1024"]
DESIGN_KEYS = {"policy", "step_time_s", "a2a_s", "inter_node_bytes", "max_over_mean_load", "retained_gate_mass",
               "mean_nodes_per_token"}  # fmt: skip


def _compare(*args: str, capsys) -> tuple[int, dict]:
    argv = ["compare", BIG, *(x for o in SMALL for x in ("--set", o)), *args, "--no-progress", "--json", "-"]
    code = main(argv)
    out = capsys.readouterr().out
    return code, (json.loads(out) if code == 0 else {})


def png_size(path) -> tuple[int, int]:
    with open(path, "rb") as fh:
        data = fh.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_policies_see_the_same_gate_scores(capsys):
    code, doc = _compare("--policy", "topk", "--policy", "node_limited:M=2", "--policy", "node_limited:M=1",
                         capsys=capsys)  # fmt: skip
    assert code == 0
    rows = doc["policies"]
    assert [r["policy"] for r in rows] == ["topk", "node_limited:M=2", "node_limited:M=1"]
    for r in rows:
        assert set(r) >= DESIGN_KEYS
    topk, m2, m1 = rows
    # M = every node of the EP group: the same selection as topk, hence the same step, bit for bit
    for k in ("step_time_s", "a2a_s", "inter_node_bytes", "max_over_mean_load", "mean_nodes_per_token"):
        assert m2[k] == topk[k], k
    assert topk["retained_gate_mass"] == 1.0 and topk["speedup"] == 1.0
    assert m1["mean_nodes_per_token"] == 1.0 and m1["retained_gate_mass"] < 1.0
    assert topk["mean_nodes_per_token"] > 1.5  # top-8 of 128 over 2 nodes almost always uses both
    assert m1["speedup"] == pytest.approx(topk["step_time_s"] / m1["step_time_s"], rel=1e-15)


def test_rows_equal_independent_simulate_calls(capsys):
    code, doc = _compare("--policy", "topk", "--policy", "device_limited:M=4", "--set",
                         "collectives.all_to_all=hierarchical", capsys=capsys)  # fmt: skip
    assert code == 0
    s = load_scenario(BIG, [*SMALL, "collectives.all_to_all=hierarchical"])
    for r in doc["policies"]:
        ref = simulate(s, policy=r["routing_policy"])
        assert r["step_time_s"] == ref["step_time_s"]
        assert r["a2a_s"] == ref["breakdown_s"]["a2a"]
        assert r["inter_node_bytes"] == ref["traffic"]["inter_node_bytes"]
        assert r["retained_gate_mass"] == ref["traffic"]["retained_gate_mass"]
        b = ref["breakdown_s"]
        assert r["compute_s"] + r["a2a_s"] + r["imbalance_wait_s"] + r["other_s"] == pytest.approx(
            ref["step_time_s"], rel=1e-9
        )  # the mean breakdown tiles the step
        assert r["other_s"] == b["exposed_comm"] + b["optimizer"]


def test_node_limited_cuts_inter_node_bytes_with_hierarchical_all_to_all(capsys):
    code, doc = _compare("--policy", "topk", "--policy", "node_limited:M=1", "--set",
                         "collectives.all_to_all=hierarchical", capsys=capsys)  # fmt: skip
    assert code == 0
    topk, m1 = doc["policies"]
    # hierarchical: one IB copy per (token, remote node); M=1 sends a token to <= 1 node
    ratio = m1["inter_node_bytes"] / topk["inter_node_bytes"]
    # with 2 nodes a topk token reaches the remote node almost surely; an M=1 token about half the time
    assert 0.4 < ratio < 0.6
    assert m1["a2a_s"] < topk["a2a_s"]


def test_vary_max_groups_fills_in_m_and_dedupes_topk():
    s = load_scenario(BIG, SMALL)
    varies = parse_varies(["routing.max_groups=1,2"])
    cases = build_cases(s, ["topk", "node_limited"], varies)
    assert [(c.policy, c.overrides) for c in cases] == [
        ("topk", ()), ("node_limited:M=1", ()), ("node_limited:M=2", ()),
    ]  # fmt: skip
    both = build_cases(s, ["node_limited"], parse_varies(["routing.max_groups=1,2", "routing.skew=0,1"]))
    assert [(c.policy, c.overrides) for c in both] == [
        ("node_limited:M=1", ("routing.skew=0",)), ("node_limited:M=1", ("routing.skew=1",)),
        ("node_limited:M=2", ("routing.skew=0",)), ("node_limited:M=2", ("routing.skew=1",)),
    ]  # fmt: skip


def test_vary_on_the_scenario_policy(capsys):
    code, doc = _compare("--set", "routing.policy=node_limited:M=1", "--set", "routing.max_groups=1",
                         "--vary", "routing.max_groups=1,2", capsys=capsys)  # fmt: skip
    assert code == 0
    assert [r["policy"] for r in doc["policies"]] == ["node_limited:M=1", "node_limited:M=2"]


def test_healthy_rows_for_a_faulty_scenario():
    straggler = ["faults.stragglers=[{rank: 3, compute_factor: 1.5}]"]
    doc = run_compare(BIG, [*SMALL, *straggler], ["topk", "node_limited:M=1"], [], healthy=True)
    labels = [r["policy"] for r in doc["policies"]]
    assert labels == ["topk", "topk (healthy)", "node_limited:M=1", "node_limited:M=1 (healthy)"]
    s = load_scenario(BIG, [*SMALL, *straggler])
    ref = simulate(without_faults(s), policy="topk")
    faulty, healthy = doc["policies"][:2]
    assert healthy["step_time_s"] == ref["step_time_s"] and healthy["healthy"] is True
    assert faulty["step_time_s"] > healthy["step_time_s"]  # rank 3 runs 1.5x slower kernels


def test_plot_is_a_png(tmp_path, capsys):
    png = tmp_path / "cmp.png"
    code, _ = _compare("--policy", "topk", "--policy", "node_limited:M=1", "--plot", str(png), capsys=capsys)
    assert code == 0
    w, h = png_size(png)
    assert w >= 1200 and h >= 500
    assert [p.name for p in tmp_path.iterdir()] == ["cmp.png"]  # no temp file left


def test_table_and_analytic_engine(capsys):
    argv = ["compare", BIG, *(x for o in SMALL for x in ("--set", o)), "--policy", "topk", "--policy",
            "node_limited:M=1", "--engine", "analytic", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "engine analytic" in out and "speed-up" in out and "node_limited:M=1" in out
    assert "1.000x" in out  # the first row


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--policy", "topk"], "nothing to compare"),
        (["--policy", "bogus", "--policy", "topk"], "--policy"),
        (["--policy", "node_limited:M=0", "--policy", "topk"], "fewer than top_k"),
        (["--vary", "routing.max_groups=1,2"], "no effect under the scenario's policy topk"),
        (["--policy", "node_limited:M=1", "--vary", "routing.max_groups=1,2"], "fixes M already"),
        (["--vary", "routing.nope=1,2"], "unknown override path"),
        (["--policy", "topk", "--policy", "node_limited:M=1", "--healthy"], "no faults"),
        (["--vary", "cluster.nodes=2,3", "--policy", "topk"], "(with cluster.nodes=3)"),
    ],
)
def test_bad_input_exits_2(args, needle, capsys):
    argv = ["compare", BIG, *(x for o in SMALL for x in ("--set", o)), *args, "--no-progress"]
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_deepseek_v3_scenario_layout():
    s = load_scenario(SCENARIOS / "deepseek-v3-h800-ep-group.yaml")
    assert (s.cluster.nodes, s.gpus_per_node, s.ep, s.world_size) == (8, 8, 64, 64)
    m, r = s.model, s.routing
    assert (m.num_experts, m.num_shared_experts, m.top_k, m.score_function) == (256, 1, 8, "sigmoid")
    assert (r.policy_string, r.capacity_factor, r.dispatch) == ("node_limited:M=4", None, "dropless")
    assert s.collectives.all_to_all == "hierarchical" and s.topology.name == "h800-cluster"
    # NVLink 160 GB/s and IB 50 GB/s per GPU as the DeepSeek-V3 report gives them
    t = s.topology
    assert t.node.intra.line_bw_GBps * t.node.intra.efficiency == pytest.approx(160.0)
    assert t.scaleout.nic_line_Gbps / 8 == 50.0


def test_deepseek_v3_node_limit_caps_nodes_per_token():
    small = ["model.num_layers=1", "training.grad_accum_steps=1", "training.seq_len=512"]
    doc = run_compare(str(SCENARIOS / "deepseek-v3-h800-ep-group.yaml"), small,
                      ["node_limited:M=8", "topk", "node_limited:M=2"], [], engine="analytic")  # fmt: skip
    m8, topk, m2 = doc["policies"]
    assert m8["step_time_s"] == topk["step_time_s"] and m8["inter_node_bytes"] == topk["inter_node_bytes"]
    assert m2["mean_nodes_per_token"] <= 2.0 and topk["mean_nodes_per_token"] > 4.0
    assert m2["inter_node_bytes"] < topk["inter_node_bytes"]


def test_resource_guard_refuses_and_force_runs(monkeypatch, capsys):
    monkeypatch.setenv("MOESIM_TIME_LIMIT_S", "0.000001")
    argv = ["compare", BIG, *(x for o in SMALL for x in ("--set", o)), "--policy", "topk", "--policy",
            "node_limited:M=1", "--no-progress"]  # fmt: skip
    assert main(argv) == 2
    assert "time limit" in capsys.readouterr().err
    code, doc = _compare("--policy", "topk", "--policy", "node_limited:M=1", "--force", capsys=capsys)
    assert code == 0 and len(doc["policies"]) == 2


def test_m_above_the_groups_spanned_runs_unlimited_with_a_note(capsys):
    """EP16 spans 2 nodes: node_limited:M=4 limits nothing, so it runs (as M=2) and selects exactly
    what topk selects -- the issue's comparison M = 1, 2, 4 stays one command -- with a note."""
    code, doc = _compare("--policy", "topk", "--policy", "node_limited:M=4", "--policy", "device_limited:M=99",
                         capsys=capsys)  # fmt: skip
    assert code == 0
    topk, m4, d99 = doc["policies"]
    assert m4["policy"] == "node_limited:M=4" and "no limit, run as M=2" in m4["note"]
    assert d99["policy"] == "device_limited:M=99" and "16 devices" in d99["note"]
    for r in (m4, d99):
        assert r["step_time_s"] == topk["step_time_s"] and r["inter_node_bytes"] == topk["inter_node_bytes"]
        assert r["retained_gate_mass"] == topk["retained_gate_mass"] == 1.0
    assert "note" not in topk
    argv = ["compare", BIG, *(x for o in SMALL for x in ("--set", o)), "--policy", "topk", "--policy",
            "node_limited:M=4", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    assert "note: node_limited:M=4: M=4 >= the 2 nodes one EP group spans" in capsys.readouterr().out
