"""Megatron-Core's selective ``recompute_modules`` (training.recompute_modules): each module's recompute
time is its forward kernels' (closed forms from the pricer's own blocks), ``moe`` re-runs the MoE
forward with its all-to-alls, ``mlp`` a dense MLP with its TP collectives, the activations each module
drops come off the stage's memory, and bad lists exit 2 naming the field."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT, run_cli

from sim.api import load_scenario, simulate
from sim.engine.simulate import cost_model
from sim.errors import InputError
from sim.frameworks.pricing import Pricer
from sim.model.flops import Gemm
from sim.model.stage_memory import memory_per_stage
from sim.routing.plan import route_scenario

SCEN = ROOT / "scenarios" / "128gpu.yaml"
MEGATRON = ["training.framework=megatron", "model.num_layers=4", "cluster.nodes=1", "parallelism.ep=4",
            "routing.generator=balanced", "training.grad_accum_steps=2"]  # fmt: skip
MLA = ["model.attention=mla", "model.q_lora_rank=512", "model.kv_lora_rank=256", "model.qk_nope_head_dim=64",
       "model.qk_rope_head_dim=32", "model.v_head_dim=64", "model.head_dim=null", "model.qk_norm=none",
       "model.num_kv_heads=null"]  # fmt: skip


def _mods(mods: list[str] | None) -> list[str]:
    if mods is None:
        return ["training.activation_checkpointing=none"]
    return ["training.activation_checkpointing=selective", f"training.recompute_modules=[{','.join(mods)}]"]


def _pricer(extra: list[str]):
    s = load_scenario(SCEN, MEGATRON + extra)
    plan = route_scenario(s)
    return s, Pricer(s, plan, cost_model(s), [1.0] * s.world_size), np.arange(s.layout.stage_size)


def _recompute_s(extra: list[str], moe: int | None = 0, layer: int = 1) -> float:
    s, p, q = _pricer(extra)
    return float(p.selective_recompute(layer, moe, 0, q, 0)[0])


def test_selective_defaults_to_layernorm_and_moe_act():
    s = load_scenario(SCEN, MEGATRON + ["training.activation_checkpointing=selective"])
    assert s.training.recompute_set == {"layernorm", "moe_act"}
    assert _recompute_s(["training.activation_checkpointing=selective"]) == _recompute_s(_mods(["layernorm", "moe_act"]))


def test_each_module_prices_its_forward_and_they_add_up():
    s, p, _ = _pricer(_mods(["layernorm"]))
    d, bpe = s.model.hidden_size, 2
    norm = 2 * p.T_sp * d * bpe / p.cost.hbm_Bps + p.cost.launch_s
    assert _recompute_s(_mods(["layernorm"])) == pytest.approx(2 * norm, rel=1e-12)
    core_f = p._attention_core(1)[0]
    assert _recompute_s(_mods(["core_attn"])) == pytest.approx(core_f, rel=1e-12)
    # moe_act: the experts' activation passes over the rows the rank's experts receive (balanced: T k in all)
    rows = p.T * s.model.top_k
    act = rows * s.model.moe_ffn_hidden_size * bpe * 3 / p.cost.hbm_Bps + s.experts_per_rank * p.cost.launch_s
    assert _recompute_s(_mods(["moe_act"])) == pytest.approx(act, rel=1e-9)
    both = _recompute_s(_mods(["layernorm", "moe_act", "core_attn"]))
    assert both == pytest.approx(2 * norm + act + core_f, rel=1e-9)
    # moe_act recomputes nothing in a dense layer
    assert _recompute_s(_mods(["moe_act"]), moe=None) == 0.0


def test_mla_up_proj_prices_the_up_projections():
    s, p, _ = _pricer(MLA + _mods(["mla_up_proj"]))
    m = s.model
    f_q, *_ = p._gemm(Gemm("linear_q_up", m.num_attention_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim),
                           m.q_lora_rank), p.T)  # fmt: skip
    f_kv, *_ = p._gemm(Gemm("linear_kv_up", m.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim),
                            m.kv_lora_rank), p.T)  # fmt: skip
    rope = 2 * p.T * (m.num_attention_heads + 1) * m.qk_rope_head_dim * 2 / p.cost.hbm_Bps + 2 * p.cost.launch_s
    assert _recompute_s(MLA + _mods(["mla_up_proj"])) == pytest.approx(float(f_q[0] + f_kv[0]) + rope, rel=1e-9)
    with pytest.raises(InputError, match="training.recompute_modules"):
        load_scenario(SCEN, MEGATRON + _mods(["mla_up_proj"]))  # GQA model


def test_moe_module_runs_the_all_to_alls_again():
    """Balanced routing, no overlap: forward 2 all-to-alls a layer, backward 2, the MoE recompute 2 more."""
    none = simulate(load_scenario(SCEN, MEGATRON + _mods(None)))
    moe = simulate(load_scenario(SCEN, MEGATRON + _mods(["moe"])))
    assert moe.breakdown_s["a2a"] / none.breakdown_s["a2a"] == pytest.approx(1.5, rel=0.02)
    assert moe.breakdown_s["compute"] > none.breakdown_s["compute"]
    # and the experts' activations are no longer kept
    assert moe.memory["activations_GiB"] < none.memory["activations_GiB"]


def test_mlp_module_reruns_the_dense_mlp_with_its_tp_collectives():
    """A dense layer's MLP is wrapped in a TP all-gather and reduce-scatter, forward and backward (4): its
    recompute adds 2 more. So recomputing the MLPs of 2 dense layers adds what making a third layer dense
    adds (an MoE layer's TP collectives are its attention's only)."""
    tp = ["parallelism.tp=2", "parallelism.ep=2", "parallelism.sequence_parallel=true"]

    def tp_comm(dense: int, mods):
        r = simulate(load_scenario(SCEN, MEGATRON + tp + [f"model.first_dense_layers={dense}"] + _mods(mods)))
        return r.breakdown_s["tp_comm"], r.breakdown_s["compute"]

    two, c2 = tp_comm(2, None)
    three, _ = tp_comm(3, None)
    again, c_again = tp_comm(2, ["mlp"])
    assert again - two == pytest.approx(three - two, rel=1e-6)
    assert c_again > c2


def test_memory_drops_what_the_modules_recompute():
    def act(extra):
        s = load_scenario(SCEN, MEGATRON + extra)
        return s, memory_per_stage(s)[0].activations

    s, none = act(_mods(None))
    _, ln = act(_mods(["layernorm"]))
    _, ln_act = act(_mods(["layernorm", "moe_act"]))
    tokens, d, bpe, layers = s.training.micro_batch_size * s.training.seq_len, s.model.hidden_size, 2, 4
    assert none - ln == 2 * tokens * d * bpe * layers
    rows = tokens * s.model.top_k  # the rows a rank's experts receive under even routing
    assert ln - ln_act == rows * s.model.moe_ffn_hidden_size * bpe * layers
    _, core = act(_mods(["core_attn"]))
    assert core == none  # FlashAttention keeps no more than the checkpoint's inputs and output


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (["training.recompute_modules=[moe]", "training.activation_checkpointing=full"], "activation_checkpointing"),
        (["training.recompute_modules=[moe,moe]", "training.activation_checkpointing=selective"], "twice"),
        (["training.recompute_modules=[attention]", "training.activation_checkpointing=selective"], "core_attn"),
    ],
)
def test_bad_lists_exit_2_naming_the_field(sets, match):
    r = run_cli("simulate", str(SCEN), *sum((["--set", x] for x in MEGATRON + sets), []))
    assert r.returncode == 2
    assert "recompute_modules" in r.stderr and match in r.stderr


def test_deepspeed_has_no_recompute_modules():
    with pytest.raises(InputError, match="training.recompute_modules"):
        load_scenario(SCEN, ["training.recompute_modules=[moe]", "training.activation_checkpointing=selective"])
