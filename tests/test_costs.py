"""GPU cost defaults from public measurements (sim/hardware/costs.py, topologies/gpus/*.yaml): the fitted
GEMM curves reproduce every published point within a stated tolerance, the fit is deterministic, kinds
without points borrow as their files say, CPU ranks keep the generic constants, a calibration overrides."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import ROOT

from sim.hardware import gemm_fit
from sim.hardware.costs import (
    GENERIC_CURVE,
    CostModel,
    FitPoint,
    GemmCurve,
    fit_gemm_curve,
    gemm_fit_report,
    gpu_curve_params,
)
from sim.inputs.calibration import Calibration, GemmFit
from sim.inputs.topology import GemmPoint, available_gpus, load_gpu, load_topology

#: Every published point within this factor of the fitted model (|log ratio| <= ln 1.42 = 0.35): the
#: spread between libraries at one shape (DeepGEMM vs cuBLAS vs CUTLASS FP8) is of this size.
POINT_TOLERANCE = 0.35
#: Root-mean-square log ratio per GPU kind and dtype (a model 20% off on average at most).
RMS_TOLERANCE = 0.20
GEMM_FIT_DOC = ROOT / "docs" / "research" / "gemm-fit.md"


@pytest.fixture(scope="module")
def gpus():
    return {name: load_gpu(name) for name in available_gpus()}


def residual_table(gpus) -> str:
    """The table of docs/research/gemm-fit.md: every point, measured vs the default cost model."""
    lines = [
        "| GPU | dtype | M | N | K | measured TFLOP/s | model TFLOP/s | log(measured / model) | kernel |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for gpu in gpus.values():
        for r in gemm_fit_report(gpu):
            lines.append(
                f"| {gpu.kind} | {r['dtype']}{' grouped' if r['grouped'] else ''} | {r['M']} | {r['N']} | {r['K']} | {r['TFLOPs']:g} | "
                f"{r['model_TFLOPs']:.1f} | {r['log_ratio']:+.2f} | {r['kernel']} |"
            )
    return "\n".join(lines)


def summary_table(gpus) -> str:
    """Per GPU kind and dtype: the fitted curve, the points it saw, and the residuals of its own points."""
    lines = [
        "| GPU | dtype | frac | m_half | n_half | k_half | m_sharpness | asymptote TFLOP/s | points fitted (own) "
        "| RMS log | max abs log |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for gpu in gpus.values():
        report = gemm_fit_report(gpu)
        for dtype, grouped in (("bf16", False), ("fp8", False), ("mxfp8", False), ("mxfp8", True), ("nvfp4", False)):
            if dtype not in gpu.peak_TFLOPs or (grouped and not gemm_fit.has_grouped_points(gpu, dtype)):
                continue
            if not grouped and dtype in (gpu.gemm_rate_over_fp8 or {}):
                continue  # a block-scaled format priced as the FP8 curve x its measured ratio
            frac, mh, nh, kh, p = gpu_curve_params(gpu, dtype, grouped)
            own = np.array([r["log_ratio"] for r in report if r["dtype"] == dtype and r["grouped"] == grouped])
            fitted = len(gemm_fit.fit_points(gpu, dtype, grouped))
            rms = f"{math.sqrt(float(np.mean(own**2))):.3f}" if len(own) else "-"
            worst = f"{float(np.abs(own).max()):.3f}" if len(own) else "-"
            lines.append(
                f"| {gpu.kind} | {dtype}{' grouped' if grouped else ''} | {frac:g} | {mh:g} | {nh:g} | {kh:g} | {p:g} | "
                f"{frac * gpu.peak_TFLOPs[dtype]:.0f} | {fitted} ({len(own)}) | {rms} | {worst} |"
            )
    return "\n".join(lines)


def test_fitted_model_reproduces_every_public_point(gpus):
    worst = []
    for gpu in gpus.values():
        report = gemm_fit_report(gpu)
        for dtype in {r["dtype"] for r in report}:
            logs = np.array([r["log_ratio"] for r in report if r["dtype"] == dtype])
            assert math.sqrt(float(np.mean(logs**2))) <= RMS_TOLERANCE, (gpu.kind, dtype, logs)
        worst += [(abs(r["log_ratio"]), gpu.kind, r) for r in report]
    bad = [w for w in worst if w[0] > POINT_TOLERANCE]
    assert not bad, bad
    assert len(worst) == 87  # every point of topologies/gpus/ was checked


def test_residuals_are_the_ones_documented(gpus):
    """docs/research/gemm-fit.md shows the fit as it is: its two tables are what the code gives now."""
    doc = GEMM_FIT_DOC.read_text()
    for table in (summary_table(gpus), residual_table(gpus)):
        assert table in doc, "docs/research/gemm-fit.md is stale; its table should read:\n" + table


def test_fit_is_deterministic_and_order_free(gpus):
    for gpu in gpus.values():
        for dtype in {p.dtype for p in gpu.gemm_points}:
            gemm_fit._FITTED.clear()
            first = gpu_curve_params(gpu, dtype)
            gemm_fit._FITTED.clear()
            assert gpu_curve_params(gpu, dtype) == first
            gemm_fit._FITTED.clear()
            reordered = gpu.model_copy(update={"gemm_points": list(reversed(gpu.gemm_points))})
            assert gpu_curve_params(reordered, dtype) == first


def test_fit_recovers_a_curve_it_generated():
    """Points made by a known curve (compute-bound, no launch) give that curve back, to rounding, once
    the prior's pull is negligible (sigma 100); started at that curve, the default fit stays there."""
    truth = (0.7, 250.0, 300.0, 600.0, 1.5)
    peak = 1000e12
    pts = []
    for m in (64, 256, 1024, 8192):
        for n, k in ((1024, 512), (4096, 7168), (16384, 2048)):
            h_m = (1 + (truth[1] / m) ** truth[4]) ** (-1 / truth[4])
            rate = peak * truth[0] * h_m * n / (n + truth[2]) * k / (k + truth[3])
            p = GemmPoint(M=m, N=n, K=k, dtype="bf16", TFLOPs=rate / 1e12, kernel="synthetic", source="test")
            pts.append(FitPoint(p, peak, 1e30, 0.0))
    assert fit_gemm_curve(pts, GENERIC_CURVE, sigma=100.0) == pytest.approx(truth, rel=2e-3)
    assert fit_gemm_curve(pts, truth) == truth


def test_kinds_without_points_borrow_as_their_files_say(gpus):
    h100, h800, h200 = gpus["h100-sxm"], gpus["h800-sxm"], gpus["h200-sxm"]
    # H800 and H200 BF16: H100's curve, fitted to H100's points, at their own peaks
    assert gpu_curve_params(h800, "bf16") == gpu_curve_params(h100, "bf16") == gpu_curve_params(h200, "bf16")
    a, b = CostModel(h100).gemm_curve("bf16"), CostModel(h800).gemm_curve("bf16")
    assert b.rate(512, 7168, 2048) / a.rate(512, 7168, 2048) == pytest.approx(990 / 989)
    # FP16 has no points anywhere: each GPU's BF16 curve; MXFP8 on GB200: B200's points, at GB200's peak
    assert gpu_curve_params(h100, "fp16") == gpu_curve_params(h100, "bf16")
    assert gpu_curve_params(gpus["gb200"], "mxfp8") == gpu_curve_params(gpus["b200-sxm"], "mxfp8")
    # H200 FP8: H100's points and its own; they see the GPU each ran on
    assert len(gemm_fit.fit_points(h200, "fp8")) == 1 + len(gemm_fit.fit_points(h100, "fp8"))
    assert {f.hbm_Bps for f in gemm_fit.fit_points(h200, "fp8")} == {4320e9, 3015e9}


def test_cpu_ranks_and_inline_specs_keep_the_generic_constants():
    for name in ("cpu-host", "dgx-a100"):
        gpu = load_topology(name).gpu
        cost = CostModel(gpu)
        for dtype in ("fp32", "bf16"):
            assert cost.gemm_curve(dtype) == GemmCurve(gpu.peak_flops(dtype) * 0.85, 400.0, 96.0, 96.0, 1.0)
        m, n, k = 300.0, 200.0, 100.0
        rate = gpu.peak_flops("fp32") * 0.85 * (m / (m + 400)) * (n / (n + 96)) * (k / (k + 96))
        hbm = gpu.hbm_bw_GBps * 1e9 * 0.90
        want = max(2 * m * n * k / rate, 4 * (m * k + k * n + m * n) / hbm) + gpu.kernel_launch_us * 1e-6
        assert cost.gemm_time(m, n, k, "fp32") == want  # bit for bit: CPU scenarios did not move
        att = 1e9
        assert cost.attention_time(att, 0.0, "fp32") == att / (gpu.peak_flops("fp32") * 0.85 * 0.65) + (
            gpu.kernel_launch_us * 1e-6
        )


def test_attention_uses_the_gpus_measured_figure(gpus):
    h100 = CostModel(gpus["h100-sxm"], burst=True)  # the figure as measured (a kernel alone)
    combined = 3.5 / (1 / 579 + 2.5 / 542) * 1e12  # FA3 forward and backward, backward at 2.5x the FLOPs
    assert h100.attention_flops_per_s("bf16") == pytest.approx(combined)
    # FP8 training keeps the attention core in BF16
    assert h100.attention_flops_per_s("fp8") == h100.attention_flops_per_s("bf16")
    assert h100.attention_flops_per_s("fp32") == pytest.approx(combined * 67 / 989)
    b200 = CostModel(gpus["b200-sxm"], burst=True)
    assert b200.attention_flops_per_s("bf16") == pytest.approx(combined * 1.88, rel=1e-3)


def test_calibration_overrides_each_default_it_measured(gpus):
    gpu = gpus["h100-sxm"]
    cal = Calibration(gemm={"bf16": GemmFit(peak_TFLOPs=500.0, m_half=10.0, nk_half=20.0)}, hbm_bw_GBps=1000.0,
                      kernel_launch_us=7.0, attention_efficiency=0.5)  # fmt: skip
    cost = CostModel(gpu, cal)
    assert cost.gemm_curve("bf16") == GemmCurve(500e12, 10.0, 20.0, 20.0)
    assert cost.hbm_Bps == 1000e9 and cost.launch_s == pytest.approx(7e-6)
    assert cost.attention_flops_per_s("bf16") == pytest.approx(500e12 * 0.5)  # of the calibrated GEMM peak
    # a dtype the calibration did not measure keeps the GPU's fitted curve
    assert cost.gemm_curve("fp8") == CostModel(gpu).gemm_curve("fp8")
    # without a calibrated attention efficiency, the GPU's measured attention figure stays
    only_gemm = CostModel(gpu, Calibration(gemm=cal.gemm))
    assert only_gemm.attention_flops_per_s("bf16") == CostModel(gpu).attention_flops_per_s("bf16")


def test_mxfp8_gemms_price_their_scales(gpus):
    b200 = CostModel(gpus["b200-sxm"], Calibration(gemm={d: GemmFit(peak_TFLOPs=4500.0, m_half=1.0, nk_half=1.0)
                                                         for d in ("fp8", "mxfp8")}))  # fmt: skip
    m, n, k = 64.0, 4096.0, 4096.0  # memory-bound at this M: the same curve, more bytes
    nbytes = m * k + k * n + m * n
    extra = b200.gemm_time(m, n, k, "mxfp8") - b200.gemm_time(m, n, k, "fp8")
    assert extra == pytest.approx(nbytes / 32 / b200.hbm_Bps)
