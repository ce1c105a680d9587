"""Kernel cost model: pure functions from FLOPs and bytes to seconds on one device.

Roofline: ``t = launch + max(FLOPs / achieved_FLOPs, bytes / HBM_bw)``. Achieved GEMM throughput
depends on shape: ``peak_eff * h(M; m_half) * h(N; nk_half) * h(K; nk_half)`` with
``h(x; c) = x / (x + c)``. The defaults (``peak_eff`` = 85% of the datasheet dense peak, m_half =
400, nk_half = 96) put an 8192^3 bf16 GEMM on H100/H200 at ~79% of peak (measured ~770-790 of 989
TFLOP/s on an H200) and small-M expert GEMMs where DeepGEMM's published tables put them
(early-2025 README, FP8 on H800: M=64 ~10-17% of peak, M=128 ~18-33%, M=4096 ~38-72%; this model:
11%, 19%, 73% for N=7168, K=2048). A calibration file (``sim.inputs.calibration``) replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.inputs.calibration import Calibration
from sim.inputs.topology import GpuSpec
from sim.model.dtypes import BYTES_PER_ELEMENT

DEFAULT_PEAK_FRACTION = 0.85
DEFAULT_M_HALF = 400.0
DEFAULT_NK_HALF = 96.0
#: Attention-core throughput relative to the achieved GEMM peak: FlashAttention-2 reaches ~50-70% of
#: the datasheet peak on H100 forward (Dao 2023, fig. 6), less backward: 0.55 / 0.85 of the GEMM peak.
DEFAULT_ATTENTION_EFFICIENCY = 0.65
#: Achieved fraction of datasheet HBM bandwidth for streaming kernels (an H200 copy: ~4.3 of 4.8 TB/s).
DEFAULT_HBM_EFFICIENCY = 0.90
#: Adam with fp32 master weights and moments: read grad (4), master (4), m (4), v (4); write
#: master, m, v (12) and the low-precision weight (2) -> ~30 B/param, rounded up for launches/casts.
DEFAULT_OPTIMIZER_BYTES_PER_PARAM = 32.0


def _h(x: float, c: float) -> float:
    return x / (x + c) if x > 0 else 0.0


@dataclass(frozen=True)
class CostModel:
    """Kernel times on one device, from the topology's GPU spec and an optional calibration."""

    gpu: GpuSpec
    calibration: Calibration | None = None

    # ---- parameters -------------------------------------------------------------------------
    def gemm_params(self, dtype: str) -> tuple[float, float, float]:
        """(achieved peak FLOP/s, m_half, nk_half) for ``dtype``: calibrated if measured, else defaults."""
        cal = self.calibration
        fit = cal.gemm.get(dtype) if cal is not None else None
        if fit is not None:
            return fit.peak_TFLOPs * 1e12, fit.m_half, fit.nk_half
        return self.gpu.peak_flops(dtype) * DEFAULT_PEAK_FRACTION, DEFAULT_M_HALF, DEFAULT_NK_HALF

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
        return self.gpu.hbm_bw_GBps * 1e9 * DEFAULT_HBM_EFFICIENCY

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
        cal = self.calibration
        if cal is not None and cal.attention_efficiency is not None:
            return cal.attention_efficiency
        return DEFAULT_ATTENTION_EFFICIENCY

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
        peak, m_half, nk_half = self.gemm_params(dtype)
        return peak * _h(m, m_half) * _h(n, nk_half) * _h(k, nk_half)

    def gemm_time(self, m: float, n: float, k: float, dtype: str, count: int = 1) -> float:
        """Seconds for ``count`` GEMMs of shape (m x k) @ (k x n): roofline of 2mnk FLOPs and the
        operand bytes, plus one launch each. ``m == 0`` costs nothing (an expert with no tokens
        is skipped by grouped GEMM kernels)."""
        if m <= 0 or n <= 0 or k <= 0 or count <= 0:
            return 0.0
        b = BYTES_PER_ELEMENT[dtype]
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
        peak, m_half, nk_half = self.gemm_params(dtype)
        mm = m[ok]
        rate = peak * (mm / (mm + m_half)) * _h(n, nk_half) * _h(k, nk_half)
        nbytes = BYTES_PER_ELEMENT[dtype] * (mm * k + k * n + mm * n)
        out[ok] = np.maximum(2.0 * mm * n * k / rate, nbytes / self.hbm_Bps) + self.launch_s
        return out

    def gemm_train_times(self, m: np.ndarray, n: float, k: float, dtype: str) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds of a linear layer on ``m`` rows: forward ``[m,k]@[k,n]``;
        backward the input gradient ``[m,n]@[n,k]`` plus the weight gradient ``[k,m]@[m,n]``."""
        m = np.asarray(m, dtype=np.float64)
        fwd = self.gemm_times(m, n, k, dtype)
        dgrad = self.gemm_times(m, k, n, dtype)
        wgrad = np.zeros(m.shape)
        ok = m > 0
        if ok.any():
            # [k, m] @ [m, n]: the token count is the reduction dimension
            peak, m_half, nk_half = self.gemm_params(dtype)
            mm = m[ok]
            rate = peak * _h(k, m_half) * _h(n, nk_half) * (mm / (mm + nk_half))
            nbytes = BYTES_PER_ELEMENT[dtype] * (mm * k + k * n + mm * n)
            wgrad[ok] = np.maximum(2.0 * mm * n * k / rate, nbytes / self.hbm_Bps) + self.launch_s
        return fwd, dgrad + wgrad

    def attention_time(self, flops: float, nbytes: float, dtype: str) -> float:
        """Attention core (FlashAttention-style fused kernel) at ``attention_efficiency`` x the GEMM peak."""
        if flops <= 0:
            return 0.0
        peak, _, _ = self.gemm_params(dtype)
        return max(flops / (peak * self.attention_efficiency), nbytes / self.hbm_Bps) + self.launch_s

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


__all__ = ["NORM_OPS_PER_TENSOR", "CostModel", "cpu_adam_time"]
