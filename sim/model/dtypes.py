"""Bytes per element of each training dtype, and the integer helper the accounting shares."""

from __future__ import annotations

from sim.inputs.precision_section import QUANTIZED_DTYPES

BYTES_PER_ELEMENT = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "mxfp8": 1, "nvfp4": 0.5}
#: Training precisions whose GEMMs run in 8 bits while weights, activations and gradients stay bf16
#: (TransformerEngine's recipes: per-tensor / blockwise FP8, MXFP8 with 32-element block scales).
FP8_RECIPES = ("fp8", "mxfp8")
#: QUANTIZED_DTYPES (sim.inputs.precision_section): the FP8 ones and NVFP4 (E2M1 with an E4M3 scale per 16
#: elements and an FP32 scale per tensor, Megatron's ``--fp4-format e2m1 --fp4-recipe nvfp4``). Weights,
#: activations, gradients and all-to-all payloads stay bf16.


def is_quantized(dtype: str) -> bool:
    """Whether training precision ``dtype`` runs its GEMMs through a TransformerEngine quantization recipe."""
    return dtype in QUANTIZED_DTYPES


def gemm_dtype(dtype: str) -> str:
    """The dtype GEMMs run in under training precision ``dtype``."""
    return dtype


def storage_dtype(dtype: str) -> str:
    """The dtype weights, activations, gradients and all-to-all payloads are kept in."""
    return "bf16" if dtype in QUANTIZED_DTYPES else dtype


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers, exactly."""
    return -(-a // b)


#: Bytes moved per element to quantize a bf16 tensor for FP8 GEMMs, per scaling recipe, as TransformerEngine
#: does it: read the bf16 tensor (2) and write its rowwise and columnwise FP8 copies (1 + 1; the columnwise
#: one serves the other operand's GEMM in backward); current scaling first reads the tensor for its amax (2);
#: block scales add 4 B per 128 elements and MX scales 1 B per 32, per copy. With these, TE's published
#: autocast-minus-prequantized GEMM times on H200 are reproduced within 2% (tests/test_fp8_recipes.py).
#: NVFP4 (TE's ``NVFP4BlockScaling``: 16-element E4M3 block scales, an FP32 tensor scale, 16x16 random
#: Hadamard transforms on the weight gradient's operands, stochastic rounding of gradients) is two-pass like
#: current scaling: an amax kernel reads the tensor (2; the rowwise and the transformed columnwise amax in
#: one pass), the cast reads it again (2) and writes both 4-bit copies, each 0.5 B + an E4M3 scale per 16.
NVFP4_COPY_BYTES = 0.5 + 1 / 16
QUANT_BYTES_PER_ELEMENT = {"current": 6.0, "delayed": 4.0, "blockwise": 4.0 + 2 * 4 / 128, "mxfp8": 4.0 + 2 / 32,
                           "nvfp4": 4.0 + 2 * NVFP4_COPY_BYTES}
#: Bytes per element of a GEMM input kept for the weight gradient under an FP8 recipe: TransformerEngine
#: keeps the quantized column-wise copy it made in forward (1 B, plus an fp32 scale per 1x128 block, or an
#: E8M0 scale per 32 elements for MXFP8), not the bf16 tensor.
SAVED_GEMM_INPUT_BYTES = {"current": 1.0, "delayed": 1.0, "blockwise": 1.0 + 4 / 128, "mxfp8": 1.0 + 1 / 32,
                          "nvfp4": NVFP4_COPY_BYTES}
#: Kernels per quantization (current scaling and NVFP4: an amax reduction, then the cast).
QUANT_KERNELS = {"current": 2, "delayed": 1, "blockwise": 1, "mxfp8": 1, "nvfp4": 2}


def fp8_recipe(dtype: str, recipe: str) -> str | None:
    """The scaling recipe GEMM inputs are quantized with under training precision ``dtype`` (None: none):
    ``fp8``'s ``recipe``, or ``mxfp8`` / ``nvfp4`` (each its own recipe)."""
    return dtype if dtype in ("mxfp8", "nvfp4") else recipe if dtype == "fp8" else None


def saved_gemm_input_bytes(dtype: str, recipe: str) -> float | None:
    """Bytes per element of a GEMM input kept for the weight gradient under training precision ``dtype``
    (:data:`SAVED_GEMM_INPUT_BYTES` of its FP8 recipe), None without FP8 (the activation's own bytes)."""
    r = fp8_recipe(dtype, recipe)
    return SAVED_GEMM_INPUT_BYTES[r] if r else None


def grad_reduce_bytes(dtype: str, grad_reduce_dtype: str | None) -> int:
    """Bytes per gradient element the gradient buffer and its reductions hold: 4 with ``grad_reduce_dtype``
    fp32, else the parameters' storage dtype's (``training.dtype``)."""
    return 4 if grad_reduce_dtype == "fp32" else BYTES_PER_ELEMENT[storage_dtype(dtype)]


def fsdp_copy_in_bytes(params: float, dtype: str, grad_reduce_dtype: str | None) -> float:
    """HBM bytes of torch FSDP2's post-backward copy-in (``foreach_reduce``) of ``params`` unsharded
    gradients: read in the parameters' dtype, written into the reduce-scatter input in the reduce dtype."""
    return params * (BYTES_PER_ELEMENT[storage_dtype(dtype)] + grad_reduce_bytes(dtype, grad_reduce_dtype))


__all__ = ["BYTES_PER_ELEMENT", "FP8_RECIPES", "NVFP4_COPY_BYTES", "QUANTIZED_DTYPES", "QUANT_BYTES_PER_ELEMENT", "is_quantized", "QUANT_KERNELS", "SAVED_GEMM_INPUT_BYTES",
           "ceil_div", "fp8_recipe", "fsdp_copy_in_bytes", "grad_reduce_bytes", "saved_gemm_input_bytes", "gemm_dtype", "storage_dtype"]  # fmt: skip
