"""Muon as Megatron-Core's dist_muon runs it (training.optimizer: muon; sim/frameworks/muon.py): five
quintic Newton-Schulz steps of three BF16 GEMMs on every weight matrix a data-parallel rank owns,
gradients all-reduced (not reduce-scattered) and parameters all-gathered after the step, 8 bytes of
optimizer state per parameter. Closed forms below; and Kimi K2 (model_type kimi_k2) at its published
size."""

from __future__ import annotations

import pytest
from conftest import ROOT, run_cli

from sim.api import load_scenario, simulate
from sim.engine.simulate import cost_model
from sim.errors import InputError
from sim.frameworks.builder import build_program
from sim.frameworks.muon import MUON_BYTES_PER_PARAM, NS_STEPS, layer_matrices, newton_schulz_s
from sim.frameworks.policies import policy_of
from sim.inputs.hfconfig import model_fields_from_hf
from sim.model.flops import Gemm
from sim.model.params import count_params

SCEN = ROOT / "scenarios" / "128gpu.yaml"
MEGATRON = ["training.framework=megatron", "model.num_layers=4", "cluster.nodes=2", "parallelism.ep=8",
            "routing.generator=balanced", "training.grad_accum_steps=2"]  # fmt: skip


def test_newton_schulz_is_five_steps_of_three_gemms():
    s = load_scenario(SCEN, MEGATRON)
    cost = cost_model(s)
    g = Gemm("w", 7168, 2048)  # a [2048, 7168] weight: m = 2048 <= n = 7168
    m, n = 2048, 7168
    want = NS_STEPS * (cost.gemm_time(m, m, n, "bf16") + cost.gemm_time(m, m, m, "bf16") + cost.gemm_time(m, n, m, "bf16"))
    assert newton_schulz_s(cost, g) == pytest.approx(want, rel=1e-12)
    assert newton_schulz_s(cost, Gemm("t", 2048, 7168)) == pytest.approx(want, rel=1e-12)  # orientation-free
    # the FLOPs a step does, 4 m^2 n + 2 m^3, at the curve's rates: more than the closed form at peak
    peak = cost.gemm_curve("bf16").peak_flops
    assert newton_schulz_s(cost, g) > NS_STEPS * (4 * m * m * n + 2 * m**3) / peak


def test_a_ranks_step_is_its_share_of_the_matrices_and_the_update():
    s = load_scenario(SCEN, MEGATRON + ["training.optimizer=muon"])
    cost = cost_model(s)
    prog = build_program(s, cost)
    tail = prog.stages[0].tail
    layers = [i for c in prog.stages[0].chunks for i in c.layers]
    ns = 0.0
    for i in layers:
        dense, expert = layer_matrices(s, i)
        ns += sum(newton_schulz_s(cost, g) for g in dense) / s.dp + sum(newton_schulz_s(cost, g) for g in expert) * s.experts_per_rank / s.edp
    want = ns + tail.optimizer_params * MUON_BYTES_PER_PARAM / cost.hbm_Bps + cost.optimizer_overhead_s
    assert tail.optimizer_s == pytest.approx(want, rel=1e-12)
    # muon_split_qkv: a GQA layer's fused QKV is orthogonalized as three matrices
    names = [g.name for g in layer_matrices(s, 0)[0]]
    assert names[:3] == ["q", "k", "v"] and "linear_qkv" not in names


def test_gradients_are_all_reduced_and_states_are_smaller():
    adam = load_scenario(SCEN, MEGATRON)
    muon = load_scenario(SCEN, MEGATRON + ["training.optimizer=muon"])
    pa, pm = policy_of(adam), policy_of(muon)
    assert (pa.grad_kind, pa.step_gather, pa.post_step_gather) == ("reduce_scatter", True, False)
    assert (pm.grad_kind, pm.step_gather, pm.post_step_gather) == ("all_reduce", False, True)
    ra, rm = simulate(adam), simulate(muon)
    assert rm.memory["optimizer_GiB"] == pytest.approx(ra.memory["optimizer_GiB"] * 8 / 12, rel=1e-3)
    assert rm.breakdown_s["optimizer"] > ra.breakdown_s["optimizer"]


def test_muon_is_megatrons():
    with pytest.raises(InputError) as err:
        load_scenario(SCEN, ["training.optimizer=muon"])  # 128gpu.yaml runs DeepSpeed
    assert err.value.field == "training.optimizer" and "dist_muon" in str(err.value)
    r = run_cli("simulate", str(SCEN), "--set", "training.optimizer=muon")
    assert r.returncode == 2 and "training.optimizer" in r.stderr
    with pytest.raises(InputError) as err:
        load_scenario(SCEN, MEGATRON + ["training.optimizer=muon", "training.offload_optimizer=cpu"])
    assert err.value.field == "training.offload_optimizer"


def test_kimi_k2_config_is_deepseek_v3s_architecture_at_its_published_size():
    path = ROOT / "validation" / "published" / "models" / "Kimi-K2" / "config.json"
    from sim.inputs.model_section import ModelConfig

    m = ModelConfig(**model_fields_from_hf(path))
    assert (m.attention, m.num_experts, m.top_k, m.first_dense_layers, m.mtp_layers) == ("mla", 384, 8, 1, 0)
    c = count_params(m)
    assert c.total == pytest.approx(1.03e12, rel=0.01)  # model card: 1T total
    assert c.active == pytest.approx(32.9e9, rel=0.01)  # model card: 32B activated
