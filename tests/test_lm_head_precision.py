"""GEMMs outside TransformerEngine's FP8 autocast: Megatron-Core's output layer is its own
ColumnParallelLinear, so it runs in BF16 under every FP8 recipe unless ``fp8_output_proj`` (MXFP8 only)
makes it a TE linear (megatron/core/models/gpt/gpt_model.py, transformer_config.py); the router is
``router_gating_linear`` (moe/moe_utils.py), a plain GEMM on BF16 operands."""

from __future__ import annotations

import pytest
from conftest import ROOT, megatron_scenario

from sim.api import load_scenario
from sim.engine.simulate import cost_model
from sim.errors import InputError
from sim.frameworks.pricing import Pricer

QWEN = ROOT / "validation" / "published" / "models" / "Qwen3-30B-A3B" / "config.json"


def head(tmp_path, block: str = "output", **training) -> tuple[float, float, float]:
    path = megatron_scenario(tmp_path, {"hf_config": str(QWEN), "num_layers": 2}, "dgx-b200", **training)
    s = load_scenario(path)
    return Pricer(s, None, cost_model(s), [1.0] * s.world_size)._static(block, s.model.num_layers)[:3]


def test_the_head_is_bf16_under_fp8_unless_fp8_output_proj(tmp_path):
    bf16 = head(tmp_path, dtype="bf16")
    assert head(tmp_path, dtype="mxfp8") == bf16  # same kernel, same bytes: BF16 GEMMs, no casts
    assert head(tmp_path, dtype="fp8", fp8_recipe="current") == bf16
    mx = head(tmp_path, dtype="mxfp8", fp8_output_proj=True)
    assert mx[0] < bf16[0] and mx[2] < bf16[2]  # the forward and weight-gradient GEMMs at the MXFP8 rate


def test_fp8_output_proj_needs_mxfp8(tmp_path):
    path = megatron_scenario(tmp_path, {"hf_config": str(QWEN), "num_layers": 2}, "dgx-b200", dtype="fp8",
                             fp8_output_proj=True)  # fmt: skip
    with pytest.raises(InputError) as e:
        load_scenario(path)
    assert e.value.field == "training.fp8_output_proj"


def test_the_router_is_never_fp8(tmp_path):
    assert head(tmp_path, "route", dtype="mxfp8") == head(tmp_path, "route", dtype="bf16")
    assert head(tmp_path, "route", dtype="fp8", fp8_recipe="current") == head(tmp_path, "route", dtype="bf16")
