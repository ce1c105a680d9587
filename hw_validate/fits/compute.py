"""Compute fits: the GEMM roofline of :class:`sim.hardware.costs.CostModel` (``peak_TFLOPs``,
``m_half``, ``nk_half`` per dtype), the memory bandwidth of elementwise kernels (``hbm_bw_GBps``)
and attention's core efficiency against the fitted GEMM peak (``attention_efficiency``)."""

from __future__ import annotations

import math

import numpy as np

from sim.inputs.calibration import GemmFit


def gemm_model_times(params: tuple[float, float, float], shapes: np.ndarray, bpe: int, hbm_Bps: float, launch_s: float) -> np.ndarray:
    """:meth:`sim.hardware.costs.CostModel.gemm_time` for every (m, n, k) row of ``shapes``."""
    peak, m_half, nk_half = params
    m, n, k = shapes[:, 0], shapes[:, 1], shapes[:, 2]
    rate = peak * (m / (m + m_half)) * (n / (n + nk_half)) * (k / (k + nk_half))
    return np.maximum(2.0 * m * n * k / rate, bpe * (m * k + k * n + m * n) / hbm_Bps) + launch_s


def fit_gemm(rows: list[dict], bpe: int, hbm_Bps: float, launch_s: float) -> tuple[GemmFit, np.ndarray]:
    """``peak_TFLOPs``, ``m_half``, ``nk_half`` by least squares on log time."""
    from scipy.optimize import least_squares

    shapes = np.array([[r["m"], r["n"], r["k"]] for r in rows], dtype=np.float64)
    t = np.array([r["time_s"] for r in rows], dtype=np.float64)
    flops = 2.0 * shapes.prod(axis=1)
    big = flops >= np.quantile(flops, 0.75)
    peak0 = float(np.max(flops[big] / np.maximum(t[big] - launch_s, 1e-9)))

    def resid(x):
        p = (math.exp(x[0]), math.exp(x[1]) - 1.0, math.exp(x[2]) - 1.0)
        return np.log(gemm_model_times(p, shapes, bpe, hbm_Bps, launch_s)) - np.log(t)

    best = None
    for m0, nk0 in ((16.0, 16.0), (128.0, 64.0), (512.0, 256.0)):
        x0 = np.array([math.log(peak0 * 1.3), math.log(m0 + 1), math.log(nk0 + 1)])
        sol = least_squares(resid, x0, bounds=([math.log(peak0 * 0.05), 0.0, 0.0], [math.log(peak0 * 50), 12.0, 12.0]))
        if best is None or sol.cost < best.cost:
            best = sol
    assert best is not None
    peak, m_half, nk_half = math.exp(best.x[0]), math.exp(best.x[1]) - 1.0, math.exp(best.x[2]) - 1.0
    pred = gemm_model_times((peak, m_half, nk_half), shapes, bpe, hbm_Bps, launch_s)
    err = np.abs(pred / t - 1.0)
    fit = GemmFit(peak_TFLOPs=peak / 1e12, m_half=m_half, nk_half=nk_half, fit_rel_err=float(np.median(err)),
                  fit_max_rel_err=float(err.max()), points=len(t))  # fmt: skip
    return fit, pred


def fit_memory(rows: list[dict], launch_s: float) -> float:
    """Bytes/s of an elementwise kernel: least squares of ``t = launch + bytes / bw`` on relative
    error, with the launch cost fixed (``kernel_launch_us``: the simulator adds it to every kernel);
    sizes that took less than a launch say nothing about bandwidth and are left out, unless all
    did (then the bandwidth is the largest bytes / time seen: a lower bound)."""
    nbytes = np.array([r["bytes"] for r in rows], dtype=np.float64)
    t = np.array([r["time_s"] for r in rows], dtype=np.float64)
    ok = t > launch_s * 1.05
    if not ok.any():
        return float(np.max(nbytes / t))
    nb, tt = nbytes[ok], t[ok]
    # minimise sum ((launch + x nbytes) / t - 1)^2 over x = 1 / bw
    x = float(np.sum(nb * (tt - launch_s) / tt**2) / np.sum(nb**2 / tt**2))
    return 1.0 / x


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> tuple[float, float]:
    """(core FLOPs, bytes) of one causal attention forward, as :mod:`sim.frameworks.deepspeed` counts them (fp32 bytes x bpe/4)."""
    pairs = seq * (seq + 1) // 2
    return 2.0 * heads * 2 * head_dim * pairs * batch, 4.0 * batch * seq * heads * head_dim


def fit_attention(rows: list[dict], peak_Bps: dict[str, float], hbm_Bps: float, launch_s: float) -> float | None:
    """Attention-core efficiency relative to the fitted GEMM peak (forward and 2.5x backward points)."""
    from sim.frameworks.kernels import ATTENTION_BWD_FACTOR
    from sim.model.dtypes import BYTES_PER_ELEMENT

    effs = []
    for r in rows:
        peak = peak_Bps.get(r["dtype"])
        if peak is None:
            continue
        flops, io = attention_flops(r["batch"], r["heads"], r["seq"], r["head_dim"])
        io *= BYTES_PER_ELEMENT[r["dtype"]]
        for f, nb, t in ((flops, io, r["fwd_s"]), (ATTENTION_BWD_FACTOR * flops, 2 * io, r["bwd_s"])):
            compute = t - launch_s
            if compute > nb / hbm_Bps and compute > 0:
                effs.append(f / compute / peak)
    if not effs:
        return None
    return float(min(1.0, math.exp(float(np.median(np.log(effs))))))

