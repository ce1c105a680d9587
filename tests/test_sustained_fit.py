"""The sustained compute fraction (topologies/gpus/*.yaml, sim/studies/sustained_fit.py): what it scales
and what it leaves alone, that the GPU files carry the recorded fit, and the fit itself on one dense row."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from conftest import ROOT

from sim.hardware.costs import CostModel
from sim.inputs.calibration import Calibration, GemmFit
from sim.inputs.topology import load_gpu
from sim.studies import sustained_fit as SF

RECORD = ROOT / "benchmarks" / "results" / "sustained_fit.json"


def test_the_fraction_scales_gemms_and_attention_only():
    gpu = load_gpu("h100-sxm")
    half = gpu.model_copy(update={"sustained_compute_fraction": 0.5})
    burst, cost = CostModel(gpu, burst=True), CostModel(half)
    for dtype in ("bf16", "fp8"):
        for m, n, k in ((64, 2112, 7168), (8192, 14336, 4096)):
            assert cost.gemm_flops_per_s(m, n, k, dtype) == pytest.approx(
                0.5 * burst.gemm_flops_per_s(m, n, k, dtype)
            )
        assert cost.attention_flops_per_s(dtype) == pytest.approx(0.5 * burst.attention_flops_per_s(dtype))
    assert cost.hbm_Bps == burst.hbm_Bps and cost.launch_s == burst.launch_s
    assert cost.memory_time(1e9) == burst.memory_time(1e9)
    # a compute-bound GEMM takes twice as long
    assert cost.gemm_time(8192, 14336, 4096, "bf16") == pytest.approx(2 * burst.gemm_time(8192, 14336, 4096, "bf16"),
                                                                      rel=1e-3)  # fmt: skip
    # a calibration's measured curve replaces it (its compute_scale carries the in-job rate)
    cal = Calibration(gemm={"bf16": GemmFit(peak_TFLOPs=500.0, m_half=10.0, nk_half=20.0)})
    assert CostModel(half, cal).gemm_curve("bf16") == CostModel(gpu, cal).gemm_curve("bf16")
    # CPU ranks and kinds without dense runs keep 1
    assert load_gpu("h100-sxm").sustained_compute_fraction < 1
    from sim.inputs.topology import load_topology

    assert load_topology("cpu-host").gpu.sustained_compute_fraction == 1.0
    assert load_topology("dgx-a100").gpu.sustained_compute_fraction == 1.0


def test_gpu_files_carry_the_recorded_fit():
    fits = {f["kind"]: f for f in json.loads(RECORD.read_text())["fits"]}
    files = {"H100-SXM": "h100-sxm", "B200-SXM": "b200-sxm", "GB200": "gb200", "GB300": "gb300"}
    assert set(fits) == set(files)
    for kind, name in files.items():
        assert load_gpu(name).sustained_compute_fraction == fits[kind]["fraction"], name
        assert abs(statistics.median(math.log1p(r["error"]) for r in fits[kind]["rows"])) < 0.01
    # same die and power limit as H100: its figure, as the files say
    for name in ("h800-sxm", "h200-sxm"):
        assert load_gpu(name).sustained_compute_fraction == fits["H100-SXM"]["fraction"]


def test_fit_zeroes_the_error_of_one_row_and_the_step_is_monotone_in_the_fraction():
    row = [e for e in SF.dense_entries() if e["id"] == "DENSE-B200-8B"]
    slow, fast = SF.predicted_step_s(row[0], 0.6), SF.predicted_step_s(row[0], 0.9)
    assert slow > fast
    fit = SF.fit_fraction(row)
    assert fit.kind == "B200-SXM" and 0.3 < fit.fraction < 1
    assert abs(fit.rows[0]["error"]) < 0.01  # one row: the fit lands on it (to the fraction's 3 digits)
    assert fit.rows[0]["error_at_1"] < -0.1  # the microbenchmark rates alone are much too fast
