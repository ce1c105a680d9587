"""The measured figures a GPU description (:class:`sim.inputs.topology.GpuSpec`) carries, each with
its source: GEMM points, the fused-attention figure, attention rates per shape and precision, and what
one SM of a dispatcher kernel moves."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from sim.inputs.yamlio import StrictModel

_STRICT = ConfigDict(extra="forbid", frozen=True)
#: Upper bound on rates (GB/s, TFLOP/s): far past any hardware, finite after unit conversions.
_BIG = 1e9
Dtype = Literal["fp8", "bf16", "fp16", "tf32", "fp32", "mxfp8", "nvfp4"]
#: Largest GEMM dimension a measurement point may give (far past any published shape).
_MAX_DIM = 10**9


class GemmPoint(StrictModel):
    """One published GEMM measurement: ``C[M, N] = A[M, K] @ B[K, N]`` at ``2 M N K / time``."""

    model_config = _STRICT
    M: int = Field(ge=1, le=_MAX_DIM, description="rows of A and C (tokens; per group in a grouped GEMM)")
    N: int = Field(ge=1, le=_MAX_DIM, description="columns of B and C")
    K: int = Field(ge=1, le=_MAX_DIM, description="reduction dimension")
    dtype: Dtype = Field(description="operand precision of the kernel")
    TFLOPs: float = Field(gt=0, le=_BIG, description="achieved 2 M N K / kernel time, TFLOP/s")
    kernel: str = Field(description="library and kernel that ran (e.g. cuBLAS via torch.matmul)")
    source: str = Field(description="where the figure is published (repository@commit, issue, paper)")
    grouped: bool = Field(default=False, description="a grouped GEMM (MoE experts, M rows per group): fits the "
                          "dtype's grouped curve, which routed experts use, not the dense one")  # fmt: skip


class AttentionFigure(StrictModel):
    """Measured throughput of a fused attention core (FlashAttention-style), BF16, forward and backward,
    with FLOPs counted as the source counts them (causal runs credit half the score matrix)."""

    model_config = _STRICT
    kernel: str = Field(description="kernel and shape, e.g. FlashAttention-3, head dim 128, seq 4096, causal")
    fwd_TFLOPs: float = Field(gt=0, le=_BIG, description="forward TFLOP/s")
    bwd_TFLOPs: float = Field(gt=0, le=_BIG, description="backward TFLOP/s")
    source: str = Field(description="where the figures are published, and how any derived one was derived")


class AttentionShapeRates(StrictModel):
    """One attention shape's measured forward / backward TFLOP/s per precision (one kernel library, one
    GPU, FLOPs as the benchmark counts them)."""

    model_config = _STRICT
    shape: Literal["gqa_causal", "mla_causal", "window_causal"] = Field(
        description="gqa_causal: softmax attention, head dim 128, causal (the reference); mla_causal: MLA's "
        "192 / 128 head dims, causal; window_causal: a sliding window of `window` tokens"
    )
    window: int | None = Field(default=None, ge=1, le=10_000_000, description="window_causal's window, tokens")
    bf16: tuple[float, float] = Field(description="BF16 forward, backward TFLOP/s")
    fp8: tuple[float, float] = Field(description="per-tensor FP8 forward, backward TFLOP/s")
    mxfp8: tuple[float, float] = Field(description="MXFP8 forward, backward TFLOP/s")


class AttentionShapes(StrictModel):
    """Measured attention rates per shape and precision against the reference shape (gqa_causal, BF16):
    a layer's attention core runs at the ``attention`` figure x (its shape's rate in its precision /
    the reference rate). A windowed layer takes window_causal when its window is at most the measured
    one; wider windows, and shapes not measured, take gqa_causal."""

    model_config = _STRICT
    kernel: str = Field(description="kernel, library version and sequence length")
    shapes: list[AttentionShapeRates] = Field(min_length=1, description="per shape, the measured rates")
    source: str = Field(description="where the figures are published")

    @model_validator(mode="after")
    def _has_reference(self) -> AttentionShapes:
        if not any(r.shape == "gqa_causal" for r in self.shapes):
            raise ValueError("attention_shapes needs the gqa_causal reference shape")
        if any((r.shape == "window_causal") != (r.window is not None) for r in self.shapes):
            raise ValueError("attention_shapes: window_causal needs its window, and only it has one")
        return self

    def ratio(self, mla: bool, window: int | None, dtype: str) -> tuple[float, float]:
        """(forward, backward) rate of a layer (MLA or not, its window or None) in ``dtype`` (``bf16``,
        ``fp8`` or ``mxfp8``) over the reference's BF16 rate."""
        rates = {r.shape: r for r in self.shapes}
        ref, r = rates["gqa_causal"], rates["gqa_causal"]
        win = rates.get("window_causal")
        if mla and "mla_causal" in rates:
            r = rates["mla_causal"]
        elif window is not None and win is not None and window <= win.window:
            r = win
        low = getattr(r, dtype)
        return low[0] / ref.bf16[0], low[1] / ref.bf16[1]


class SsdFigure(StrictModel):
    """Measured forward throughput of Mamba-2's chunked SSD (mamba_ssm's Triton ``mamba_chunk_scan_combined``,
    which Megatron-Core's Mamba mixer runs), in head-tokens per second (tokens x heads / kernel time) at
    one head dim and state size. The kernels run far below the tensor-core peak, bound by moving the
    per-chunk states (heads x head dim x state per chunk), so a head-token of another shape costs in
    proportion to head dim x state."""

    model_config = _STRICT
    kernel: str = Field(description="kernel, shape and sequence length of the measurement")
    head_dim: int = Field(ge=1, le=_MAX_DIM, description="head dim P of the measured shape")
    state_dim: int = Field(ge=1, le=_MAX_DIM, description="state size N of the measured shape")
    fwd_Gheadtokens_per_s: float = Field(gt=0, le=_BIG, description="forward, 1e9 x tokens x heads per second")
    source: str = Field(description="where the measurement is published, and how a derived figure was derived")


class DispatcherSMFigure(StrictModel):
    """What one SM of a dispatcher kernel moves: its benchmark's bandwidth over the SMs it ran on, where
    that bandwidth grows with the SMs (the kernel, not the link, is the limit)."""

    model_config = _STRICT
    kernel: str = Field(description="kernel, measurement and shape, e.g. DeepEP normal intranode, 8 ranks")
    dispatch_GBps: float = Field(gt=0, le=_BIG, description="dispatch bandwidth per SM, GB/s (the benchmark's bytes)")
    combine_GBps: float = Field(gt=0, le=_BIG, description="combine bandwidth per SM, GB/s")
    source: str = Field(description="where the measurement is published and how the per-SM figure was derived")


__all__ = [
    "AttentionFigure", "AttentionShapeRates", "AttentionShapes", "DispatcherSMFigure", "Dtype", "GemmPoint", "SsdFigure",
]  # fmt: skip
