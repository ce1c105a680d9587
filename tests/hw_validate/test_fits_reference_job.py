"""The reference job simulated as it ran (hw_validate/fits/reference_job.py, hw_validate/phases.py):
the compute scale multiplies the compute blocks only and the call overhead follows every blocking
call, each fit recovers a figure planted in a 'job' made of the simulator's own phases, and the
prediction is the median over the rank noise's draws."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from hw_validate.desync import REFERENCE
from sim.api import load_scenario

ROOT = Path(__file__).resolve().parents[2]


def _reference_trace(tmp_path: Path, steps: int = 4) -> Path:
    """A router trace of the reference scenario (2 ranks, 3 MoE layers, 8 experts top-2, 384
    tokens a rank): near-uniform counts, each expert's kept tokens capped at its capacity."""
    from sim.inputs.router_trace import RouterTrace, save_trace

    s = load_scenario(REFERENCE)
    m, tokens = s.model, s.tokens_per_micro_batch
    rng = np.random.default_rng(3)
    shape = (steps, 1, m.num_layers, 2, m.num_experts)
    assigned = np.zeros(shape, dtype=np.int64)
    for idx in np.ndindex(shape[:-1]):
        assigned[idx] = rng.multinomial(tokens * m.top_k, [1 / m.num_experts] * m.num_experts)
    cap = math.ceil(s.routing.capacity_factor * tokens * m.top_k / m.num_experts)
    path = tmp_path / "router_trace.json"
    save_trace(path, RouterTrace("cpu-desync", m.num_experts, m.top_k, 2, 2, m.num_layers, tokens,
                                 assigned, np.minimum(assigned, cap)))  # fmt: skip
    return path


def _quiet_calibration(**update):
    """The committed accuracy calibration without rank drift (deterministic, symmetric ranks)."""
    from sim.inputs.calibration import load_calibration

    cal = load_calibration(ROOT / "benchmarks" / "accuracy" / "cpu-2rank-gloo.calibration.json")
    return cal.model_copy(update={"compute_noise_cv": 0.0, "wake_delay_p": 0.0, "compute_scale": None,
                            "pause_rate_per_s": None, "call_overhead_us": None, **update})


def _predict(tmp_path: Path, cal, trace: Path, name: str):
    from hw_validate.phases import predicted_phases, simulation_scenario
    from sim.engine.simulate import simulate
    from sim.inputs.calibration import save_calibration

    path = tmp_path / f"{name}.json"
    save_calibration(path, cal)
    s = simulation_scenario(REFERENCE, [], path, trace)
    res = simulate(s, trace_ranks={0, 1})
    spans = res.pop("_spans")
    hooks = max(sum(sp.end - sp.start for sp in spans if sp.name == "grad_hooks" and sp.rank == r) for r in (0, 1))
    return predicted_phases(spans, 2), hooks, res


def _planted_profile(tmp_path: Path, **cal) -> tuple[dict, float, dict]:
    """``(phases, hooks, profile)``: a reference-job profile whose measured phases are the
    simulator's own with the quiet calibration updated by ``cal``."""
    trace = _reference_trace(tmp_path)
    planted, hooks, _ = _predict(tmp_path, _quiet_calibration(**cal), trace, "planted")
    prof = {"scenario": str(REFERENCE), "overrides": [], "measured": {"phases_s": planted, "dtype": "fp32"},
            "job": {"trace": str(trace)}}  # fmt: skip
    return planted, hooks, prof


def test_compute_scale_multiplies_the_compute_blocks_only(tmp_path):
    """compute_scale 1.4: every forward/backward compute phase takes exactly 1.4x as long; ZeRO's
    gradient hooks and the optimizer's own step do not move."""
    trace = _reference_trace(tmp_path)
    base, hooks0, r0 = _predict(tmp_path, _quiet_calibration(), trace, "c1")
    scaled, hooks1, r1 = _predict(tmp_path, _quiet_calibration(compute_scale=1.4), trace, "c14")
    for ph in ("attention", "route", "permute", "experts", "unpermute", "output", "attention_bwd", "experts_bwd"):
        assert base[ph] > 0 and scaled[ph] == pytest.approx(1.4 * base[ph], rel=1e-9), ph
    assert hooks0 > 0 and hooks1 == pytest.approx(hooks0, rel=1e-12)
    opt = (lambda p: p["optimizer"] - p["optimizer_comm"])  # noqa: E731
    assert opt(scaled) == pytest.approx(opt(base), rel=1e-9)
    assert r1["step_time_s"] > r0["step_time_s"]


def test_fit_compute_scale_recovers_a_planted_factor(tmp_path):
    """A 'job' whose phases are the simulator's own at compute_scale 1.3: the fit on the
    unscaled calibration gives back 1.3 (the secant between scales 1 and 2 is exact where the
    step is linear in the scale), and the calibration report names it."""
    from hw_validate.calibration_report import format_report
    from hw_validate.fits.reference_job import compute_time, fit_compute_scale

    planted, hooks, prof = _planted_profile(tmp_path, compute_scale=1.3)
    fit = fit_compute_scale(_quiet_calibration(), prof)
    assert fit["compute_scale"] == pytest.approx(1.3, rel=1e-6)
    assert fit["measured_compute_s"] == pytest.approx(compute_time(planted)) and fit["predicted_hooks_s"] == pytest.approx(hooks)
    assert fit["predicted_compute_s"] < fit["measured_compute_s"]
    assert fit_compute_scale(_quiet_calibration(), {**prof, "job": {}}) is None  # no kept job: no fit
    cal = _quiet_calibration(compute_scale=fit["compute_scale"])
    cal.sweeps["desync"] = {"scenario": str(REFERENCE), "ranks": 2, "calls": 0, "wake": [], "noise": {},
                            "fit": {"compute_noise_cv": 0.0, "wake_delay_p": None}, "compute": fit}  # fmt: skip
    assert "compute scale 1.300 -- used" in format_report(cal)


def test_validate_predicts_the_median_over_noise_draws(tmp_path):
    """With the calibrated rank noise the prediction is the median over PREDICT_DRAWS independent
    draws (the job's figure is a median over steps), step and each phase; draw 0 is what
    ``moesim simulate`` gives; the draws differ; without noise one draw is taken."""
    from hw_validate.phases import (
        PREDICT_DRAWS,
        noise_draws,
        predicted_phases,
        simulate_median,
        simulation_scenario,
    )
    from sim.engine.simulate import simulate
    from sim.inputs.calibration import save_calibration

    trace = _reference_trace(tmp_path)
    noisy = _quiet_calibration(compute_noise_cv=0.1, pause_rate_per_s=20.0, pause_mean_s=4e-3)
    save_calibration(tmp_path / "noisy.json", noisy)
    s = simulation_scenario(REFERENCE, [], tmp_path / "noisy.json", trace)
    assert noise_draws(s) == PREDICT_DRAWS and PREDICT_DRAWS % 2 == 1
    runs = [simulate(s, trace_ranks={0, 1}, draw=d) for d in range(PREDICT_DRAWS)]
    steps = [r["step_time_s"] for r in runs]
    assert len(set(steps)) == PREDICT_DRAWS  # independent draws
    step, phases, res0, _ = simulate_median(s)
    assert step == pytest.approx(float(np.median(steps)), rel=1e-12) and phases["step"] == step
    per = [predicted_phases(r.pop("_spans"), 2) for r in runs]
    assert phases["experts_bwd"] == pytest.approx(float(np.median([p["experts_bwd"] for p in per])), rel=1e-12)
    assert res0["step_time_s"] == steps[0] == simulate(s)["step_time_s"]
    save_calibration(tmp_path / "quiet.json", _quiet_calibration())
    assert noise_draws(simulation_scenario(REFERENCE, [], tmp_path / "quiet.json", trace)) == 1


def test_call_overhead_follows_every_blocking_call(tmp_path):
    """call_overhead_us 700 on quiet ranks: every rank resumes 0.7 ms late after each blocking call
    -- each all-to-all, the flushing gradient all-reduce, the tail's norm all-reduces (2 groups
    over dp 2; edp 1) and its parameter gather -- so the step grows by exactly 0.7 ms x that count,
    and validate charges each to the call it follows."""
    from sim.frameworks.ops import AllToAll

    trace = _reference_trace(tmp_path)
    base, _, r0 = _predict(tmp_path, _quiet_calibration(), trace, "o0")
    over, _, r1 = _predict(tmp_path, _quiet_calibration(call_overhead_us=700.0), trace, "o7")
    s = load_scenario(REFERENCE)
    a2a = 4 * s.model.num_moe_layers  # dispatch, combine, and their gradients
    tail = 2 + 1  # two norm all-reduces, one gather
    calls = a2a + 1 + tail
    assert r1["step_time_s"] - r0["step_time_s"] == pytest.approx(700e-6 * calls, rel=1e-9)
    assert over["grad_sync"] - base["grad_sync"] == pytest.approx(700e-6, rel=1e-9)
    assert over["optimizer_comm"] - base["optimizer_comm"] == pytest.approx(700e-6 * tail, rel=1e-9)
    moved = sum(over[p] - base[p] for p in ("dispatch", "combine", "dispatch_bwd", "combine_bwd"))
    assert moved == pytest.approx(700e-6 * a2a, rel=1e-9)
    for ph in ("attention", "experts", "attention_bwd", "experts_bwd"):
        assert over[ph] == pytest.approx(base[ph], rel=1e-12), ph
    assert sum(isinstance(op, AllToAll) for op in build_schedule_of(s)) == a2a


def build_schedule_of(s):
    from sim.engine.simulate import cost_model
    from sim.engine.step import build_step
    from sim.routing.plan import route_scenario

    return build_step(s, route_scenario(s), cost_model(s), np.ones(s.world_size)).ops


def test_fit_call_overhead_recovers_a_planted_overhead(tmp_path):
    """A 'job' whose phases are the simulator's own with 0.9 ms a call: the fit gives back 900 us
    (the step's blocking time is linear in the overhead), a job faster than the isolated calls
    gives 0, and the calibration report names the figure."""
    from hw_validate.calibration_report import format_report
    from hw_validate.fits.reference_job import BLOCKING, blocking_time, fit_call_overhead

    planted, _, prof = _planted_profile(tmp_path, call_overhead_us=900.0)
    fit = fit_call_overhead(_quiet_calibration(), prof)
    assert fit["call_overhead_us"] == pytest.approx(900.0, rel=1e-6)
    assert fit["measured_blocking_s"] == pytest.approx(blocking_time(planted))
    fast = {k: v * (0.1 if k in BLOCKING else 1.0) for k, v in planted.items()}
    assert fit_call_overhead(_quiet_calibration(), {**prof, "measured": {"phases_s": fast}})["call_overhead_us"] == 0.0
    assert fit_call_overhead(_quiet_calibration(), {**prof, "job": {}}) is None
    cal = _quiet_calibration(call_overhead_us=fit["call_overhead_us"])
    cal.sweeps["desync"] = {"scenario": str(REFERENCE), "ranks": 2, "calls": 0, "wake": [], "noise": {},
                            "fit": {"compute_noise_cv": 0.0, "wake_delay_p": None}, "call_overhead": fit}  # fmt: skip
    assert "call overhead 900 us -- used" in format_report(cal)
