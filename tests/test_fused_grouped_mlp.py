"""TransformerEngine's CuTe DSL fused grouped MLP (training.cutedsl_fused_grouped_mlp; TE
ops/fused/grouped_mlp.py, Megatron-Bridge cutedsl_fused_grouped_mlp): fc1's epilogue applies the GLU
and writes fc2's MXFP8 input, fc2's dgrad epilogue applies the GLU's gradient and quantizes it. So the
experts lose exactly their activation passes and those two quantizations (closed forms below), the
GEMMs are unchanged, ``moe_act`` recompute costs nothing more, and bad combinations exit 2."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT, run_cli

from sim.api import load_scenario
from sim.engine.simulate import cost_model
from sim.errors import InputError
from sim.frameworks.pricing import Pricer
from sim.model.dtypes import QUANT_BYTES_PER_ELEMENT, QUANT_KERNELS
from sim.model.flops import expert_gemms
from sim.routing.plan import route_scenario

SCEN = ROOT / "scenarios" / "128gpu.yaml"
BASE = ["cluster.topology=dgx-b200", "cluster.nodes=1", "training.framework=megatron", "training.dtype=mxfp8",
        "model.num_layers=4", "parallelism.ep=8", "routing.generator=balanced", "training.grad_accum_steps=2"]  # fmt: skip


def _experts(extra: list[str]):
    s = load_scenario(SCEN, BASE + extra)
    p = Pricer(s, route_scenario(s), cost_model(s), [1.0] * s.world_size)
    q = np.arange(s.layout.stage_size)
    return s, p, q, p._routed("experts", 0, 0, q)


def test_fusion_removes_the_activation_passes_and_two_quantizations():
    s, p, q, (f0, d0, w0, x0) = _experts([])
    _, pf, _, (f1, d1, w1, x1) = _experts(["training.cutedsl_fused_grouped_mlp=true"])
    assert pf.fused_mlp and not p.fused_mlp
    m, hbm, launch = s.model, p.cost.hbm_Bps, p.cost.launch_s
    rows = p._expert_rows(0, 0, q)  # (ranks, experts_per_rank), every expert receives rows here
    assert (rows > 0).all()
    width, bpe = m.moe_ffn_hidden_size, 2
    per, k = QUANT_BYTES_PER_ELEMENT["mxfp8"] / hbm, QUANT_KERNELS["mxfp8"] * launch
    act = (rows * width * bpe * 3 / hbm + launch).sum(axis=1)  # SwiGLU: read 2w, write w
    fc2_in = (rows * width * per + k).sum(axis=1)  # forward: fc2's input, written quantized by fc1's epilogue
    fc1_grad = (rows * 2 * width * per + k).sum(axis=1)  # backward: the GLU's gradient, quantized in fc2's dgrad
    assert f0 - f1 == pytest.approx(act + fc2_in, rel=1e-9)
    assert d0 - d1 == pytest.approx(2 * act + fc1_grad, rel=1e-9)
    assert w1 == pytest.approx(w0, rel=1e-12) and x1 == pytest.approx(x0, rel=1e-12)  # same GEMMs, same FLOPs
    assert x0[0] == pytest.approx(rows[0].sum() * sum(2 * g.n * g.k for g in expert_gemms(m)), rel=1e-12)


def test_moe_act_recompute_is_inside_the_fused_kernel():
    sel = ["training.activation_checkpointing=selective", "training.recompute_modules=[moe_act]"]
    _, p, q, _ = _experts(sel)
    _, pf, _, _ = _experts(sel + ["training.cutedsl_fused_grouped_mlp=true"])
    assert float(p.selective_recompute(1, 0, 0, q, 0)[0]) > 0
    assert float(pf.selective_recompute(1, 0, 0, q, 0)[0]) == 0.0


def test_the_fused_step_is_faster_and_only_by_the_experts():
    from sim.api import simulate

    plain = simulate(load_scenario(SCEN, BASE))
    fused = simulate(load_scenario(SCEN, BASE + ["training.cutedsl_fused_grouped_mlp=true"]))
    assert fused.step_time_s < plain.step_time_s
    assert fused.breakdown_s["compute"] < plain.breakdown_s["compute"]
    assert fused.traffic == plain.traffic  # the same tokens move


@pytest.mark.parametrize(
    "extra, says",
    [
        (["training.dtype=bf16"], "training.dtype is 'bf16'"),
        (["model.ffn_type=plain", "model.ffn_hidden_size=4096"], "model.ffn_type 'plain'"),
    ],
)
def test_fusion_needs_mxfp8_and_gated_experts(extra, says):
    with pytest.raises(InputError) as err:
        load_scenario(SCEN, BASE + ["training.cutedsl_fused_grouped_mlp=true"] + extra)
    assert err.value.field == "training.cutedsl_fused_grouped_mlp" and says in str(err.value)


def test_cli_exit_2_names_the_field():
    r = run_cli("simulate", str(SCEN), "--set", "training.cutedsl_fused_grouped_mlp=true")
    assert r.returncode == 2 and "cutedsl_fused_grouped_mlp" in r.stderr
