"""Faults through the whole step: stragglers, degraded/failed NICs and kernel jitter vs the healthy run."""

from __future__ import annotations

import pytest
from conftest import ROOT, run_cli

from sim.api import load_scenario
from sim.engine.simulate import simulate
from sim.ioutil import dumps_json

BIG = ROOT / "scenarios" / "128gpu.yaml"
BASE = ["model.num_layers=2", "training.grad_accum_steps=1", "training.seq_len=1024", "cluster.nodes=2",
        "parallelism.ep=16", "routing.generator=uniform"]  # fmt: skip


def scen(*extra):
    return load_scenario(BIG, [*BASE, *extra])


def test_straggler_sets_the_pace_and_others_wait_for_it():
    r = simulate(scen("faults.stragglers=[{rank: 3, compute_factor: 2}]"))
    f = r["faults"]
    assert f["step_time_s"] > 1.2 * f["healthy_step_time_s"]
    assert f["slowdown"] == pytest.approx(f["step_time_s"] / f["healthy_step_time_s"] - 1)
    waiting = r["ranks"]["most_waiting"]
    assert all(w["waited_on"] == 3 for w in waiting if w["rank"] != 3)
    assert r["critical_rank"] == 3
    # the straggler's compute is 2x a healthy rank's
    assert r["critical_rank_breakdown_s"]["compute"] == pytest.approx(2 * f["healthy_breakdown_s"]["compute"], rel=0.02)


def test_degraded_nic_slows_all_to_all_and_failed_nic_is_routed_around():
    half = simulate(scen("faults.links=[{nic: {node: 1, rail: 0}, bw_factor: 0.5}]"))
    assert half["breakdown_s"]["a2a"] > half["faults"]["healthy_breakdown_s"]["a2a"]
    dead = simulate(scen("faults.links=[{nic: {node: 1, rail: 0}, failed: true}]"))
    assert dead["faults"]["slowdown"] > 0
    assert dead["faults"]["links"] and dead["traffic"]["a2a_bytes"] == half["traffic"]["a2a_bytes"]


def test_jitter_is_deterministic_by_seed_and_mean_one():
    a = simulate(scen("faults.jitter={kernel_cv: 0.2, seed: 1}"))
    b = simulate(scen("faults.jitter={kernel_cv: 0.2, seed: 1}"))
    c = simulate(scen("faults.jitter={kernel_cv: 0.2, seed: 2}"))
    assert dumps_json(a) == dumps_json(b) and a["step_time_s"] != c["step_time_s"]
    assert a["faults"]["healthy_step_time_s"] < a["step_time_s"]  # noise makes barriers wait
    assert a["breakdown_s"]["compute"] == pytest.approx(a["faults"]["healthy_breakdown_s"]["compute"], rel=0.05)


def test_cli_prints_fault_impact_and_refuses_missing_targets():
    p = run_cli("simulate", str(BIG), *sum((["--set", x] for x in BASE), []),
                "--set", "faults.stragglers=[{rank: 3, compute_factor: 2}]")  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "vs healthy" in p.stdout
    bad = run_cli("simulate", str(BIG), *sum((["--set", x] for x in BASE), []),
                  "--set", "faults.links=[{nic: {node: 7, rail: 0}, failed: true}]")  # fmt: skip
    assert bad.returncode == 2 and "faults" in bad.stderr


def test_json_to_unwritable_path_is_exit_2(tmp_path):
    p = run_cli("simulate", str(ROOT / "scenarios" / "cpu-2rank.yaml"), "--json", "/proc/nope/r.json")
    assert p.returncode == 2 and "--json" in p.stderr
