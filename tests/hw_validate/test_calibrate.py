"""``moesim calibrate``: a real quick calibration on 2 gloo CPU ranks (torchrun), its file consumed
by ``simulate``, the fitted alpha/bandwidth checked against the closed form of the simulator's
collectives and against the measured sweep, and the failure paths (bad input, a rank that dies, a
job past its timeout). Measured values are never asserted against wall-clock figures."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from sim.api import load_scenario
from sim.engine.simulate import simulate
from sim.inputs.calibration import Calibration, GemmFit, LinkFit, load_calibration, save_calibration
from tests.conftest import calibrated_scenario, run_cli

ROOT = Path(__file__).resolve().parents[2]
CPU2 = ROOT / "scenarios" / "cpu-2rank.yaml"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One real ``moesim calibrate --quick`` on 2 gloo ranks: (process, calibration path, --json doc)."""
    pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("calib")
    out, js = d / "sub" / "calib.json", d / "calib.out.json"
    proc = run_cli("calibrate", "--quick", "--nproc", "2", "--scenario", str(CPU2), "--out", str(out),
                   "--json", str(js), "--timeout", "300")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, out, json.loads(js.read_text())


@pytest.mark.slow
def test_cli_prints_table_and_fits_and_writes_a_loadable_file(quick):
    proc, out, doc = quick
    assert "algbw GB/s" in proc.stdout and "busbw GB/s" in proc.stdout
    assert "link intra: alpha" in proc.stdout and "GEMM fp32: peak" in proc.stdout
    assert "[calibrate] microbenchmarks: 2 gloo ranks" in proc.stderr  # progress while it runs
    cal = load_calibration(out)
    assert cal.format == "moesim.calibration" and cal.version == 1
    assert cal.hardware["world_size"] == 2 and cal.hardware["backend"] == "gloo"
    assert set(cal.links) == {"intra"}  # one host: no inter-node class
    intra = cal.links["intra"]
    kinds = {"all_to_all", "all_reduce", "all_gather", "reduce_scatter"}
    assert len(cal.sweeps["comm"]) == 16 and {r["kind"] for r in cal.sweeps["comm"]} == kinds
    # the link pair is fitted on the all-to-all and all-reduce sizes; all-gather and reduce-scatter
    # (sequence parallelism's entry and exit) get a bytes factor each
    assert intra.alpha_us >= 0 and intra.bw_GBps > 0 and intra.points == 8
    assert cal.collective_bytes_factor["all_gather"] > 0 and "all_gather: the link fit with" in proc.stdout
    assert cal.collective_bytes_factor["reduce_scatter"] > 0 and "reduce_scatter: the link fit with" in proc.stdout
    g = cal.gemm["fp32"]
    assert g.peak_TFLOPs > 0 and g.points == len(cal.sweeps["gemm"]) > 6
    for v in (cal.hbm_bw_GBps, cal.kernel_launch_us, cal.attention_efficiency, cal.optimizer_bytes_per_param):
        assert v is not None and math.isfinite(v) and v > 0
    # nccl-tests definitions for 2 ranks: algbw = S / t; busbw = algbw (all-reduce: 2(n-1)/n = 1),
    # algbw / 2 (all-to-all: (n-1)/n)
    for r in cal.sweeps["comm"]:
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9, rel=1e-12)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * (1.0 if r["kind"] == "all_reduce" else 0.5), rel=1e-12)
        # the fit reads the default statistic: for isolated gloo calls the mean over every call
        # (a job pays the heavy tail too), kept beside the median and quartile of the repetitions
        assert r["stat"] == "mean" and r["time_s"] == r["median_time_s"] == pytest.approx(np.mean(r["reps_s"]), rel=1e-12)
        assert r["median_rep_s"] == pytest.approx(np.median(r["reps_s"]), rel=1e-12)
        assert r["median_rep_s"] >= r["p25_s"]
    assert doc["out"] == str(out) and doc["links"]["intra"] == intra.model_dump(mode="json")
    assert doc["report"]["links"]["intra"]["bw_GBps"] == intra.bw_GBps
    # the optimizer is DeepSpeed's own ZeRO step (the scenario's stage 2), its all-gather timed apart
    opt = cal.sweeps["optimizer"]
    assert len(opt) == 2 and [r["params"] for r in opt] == sorted(r["params"] for r in opt)
    for r in opt:
        assert r["impl"] == "deepspeed" and r["zero_stage"] == 2
        assert r["time_s"] > 0 and r["comm_s"] > 0  # ZeRO-2 all-gathers the updated partitions
        # engine.backward() beyond plain autograd, for the whole local model (2 ranks: 2 partitions)
        assert r["model_params"] == 2 * r["params"] and r["grad_hooks_s"] >= 0 and r["grad_comm_s"] > 0
    assert cal.zero_grad_hook_ns_per_param is not None and cal.zero_grad_hook_overhead_us is not None
    assert "ZeRO backward beyond autograd" in proc.stdout
    # DeepSpeed's token dispatcher at the scenario's shape (256 tokens a rank, d 128, 4 experts,
    # top-2, capacity factor 1.25: C = ceil(256 * 2 / 4 * 1.25) = 160), fitted within its bounds
    (disp,) = cal.sweeps["dispatcher"]
    assert (disp["tokens"], disp["d"], disp["experts"], disp["k"], disp["capacity"]) == (256, 128, 4, 2, 160)
    for piece in ("gate", "encode", "decode"):
        assert disp[f"{piece}_fwd_s"] > 0 and disp[f"{piece}_bwd_s"] > 0
        assert disp[f"fit_{piece}_fwd_s"] > 0
    assert cal.dispatcher_op_us >= cal.kernel_launch_us and cal.dispatcher_bw_GBps <= cal.hbm_bw_GBps
    assert "token dispatcher (DeepSpeed gate, sparse encode/decode)" in proc.stdout


@pytest.mark.slow
def test_calibration_round_trips(quick, tmp_path):
    _, out, _ = quick
    cal = load_calibration(out)
    again = tmp_path / "again.json"
    save_calibration(again, cal)
    assert load_calibration(again) == cal
    assert again.read_bytes() == out.read_bytes()  # deterministic JSON, bit for bit


@pytest.mark.slow
def test_fitted_link_reproduces_the_measured_sweep(quick):
    """Re-simulating every measured size with the calibrated cluster (the path ``simulate`` takes)
    gives the closed form of the simulator's collectives on 2 ranks -- all-to-all 2 alpha + S/2 / bw,
    ring all-reduce 4 alpha + S / bw (two links per transfer), ring all-gather and reduce-scatter 2 alpha + f S/2 / bw
    with its calibrated bytes factor f -- and stays within the fit's errors."""
    from hw_validate.fits.links import bench_cluster, simulate_sweep
    from sim.hardware.calibrated import apply_link_calibration

    _, out, _ = quick
    cal = load_calibration(out)
    f = cal.links["intra"]
    rows = cal.sweeps["comm"]
    pred = simulate_sweep(apply_link_calibration(bench_cluster("cpu-host", 2), cal), rows)
    a, bw = f.alpha_us * 1e-6, f.bw_GBps * 1e9
    fag, frs = cal.collective_bytes_factor["all_gather"], cal.collective_bytes_factor["reduce_scatter"]
    closed = {"all_to_all": lambda s: 2 * a + s / 2 / bw, "all_reduce": lambda s: 4 * a + s / bw,
              "all_gather": lambda s: 2 * a + fag * s / 2 / bw, "reduce_scatter": lambda s: 2 * a + frs * s / 2 / bw}  # fmt: skip
    np.testing.assert_allclose(pred, [closed[r["kind"]](r["bytes"]) for r in rows], rtol=1e-6)
    np.testing.assert_allclose(pred, [r["fit_time_s"] for r in rows], rtol=1e-12)
    # the bytes factor is the closed-form least squares of the all-gather rows' relative error
    ag = [r for r in rows if r["kind"] == "all_gather"]
    t = np.array([r["time_s"] for r in ag])
    # (the fit splits each time into a 1-byte call and the rest: (S - 1) / 2 / bw)
    lat, byt = np.array([2 * a + 0.5 / bw for _ in ag]) / t, np.array([(r["bytes"] - 1) / 2 / bw for r in ag]) / t
    assert fag == pytest.approx(max(0.05, (byt @ (1 - lat)) / (byt @ byt)), rel=1e-9)
    link = [i for i, r in enumerate(rows) if r["kind"] in ("all_to_all", "all_reduce")]  # the link pair's rows
    err = np.abs(pred[link] / np.array([rows[i]["time_s"] for i in link]) - 1)
    assert err.max() <= f.fit_max_rel_err * (1 + 1e-9)
    assert np.median(err) == pytest.approx(f.fit_rel_err, rel=1e-9)
    # the GEMM fit's errors are those of its own predictions
    g = cal.gemm["fp32"]
    gerr = np.array([abs(r["fit_time_s"] / r["time_s"] - 1) for r in cal.sweeps["gemm"]])
    assert gerr.max() == pytest.approx(g.fit_max_rel_err, rel=1e-9)
    assert np.median(gerr) == pytest.approx(g.fit_rel_err, rel=1e-9)


def _scenario_with(cal: Calibration, d: Path, name: str = "s") -> Path:
    return calibrated_scenario(cal, d, name, base=CPU2)


def test_simulate_consumes_link_bandwidth(tmp_path):
    """Pure bandwidth (alpha 0): the padded all-to-all time is bytes / bw, so halving bw_GBps adds
    exactly a2a_bytes / bw; the grad sync doubles too."""
    res = {}
    for bw in (1.5, 0.75):
        p = _scenario_with(Calibration(links={"intra": LinkFit(alpha_us=0.0, bw_GBps=bw)}), tmp_path, f"bw{bw}")
        res[bw] = simulate(load_scenario(p))
    full, half = res[1.5], res[0.75]
    sent = full["traffic"]["a2a_bytes"]
    assert sent > 0 and half["traffic"]["a2a_bytes"] == sent
    assert full["breakdown_s"]["a2a"] == pytest.approx(sent / 1.5e9, rel=1e-9)
    assert half["breakdown_s"]["a2a"] - full["breakdown_s"]["a2a"] == pytest.approx(sent / 1.5e9, rel=1e-9)
    assert half["breakdown_s"]["grad_sync"] == pytest.approx(2 * full["breakdown_s"]["grad_sync"], rel=1e-9)
    assert half["breakdown_s"]["compute"] == full["breakdown_s"]["compute"]


def test_simulate_consumes_gemm_peak(tmp_path):
    """Launch 0 and unbounded memory bandwidth: every compute kernel is FLOP-bound at a rate
    proportional to the GEMM peak (attention at a fixed fraction of it), so doubling peak_TFLOPs
    halves the compute time; the calibrated optimizer overhead is the optimizer time."""
    res = {}
    for peak in (0.1, 0.2):
        cal = Calibration(gemm={"fp32": GemmFit(peak_TFLOPs=peak, m_half=10.0, nk_half=10.0)}, hbm_bw_GBps=1e9,
                          kernel_launch_us=0.0, attention_efficiency=0.5, optimizer_step_overhead_us=250.0)  # fmt: skip
        res[peak] = simulate(load_scenario(_scenario_with(cal, tmp_path, f"p{peak}")))
    slow, fast = res[0.1]["breakdown_s"], res[0.2]["breakdown_s"]
    assert slow["compute"] > 0
    assert fast["compute"] == pytest.approx(slow["compute"] / 2, rel=1e-6)
    assert slow["optimizer"] == pytest.approx(250e-6, rel=1e-6)
    assert fast["a2a"] == pytest.approx(slow["a2a"], rel=1e-12)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--nproc", "0"], "--nproc"),
        (["--backend", "mpi"], "--backend"),
        (["--launcher", "srun"], "--launcher"),
        (["--scenario", "no/such/scenario.yaml"], "--scenario"),
        (["--timeout", "-5"], "--timeout"),
        (["--topology", "no-such-topology"], "--topology"),
    ],
)
def test_bad_input_exits_2_naming_the_field(tmp_path, args, field):
    proc = run_cli("calibrate", "--out", str(tmp_path / "c.json"), *args)
    assert proc.returncode == 2, proc.stderr
    assert field in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "c.json").exists()


def test_unwritable_out_exits_2(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out in (blocker / "c.json", tmp_path):  # under a regular file; a folder
        proc = run_cli("calibrate", "--out", str(out))
        assert proc.returncode == 2 and "--out" in proc.stderr, proc.stderr


@pytest.mark.slow
def test_hung_job_is_stopped_at_the_timeout(tmp_path):
    pytest.importorskip("torch")
    proc = run_cli("calibrate", "--nproc", "2", "--timeout", "1", "--out", str(tmp_path / "c.json"))
    assert proc.returncode == 1
    assert "timed out after 1 s" in proc.stderr and "last lines of the job" in proc.stderr
    assert "internal error" not in proc.stderr
    assert not (tmp_path / "c.json").exists()


@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_launcher_runs_the_same_job(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "ds.json"
    proc = run_cli("calibrate", "--quick", "--launcher", "deepspeed", "--no-progress", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    cal = load_calibration(out)
    assert "deepspeed.launcher.runner" in " ".join(cal.sweeps["command"])
    assert cal.links["intra"].points == 8 and cal.gemm["fp32"].peak_TFLOPs > 0
