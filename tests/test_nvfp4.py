"""NVFP4 training (training.dtype nvfp4: TransformerEngine's NVFP4BlockScaling as Megatron-Core runs it), against
TransformerEngine's GEMM profiling guide on B300 and Megatron-Bridge's same-layout MXFP8 / NVFP4 pair (F1, F2)."""

from __future__ import annotations

import numpy as np
import pytest

from sim.cli.main import main
from sim.engine.simulate import cost_model, simulate
from sim.frameworks.pricing import Pricer
from sim.hardware.costs import CostModel
from sim.inputs.topology import load_gpu
from sim.model.dtypes import (
    NVFP4_COPY_BYTES,
    QUANT_BYTES_PER_ELEMENT,
    QUANT_KERNELS,
    fp8_recipe,
    is_quantized,
    saved_gemm_input_bytes,
    storage_dtype,
)
from sim.model.flops import dense_ffn_gemms
from sim.studies.published import FOLDER, entries, scenario_of
from tests.conftest import megatron_scenario

#: TE docs/examples/gemm_profiling/gemm_profiling.rst (TE@1609c89), B300 SXM6 AC, hidden 4096, FFN 16384,
#: M = 31 x 512: per-layer GEMM ms (fprop + dgrad + wgrad of QKV, attention out, MLP up, MLP down), pre-quantized
TE_B300_PREQUANT_MS = {"fp8": 6.812, "mxfp8": 7.161, "nvfp4": 3.764}


def test_nvfp4_bytes_are_the_formats():
    assert NVFP4_COPY_BYTES == 0.5 + 1 / 16  # E2M1 nibble + one E4M3 scale per 16 elements
    # amax pass (read bf16), cast pass (read bf16), rowwise + transformed columnwise 4-bit copies
    assert QUANT_BYTES_PER_ELEMENT["nvfp4"] == 2 + 2 + 2 * (0.5 + 1 / 16)
    assert QUANT_KERNELS["nvfp4"] == 2
    assert saved_gemm_input_bytes("nvfp4", "delayed") == 0.5625
    assert fp8_recipe("nvfp4", "delayed") == "nvfp4" and storage_dtype("nvfp4") == "bf16"
    assert is_quantized("nvfp4") and is_quantized("mxfp8") and not is_quantized("bf16")


def test_block_scaled_gemms_match_transformer_engines_b300_guide():
    """FP8's curve (fitted to vLLM's and ml-engineering's points, not to TE's) and the block-scaled formats at
    their measured ratios to it: each of TE's three kernel-only layer times within 10%."""
    gpu = load_gpu("b300-sxm")
    assert gpu.gemm_rate_over_fp8 == {"mxfp8": pytest.approx(6.812 / 7.161, abs=5e-4),
                                      "nvfp4": pytest.approx(6.812 / 3.764, abs=5e-4)}  # fmt: skip
    cost = CostModel(gpu, burst=True)
    m, h, f = 31 * 512, 4096, 16384
    for dt, ms in TE_B300_PREQUANT_MS.items():
        model = sum(sum(x[0] for x in cost.gemm_train_times(np.array([m]), n, k, dt))
                    for k, n in [(h, 3 * h), (h, h), (h, f), (f, h)])  # fmt: skip
        assert model * 1e3 == pytest.approx(ms, rel=0.10), dt
    assert load_gpu("gb300").gemm_rate_over_fp8 == gpu.gemm_rate_over_fp8  # Blackwell Ultra: B300's ratios
    for kind in ("b200-sxm", "gb200"):  # Blackwell: B300's MXFP8 ratio; NVFP4 fitted to B200's own kernel points
        assert load_gpu(kind).gemm_rate_over_fp8 == {"mxfp8": gpu.gemm_rate_over_fp8["mxfp8"]}
    b200 = CostModel(load_gpu("b200-sxm"), burst=True)  # vLLM PR #20646, N 6144, K 4096, kernel only
    for m, tflops in ((1024, 2895.0), (4096, 3645.6), (16384, 3904.3)):
        assert 2 * m * 6144 * 4096 / b200.gemm_time(m, 6144, 4096, "nvfp4") / 1e12 == pytest.approx(tflops, rel=0.10)


def _pricer(entry_id: str):
    s = scenario_of(next(x for x in entries() if x["id"] == entry_id))
    return Pricer(s, None, cost_model(s), [1.0] * s.world_size)


def test_nvfp4_gemm_pays_its_casts():
    p = _pricer("F2")
    assert p.dt == "nvfp4" and p.recipe == "nvfp4" and p.quantized
    g = dense_ffn_gemms(p.m)[0]
    rows = 8192.0
    fwd, dgrad, wgrad, flops = p._gemm(g, rows)
    bare_f, bare_b = p.cost.gemm_train_times(np.array([rows]), g.n, g.k, "nvfp4")
    per, launch = QUANT_BYTES_PER_ELEMENT["nvfp4"] / p.cost.hbm_Bps, 2 * p.cost.launch_s
    assert fwd[0] - bare_f[0] == pytest.approx(rows * g.k * per + launch + (g.n * g.k * per + launch) / 16, rel=1e-9)
    assert dgrad[0] + wgrad[0] - bare_b[0] == pytest.approx(rows * g.n * per + launch, rel=1e-9)
    assert flops[0] == 2 * rows * g.n * g.k


def test_nvfp4_step_against_its_mxfp8_pair():
    """Megatron-Bridge 26.04.01, Llama 3 70B on 64 GB300, one layout: NVFP4 / MXFP8 throughput 7296 / 4864 = 1.50."""
    f1, f2 = (simulate(scenario_of(next(x for x in entries() if x["id"] == i))) for i in ("F1", "F2"))
    assert f1["step_time_s"] / f2["step_time_s"] == pytest.approx(7296 / 4864, rel=0.05)


@pytest.mark.parametrize("topology, training, field", [
    ("dgx-h100", {}, "training.dtype"),                                    # Hopper has no FP4 tensor cores
    ("dgx-b200", {"framework": "fsdp2"}, "training.dtype"),                # Megatron-Core's recipe only
    ("dgx-b200", {"fp8_attention": True}, "training.fp8_attention"),       # FP8 attention needs fp8 / mxfp8
    ("dgx-b200", {"fp8_output_proj": True}, "training.fp8_output_proj"),   # MXFP8 only, as Megatron
])  # fmt: skip
def test_nvfp4_refusals_exit_2(tmp_path, capsys, topology, training, field):
    model = {"hf_config": str(FOLDER / "models" / "Qwen3-30B-A3B" / "config.json")}
    path = megatron_scenario(tmp_path, model, topology=topology, **{"dtype": "nvfp4", "framework": "megatron", **training})
    assert main(["simulate", str(path)]) == 2
    assert field in capsys.readouterr().err


#: Megatron-Bridge's Nemotron 3 Super NVFP4 recipe (scripts/performance/configs/nemotronh/te_quant.cfg@63b08b3):
#: attention and LatentMoE projections and MTP in BF16, Mamba's out_proj in MXFP8; the last 14 layers BF16
SUPER_TE_QUANT = [{"pattern": "*.linear_qkv", "dtype": "bf16"}, {"pattern": "*.linear_proj", "dtype": "bf16"},
                  {"pattern": "*mlp.fc[12]_latent_proj", "dtype": "bf16"}, {"pattern": "mtp.*", "dtype": "bf16"},
                  {"pattern": "*mixer.out_proj", "dtype": "mxfp8"}]  # fmt: skip


def test_module_paths_are_megatrons_and_the_recipe_matches_them():
    from sim.frameworks.precision import gemm_precision, module_path
    from sim.inputs.precision_section import GemmPrecision

    s = scenario_of(next(x for x in entries() if x["id"] == "S1"))
    m = s.model
    assert module_path(m, "mamba.out_proj", 0) == "decoder.layers.0.mixer.out_proj"
    assert module_path(m, "moe.fc1_latent_proj", 1) == "decoder.layers.1.mlp.fc1_latent_proj"
    assert module_path(m, "expert.linear_fc2", 1) == "decoder.layers.1.mlp.experts.linear_fc2"
    assert module_path(m, "linear_qkv", m.num_layers) == "mtp.layers.0.transformer_layer.self_attention.linear_qkv"
    assert module_path(m, "mtp.eh_proj", m.num_layers + 1) == "mtp.layers.1.eh_proj"
    p = GemmPrecision(bf16_first_layers=1, bf16_last_layers=14, modules=SUPER_TE_QUANT)
    at = lambda g, layer: gemm_precision(m, p, "nvfp4", g, layer)  # noqa: E731
    assert at("mamba.in_proj", 0) == "bf16" and at("mamba.in_proj", 1) == "nvfp4"  # the first layer
    assert at("mamba.out_proj", 1) == "mxfp8" and at("linear_qkv", 5) == "bf16"
    assert at("moe.fc2_latent_proj", 5) == "bf16" and at("expert.linear_fc1", 5) == "nvfp4"
    assert at("expert.linear_fc1", m.num_layers - 14) == "bf16" and at("expert.linear_fc1", m.num_layers - 15) == "nvfp4"
    assert at("mtp.eh_proj", m.num_layers) == "bf16"
    assert gemm_precision(m, GemmPrecision(), "nvfp4", "linear_qkv", 5) == "nvfp4"  # nothing moved


def test_moved_gemms_are_priced_in_their_precision():
    s = scenario_of(next(x for x in entries() if x["id"] == "F2"))
    from sim.inputs.precision_section import GemmPrecision

    t = s.training.model_copy(update={"gemm_precision": GemmPrecision.model_validate({"bf16_last_layers": 2, "modules": [
        {"pattern": "*.mlp.linear_fc2", "dtype": "mxfp8"}]})})  # fmt: skip
    moved = s.model_copy(update={"training": t})
    moved._topology = s.topology
    base, p = Pricer(s, None, cost_model(s), [1.0] * s.world_size), Pricer(moved, None, cost_model(s), [1.0] * s.world_size)
    fc1, fc2 = dense_ffn_gemms(s.model)
    last = s.model.num_layers - 1
    bf16 = p.cost.gemm_train_times(np.array([8192.0]), fc1.n, fc1.k, "bf16")[0][0]
    assert p._gemm(fc1, 8192.0, layer=last)[0][0] == pytest.approx(bf16, rel=1e-12)  # BF16, no casts
    assert p._gemm(fc1, 8192.0, layer=0)[0][0] == base._gemm(fc1, 8192.0, layer=0)[0][0]  # untouched
    mx = p._gemm(fc2, 8192.0, layer=0)[0][0]
    assert mx > base._gemm(fc2, 8192.0, layer=0)[0][0]  # MXFP8 at 0.951 x FP8 against NVFP4 at 1.81 x
    q = QUANT_BYTES_PER_ELEMENT["mxfp8"] / p.cost.hbm_Bps
    bare = p.cost.gemm_train_times(np.array([8192.0]), fc2.n, fc2.k, "mxfp8")[0][0]
    assert mx - bare == pytest.approx(8192 * fc2.k * q + p.cost.launch_s + (fc2.n * fc2.k * q + p.cost.launch_s) / 16, rel=1e-9)
    assert simulate(moved)["step_time_s"] > simulate(s)["step_time_s"]


@pytest.mark.parametrize("training, field", [
    ({"dtype": "bf16", "gemm_precision": {"bf16_last_layers": 1}}, "training.gemm_precision"),
    ({"dtype": "nvfp4", "gemm_precision": {"bf16_first_layers": 40, "bf16_last_layers": 40}}, "training.gemm_precision"),
    ({"dtype": "nvfp4", "gemm_precision": {"modules": [{"pattern": "*", "dtype": "fp16"}]}}, "training.gemm_precision"),
])  # fmt: skip
def test_gemm_precision_refusals_exit_2(tmp_path, capsys, training, field):
    model = {"hf_config": str(FOLDER / "models" / "Qwen3-30B-A3B" / "config.json")}
    path = megatron_scenario(tmp_path, model, topology="dgx-b200", **{"framework": "megatron", **training})
    assert main(["simulate", str(path)]) == 2
    assert field in capsys.readouterr().err
