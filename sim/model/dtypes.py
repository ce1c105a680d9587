"""Bytes per element of each training dtype, and the integer helper the accounting shares."""

from __future__ import annotations

BYTES_PER_ELEMENT = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers, exactly."""
    return -(-a // b)


__all__ = ["BYTES_PER_ELEMENT", "ceil_div"]
