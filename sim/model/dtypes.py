"""Bytes per element of each training dtype, and the integer helper the accounting shares."""

from __future__ import annotations

BYTES_PER_ELEMENT = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "mxfp8": 1}
#: Training precisions whose GEMMs run in 8 bits while weights, activations and gradients stay bf16
#: (TransformerEngine's recipes: per-tensor / blockwise FP8, MXFP8 with 32-element block scales).
FP8_RECIPES = ("fp8", "mxfp8")


def gemm_dtype(dtype: str) -> str:
    """The dtype GEMMs run in under training precision ``dtype``."""
    return dtype


def storage_dtype(dtype: str) -> str:
    """The dtype weights, activations, gradients and all-to-all payloads are kept in."""
    return "bf16" if dtype in FP8_RECIPES else dtype


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers, exactly."""
    return -(-a // b)


__all__ = ["BYTES_PER_ELEMENT", "FP8_RECIPES", "ceil_div", "gemm_dtype", "storage_dtype"]
