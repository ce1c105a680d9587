"""``training.gemm_precision``: which GEMMs leave the training precision, as Megatron-Core decides it.

- ``bf16_first_layers`` / ``bf16_last_layers``: Megatron's ``first_last_layers_bf16`` with
  ``num_layers_at_start_in_bf16`` / ``num_layers_at_end_in_bf16`` (``fp8_utils`` / ``fp4_utils``
  ``get_fp*_context``): those decoder layers run outside the FP8 / FP4 autocast, every GEMM in BF16. An MTP
  module counts as past the last layer.
- ``modules``: Megatron-Core's quantization recipe (``--quant-recipe``, ``megatron.core.quantization``; the
  matchers of a ``te_quant.cfg``): glob patterns over Megatron's module paths, each with the precision its
  GEMMs run in; the first matching pattern wins. The paths moesim gives its GEMMs are Megatron's
  (:func:`sim.frameworks.precision.module_path`): ``decoder.layers.3.self_attention.linear_qkv``,
  ``decoder.layers.5.mixer.out_proj``, ``decoder.layers.7.mlp.experts.linear_fc1``,
  ``decoder.layers.7.mlp.fc1_latent_proj``, ``mtp.layers.0.eh_proj``, ...
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sim.inputs.yamlio import StrictModel

#: Training precisions whose GEMMs run through a TransformerEngine quantization recipe (per-tensor / blockwise
#: FP8, MXFP8, NVFP4); :mod:`sim.model.dtypes` prices them.
QUANTIZED_DTYPES = ("fp8", "mxfp8", "nvfp4")


class PrecisionMatcher(StrictModel):
    """One matcher of a quantization recipe: a glob over module paths and the precision of its GEMMs."""

    pattern: str = Field(min_length=1, description="fnmatch glob over Megatron module paths, e.g. '*.linear_qkv'")
    dtype: Literal["bf16", "fp8", "mxfp8", "nvfp4"] = Field(description="the matched GEMMs' precision")


class GemmPrecision(StrictModel):
    """GEMMs run in another precision than ``training.dtype``: whole first / last layers, or modules."""

    bf16_first_layers: int = Field(default=0, ge=0, le=1_000_000,
                                   description="decoder layers at the start in BF16 (Megatron num_layers_at_start_in_bf16)")  # fmt: skip
    bf16_last_layers: int = Field(default=0, ge=0, le=1_000_000,
                                  description="decoder layers at the end in BF16 (Megatron num_layers_at_end_in_bf16)")  # fmt: skip
    modules: list[PrecisionMatcher] = Field(
        default_factory=list, description="quantization-recipe matchers, first match wins (Megatron --quant-recipe)"
    )

    @property
    def active(self) -> bool:
        return bool(self.bf16_first_layers or self.bf16_last_layers or self.modules)


__all__ = ["QUANTIZED_DTYPES", "GemmPrecision", "PrecisionMatcher"]
