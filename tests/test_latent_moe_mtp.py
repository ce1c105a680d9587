"""LatentMoE (``model.moe_latent_size``, Megatron's ``fc1_latent_proj`` / ``fc2_latent_proj``) and the MTP
modules' layers (DeepSeek-V3's MLA + MoE, Nemotron 3's attention + MoE, repeated or not): Nemotron 3 Super's
parameter count against its name, the latent shapes and dispatch width by hand, and the ops the last stage
runs for each MTP module."""

from __future__ import annotations

import pytest
from conftest import ROOT, megatron_scenario

from sim.api import load_scenario
from sim.engine.simulate import cost_model
from sim.errors import InputError
from sim.frameworks.builder import build_program
from sim.frameworks.program import Grads, Kernels
from sim.inputs.hfconfig import model_fields_from_hf
from sim.inputs.model_section import ModelConfig
from sim.model.flops import expert_gemms, latent_gemms
from sim.model.params import count_params, layer_params, mtp_params
from sim.routing.plan import route_scenario

MODELS = ROOT / "validation" / "published" / "models"
SUPER = MODELS / "Nemotron-3-Super-120B-A12B" / "config.json"


def super_model(**changes) -> ModelConfig:
    return ModelConfig(**{**model_fields_from_hf(SUPER), **changes})


def scenario(tmp_path, model: dict):
    return megatron_scenario(tmp_path, model, "dgx-b200", seq_len=2048, dtype="mxfp8")


def test_nemotron3_super_matches_its_name():
    m = super_model()
    c = count_params(m)
    assert c.total == pytest.approx(120e9, rel=1e-2)  # 120B-A12B
    assert c.active - m.vocab_size * m.hidden_size == pytest.approx(12e9, rel=2.5e-2)


def test_latent_shapes_and_parameters_by_hand():
    m = super_model()
    d, latent, w = 4096, 1024, 2688
    assert [(g.n, g.k) for g in expert_gemms(m)] == [(w, latent), (latent, w)]  # relu2: fc1, fc2 at the latent
    assert [(g.n, g.k) for g in latent_gemms(m)] == [(latent, d), (d, latent)]
    moe = layer_params(m, 1)  # MEMEM...: block 1 is MoE
    assert moe.expert_each == 2 * latent * w and moe.latent_proj == 2 * d * latent
    assert moe.shared_expert == 2 * d * 5376  # the shared expert stays at hidden_size
    assert layer_params(m, 0).latent_proj == 0  # a Mamba-2 block


def test_repeated_mtp_counts_one_module():
    once, twice = super_model(), super_model(mtp_layers=2, mtp_repeated_layer=True)
    assert mtp_params(twice) == mtp_params(once)
    assert mtp_params(super_model(mtp_layers=2))[0] == 2 * mtp_params(once)[0]
    block = layer_params(once, once.num_layers)  # the *E module: attention, MoE, two pre-norms
    assert block.attention > 0 and block.num_experts == 512 and block.norms == 2 * 4096
    with pytest.raises(ValueError, match=r"\[mtp_repeated_layer\]"):
        super_model(mtp_layers=0, mtp_repeated_layer=True)


def test_dispatch_moves_the_latent_width(tmp_path):
    model = {"hf_config": str(SUPER), "num_layers": 4, "hybrid_pattern": "M*EE", "mtp_layers": 0}
    s = load_scenario(scenario(tmp_path, model))
    assert s.model.moe_token_width == 1024
    assert route_scenario(s).hidden_size == 1024  # the all-to-all's bytes per routed token (x bytes/element)


def _head_ops(s):
    prog = build_program(s, cost_model(s))
    chunk = next(c for st in prog.stages for c in st.chunks if c.layers and c.layers[-1] == s.model.num_layers - 1)
    return chunk


def test_mtp_modules_run_their_layer_and_the_head_again(tmp_path):
    model = {"hf_config": str(SUPER), "num_layers": 4, "hybrid_pattern": "M*EE", "mtp_layers": 2,
             "mtp_repeated_layer": True}  # fmt: skip
    s = load_scenario(scenario(tmp_path, model))
    chunk = _head_ops(s)
    names = [k.name for op in chunk.fwd if isinstance(op, Kernels) for k in op.kernels]
    assert names.count("mtp_proj") == 2 and names.count("output") == 3  # the LM head for the model and each module
    mtp = [op for op in chunk.fwd if isinstance(op, Kernels) and op.layer in (4, 5)]
    assert {k.name for op in mtp for k in op.kernels} >= {"attention", "experts", "route"}
    grads = {op.layer: op for op in chunk.bwd if isinstance(op, Grads)}
    assert grads[4].nonexpert > 0 and grads[4].expert > 0  # the module's weights, reduced once
    assert grads[5].nonexpert == grads[5].expert == 0  # repeated: the same weights again


def test_deepseek_mtp_layer_is_mla_and_moe(tmp_path):
    model = {"hf_config": str(MODELS / "DeepSeek-V3" / "config.json"), "num_layers": 4, "first_dense_layers": 1}
    s = load_scenario(scenario(tmp_path, model))
    chunk = _head_ops(s)
    mtp = [k.name for op in chunk.fwd if isinstance(op, Kernels) and op.layer == 4 for k in op.kernels]
    assert "attention" in mtp and "experts" in mtp and "shared_experts" in mtp


def test_latent_moe_needs_megatron_or_fsdp2(tmp_path):
    model = {"hf_config": str(SUPER), "num_layers": 4, "hybrid_pattern": "M*EE", "mtp_layers": 0}
    with pytest.raises(InputError) as e:
        load_scenario(scenario(tmp_path, model), ["training.framework=deepspeed"])
    assert e.value.field == "training.framework"
    with pytest.raises(ValueError, match=r"\[moe_latent_size\]"):
        ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=128, moe_latent_size=16)
