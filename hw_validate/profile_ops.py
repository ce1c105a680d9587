"""What a PyTorch profiler (Kineto) trace's events mean to :mod:`hw_validate.profile_trace`: the op
names read as GEMMs, attention, memory-bound ops and collectives, the dtypes and their bytes, the
shapes and bytes an op's inputs imply, and which events nest in which on a thread.
"""

from __future__ import annotations

import numpy as np

DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "c10::Float8_e4m3fn": "fp8",
          "c10::Float8_e5m2": "fp8"}  # fmt: skip
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"}
_SDPA = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
         "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
         "aten::_flash_attention_forward", "aten::_efficient_attention_forward")  # fmt: skip
ATTENTION_FWD = set(_SDPA)
ATTENTION_BWD = {n + "_backward" for n in _SDPA}
#: memory-bound ops and how many tensors they write (0: in place on their first input, which is
#: then also written; "w": write only)
MEMORY_OPS = {
    **dict.fromkeys(("aten::add", "aten::mul", "aten::div", "aten::sub", "aten::gelu", "aten::silu", "aten::relu",
                     "aten::sigmoid", "aten::exp", "aten::neg", "aten::rsqrt", "aten::native_layer_norm",
                     "aten::_softmax", "aten::gelu_backward", "aten::silu_backward", "aten::threshold_backward",
                     "aten::native_layer_norm_backward", "aten::_softmax_backward_data", "aten::where",
                     "aten::_fused_rms_norm", "aten::_fused_rms_norm_backward"), 1),
    **dict.fromkeys(("aten::add_", "aten::mul_", "aten::div_", "aten::sub_", "aten::addcmul_", "aten::addcdiv_",
                     "aten::lerp_", "aten::sqrt_", "aten::copy_"), 0),
    **dict.fromkeys(("aten::fill_", "aten::zero_"), "w"),
}  # fmt: skip
#: c10d op or ``Collective name`` -> the collective kind the link fit knows
COLLECTIVES = {"alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all": "all_to_all",
               "all_to_allv": "all_to_all", "allreduce_": "all_reduce", "allreduce": "all_reduce",
               "all_reduce": "all_reduce", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
               "all_gather_into_tensor": "all_gather", "_allgather_base": "all_gather", "allgather": "all_gather",
               "all_gather": "all_gather", "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
               "reduce_scatter": "reduce_scatter", "reduce_scatter_": "reduce_scatter", "barrier": "barrier",
               "broadcast_": "broadcast", "broadcast": "broadcast"}  # fmt: skip
_NCCL_KINDS = (("alltoall", "all_to_all"), ("sendrecv", "all_to_all"), ("allreduce", "all_reduce"),
               ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("broadcast", "broadcast"))  # fmt: skip
_GLOO = {"gloo:all_to_all": "all_to_all", "gloo:all_reduce": "all_reduce", "gloo:all_gather": "all_gather",
         "gloo:reduce_scatter": "reduce_scatter", "gloo:barrier": "barrier", "gloo:broadcast": "broadcast"}  # fmt: skip
#: a gloo thread starts a call's work at most this long after the c10d op returned (microseconds)
GLOO_START_US = 300.0
#: gaps between consecutive ops longer than this are idle time, not per-op overhead (seconds)
SHORT_GAP_S = 100e-6
_DT_NAMES = {"Float": "fp32", "BFloat16": "bf16", "Half": "fp16"}


def _dims(e: dict) -> list:
    return (e.get("args") or {}).get("Input Dims") or []


def _types(e: dict) -> list:
    return (e.get("args") or {}).get("Input type") or []


def _numel(d) -> int:
    return int(np.prod(d)) if isinstance(d, list) and all(isinstance(x, int) for x in d) else 0


def _dtype(e: dict) -> str | None:
    for t in _types(e):
        if t in DTYPES:
            return DTYPES[t]
    return None


def gemm_shape(name: str, dims: list) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a GEMM op from its input dims, or None when they are not there."""
    try:
        if name == "aten::mm":
            (m, k), (_, n) = dims[0], dims[1]
            return 1, m, n, k
        if name in ("aten::addmm", "aten::_addmm_activation"):
            (m, k), (_, n) = dims[1], dims[2]
            return 1, m, n, k
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = dims[0], dims[1]
            return b, m, n, k
        if name == "aten::baddbmm":
            (b, m, k), (_, _, n) = dims[1], dims[2]
            return b, m, n, k
    except (IndexError, TypeError, ValueError):
        return None
    return None


def memory_bytes(name: str, e: dict, bpe: int) -> int:
    """Bytes a memory-bound op moves: every tensor input read and its output written (in place: the
    first input written back; fill and zero: written only)."""
    tensors = [_numel(d) for d, t in zip(_dims(e), _types(e), strict=False) if t in DTYPES and isinstance(d, list)]
    if not tensors:
        return 0
    writes = MEMORY_OPS[name]
    if writes == "w":
        return tensors[0] * bpe
    return (sum(tensors) + (tensors[0] if writes == 0 else max(tensors))) * bpe


def _nccl_kind(kernel: str) -> str | None:
    low = kernel.lower()
    for key, kind in _NCCL_KINDS:
        if key in low:
            return kind
    return None


def _top_level(events: list[dict]) -> list[dict]:
    """Events not contained in another of the list on the same thread (sorted by start)."""
    out, by_tid = [], {}
    for e in sorted(events, key=lambda x: (x["ts"], -x["dur"])):
        end = by_tid.get(e["tid"])
        if end is None or e["ts"] >= end:
            out.append(e)
            by_tid[e["tid"]] = e["ts"] + e["dur"]
    return out


def _innermost(events: list[dict]) -> list[dict]:
    """Events that contain no other event of the list on the same thread."""
    keep = []
    evs = sorted(events, key=lambda x: (x["tid"], x["ts"], -x["dur"]))
    for i, e in enumerate(evs):
        nxt = evs[i + 1] if i + 1 < len(evs) else None
        inner = nxt is not None and nxt["tid"] == e["tid"] and nxt["ts"] < e["ts"] + e["dur"]
        if not inner:
            keep.append(e)
    return keep
