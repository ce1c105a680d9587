"""The precision each GEMM runs in: ``training.dtype``, unless ``training.gemm_precision`` moves it.

A GEMM is named by Megatron-Core's module path (:func:`module_path`), so a Megatron quantization recipe's
glob matchers (``te_quant.cfg``) apply to moesim's GEMMs as they apply to Megatron's modules.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from functools import lru_cache

from sim.inputs.model_section import ModelConfig
from sim.inputs.precision_section import GemmPrecision

#: moesim's GEMM names (sim.model.flops) -> the module path under a Megatron layer
MEGATRON_PATH = {
    "linear_qkv": "self_attention.linear_qkv",
    "linear_proj": "self_attention.linear_proj",
    "linear_q": "self_attention.linear_q_proj",
    "linear_q_down": "self_attention.linear_q_down_proj",
    "linear_q_up": "self_attention.linear_q_up_proj",
    "linear_kv_down": "self_attention.linear_kv_down_proj",
    "linear_kv_up": "self_attention.linear_kv_up_proj",
    "linear_fc1": "mlp.linear_fc1",
    "linear_fc2": "mlp.linear_fc2",
    "expert.linear_fc1": "mlp.experts.linear_fc1",
    "expert.linear_fc2": "mlp.experts.linear_fc2",
    "shared_expert.linear_fc1": "mlp.shared_experts.linear_fc1",
    "shared_expert.linear_fc2": "mlp.shared_experts.linear_fc2",
    "shared_expert.gate": "mlp.shared_experts.gate_weight",
    "moe.fc1_latent_proj": "mlp.fc1_latent_proj",
    "moe.fc2_latent_proj": "mlp.fc2_latent_proj",
    "mamba.in_proj": "mixer.in_proj",
    "mamba.out_proj": "mixer.out_proj",
}


def module_path(m: ModelConfig, gemm: str, layer: int) -> str:
    """Megatron-Core's module path of GEMM ``gemm`` in layer ``layer`` (0-based; from ``num_layers`` on, the
    MTP modules: ``mtp.layers.J.eh_proj`` and ``mtp.layers.J.transformer_layer.*``)."""
    if gemm == "mtp.eh_proj":
        return f"mtp.layers.{max(layer - m.num_layers, 0)}.eh_proj"
    if layer >= m.num_layers:
        return f"mtp.layers.{layer - m.num_layers}.transformer_layer.{MEGATRON_PATH[gemm]}"
    return f"decoder.layers.{layer}.{MEGATRON_PATH[gemm]}"


@lru_cache(maxsize=65536)
def _matched(patterns: tuple[tuple[str, str], ...], path: str) -> str | None:
    return next((dt for pattern, dt in patterns if fnmatchcase(path, pattern)), None)


def gemm_precision(m: ModelConfig, p: GemmPrecision, default: str, gemm: str, layer: int | None) -> str:
    """The dtype GEMM ``gemm`` of layer ``layer`` runs in: BF16 in the BF16 first / last layers (an MTP module
    counts as past the last), else the first matching module pattern's, else ``default``. ``layer`` None: a
    GEMM outside the layers (``default``)."""
    if layer is None or not p.active:
        return default
    if layer < p.bf16_first_layers or (p.bf16_last_layers and layer >= m.num_layers - p.bf16_last_layers):
        return "bf16"
    hit = _matched(tuple((x.pattern, x.dtype) for x in p.modules), module_path(m, gemm, layer))
    return hit or default


__all__ = ["MEGATRON_PATH", "gemm_precision", "module_path"]
