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

from sim.hardware.gemm_fit import (  # noqa: F401  (re-exported: the fit lives in gemm_fit)
    DEFAULT_HBM_EFFICIENCY,
    GENERIC_CURVE,
    GROUPED,
    PRIOR_SIGMA,
    RELATED_DTYPE,
    FitPoint,
    GemmCurve,
    Params,
    _gpu_hbm_Bps,
    bytes_per_element,
    fit_gemm_curve,
    fit_points,
    gpu_curve_params,
    has_grouped_points,
)
from sim.inputs.calibration import Calibration
from sim.inputs.precision_section import QUANTIZED_DTYPES
from sim.inputs.topology import GpuSpec

#: Attention-core throughput relative to the achieved GEMM peak, for kinds without an attention
#: figure: 0.55 / 0.85 of the datasheet peak (FA3 on H100: 0.52-0.59 forward, gpu-figures.md section 3).
DEFAULT_ATTENTION_EFFICIENCY = 0.65
#: FlashAttention's backward runs 2.5x the forward FLOPs (as sim.frameworks.kernels.ATTENTION_BWD_FACTOR):
#: the weight of the backward figure when forward and backward make one rate.
ATTENTION_BWD_FLOPS = 2.5
#: FP8, MXFP8 and NVFP4 training keep the attention core in BF16 (TransformerEngine's recipes without fp8_dpa).
ATTENTION_DTYPE = dict.fromkeys(QUANTIZED_DTYPES, "bf16")
#: Adam with fp32 master weights and moments: read grad (4), master (4), m (4), v (4); write
#: master, m, v (12) and the low-precision weight (2) -> ~30 B/param, rounded up for launches/casts.
DEFAULT_OPTIMIZER_BYTES_PER_PARAM = 32.0


def gemm_fit_report(gpu: GpuSpec) -> list[dict]:
    """Every GEMM point of ``gpu`` beside the default cost model's figure for it (no calibration):
    ``model_TFLOPs`` = 2MNK / :meth:`CostModel.gemm_time`, ``log_ratio`` = log(model time / measured)."""
    cost = CostModel(gpu, burst=True)
    out = []
    for p in gpu.gemm_points:
        t = cost.gemm_time(p.M, p.N, p.K, p.dtype + (GROUPED if p.grouped else ""))
        model = 2.0 * p.M * p.N * p.K / t / 1e12
        out.append({**p.model_dump(), "model_TFLOPs": model, "log_ratio": float(np.log(p.TFLOPs / model))})
    return out


@dataclass(frozen=True)
class CostModel:
    """Kernel times on one device, from the topology's GPU spec and an optional calibration."""

    gpu: GpuSpec
    calibration: Calibration | None = None
    #: price kernels as isolated microbenchmarks ran them (the GEMM points' and attention figure's own
    #: conditions), without the GPU's ``sustained_compute_fraction``: for comparing with such measurements
    burst: bool = False

    # ---- parameters -------------------------------------------------------------------------
    @cached_property
    def _curves(self) -> dict[str, GemmCurve]:
        return {}

    def gemm_curve(self, dtype: str) -> GemmCurve:
        """The GEMM throughput curve for ``dtype``: the calibration's fit if it measured one, else the
        GPU description's: the FP8 curve times ``gemm_rate_over_fp8`` for a block-scaled format the GPU
        measured that way, else fitted to its points (or the generic constants)."""
        curve = self._curves.get(dtype)
        if curve is None and dtype.endswith(GROUPED):  # routed experts' grouped GEMMs: their own measurements
            base = dtype.removesuffix(GROUPED)  # where the GPU has some, else the dense curve
            if self.calibration is None and has_grouped_points(self.gpu, base):
                frac, mh, nh, kh, p = gpu_curve_params(self.gpu, base, grouped=True)
                curve = GemmCurve(self.gpu.peak_flops(base) * frac * self.sustained, mh, nh, kh, p)
            else:
                curve = self.gemm_curve(base)
            self._curves[dtype] = curve
        if curve is None:
            cal = self.calibration
            fit = cal.gemm.get(dtype) if cal is not None else None
            ratio = (self.gpu.gemm_rate_over_fp8 or {}).get(dtype)  # type: ignore[call-overload]
            if fit is not None:
                curve = GemmCurve(fit.peak_TFLOPs * 1e12, fit.m_half, fit.nk_half, fit.nk_half)
            elif ratio is not None:  # a block-scaled format measured against per-tensor FP8 on the same shapes
                fp8 = self.gemm_curve("fp8")
                curve = GemmCurve(fp8.peak_flops * ratio, fp8.m_half, fp8.n_half, fp8.k_half, fp8.m_sharpness)
            else:
                frac, mh, nh, kh, p = gpu_curve_params(self.gpu, dtype)
                curve = GemmCurve(self.gpu.peak_flops(dtype) * frac * self.sustained, mh, nh, kh, p)
            self._curves[dtype] = curve
        return curve

    @property
    def sustained(self) -> float:
        """Share of the microbenchmark GEMM/attention rates kept in a training step: the GPU's
        ``sustained_compute_fraction`` (1 with ``burst``; a calibration's measured curve and
        ``compute_scale`` replace it)."""
        return 1.0 if self.burst else self.gpu.sustained_compute_fraction

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

    @property
    def attention_from_figure(self) -> bool:
        """Whether the attention core runs at the GPU's ``attention`` figure (no calibrated efficiency)."""
        cal = self.calibration
        return self.gpu.attention is not None and (cal is None or cal.attention_efficiency is None)

    def attention_flops_per_s(self, dtype: str) -> float:
        """Attention-core FLOP/s: the calibration's efficiency x the GEMM peak if it measured one, else
        the GPU's attention figure (forward and backward as one rate, backward weighted by its 2.5x
        FLOPs; in BF16 for FP8 training), else the generic efficiency x the GEMM peak."""
        fig = self.gpu.attention
        if not self.attention_from_figure:
            return self.gemm_curve(dtype).peak_flops * self.attention_efficiency
        w = ATTENTION_BWD_FLOPS
        combined = (1.0 + w) / (1.0 / fig.fwd_TFLOPs + w / fig.bwd_TFLOPs) * 1e12
        scale = self.gpu.peak_flops(ATTENTION_DTYPE.get(dtype, dtype)) / self.gpu.peak_flops("bf16")
        return combined * scale * self.sustained

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

    def gemm_times(self, m: np.ndarray, n: float, k: float, dtype: str, rate_scale: float = 1.0) -> np.ndarray:
        """:meth:`gemm_time` over an array of row counts ``m`` (zero rows cost nothing); ``rate_scale``
        multiplies the achieved FLOP/s (a kernel family slower than the curve's, e.g. block-scaled FP8)."""
        m = np.asarray(m, dtype=np.float64)
        out = np.zeros(m.shape)
        ok = m > 0
        if n <= 0 or k <= 0 or not ok.any():
            return out
        mm = m[ok]
        rate = self.gemm_curve(dtype).rate(mm, n, k) * rate_scale
        nbytes = bytes_per_element(dtype) * (mm * k + k * n + mm * n)
        out[ok] = np.maximum(2.0 * mm * n * k / rate, nbytes / self.hbm_Bps) + self.launch_s
        return out

    def gemm_train_times(
        self, m: np.ndarray, n: float, k: float, dtype: str, rate_scale: float = 1.0
    ) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds of a linear layer on ``m`` rows: forward ``[m,k]@[k,n]``;
        backward the input gradient ``[m,n]@[n,k]`` plus the weight gradient ``[k,m]@[m,n]``."""
        m = np.asarray(m, dtype=np.float64)
        fwd = self.gemm_times(m, n, k, dtype, rate_scale)
        dgrad = self.gemm_times(m, k, n, dtype, rate_scale)
        wgrad = np.zeros(m.shape)
        ok = m > 0
        if ok.any():
            # [k, m] @ [m, n]: the token count is the reduction dimension
            mm = m[ok]
            rate = self.gemm_curve(dtype).rate(k, n, mm) * rate_scale
            nbytes = bytes_per_element(dtype) * (mm * k + k * n + mm * n)
            wgrad[ok] = np.maximum(2.0 * mm * n * k / rate, nbytes / self.hbm_Bps) + self.launch_s
        return fwd, dgrad + wgrad

    def ssd_time(self, head_tokens: float, head_dim: int, state_dim: int) -> float:
        """Forward seconds of Mamba-2's chunked SSD over ``head_tokens`` (tokens x heads) at the GPU's ``ssd``
        figure, a head-token costing in proportion to head dim x state (the per-chunk states it moves),
        with the sustained share of the microbenchmark rate as for attention; 5 kernels (cumsum, chunk
        states, state passing, C B^T, chunk scan)."""
        fig = self.gpu.ssd
        if fig is None:
            raise ValueError(f"{self.gpu.kind} has no ssd figure")  # the scenario refuses this with exit 2
        rate = fig.fwd_Gheadtokens_per_s * 1e9 * (fig.head_dim * fig.state_dim) / (head_dim * state_dim)
        return head_tokens / (rate * self.sustained) + SSD_FWD_KERNELS * self.launch_s

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


#: Triton kernels of mamba_ssm's SSD forward (_chunk_cumsum, _chunk_state, _state_passing, _bmm_chunk, _chunk_scan)
SSD_FWD_KERNELS = 5


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
