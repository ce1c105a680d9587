"""Fitting a GPU kind's GEMM efficiency curve to its published GEMM measurements.

A GEMM ``C[M, N] = A[M, K] @ B[K, N]`` achieves ``peak x frac x h_p(M; m_half) x h(N; n_half) x
h(K; k_half)`` (:class:`GemmCurve`). :func:`gpu_curve_params` fits ``(frac, m_half, n_half, k_half,
m_sharpness)`` per GPU description and dtype to the description's ``gemm_points`` (and its lender's):
a MAP estimate in log kernel time with a log-normal prior (see :mod:`sim.hardware.costs` for where the
curve is used, and docs/research/gemm-fit.md for the fit's residuals). The points are isolated
microbenchmarks: the curve prices a kernel as they ran it; inside a training step kernels keep
``GpuSpec.sustained_compute_fraction`` of that rate (applied by :class:`sim.hardware.costs.CostModel`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.inputs.topology import GemmPoint, GpuSpec, load_gpu
from sim.model.dtypes import BYTES_PER_ELEMENT, NVFP4_COPY_BYTES

DEFAULT_PEAK_FRACTION = 0.85
DEFAULT_M_HALF = 400.0
DEFAULT_NK_HALF = 96.0
#: (frac, m_half, n_half, k_half, m_sharpness) for kinds without GEMM measurements, and the root
#: prior of every fit
GENERIC_CURVE = (DEFAULT_PEAK_FRACTION, DEFAULT_M_HALF, DEFAULT_NK_HALF, DEFAULT_NK_HALF, 1.0)
#: Standard deviation of the log-normal prior of each fitted parameter: e^2 = 7.4x per sigma. The
#: points set what they determine (the level, m_half, the knee); the halves of N and K, which few
#: published sweeps vary, stay near the prior (tests/test_costs.py shows both).
PRIOR_SIGMA = 2.0
#: Bounds of the fit: frac in [0.01, 1], halves in [1, 1e6], m_sharpness in [1, 8].
_FIT_LOW, _FIT_HIGH = np.log([0.01, 1.0, 1.0, 1.0, 1.0]), np.log([1.0, 1e6, 1e6, 1e6, 8.0])
Params = tuple[float, float, float, float, float]
#: A dtype without a curve of its own on a GPU starts from this dtype's curve of the same GPU.
RELATED_DTYPE = {"fp16": "bf16", "tf32": "bf16", "fp32": "bf16", "fp8": "bf16", "mxfp8": "fp8", "nvfp4": "mxfp8"}
#: Achieved fraction of datasheet HBM bandwidth for streaming kernels where the GPU gives none.
DEFAULT_HBM_EFFICIENCY = 0.90


def _h(x, c):
    """``x / (x + c)`` on a number (0 for x <= 0) or on an array of positive sizes."""
    if isinstance(x, np.ndarray):
        return x / (x + c)
    return x / (x + c) if x > 0 else 0.0


def _h_p(x, c, p: float):
    """``x / (x^p + c^p)^(1/p)`` (``p = 1``: exactly :func:`_h`), written ``(1 + (c/x)^p)^(-1/p)``."""
    if p == 1.0:
        return _h(x, c)
    if isinstance(x, np.ndarray):
        return (1.0 + (c / x) ** p) ** (-1.0 / p)
    return (1.0 + (c / x) ** p) ** (-1.0 / p) if x > 0 else 0.0


GROUPED = ":grouped"  #: suffix of a dtype key naming its grouped-GEMM curve (``"mxfp8:grouped"``)


def bytes_per_element(dtype: str) -> float:
    """Operand bytes per element; MXFP8 adds one E8M0 scale per 32 elements (OCP MX format), NVFP4 one
    E4M3 scale per 16 (:data:`~sim.model.dtypes.NVFP4_COPY_BYTES`)."""
    dtype = dtype.removesuffix(GROUPED)
    if dtype == "nvfp4":
        return NVFP4_COPY_BYTES
    return 1.0 + 1.0 / 32.0 if dtype == "mxfp8" else BYTES_PER_ELEMENT[dtype]


@dataclass(frozen=True)
class GemmCurve:
    """Achieved FLOP/s of a GEMM by shape: ``peak_flops x h_p(M; m_half) x h(N; n_half) x h(K; k_half)``,
    ``peak_flops`` being the achieved asymptote (datasheet peak x frac, or a calibrated peak)."""

    peak_flops: float
    m_half: float
    n_half: float
    k_half: float
    m_sharpness: float = 1.0

    def rate(self, m, n, k):
        """FLOP/s of an (m x k) @ (k x n) GEMM; any of m, n, k may be an array of positive sizes."""
        h_m = _h_p(m, self.m_half, self.m_sharpness)
        return self.peak_flops * h_m * _h(n, self.n_half) * _h(k, self.k_half)


# ---- fitting a GPU's curves to its public measurements ------------------------------------------
def _gpu_hbm_Bps(gpu: GpuSpec) -> float:
    eff = gpu.hbm_efficiency if gpu.hbm_efficiency is not None else DEFAULT_HBM_EFFICIENCY
    return gpu.hbm_bw_GBps * 1e9 * eff


@dataclass(frozen=True)
class FitPoint:
    """A GEMM point with the GPU it ran on: its datasheet peak, achieved HBM bandwidth and launch."""

    point: GemmPoint
    peak_flops: float
    hbm_Bps: float
    launch_s: float


def fit_gemm_curve(points: list[FitPoint], prior: Params, sigma: float = PRIOR_SIGMA) -> Params:
    """(frac, m_half, n_half, k_half, m_sharpness) fitted to ``points`` (one dtype): least squares in
    log time of ``max(2MNK / (peak x frac x h_p h h), bytes / hbm) + launch`` (each point with its
    own GPU's figures) plus ``((log x - log prior) / sigma)^2`` per parameter; started at the prior,
    rounded to 4 significant digits."""
    from scipy.optimize import least_squares

    def col(get) -> np.ndarray:
        return np.array([get(f) for f in points], dtype=np.float64)

    m, n, k = col(lambda f: f.point.M), col(lambda f: f.point.N), col(lambda f: f.point.K)
    peak, launch = col(lambda f: f.peak_flops), col(lambda f: f.launch_s)
    flops = 2.0 * m * n * k
    log_t = np.log(flops / (col(lambda f: f.point.TFLOPs) * 1e12))
    mem_s = (
        col(lambda f: bytes_per_element(f.point.dtype)) * (m * k + k * n + m * n) / col(lambda f: f.hbm_Bps)
    )
    x0 = np.log(np.asarray(prior, dtype=np.float64))

    def residuals(x: np.ndarray) -> np.ndarray:
        frac, mh, nh, kh, p = np.exp(x)
        rate = peak * frac * (1.0 + (mh / m) ** p) ** (-1.0 / p) * (n / (n + nh)) * (k / (k + kh))
        model = np.maximum(flops / rate, mem_s) + launch
        return np.concatenate([np.log(model) - log_t, (x - x0) / sigma])

    start = np.clip(x0, _FIT_LOW + 1e-9, _FIT_HIGH - 1e-9)
    sol = least_squares(
        residuals, start, bounds=(_FIT_LOW, _FIT_HIGH), method="trf", xtol=1e-12, ftol=1e-12, gtol=1e-12
    )
    frac, mh, nh, kh, p = (float(f"{v:.4g}") for v in np.exp(sol.x))
    return frac, mh, nh, kh, p


def _lender(gpu: GpuSpec, dtype: str) -> GpuSpec | None:
    ref = gpu.gemm_points_from.get(dtype)  # type: ignore[call-overload]
    return None if ref is None else ref if isinstance(ref, GpuSpec) else load_gpu(ref)


def fit_points(gpu: GpuSpec, dtype: str, grouped: bool = False) -> list[FitPoint]:
    """The points ``gpu``'s curve for ``dtype`` is fitted to: its own, then those of the GPU that
    ``gemm_points_from`` names for the dtype (recursively), each with the figures of its own GPU; dense
    points, or with ``grouped`` the grouped-GEMM ones."""
    own = [
        FitPoint(p, gpu.peak_flops(dtype), _gpu_hbm_Bps(gpu), gpu.kernel_launch_us * 1e-6)
        for p in gpu.gemm_points
        if p.dtype == dtype and p.grouped == grouped
    ]
    lender = _lender(gpu, dtype)
    return own + (fit_points(lender, dtype, grouped) if lender is not None else [])


def _prior_params(gpu: GpuSpec, dtype: str) -> Params:
    lender = _lender(gpu, dtype)
    if lender is not None:
        return _prior_params(lender, dtype)
    related = RELATED_DTYPE.get(dtype)
    if related is not None:
        return gpu_curve_params(gpu, related)
    return GENERIC_CURVE


_FITTED: dict[tuple[str, str, bool], Params] = {}


def gpu_curve_params(gpu: GpuSpec, dtype: str, grouped: bool = False) -> Params:
    """(frac, m_half, n_half, k_half, m_sharpness) of ``gpu`` for ``dtype``: fitted to :func:`fit_points` on the
    prior (see the module docstring); the prior itself where there are none. ``grouped``: the grouped-GEMM
    curve, fitted to the grouped points on the dense curve's parameters as prior. Cached per description."""
    key = (gpu.model_dump_json(exclude={"sustained_compute_fraction"}), dtype, grouped)  # the fit ignores it
    hit = _FITTED.get(key)
    if hit is None:
        points = fit_points(gpu, dtype, grouped)
        prior = gpu_curve_params(gpu, dtype) if grouped else _prior_params(gpu, dtype)
        hit = _FITTED[key] = fit_gemm_curve(points, prior) if points else prior
    return hit


def has_grouped_points(gpu: GpuSpec, dtype: str) -> bool:
    """Whether ``gpu`` (or its lender for ``dtype``) publishes grouped-GEMM points of ``dtype``."""
    return bool(fit_points(gpu, dtype, grouped=True))


__all__ = [
    "DEFAULT_HBM_EFFICIENCY",
    "GENERIC_CURVE",
    "GROUPED",
    "PRIOR_SIGMA",
    "RELATED_DTYPE",
    "FitPoint",
    "GemmCurve",
    "Params",
    "bytes_per_element",
    "fit_gemm_curve",
    "fit_points",
    "gpu_curve_params",
    "has_grouped_points",
]
