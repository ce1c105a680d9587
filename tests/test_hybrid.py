"""Hybrid models (``model.hybrid_pattern``, Megatron-Core's hybrid_override_pattern): Mamba-2, attention,
MLP and MoE blocks, each with its own pre-norm, as Nemotron-H and Nemotron-3 lay them out. Parameter
counts against NVIDIA's published ones, the Mamba-2 mixer's shapes and SSD FLOPs by hand, the SSD figure
against its source, the program's ops per block, the pricing, memory and the exit-2 checks."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT, megatron_scenario, run_cli

from sim.api import load_scenario, simulate
from sim.engine.simulate import cost_model
from sim.errors import InputError
from sim.frameworks.builder import build_program
from sim.frameworks.pricing import SSD_BWD_OVER_FWD, Pricer
from sim.frameworks.program import Kernels
from sim.hardware.costs import SSD_FWD_KERNELS
from sim.inputs.hfconfig import model_fields_from_hf
from sim.inputs.model_section import ModelConfig
from sim.inputs.topology import load_gpu
from sim.model.flops import mamba_gemms, ssd_flops_per_token
from sim.model.memory import layer_activation_bytes
from sim.model.params import count_params, layer_params, mamba_params

NANO = ROOT / "validation" / "published" / "models" / "Nemotron-3-Nano-30B-A3B" / "config.json"


def nano(**changes) -> ModelConfig:
    return ModelConfig(**{**model_fields_from_hf(NANO), **changes})


def scenario(tmp_path, pattern="ME*E", topology="dgx-h100", **training):
    return megatron_scenario(tmp_path, {"hf_config": str(NANO), "num_layers": len(pattern), "hybrid_pattern": pattern},
                             topology, **training)


def test_nemotron3_nano_matches_its_published_size():
    m = nano()
    assert (m.hybrid_pattern.count("M"), m.hybrid_pattern.count("*"), m.hybrid_pattern.count("E")) == (23, 6, 23)
    c = count_params(m)
    assert c.total == pytest.approx(31.6e9, rel=2e-3)  # model card: 31.6B total
    assert c.active == pytest.approx(3.6e9, rel=1e-2)  # 3.6B active with embeddings
    assert c.active - m.vocab_size * m.hidden_size == pytest.approx(3.2e9, rel=1e-2)  # ~3.2B without
    assert c.moe_layers == 23 and c.mamba == 23 * mamba_params(m)


def test_mamba_mixer_shapes_by_hand():
    m = nano()
    d, heads, p, g, n = 2688, 64, 64, 8, 128
    d_inner = heads * p
    in_width = 2 * d_inner + 2 * g * n + heads  # z, x, B, C, dt
    conv = d_inner + 2 * g * n
    assert [(x.n, x.k) for x in mamba_gemms(m)] == [(in_width, d), (d, d_inner)]
    assert mamba_params(m) == d * in_width + conv * 4 + conv + 3 * heads + d_inner + d_inner * d
    # one block per layer: an M layer holds the mixer and one norm, an E layer no attention
    mixer, moe, attn = (layer_params(m, i) for i in (0, 1, 5))
    assert (mixer.mamba, mixer.attention, mixer.expert, mixer.norms) == (mamba_params(m), 0, 0, d)
    assert (moe.mamba, moe.attention, moe.num_experts) == (0, 0, 128)
    assert attn.attention > 0 and attn.expert == attn.mamba == attn.dense_ffn == 0


def test_ssd_flops_by_hand_and_under_tp():
    m = nano()
    q, n, p, g, h = 128, 128, 64, 8, 64
    want = 2 * q * n * g + h * (2 * p * n + 2 * q * p + 2 * n * p)
    assert ssd_flops_per_token(m) == want == 3_407_872
    assert ssd_flops_per_token(m, 32) == want // 2  # a tp=2 rank: half the heads and half the groups


def test_ssd_figures_follow_their_sources():
    h100 = load_gpu("h100-sxm").ssd
    assert h100.fwd_Gheadtokens_per_s == pytest.approx(1.180002e7 * 128 / 1e9, abs=1e-3)  # vLLM PR #27299
    for name in ("h200-sxm", "b200-sxm", "gb200", "b300-sxm", "gb300"):
        gpu = load_gpu(name)  # derived: H100's rate x achieved HBM bandwidth ratio
        ratio = gpu.hbm_bw_GBps * gpu.hbm_efficiency / (3350 * 0.90)
        assert gpu.ssd.fwd_Gheadtokens_per_s == pytest.approx(h100.fwd_Gheadtokens_per_s * ratio, abs=2e-3)


def test_pattern_places_blocks_and_keeps_plain_models():
    m = nano()
    assert [m.layer_mixer(i) for i in range(6)] == ["mamba", None, "mamba", None, "mamba", "attention"]
    assert [m.layer_ffn(i) for i in range(6)] == [None, "moe", None, "moe", None, None]
    plain = ModelConfig(num_layers=3, hidden_size=64, ffn_hidden_size=128, moe_ffn_hidden_size=32, num_experts=4,
                        top_k=2, first_dense_layers=1)  # fmt: skip
    assert [plain.layer_mixer(i) for i in range(3)] == ["attention"] * 3
    assert [plain.layer_ffn(i) for i in range(3)] == ["dense", "moe", "moe"]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"hybrid_pattern": "MX*E" * 13}, "hybrid_pattern"),
        ({"hybrid_pattern": "ME"}, "hybrid_pattern"),
        ({"mamba_num_heads": None}, "mamba_num_heads"),
        ({"mamba_groups": 5}, "mamba_groups"),
        ({"num_experts": 1, "top_k": 1}, "hybrid_pattern"),
        ({"hybrid_pattern": None}, "mamba_num_heads"),
        ({"first_dense_layers": 1}, "hybrid_pattern"),
    ],
)
def test_bad_hybrid_models_name_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"\[{field}\]"):
        nano(**changes)


def test_program_runs_each_blocks_ops(tmp_path):
    s = load_scenario(scenario(tmp_path, "ME*E"), ["parallelism.tp=2", "parallelism.dp=4", "parallelism.ep=4",
                                                    "parallelism.sequence_parallel=true"])  # fmt: skip
    prog = build_program(s, cost_model(s))
    fwd = prog.stages[0].chunks[0].fwd
    names = {}
    for op in fwd:
        if isinstance(op, Kernels):
            names.setdefault(op.layer, []).extend(k.name for k in op.kernels)
    assert names[0] == ["mamba"] and names[2] == ["attention"]
    assert "attention" not in names[1] and "experts" in names[1] and "mamba" not in names[3]
    comms = [op.name for op in fwd if getattr(op, "layer", None) == 0 and not isinstance(op, Kernels)]
    assert comms == ["tp_all_gather", "tp_reduce_scatter"]  # in_proj column-, out_proj row-parallel


def test_mamba_block_prices_gemms_ssd_and_passes(tmp_path):
    s = load_scenario(scenario(tmp_path, "MEME"))
    cost = cost_model(s)
    pricer = Pricer(s, None, cost, [1.0] * s.world_size)
    T = 4096
    f, b, w, flops = pricer._static("mamba", 0)
    ssd = cost.ssd_time(T * 64, 64, 128)
    fig = cost.gpu.ssd
    assert ssd == pytest.approx(T * 64 / (fig.fwd_Gheadtokens_per_s * 1e9 * cost.sustained) + SSD_FWD_KERNELS * cost.launch_s)
    gemm_f = sum(float(cost.gemm_train_times([T], g.n, g.k, "bf16")[0][0]) for g in mamba_gemms(s.model))
    assert f > gemm_f + ssd and b + w > SSD_BWD_OVER_FWD * ssd
    assert flops == sum(2 * T * g.n * g.k for g in mamba_gemms(s.model)) + T * ssd_flops_per_token(s.model)


def test_mamba_layer_memory_is_its_kept_tensors():
    m = nano()
    T, d = 4096, 2688
    kept = T * d * 2  # the block's pre-norm output
    kept += (T * (d + 4096) + T * (m.mamba_in_proj_width + 4096)) * 2  # GEMM inputs, in_proj output, SSD output
    assert layer_activation_bytes(m, T, T, 1, 2, None, layer=0) == kept


@pytest.mark.parametrize(
    ("sets", "field"),
    [
        (["training.framework=deepspeed"], "training.framework"),
        (["parallelism.tp=16", "cluster.nodes=2", "parallelism.dp=1", "parallelism.ep=1"], "parallelism.tp"),
        (["parallelism.cp=2", "parallelism.dp=4", "parallelism.ep=4"], "parallelism.cp"),
    ],
)
def test_scenarios_a_hybrid_cannot_run_exit_2(tmp_path, sets, field):
    with pytest.raises(InputError) as e:
        load_scenario(scenario(tmp_path), sets)
    assert e.value.field == field


def test_simulate_a_hybrid_end_to_end(tmp_path):
    path = scenario(tmp_path, "MEM*E-", topology="dgx-b200", dtype="mxfp8")
    a = simulate(load_scenario(path, ["model.ffn_hidden_size=1024"])).to_dict()
    assert a["breakdown_s"]["compute"] > 0 and a["phases_s"]["mamba"] > 0 and a["phases_s"]["mlp"] > 0
    assert a == simulate(load_scenario(path, ["model.ffn_hidden_size=1024"])).to_dict()  # deterministic
    r = run_cli("simulate", str(path), "--set", "training.framework=deepspeed")
    assert r.returncode == 2 and "hybrid" in r.stderr


def test_selective_recompute_skips_mamba_blocks(tmp_path):
    # Megatron's MambaLayer recomputes nothing: recompute_modules act on the transformer blocks only
    s = load_scenario(scenario(tmp_path, "MEM*", activation_checkpointing="selective",
                               recompute_modules=["layernorm", "core_attn"]))  # fmt: skip
    pricer = Pricer(s, None, cost_model(s), [1.0] * s.world_size)
    q = np.arange(1)
    mamba, moe, attn = (float(pricer.selective_recompute(i, None, 0, q, 0)[0]) for i in (0, 1, 3))
    assert mamba == 0.0 and moe > 0.0 and attn > moe  # the E block's pre-norm; the attention block's core too
