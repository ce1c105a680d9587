"""Kernel cost model: pure functions from FLOPs and bytes to seconds on one device.

Roofline: ``t = launch + max(FLOPs / achieved_FLOPs, bytes / HBM_bw)``. The achieved throughput of a
GEMM ``C[M, N] = A[M, K] @ B[K, N]`` depends on its shape (:class:`GemmCurve`):
``peak x frac x h_p(M; m_half) x h(N; n_half) x h(K; k_half)`` with ``h(x; c) = x / (x + c)`` and
``h_p(x; c) = x / (x^p + c^p)^(1/p)`` (``p`` = ``m_sharpness``; 1 is the hyperbola, larger p a
sharper knee: measured throughput rises about linearly in M until the tiles fill, then stays flat):
small-M expert GEMMs and small-K GEMMs reach a fraction of the peak.

Where each figure comes from, the first that applies:

1. a calibration file (:mod:`sim.inputs.calibration`), field by field: ``gemm[dtype]`` (its achieved
   peak with ``frac`` 1, ``n_half = k_half = nk_half``, ``p`` 1), ``attention_efficiency`` (of that
   GEMM peak), ``hbm_bw_GBps``, ``kernel_launch_us``;
2. the GPU description's public measurements (``topologies/gpus/*.yaml``): the curve fitted per dtype
   to its ``gemm_points`` (:func:`fit_gemm_curve`), its ``attention`` figure, its ``hbm_efficiency``;
3. generic constants for kinds without measurements (CPU ranks, A100, inline specs): ``frac`` 0.85,
   ``m_half`` 400, ``n_half = k_half`` 96, ``p`` 1, attention at 0.65 of the GEMM peak, 90% of HBM.

The fit is a MAP estimate: least squares in log kernel time (this module's roofline, launch included)
over the GPU's points of that dtype, plus a pull of each log-parameter toward a prior curve with
standard deviation :data:`PRIOR_SIGMA`. The points are the GPU's own and, where ``gemm_points_from``
names a GPU description for the dtype, that one's (each priced with the figures of the GPU it ran
on, so the curve is fitted in fractions of peak): a kind without measurements of a dtype borrows
another's curve, at its own peak (H800's BF16 is H100's), and a kind with a few own points is
fitted with its lender's (GB200's best shapes with B200's sweeps). The prior is this GPU's curve of
a related dtype (:data:`RELATED_DTYPE`: FP8 starts from BF16's shape, MXFP8 from FP8's), else the
generic constants. Parameters are rounded to 4 significant digits, so one description gives one
curve, bit for bit. Fit residuals per point: docs/research/gemm-fit.md (checked by tests/test_costs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from sim.inputs.calibration import Calibration
from sim.inputs.topology import GemmPoint, GpuSpec, load_gpu
from sim.model.dtypes import BYTES_PER_ELEMENT

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
RELATED_DTYPE = {"fp16": "bf16", "tf32": "bf16", "fp32": "bf16", "fp8": "bf16", "mxfp8": "fp8"}
#: Attention-core throughput relative to the achieved GEMM peak, for kinds without an attention
#: figure: 0.55 / 0.85 of the datasheet peak (FA3 on H100: 0.52-0.59 forward, gpu-figures.md section 3).
DEFAULT_ATTENTION_EFFICIENCY = 0.65
#: FlashAttention's backward runs 2.5x the forward FLOPs (as sim.frameworks.kernels.ATTENTION_BWD_FACTOR):
#: the weight of the backward figure when forward and backward make one rate.
ATTENTION_BWD_FLOPS = 2.5
#: FP8 and MXFP8 training keep the attention core in BF16 (TransformerEngine's recipes without fp8_dpa).
ATTENTION_DTYPE = {"fp8": "bf16", "mxfp8": "bf16"}
#: Achieved fraction of datasheet HBM bandwidth for streaming kernels where the GPU gives none.
DEFAULT_HBM_EFFICIENCY = 0.90
#: Adam with fp32 master weights and moments: read grad (4), master (4), m (4), v (4); write
#: master, m, v (12) and the low-precision weight (2) -> ~30 B/param, rounded up for launches/casts.
DEFAULT_OPTIMIZER_BYTES_PER_PARAM = 32.0


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


def bytes_per_element(dtype: str) -> float:
    """Operand bytes per element; MXFP8 adds one E8M0 scale per 32 elements (OCP MX format)."""
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


def fit_points(gpu: GpuSpec, dtype: str) -> list[FitPoint]:
    """The points ``gpu``'s curve for ``dtype`` is fitted to: its own, then those of the GPU that
    ``gemm_points_from`` names for the dtype (recursively), each with the figures of its own GPU."""
    own = [
        FitPoint(p, gpu.peak_flops(dtype), _gpu_hbm_Bps(gpu), gpu.kernel_launch_us * 1e-6)
        for p in gpu.gemm_points
        if p.dtype == dtype
    ]
    lender = _lender(gpu, dtype)
    return own + (fit_points(lender, dtype) if lender is not None else [])


def _prior_params(gpu: GpuSpec, dtype: str) -> Params:
    lender = _lender(gpu, dtype)
    if lender is not None:
        return _prior_params(lender, dtype)
    related = RELATED_DTYPE.get(dtype)
    if related is not None:
        return gpu_curve_params(gpu, related)
    return GENERIC_CURVE


_FITTED: dict[tuple[str, str], Params] = {}


def gpu_curve_params(gpu: GpuSpec, dtype: str) -> Params:
    """(frac, m_half, n_half, k_half, m_sharpness) of ``gpu`` for ``dtype``: fitted to :func:`fit_points` on the
    prior (see the module docstring); the prior itself where there are none. Cached per description."""
    key = (gpu.model_dump_json(), dtype)
    hit = _FITTED.get(key)
    if hit is None:
        points, prior = fit_points(gpu, dtype), _prior_params(gpu, dtype)
        hit = _FITTED[key] = fit_gemm_curve(points, prior) if points else prior
    return hit


def gemm_fit_report(gpu: GpuSpec) -> list[dict]:
    """Every GEMM point of ``gpu`` beside the default cost model's figure for it (no calibration):
    ``model_TFLOPs`` = 2MNK / :meth:`CostModel.gemm_time`, ``log_ratio`` = log(model time / measured)."""
    cost = CostModel(gpu)
    out = []
    for p in gpu.gemm_points:
        t = cost.gemm_time(p.M, p.N, p.K, p.dtype)
        model = 2.0 * p.M * p.N * p.K / t / 1e12
        out.append({**p.model_dump(), "model_TFLOPs": model, "log_ratio": float(np.log(p.TFLOPs / model))})
    return out


@dataclass(frozen=True)
class CostModel:
    """Kernel times on one device, from the topology's GPU spec and an optional calibration."""

    gpu: GpuSpec
    calibration: Calibration | None = None

    # ---- parameters -------------------------------------------------------------------------
    @cached_property
    def _curves(self) -> dict[str, GemmCurve]:
        return {}

    def gemm_curve(self, dtype: str) -> GemmCurve:
        """The GEMM throughput curve for ``dtype``: the calibration's fit if it measured one, else the
        GPU description's (fitted to its points, or the generic constants)."""
        curve = self._curves.get(dtype)
        if curve is None:
            cal = self.calibration
            fit = cal.gemm.get(dtype) if cal is not None else None
            if fit is not None:
                curve = GemmCurve(fit.peak_TFLOPs * 1e12, fit.m_half, fit.nk_half, fit.nk_half)
            else:
                frac, mh, nh, kh, p = gpu_curve_params(self.gpu, dtype)
                curve = GemmCurve(self.gpu.peak_flops(dtype) * frac, mh, nh, kh, p)
            self._curves[dtype] = curve
        return curve

    @property
    def launch_s(self) -> float:
        cal = self.calibration
        us = (
            cal.kernel_launch_us
            if cal is not None and cal.kernel_launch_us is not None
            else self.gpu.kernel_launch_us
        )
        return us * 1e-6

    @property
    def hbm_Bps(self) -> float:
        cal = self.calibration
        if cal is not None and cal.hbm_bw_GBps is not None:
            return cal.hbm_bw_GBps * 1e9
        return _gpu_hbm_Bps(self.gpu)

    @property
    def dispatcher_op_s(self) -> float:
        """Cost of one eager op of the token dispatcher (router top-k and masks, permute, unpermute):
        calibrated if measured (``dispatcher_op_us``), else one kernel launch."""
        cal = self.calibration
        if cal is not None and cal.dispatcher_op_us is not None:
            return cal.dispatcher_op_us * 1e-6
        return self.launch_s

    @property
    def dispatcher_Bps(self) -> float:
        """Bandwidth of the token dispatcher's gathers and scatters: calibrated if measured
        (``dispatcher_bw_GBps``), else the memory-bound kernels' bandwidth."""
        cal = self.calibration
        if cal is not None and cal.dispatcher_bw_GBps is not None:
            return cal.dispatcher_bw_GBps * 1e9
        return self.hbm_Bps

    @property
    def compute_scale(self) -> float:
        """Factor on the step's forward and backward compute blocks (``compute_scale`` of the
        calibration: their in-job cost over the microbenchmarks'), else 1."""
        cal = self.calibration
        if cal is not None and cal.compute_scale is not None:
            return cal.compute_scale
        return 1.0

    @property
    def attention_efficiency(self) -> float:
        """Attention-core throughput over the achieved GEMM peak, where no attention figure applies."""
        cal = self.calibration
        if cal is not None and cal.attention_efficiency is not None:
            return cal.attention_efficiency
        return DEFAULT_ATTENTION_EFFICIENCY

    def attention_flops_per_s(self, dtype: str) -> float:
        """Attention-core FLOP/s: the calibration's efficiency x the GEMM peak if it measured one, else
        the GPU's attention figure (forward and backward as one rate, backward weighted by its 2.5x
        FLOPs; in BF16 for FP8 training), else the generic efficiency x the GEMM peak."""
        cal, fig = self.calibration, self.gpu.attention
        if (cal is not None and cal.attention_efficiency is not None) or fig is None:
            return self.gemm_curve(dtype).peak_flops * self.attention_efficiency
        w = ATTENTION_BWD_FLOPS
        combined = (1.0 + w) / (1.0 / fig.fwd_TFLOPs + w / fig.bwd_TFLOPs) * 1e12
        return combined * self.gpu.peak_flops(ATTENTION_DTYPE.get(dtype, dtype)) / self.gpu.peak_flops("bf16")

    @property
    def optimizer_bytes_per_param(self) -> float:
        cal = self.calibration
        if cal is not None and cal.optimizer_bytes_per_param is not None:
            return cal.optimizer_bytes_per_param
        return DEFAULT_OPTIMIZER_BYTES_PER_PARAM

    @property
    def optimizer_overhead_s(self) -> float:
        """Fixed cost of one optimizer step (framework bookkeeping beyond the update's bytes):
        calibrated if measured, else one kernel launch."""
        cal = self.calibration
        if cal is not None and cal.optimizer_step_overhead_us is not None:
            return cal.optimizer_step_overhead_us * 1e-6
        return self.launch_s

    # ---- kernels ----------------------------------------------------------------------------
    def gemm_flops_per_s(self, m: float, n: float, k: float, dtype: str) -> float:
        """Achieved FLOP/s of an (m x k) @ (k x n) GEMM."""
        return self.gemm_curve(dtype).rate(m, n, k)

    def gemm_time(self, m: float, n: float, k: float, dtype: str, count: int = 1) -> float:
        """Seconds for ``count`` GEMMs of shape (m x k) @ (k x n): roofline of 2mnk FLOPs and the
        operand bytes, plus one launch each. ``m == 0`` costs nothing (an expert with no tokens
        is skipped by grouped GEMM kernels)."""
        if m <= 0 or n <= 0 or k <= 0 or count <= 0:
            return 0.0
        b = bytes_per_element(dtype)
        flops = 2.0 * m * n * k
        nbytes = b * (m * k + k * n + m * n)
        t = max(flops / self.gemm_flops_per_s(m, n, k, dtype), nbytes / self.hbm_Bps)
        return count * (t + self.launch_s)

    def gemm_times(self, m: np.ndarray, n: float, k: float, dtype: str) -> np.ndarray:
        """:meth:`gemm_time` over an array of row counts ``m`` (zero rows cost nothing)."""
        m = np.asarray(m, dtype=np.float64)
        out = np.zeros(m.shape)
        ok = m > 0
        if n <= 0 or k <= 0 or not ok.any():
            return out
        mm = m[ok]
        rate = self.gemm_curve(dtype).rate(mm, n, k)
        nbytes = bytes_per_element(dtype) * (mm * k + k * n + mm * n)
        out[ok] = np.maximum(2.0 * mm * n * k / rate, nbytes / self.hbm_Bps) + self.launch_s
        return out

    def gemm_train_times(
        self, m: np.ndarray, n: float, k: float, dtype: str
    ) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds of a linear layer on ``m`` rows: forward ``[m,k]@[k,n]``;
        backward the input gradient ``[m,n]@[n,k]`` plus the weight gradient ``[k,m]@[m,n]``."""
        m = np.asarray(m, dtype=np.float64)
        fwd = self.gemm_times(m, n, k, dtype)
        dgrad = self.gemm_times(m, k, n, dtype)
        wgrad = np.zeros(m.shape)
        ok = m > 0
        if ok.any():
            # [k, m] @ [m, n]: the token count is the reduction dimension
            mm = m[ok]
            rate = self.gemm_curve(dtype).rate(k, n, mm)
            nbytes = bytes_per_element(dtype) * (mm * k + k * n + mm * n)
            wgrad[ok] = np.maximum(2.0 * mm * n * k / rate, nbytes / self.hbm_Bps) + self.launch_s
        return fwd, dgrad + wgrad

    def attention_time(self, flops: float, nbytes: float, dtype: str) -> float:
        """Attention core (FlashAttention-style fused kernel) at :meth:`attention_flops_per_s`."""
        if flops <= 0:
            return 0.0
        return max(flops / self.attention_flops_per_s(dtype), nbytes / self.hbm_Bps) + self.launch_s

    def memory_time(self, nbytes: float, kernels: int = 1) -> float:
        """A memory-bound kernel (elementwise, norm, softmax, permute, copy) moving ``nbytes``."""
        if nbytes <= 0:
            return 0.0
        return nbytes / self.hbm_Bps + kernels * self.launch_s

    def dispatcher_time(self, nbytes: float | np.ndarray, ops: int) -> np.ndarray:
        """The token dispatcher's eager ops (:func:`sim.frameworks.deepspeed.dispatcher_work`): ``ops`` ops moving
        ``nbytes`` by gathers, scatters and masks; 0 where nothing moves."""
        nb = np.asarray(nbytes, dtype=np.float64)
        return np.where(nb > 0, nb / self.dispatcher_Bps + ops * self.dispatcher_op_s, 0.0)

    def grad_norm_time(self, tensors: float, params: float) -> float:
        """One parameter group's share of ZeRO's gradient norm on a rank (DeepSpeed
        ``get_grad_norm_direct``): per gradient tensor of the partition a cast to fp64, a
        ``vector_norm`` and a move (:data:`NORM_OPS_PER_TENSOR` eager ops), then stack, pow and sum;
        bytes: each fp32 gradient read, its fp64 copy written and read."""
        if tensors <= 0:
            return 0.0
        ops = NORM_OPS_PER_TENSOR * tensors + 3
        return ops * self.dispatcher_op_s + params * (4 + 8 + 8) / self.hbm_Bps

    def optimizer_time(self, params: float) -> float:
        """Fused Adam step on the device over ``params`` parameters (memory bound) plus the step's
        fixed overhead (:attr:`optimizer_overhead_s`)."""
        if params <= 0:
            return 0.0
        return params * self.optimizer_bytes_per_param / self.hbm_Bps + self.optimizer_overhead_s


#: eager ops per gradient tensor in DeepSpeed's gradient norm (``.to(fp64)``, ``vector_norm``, ``.to(device)``)
NORM_OPS_PER_TENSOR = 3


def cpu_adam_time(params: float, ranks_per_node: int, adam_Gparams_per_s: float) -> float:
    """DeepSpeedCPUAdam over one rank's partition while ``ranks_per_node`` ranks share the host CPUs."""
    if params <= 0:
        return 0.0
    return params * ranks_per_node / (adam_Gparams_per_s * 1e9)


__all__ = [
    "NORM_OPS_PER_TENSOR",
    "CostModel",
    "FitPoint",
    "GemmCurve",
    "cpu_adam_time",
    "fit_gemm_curve",
    "fit_points",
    "gemm_fit_report",
    "gpu_curve_params",
]
