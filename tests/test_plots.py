"""Step plots (``simulate --plot DIR``) and the sweep plot's helpers: files are real PNGs written
atomically; the per-rank totals and the layer chosen for the Gantt come from the spans."""

from __future__ import annotations

import pytest
from conftest import SCENARIOS
from test_compare import png_size

from sim.api import load_scenario
from sim.cli.main import main
from sim.engine.simulate import simulate
from sim.engine.spans import Span
from sim.errors import InputError
from sim.reports.plots import _layer_window, rank_totals, step_plots, sweep_x_key
from sim.studies.sweep import parse_varies

BIG = SCENARIOS / "128gpu.yaml"
SMALL = ["cluster.nodes=2", "model.num_layers=3", "training.grad_accum_steps=1", "training.seq_len=1024"]
STEP_PNGS = {"breakdown.png", "timeline_layer.png", "timeline_step.png", "ranks.png", "routing.png"}


def test_step_plots_write_every_png(tmp_path):
    s = load_scenario(BIG, SMALL)
    res = simulate(s, trace_ranks=set(range(16)))
    spans = res.pop("_spans")
    paths = step_plots(tmp_path / "plots", res, spans, s)
    assert {p.name for p in paths} == STEP_PNGS
    assert {p.name for p in (tmp_path / "plots").iterdir()} == STEP_PNGS  # no temp files left
    for p in paths:
        w, h = png_size(p)
        assert w >= 600 and h >= 250, p.name


def test_faulty_breakdown_and_no_spans(tmp_path):
    s = load_scenario(BIG, [*SMALL, "faults.stragglers=[{rank: 2, compute_factor: 1.4}]"])
    res = simulate(s)
    assert "faults" in res
    paths = step_plots(tmp_path, res, [], s)  # no traced ranks: breakdown and routing only
    assert {p.name for p in paths} == {"breakdown.png", "routing.png"}


def test_cli_simulate_plot(tmp_path):
    out = tmp_path / "p"
    argv = ["simulate", str(BIG), *(x for o in SMALL for x in ("--set", o)), "--plot", str(out)]
    assert main(argv) == 0
    assert {p.name for p in out.iterdir()} == STEP_PNGS


def test_rank_totals_by_category():
    spans = [
        Span(0, "compute", "attention", 0.0, 1.0), Span(0, "compute", "imbalance_wait", 1.0, 1.5),
        Span(0, "compute", "dispatch", 1.5, 2.0), Span(0, "compute", "grad_sync_wait", 2.0, 2.25),
        Span(0, "compute", "optimizer", 2.25, 2.5), Span(0, "comm", "grad_sync", 0.5, 2.0),
        Span(1, "compute", "experts", 0.0, 1.5), Span(1, "compute", "combine", 1.5, 2.5),
    ]  # fmt: skip
    t = rank_totals(spans)
    assert t[0] == {"compute": 1.0, "a2a": 0.5, "imbalance_wait": 0.5, "exposed_comm": 0.25, "optimizer": 0.25}
    assert t[1] == {"compute": 1.5, "a2a": 1.0, "imbalance_wait": 0.0, "exposed_comm": 0.0, "optimizer": 0.0}


def test_layer_window_picks_the_layer_with_most_waiting():
    def layer(i, t0, wait):
        f = {"phase": "fwd", "layer": i, "micro": 0}
        return [
            Span(0, "compute", "attention", t0, t0 + 1, f),
            Span(0, "compute", "imbalance_wait", t0 + 1, t0 + 1 + wait, {"layer": i, "micro": 0}),
            Span(0, "compute", "dispatch", t0 + 1 + wait, t0 + 2 + wait, f),
            Span(0, "compute", "experts", t0 + 2 + wait, t0 + 3 + wait, f),
        ]

    spans = layer(0, 0.0, 0.1) + layer(1, 3.1, 0.7) + layer(2, 6.8, 0.2)
    assert _layer_window(spans) == (1, 3.1, 6.8)
    assert _layer_window([Span(0, "compute", "mlp", 0.0, 1.0, {"phase": "fwd", "layer": 0, "micro": 0})]) is None


def test_sweep_x_key():
    v = parse_varies(["routing.policy=topk,node_limited:M=1", "routing.skew=0,1", "cluster.nodes=2,4"])
    assert sweep_x_key(v) == "cluster.nodes"
    assert sweep_x_key(v, "routing.skew") == "routing.skew"
    assert sweep_x_key(parse_varies(["routing.policy=topk,node_limited:M=1", "routing.skew=0,1"])) == "routing.skew"
    with pytest.raises(InputError, match="--x"):
        sweep_x_key(v, "routing.policy")
    with pytest.raises(InputError, match="numeric"):
        sweep_x_key(parse_varies(["routing.policy=topk,node_limited:M=1"]))
