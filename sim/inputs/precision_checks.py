"""What a training precision (``training.dtype`` and its FP8 flags) and the optimizer need from the GPU and the
rest of a scenario; each miss is an :class:`~sim.errors.InputError` naming the field (exit 2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.errors import InputError
from sim.inputs.precision_section import QUANTIZED_DTYPES

if TYPE_CHECKING:
    from sim.inputs.scenario import Scenario


def check_precision(s: Scenario) -> None:
    """FP8, MXFP8 and NVFP4 GEMMs need tensor cores for them: a GPU whose description lists no peak for the
    format (A100 has no FP8; Hopper no MX or FP4 formats) cannot run it, rather than silently at bf16. NVFP4
    is priced as Megatron-Core runs it; the FP8 flags need their formats; Muon is Megatron's, on the GPU."""
    dtype, gpu = s.training.dtype, s.topology.gpu

    def needs_cores(dt: str, field: str) -> None:  # a quantized format the GPU has no tensor cores for
        if dt in QUANTIZED_DTYPES and dt not in gpu.peak_TFLOPs:
            raise InputError(
                f"{dt} needs tensor cores for it: {gpu.kind} (topology '{s.topology.name}') lists peaks "
                f"for {', '.join(gpu.peak_TFLOPs)} only" + ("; on Hopper use fp8 with fp8_recipe: blockwise"
                                                            if dt == "mxfp8" and "fp8" in gpu.peak_TFLOPs else ""),
                field=field,
            )

    needs_cores(dtype, "training.dtype")
    if dtype == "nvfp4" and s.training.framework != "megatron":
        raise InputError(
            "nvfp4 is Megatron-Core's TransformerEngine NVFP4 recipe (--fp4-format e2m1 --fp4-recipe nvfp4): "
            f"training.framework is {s.training.framework!r} (needs megatron)", field="training.dtype",
        )  # fmt: skip
    m, gp = s.model, s.training.gemm_precision
    if gp.active and (dtype not in QUANTIZED_DTYPES or s.training.framework != "megatron"):
        raise InputError(
            "gemm_precision moves GEMMs off a quantized training precision, as Megatron-Core's first_last_layers_bf16 "
            f"and --quant-recipe do: training.dtype is {dtype!r}, framework {s.training.framework!r} "
            "(needs fp8, mxfp8 or nvfp4 under megatron)", field="training.gemm_precision",
        )  # fmt: skip
    if gp.bf16_first_layers + gp.bf16_last_layers > m.num_layers:
        raise InputError(f"bf16_first_layers + bf16_last_layers = {gp.bf16_first_layers + gp.bf16_last_layers} exceed "
                         f"model.num_layers ({m.num_layers})", field="training.gemm_precision")  # fmt: skip
    for i, x in enumerate(gp.modules):
        needs_cores(x.dtype, f"training.gemm_precision.modules[{i}].dtype")
    if s.training.cutedsl_fused_grouped_mlp and (dtype != "mxfp8" or m.num_experts <= 1 or m.ffn_type != "gated"):
        raise InputError(
            "cutedsl_fused_grouped_mlp is TransformerEngine's block-scaled grouped GLU MLP (ops/fused/grouped_mlp.py: "
            f"MXFP8 on Blackwell, gated experts); training.dtype is {dtype!r}, model.num_experts {m.num_experts}, "
            f"model.ffn_type {m.ffn_type!r} (needs mxfp8 and gated experts)",
            field="training.cutedsl_fused_grouped_mlp",
        )

    wrong = ([f"training.dtype is {dtype!r} (needs fp8 or mxfp8)"] if dtype not in ("fp8", "mxfp8") else []) + (
        [f"{gpu.kind} (topology '{s.topology.name}') has no attention_shapes figure"]
        if gpu.attention_shapes is None else [])  # fmt: skip
    if s.training.fp8_attention and wrong:
        raise InputError(
            "fp8_attention runs the attention core at the GPU's measured FP8 attention rates: " + "; ".join(wrong),
            field="training.fp8_attention",
        )

    if s.training.fp8_output_proj and dtype != "mxfp8":  # Megatron's TransformerConfig raises the same
        raise InputError(f"fp8_output_proj runs the LM head under MXFP8: training.dtype is {dtype!r} (needs mxfp8)",
                         field="training.fp8_output_proj")  # fmt: skip
    if s.training.optimizer == "muon" and s.training.offload_optimizer != "none":
        raise InputError(
            "optimizer muon (Megatron-Core's LayerWiseDistributedOptimizer) keeps its states on the GPU: "
            "offload_optimizer must be none", field="training.offload_optimizer",
        )  # fmt: skip
    if s.training.optimizer == "muon" and s.training.framework != "megatron":
        raise InputError(
            f"optimizer muon is Megatron-Core's dist_muon (LayerWiseDistributedOptimizer); framework is "
            f"{s.training.framework!r} (use framework: megatron)",
            field="training.optimizer",
        )
