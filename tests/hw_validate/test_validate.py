"""``moesim validate``: the real DeepSpeed job on 2 gloo CPU ranks against the simulator.

Span-to-phase mapping and errors are checked against hand-computed values; the real runs check the
result against an independent read of the Measurement and an independent ``simulate`` of the same
scenario (calibration + replayed trace), not against themselves."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hw_validate.validate import compare
from sim.inputs.calibration import Calibration, GemmFit, LinkFit, save_calibration

ROOT = Path(__file__).resolve().parents[2]
CPU2 = ROOT / "scenarios" / "cpu-2rank.yaml"
STEPS = "3"


def _cli(*args: str, env_extra: dict[str, str] | None = None, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "sim", "validate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("cal") / "cal.json"
    save_calibration(p, Calibration(
        hardware={"device": "cpu", "backend": "gloo", "world_size": 2},
        gemm={"fp32": GemmFit(peak_TFLOPs=0.05, m_half=8.0, nk_half=8.0)},
        hbm_bw_GBps=5.0, kernel_launch_us=10.0, attention_efficiency=0.3,
        links={"intra": LinkFit(alpha_us=100.0, bw_GBps=1.0)},
    ))  # fmt: skip
    return p


# ---- pure parts: closed forms -------------------------------------------------------------------
def test_compare_relative_errors_and_worst_phase(monkeypatch):
    from hw_validate import validate as v

    names = ["step", "experts", "combine", "dispatch"]
    monkeypatch.setattr(v, "ORDER", tuple(names))
    band = dict.fromkeys(names, 0.0)
    meas = {"step_time_s": 2.0, "phases_s": dict(zip(names, [2.0, 1.0, 0.5, 0.0], strict=True)), "p10_s": band, "p90_s": band}
    pred = {"step_time_s": 1.5, "phases_s": dict(zip(names, [1.5, 0.9, 0.8, 0.0], strict=True))}
    err, rows = compare(meas, pred)
    assert err["step_time_rel"] == pytest.approx(-0.25)
    assert err["phases_rel"]["experts"] == pytest.approx(-0.1) and err["phases_rel"]["combine"] == pytest.approx(0.6)
    assert "dispatch" not in err["phases_rel"]  # 0 measured and 0 predicted: not a row
    assert err["worst_phase"] == "combine" and err["worst_phase_abs_s"] == pytest.approx(0.3)
    assert [r["phase"] for r in rows] == ["step", "experts", "combine"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["scenarios/nope.yaml"], "scenarios/nope.yaml"),
        ([str(CPU2), "--calibration", "/nonexistent/cal.json"], "calibration file not found"),
        ([str(CPU2), "--steps", "0"], "--steps"),
        ([str(CPU2), "--set", "model.top_k=99"], "model"),
    ],
)
def test_bad_input_exits_2_before_any_job(args, needle):
    p = _cli(*args, timeout=60)
    assert p.returncode == 2, p.stdout + p.stderr
    assert needle in p.stderr and "Traceback" not in p.stderr


# ---- real jobs ------------------------------------------------------------------------------------
@pytest.mark.deepspeed
@pytest.mark.slow
def test_real_validate_with_calibration_and_reuse(tmp_path, calib):
    pytest.importorskip("deepspeed")
    from hw_validate.measurement import load_measurement
    from hw_validate.phases import predicted_phases as phases_of
    from hw_validate.phases import simulation_scenario
    from sim.engine.simulate import simulate

    keep, out = tmp_path / "keep", tmp_path / "v.json"
    p = _cli(str(CPU2), "--calibration", str(calib), "--steps", STEPS, "--keep", str(keep), "--quiet", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "quick calibration" not in p.stdout and not (keep / "calibration.json").exists()
    r = json.loads(out.read_text())
    assert {"measured", "predicted", "error"} <= set(r) and "step_time_rel" in r["error"]
    meas = load_measurement(keep / "measurement.json")  # independent read of what the job measured
    assert r["measured"]["step_time_s"] == meas["timing"]["summary"]["step"]["median"] > 0
    assert r["measured"]["phases_s"]["experts"] == meas["timing"]["summary"]["experts"]["median"]
    s = simulation_scenario(CPU2, [], calib, keep / "router_trace.json")  # independent simulation
    sim = simulate(s, trace_ranks={0, 1})
    assert r["predicted"]["step_time_s"] == pytest.approx(sim["step_time_s"], rel=1e-12)
    assert r["predicted"]["phases_s"]["experts_bwd"] == pytest.approx(phases_of(sim["_spans"], 2)["experts_bwd"])
    m, q = r["measured"]["step_time_s"], r["predicted"]["step_time_s"]
    assert r["error"]["step_time_rel"] == pytest.approx((q - m) / m)
    leaves = {"attention", "route", "experts", "dispatch", "combine", "attention_bwd", "experts_bwd", "grad_sync"}
    assert leaves <= set(r["error"]["phases_rel"])
    assert all(math.isfinite(r["error"]["phases_rel"][k]) for k in leaves)
    for k in ("step", "experts", "dispatch"):
        assert f"\n{k} " in p.stdout  # the human table
    assert "step time error" in p.stdout and (keep / "validation.json").is_file()
    # same scenario and steps in --keep: the measurement is reused, the prediction is the same
    p2 = _cli(str(CPU2), "--calibration", str(calib), "--steps", STEPS, "--keep", str(keep), "--json", "-")
    assert p2.returncode == 0, p2.stderr
    assert "reusing the finished measurement" in p2.stderr
    r2 = json.loads(p2.stdout)
    assert r2["reused_measurement"] and r2["predicted"] == r["predicted"] and r2["measured"] == r["measured"]


@pytest.mark.deepspeed
@pytest.mark.slow
def test_without_calibration_it_uses_the_cached_one_refitted(tmp_path):
    """No --calibration: the cached full calibration of this machine (seeded here with the committed
    record's, keyed by this machine's facts) with its in-job figures refitted on a reference job."""
    pytest.importorskip("deepspeed")
    from hw_validate.calibration_cache import cache_key, cached_path, machine_facts
    from sim.inputs.calibration import load_calibration

    env = {"MOESIM_CACHE_DIR": str(tmp_path / "cache")}
    os.environ.update(env)
    try:
        facts = machine_facts("gloo", 2)
        seeded = load_calibration(ROOT / "benchmarks" / "accuracy" / "cpu-2rank-gloo.calibration.json")
        seeded.hardware["cache"] = {"facts": facts, "key": cache_key(facts), "created_unix_s": 0.0}
        cached = cached_path(facts)
        cached.parent.mkdir(parents=True)
        save_calibration(cached, seeded)
    finally:
        for k in env:
            os.environ.pop(k)
    keep = tmp_path / "keep"
    p = _cli(str(CPU2), "--steps", "2", "--keep", str(keep), "--quiet", "--launcher", "torchrun", env_extra=env)
    assert p.returncode == 0, p.stderr
    assert f"the cached full calibration of this machine ({cached})" in p.stdout and "refitting" in p.stdout
    r = json.loads((keep / "validation.json").read_text())
    cal_info = r["calibration"]
    assert cal_info["cached"] == str(cached) and cal_info["refit"] and not cal_info["computed"]
    assert cal_info["file"] == str(keep / "calibration.json")
    used = load_calibration(keep / "calibration.json")
    # the microbenchmark fits are the cached ones; the in-job figures come from the reference job run now
    assert used.gemm == seeded.gemm and used.links == seeded.links
    assert used.sweeps["refit"]["job_wall_s"] > 0 and used.sweeps["desync"]["calls"] > 0
    assert used.compute_scale != seeded.compute_scale
    assert "cached full calibration of this machine, in-job figures refitted now" in p.stdout
    assert math.isfinite(r["error"]["step_time_rel"])


@pytest.mark.deepspeed
@pytest.mark.slow
def test_a_dying_rank_is_a_clear_error_and_nothing_is_written(tmp_path, calib):
    pytest.importorskip("deepspeed")
    keep, out = tmp_path / "keep", tmp_path / "v.json"
    p = _cli(str(CPU2), "--calibration", str(calib), "--steps", STEPS, "--keep", str(keep), "--quiet",
             "--launcher", "torchrun", "--json", str(out),
             env_extra={"MOESIM_KILL_RANK": "1", "MOESIM_KILL_AT_STEP": "1"})  # fmt: skip
    assert p.returncode == 1
    first = p.stderr.splitlines()[0]
    assert first.startswith("moesim: error: the real job failed:") and "rank 1 exited with status 1 at step 1" in first
    assert "fault injection" in p.stderr and "Traceback" not in p.stderr  # the rank's last log lines
    assert not out.exists() and not (keep / "validation.json").exists() and not (keep / "measurement.json").exists()


# ---- the GPU script (cannot run here: its dry run) ----------------------------------------------
def test_gpu_check_dry_run_prints_the_session(tmp_path):
    script = ROOT / "hw_validate" / "gpu_check.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    p = subprocess.run(["bash", str(script), str(tmp_path / "out"), "--dry-run", "--ngpus", "8", "--wheels", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    status = (tmp_path / "out" / "status.txt").read_text()
    gpu = sorted((ROOT / "scenarios" / "accuracy" / "gpu").glob("*.yaml"))
    assert len(gpu) >= 2
    assert "--no-index --find-links" in status and "calibrate --backend nccl --nproc 8" in status
    for s in gpu:  # every GPU scenario validated on 8 GPUs with EP8, against the one calibration
        line = next(x for x in status.splitlines() if "validate" in x and s.name in x)
        assert "parallelism.ep=8" in line and "--nproc 8" in line and "calibration.json" in line
    assert "bench_accuracy.py --collect" in status
    # the kernel probe runs first, on one GPU; its plan (no GPU needed) is checked and kept by the dry run
    lines = status.splitlines()
    probe = next(i for i, x in enumerate(lines) if "hw_validate.gpu_kernels --out" in x)
    assert probe < next(i for i, x in enumerate(lines) if "calibrate --backend nccl" in x)
    assert "kernel probe plan in" in status and "FAILED" not in status
    plan = json.loads((tmp_path / "out" / "gpu_kernels" / "gpu_kernels.json").read_text())
    assert plan["dry_run"] and plan["rows"]
    bad = subprocess.run(["bash", str(script), str(tmp_path / "o2"), "--ngpus", "x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--ngpus must be a number" in bad.stderr
