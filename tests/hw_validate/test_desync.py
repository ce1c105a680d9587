"""The desync profile (hw_validate/desync.py): per-call spans of a real job turned into the late
wake-up and compute-noise models. The fit is checked on spans built from a known model (closed
form: the exit spread and segment deviations are planted exactly), then on a real 2-rank job of the
reference scenario; calibrate's choice of when to run it, and the fit_all hand-over."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hw_validate.desync import (
    BIN_EDGES_S,
    PAUSE_MIN_S,
    REFERENCE,
    aligned_calls,
    desync_rows,
    fit_profile,
    read_spans,
    reference_overrides,
)
from sim.api import load_scenario
from sim.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["dispatch", "combine", "dispatch_bwd", "combine_bwd", "grad_sync", "optimizer_comm"]


def plant(tmp: Path, p_every: int, cap_s: float, cv: float, steps: int = 40, world: int = 2,
          segs_s=(0.3e-3, 1.5e-3, 3e-3, 6e-3, 12e-3), base_s: float = 0.0, call_s: float = 2e-4) -> Path:  # fmt: skip
    """Spans of ``steps`` steps in which every ``p_every``-th call followed by each segment length
    has one rank leave late by min(longest next segment, cap_s) and every segment's ranks deviate by +-cv/sqrt(pi) (the mean
    |deviation| of two normal ranks of relative std cv), written as the job writes them."""
    t = np.zeros(world)
    recs = [[] for _ in range(world)]
    k = 0
    count = [0] * len(segs_s)
    dev = cv / math.sqrt(math.pi)  # 2 normal ranks of std cv: E|seg_r / mean - 1| = cv / sqrt(pi)
    for st in range(steps):
        spans = [[["forward", float(t[r]), float(t[r] + 1e-3)]] for r in range(world)]
        for i, name in enumerate(NAMES):
            seg = segs_s[(st + i) % len(segs_s)]
            sign = 1 if (st + i) % 2 else -1
            comp = np.array([seg * (1 + sign * dev), seg * (1 - sign * dev)])
            arrive = t + comp
            out = np.full(world, arrive.max() + call_s)
            out[(k + 1) % world] += base_s  # the same rank as a late wake-up: spreads add
            if i + 1 < len(NAMES):  # every p_every-th call before each segment length is late
                cls = (st + i + 1) % len(segs_s)
                count[cls] += 1
                if count[cls] % p_every == 0:
                    out[(k + 1) % world] += min(segs_s[cls] * (1 + dev), cap_s)
            k += 1
            for r in range(world):
                spans[r].append([name, float(arrive[r]), float(out[r])])
            t = out
        t = np.full(world, t.max() + 1e-3)  # the step's end
        for r in range(world):
            recs[r].append({"step": st, "spans": spans[r]})
    for r in range(world):
        (tmp / f"rank-{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs[r]))
    return tmp


def profile_of(d: Path, warmup: int = 0) -> dict:
    e, x, last, skipped = aligned_calls(read_spans(d, 2), warmup)
    rows, noise = desync_rows(e, x, last)
    return {"scenario": "planted", "ranks": 2, "calls": e.shape[1], "skipped_steps": skipped, "wake": rows, "noise": noise}


def test_fit_recovers_the_planted_wake_ups_and_noise(tmp_path):
    prof = profile_of(plant(tmp_path, p_every=4, cap_s=2.5e-3, cv=0.08))
    assert prof["calls"] == 40 * len(NAMES) and prof["skipped_steps"] == 0
    (p, cap), cv = fit_profile(prof)
    assert p == pytest.approx(0.25, abs=0.03)
    assert cap == pytest.approx(2.5e-3, rel=0.1)
    assert cv == pytest.approx(0.08, rel=0.02)
    # the rows are the bins of the longest next segment, each with its calls' spreads
    for r in prof["wake"][1:]:
        lo, hi = r["bin_s"]
        assert lo <= r["segment_s"] < (hi or math.inf) and r["calls"] == len(r["exit_spread_s"]) >= 8


def test_no_late_wake_ups_fit_p_zero_and_no_noise_cv_zero(tmp_path):
    prof = profile_of(plant(tmp_path, p_every=10**9, cap_s=1e-3, cv=0.0))
    # no late call planted: p 0
    (p, _), cv = fit_profile(prof)
    assert p < 0.02 and cv == pytest.approx(0.0, abs=1e-9)


def test_base_spread_is_subtracted(tmp_path):
    """A constant exit skew of the collective itself (base) is not a late wake-up."""
    d = plant(tmp_path, p_every=4, cap_s=2.5e-3, cv=0.0, base_s=3e-4)
    (p0, _), _ = fit_profile(profile_of(d))
    (p1, cap1), _ = fit_profile(profile_of(d), base_spread_s=3e-4)
    assert p1 == pytest.approx(0.25, abs=0.03) and cap1 == pytest.approx(2.5e-3, rel=0.1)
    assert p0 > p1  # without the base, the skew reads as more wake-ups


def test_warmup_and_mismatched_steps_are_left_out(tmp_path):
    d = plant(tmp_path, p_every=4, cap_s=2.5e-3, cv=0.05, steps=10)
    lines = (d / "rank-1.jsonl").read_text().splitlines()
    rec = json.loads(lines[5])
    rec["spans"] = rec["spans"][:-1]  # rank 1's step 5 lost its last call
    lines[5] = json.dumps(rec)
    (d / "rank-1.jsonl").write_text("\n".join(lines) + "\n")
    e, x, last, skipped = aligned_calls(read_spans(d, 2), warmup=2)
    assert skipped == 1 and e.shape == (2, 7 * len(NAMES)) and last.sum() == 7
    assert np.all(x >= e)
    with pytest.raises(FileNotFoundError, match="rank-2.jsonl"):
        read_spans(d, 3)


def test_reference_scenario_is_none_of_the_accuracy_shapes():
    ref = load_scenario(REFERENCE)
    assert ref.world_size == 2 and ref.routing.dispatch == "capacity_padded" and ref.parallelism.ep == 2
    shape = lambda s: (s.model.num_layers, s.model.hidden_size, s.model.num_experts, s.model.top_k,  # noqa: E731
                       s.training.micro_batch_size * s.training.seq_len)  # fmt: skip
    for f in sorted((ROOT / "scenarios" / "accuracy").glob("*.yaml")):
        assert shape(load_scenario(f)) != shape(ref), f.name
    four = load_scenario(REFERENCE, reference_overrides(4))
    assert four.world_size == 4 and four.parallelism.ep == 4
    assert BIN_EDGES_S[0] == 0 and math.isinf(BIN_EDGES_S[-1])


def test_when_calibrate_runs_the_desync_job(tmp_path):
    from hw_validate.calibrate import _desync_scenario

    pytest.importorskip("deepspeed")
    assert _desync_scenario("auto", "gloo", 2, quick=False) == REFERENCE
    assert _desync_scenario("auto", "gloo", 2, quick=True) is None
    assert _desync_scenario("auto", "nccl", 2, quick=False) is None
    assert _desync_scenario("auto", "gloo", 1, quick=False) is None
    assert _desync_scenario(None, "gloo", 2, quick=False) is None
    with pytest.raises(InputError) as e:
        _desync_scenario(str(tmp_path / "nope.yaml"), "gloo", 2, quick=False)
    assert e.value.field == "--desync-scenario"
    with pytest.raises(InputError):
        _desync_scenario(str(REFERENCE), "nccl", 2, quick=False)


def test_fit_all_takes_the_job_figures_and_keeps_the_loops(tmp_path):
    """fit_all: the desync profile's p, cap and cv replace the microbenchmarks'; both recorded."""
    from hw_validate.calibrate_fit import fit_noise, fit_wake, format_report

    prof = profile_of(plant(tmp_path, p_every=2, cap_s=4e-3, cv=0.12))
    wake_rows = [{"segment_s": s, "exit_spread_s": [0.1 * min(s, 2e-3)] * 5} for s in (0.0, 1e-3, 2e-3, 4e-3)]
    noise_rows = [{"segment_s": 1e-3, "per_rank_s": [[1e-3, 1.02e-3], [0.98e-3, 1e-3]]}]
    loops = fit_wake([dict(r) for r in wake_rows]), fit_noise([dict(r) for r in noise_rows])
    raw = _minimal_raw(wake_rows, noise_rows, prof)
    from hw_validate.calibrate_fit import fit_all

    cal = fit_all(raw, "cpu-host", {}).calibration
    assert cal.wake_delay_p == pytest.approx(0.5, abs=0.04) and cal.wake_delay_cap_s == pytest.approx(4e-3, rel=0.1)
    assert cal.compute_noise_cv == pytest.approx(0.12, rel=0.02)
    mb = cal.sweeps["desync"]["microbench"]
    assert mb["wake_delay_p"] == pytest.approx(loops[0][0]) and mb["compute_noise_cv"] == pytest.approx(loops[1])
    text = format_report(cal)
    assert "rank desync in a real job (planted" in text and "the microbenchmark loops alone" in text


def _minimal_raw(wake_rows, noise_rows, desync) -> dict:
    """A microbenchmark result with just enough to fit (no collectives, one GEMM dtype)."""
    gemm = [{"dtype": "fp32", "m": m, "n": n, "k": k, "time_s": 2 * m * n * k / 5e10 + 5e-6, "p25_s": 0.0}
            for m in (64, 256, 1024) for n in (64, 256) for k in (64, 256)]  # fmt: skip
    return {"hardware": {"device": "cpu", "backend": "gloo", "world_size": 2}, "launch": {"fwd_op_s": 5e-6},
            "memory": [{"op": "add", "elements": e, "bytes": 12 * e, "time_s": 5e-6 + 12 * e / 5e10} for e in (1e4, 1e5, 1e6)],
            "gemm": gemm, "attention": [], "optimizer": [], "comm": [], "noise": noise_rows, "wake": wake_rows,
            "desync": desync}  # fmt: skip


@pytest.mark.slow
@pytest.mark.deepspeed
def test_real_reference_job_gives_a_profile(tmp_path):
    """A short real job of the reference scenario on 2 gloo ranks: every measured step's calls are
    aligned across the ranks, and the fit's figures are in their domains."""
    import os
    import time

    from hw_validate.desync import profile_job
    from hw_validate.launch import SHM_DIR

    t0 = time.time()
    prof = profile_job(2, REFERENCE, steps=6, timeout_s=600, echo=False, spans_dir=tmp_path / "spans")
    # DeepSpeed's CPU all-reduce buffers of the job are gone with it (hw_validate.launch.remove_shm_buffers)
    left = [f for f in SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*") if f.stat().st_mtime >= t0]
    assert left == []
    # 3 MoE layers: 4 all-to-alls each, plus the gradient and optimizer reductions, per step
    per_step = prof["calls"] / (6 - load_scenario(REFERENCE).training.warmup_steps)
    assert prof["skipped_steps"] == 0 and per_step == int(per_step) and per_step >= 12 + 2
    assert sorted(p.name for p in (tmp_path / "spans").iterdir()) == ["rank-0.jsonl", "rank-1.jsonl"]
    assert prof["noise"]["cv"] is not None and 0 <= prof["noise"]["cv"] < 2
    wake, cv = fit_profile(prof)
    if wake is not None:  # too few calls in some bins of so short a job is possible
        assert 0 <= wake[0] <= 1 and 2.5e-4 <= wake[1] <= 3.2e-2
    # the stalls' fit reads the same segments (steps x calls - 1 per rank); with stalls seen the
    # noise cv is the spread without them
    pz = prof["pauses"]
    assert pz["segments"] == 2 * (prof["calls"] - (6 - load_scenario(REFERENCE).training.warmup_steps))
    if pz["rate_per_s"]:
        assert cv == pz["body_cv"] and 0 <= cv < 2 and pz["mean_s"] > PAUSE_MIN_S
    else:
        assert cv == prof["noise"]["cv"]
    assert prof["measured"]["phases_s"]["experts"] > 0 and prof["measured"]["step_time_s"] > 0


def test_wake_fit_weighs_rows_by_their_calls():
    """A bin of few calls off the model moves the fit little; with equal counts it would pull it."""
    from hw_validate.calibrate_fit import fit_wake

    p, cap = 0.4, 2e-3
    rows = [{"segment_s": 0.0, "exit_spread_s": [0.0]}]
    rows += [{"segment_s": s, "calls": 100, "exit_spread_s": [p * min(s, cap)] * 100} for s in (0.5e-3, 1e-3, 3e-3, 6e-3)]
    odd = {"segment_s": 10e-3, "exit_spread_s": [0.2e-3] * 10}
    (pw, cw) = fit_wake([*rows, {**odd, "calls": 10}])
    (pu, cu) = fit_wake([*rows, {**odd, "calls": 100, "exit_spread_s": [0.2e-3] * 100}])
    assert pw == pytest.approx(p, rel=0.1) and cw == pytest.approx(cap, rel=0.15)
    assert abs(pu * cu - p * cap) > abs(pw * cw - p * cap)


def test_remove_shm_buffers_takes_only_the_jobs_own(tmp_path):
    import os

    from hw_validate.launch import remove_shm_buffers

    uid = os.getuid()
    mine = [tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_12345_{r}" for r in (0, 1)]
    others = [tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_123456_0",
              tmp_path / f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_12345_0", tmp_path / "other_12345_0"]  # fmt: skip
    for f in mine + others:
        f.write_bytes(b"x")
    assert remove_shm_buffers(12345, tmp_path) == 2
    assert not any(f.exists() for f in mine) and all(f.exists() for f in others)
    assert remove_shm_buffers(12345, tmp_path) == 0


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
    from hw_validate.validate import predicted_phases, simulation_scenario
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
    from hw_validate.calibrate_fit import format_report
    from hw_validate.desync import compute_time, fit_compute_scale

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


def _planted_segments(rate: float, mean: float, cv: float, steps: int = 400, seed: int = 5) -> np.ndarray:
    """(2, steps, 12) segments of 1-8 ms with lognormal noise ``cv`` and Poisson stalls of
    exponential length (the simulator's model, sim.frameworks.deepspeed.apply_pauses)."""
    rng = np.random.default_rng(seed)
    base = np.linspace(1e-3, 8e-3, 12)
    sigma = math.sqrt(math.log1p(cv**2))
    seg = base * rng.lognormal(-sigma**2 / 2, sigma, (2, steps, 12))
    n = rng.poisson(rate * np.broadcast_to(base, seg.shape))
    return seg + np.array([rng.exponential(mean, k).sum() for k in n.ravel()]).reshape(seg.shape)


def test_fit_pauses_recovers_the_stalled_time_of_planted_stalls():
    """Stalls of 5 ms mean (exponential) at 15 per second over segments with a 2% body: the fit
    sees those above 1 ms, and their rate x mean -- the stalled time per second of compute -- is
    the planted one within the sampling error, the body's cv comes back without them; no stalls:
    none found."""
    from hw_validate.desync import fit_pauses, step_segments

    rate, mean = 15.0, 5e-3
    fit = fit_pauses(_planted_segments(rate, mean, 0.02))
    seen = math.exp(-1e-3 / mean)  # the share of exponential stalls above the 1 ms threshold
    assert fit["rate_per_s"] == pytest.approx(rate * seen, rel=0.1)
    assert fit["mean_s"] == pytest.approx(mean + 1e-3, rel=0.1)  # memoryless: threshold + mean
    assert fit["rate_per_s"] * fit["mean_s"] == pytest.approx(rate * mean, rel=0.12)
    assert fit["body_cv"] == pytest.approx(0.02, rel=0.25) and fit["sigma_rel"] < 0.05
    quiet = fit_pauses(_planted_segments(0.0, mean, 0.02))
    assert quiet["rate_per_s"] is None and quiet["pauses"] == 0 and quiet["body_cv"] == pytest.approx(0.02, rel=0.25)
    # step_segments: entry into call i+1 minus exit from call i within each step
    ent = np.array([[0.0, 2.0, 5.0, 10.0, 12.0, 15.0, 20.0, 22.0, 25.0]] * 2)
    ext = ent + 1.0
    last = np.array([False, False, True] * 3)
    assert step_segments(ent, ext, last).tolist() == [[[1.0, 2.0]] * 3] * 2
    assert step_segments(ent[:, :6], ext[:, :6], last[:6]) is None  # fewer than 3 steps


def test_apply_pauses_adds_rate_times_mean_of_stall_time_per_second():
    """Over many segments the stalls add rate x mean x the compute time (Poisson count, exponential
    lengths); rate 0 adds nothing; the same seed gives the same draws, and a rank's draws do not
    depend on how many ranks there are."""
    from sim.frameworks.ops import Compute
    from sim.host.cpu_ranks import apply_pauses

    def ops(world):
        return [Compute(["experts"], np.full((1, world), 4e-3), np.zeros((1, world)), "fwd", i, 0) for i in range(4000)]

    a, b = ops(2), ops(2)
    tail = apply_pauses(a, np.full(2, 0.01), 20.0, 3e-3, seed=11)
    apply_pauses(b, np.full(2, 0.01), 20.0, 3e-3, seed=11)
    added = sum(float(op.durs[:, 0].sum()) for op in a) - 4000 * 4e-3
    assert added == pytest.approx(20.0 * 3e-3 * 4000 * 4e-3, rel=0.06)
    assert all(np.array_equal(x.durs, y.durs) for x, y in zip(a, b, strict=True)) and tail[0] >= 0.01
    c = ops(3)
    apply_pauses(c, np.full(3, 0.01), 20.0, 3e-3, seed=11)
    assert all(np.array_equal(x.durs[:, :2], y.durs[:, :2]) for x, y in zip(a, c, strict=True))
    d = ops(2)
    assert np.array_equal(apply_pauses(d, np.full(2, 0.01), 0.0, 3e-3, seed=11), np.full(2, 0.01))
    assert all(np.all(op.durs == 4e-3) for op in d)


def test_validate_predicts_the_median_over_noise_draws(tmp_path):
    """With the calibrated rank noise the prediction is the median over PREDICT_DRAWS independent
    draws (the job's figure is a median over steps), step and each phase; draw 0 is what
    ``moesim simulate`` gives; the draws differ; without noise one draw is taken."""
    from hw_validate.validate import (
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
    from hw_validate.calibrate_fit import format_report
    from hw_validate.desync import BLOCKING, blocking_time, fit_call_overhead

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
