"""Memory per GPU: ZeRO stages against the ZeRO paper's formulas, expert/EDP sharding, CPU offload,
Korthikanti et al.'s activation formula, capacity padding and checkpointing."""

from __future__ import annotations

import math

import pytest
from conftest import SCENARIOS

from sim.api import load_scenario, scenario_from_dict
from sim.inputs.scenario import ModelConfig
from sim.model.memory import (
    GiB,
    activation_bytes,
    capacity,
    layer_activation_bytes,
    memory_per_gpu,
    moe_rows_per_rank,
)
from sim.model.params import count_params

DENSE = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "vocab_size": 128,
    "ffn_hidden_size": 256,
}
MOE = {**DENSE, "num_experts": 8, "top_k": 2, "moe_ffn_hidden_size": 32}


def scenario(model: dict, nodes: int = 1, ep: int = 1, zero: int = 0, **training):
    return scenario_from_dict(
        {
            "cluster": {"topology": "dgx-h100", "nodes": nodes},
            "model": model,
            "parallelism": {"ep": ep, "zero_stage": zero},
            "training": {"micro_batch_size": 1, "seq_len": 16, **training},
            "routing": {"capacity_factor": None, "dispatch": "dropless"},
        }
    )


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_stages_follow_the_zero_paper(zero):
    # ZeRO (Rajbhandari et al. 2020) sec. 5.1, mixed precision, K = 12, Nd = 8:
    # baseline (2 + 2 + K) psi; P_os 2psi + 2psi + K psi/Nd; P_os+g 2psi + (2 + K) psi/Nd; P_os+g+p (2 + 2 + K) psi/Nd.
    s = scenario(DENSE, zero=zero, dtype="bf16")
    psi, nd = count_params(s.model).total, s.dp
    assert nd == 8 and psi % nd == 0
    expected = {
        0: (2 * psi, 2 * psi, 12 * psi),
        1: (2 * psi, 2 * psi, 12 * psi // nd),
        2: (2 * psi, 2 * psi // nd, 12 * psi // nd),
        3: (2 * psi // nd, 2 * psi // nd, 12 * psi // nd),
    }[zero]
    mem = memory_per_gpu(s)
    assert (mem.weights, mem.gradients, mem.optimizer_states) == expected
    assert mem.host_bytes_per_node == 0


def test_fp32_training_is_16_bytes_per_parameter():
    s = scenario(DENSE, dtype="fp32")
    psi = count_params(s.model).total
    mem = memory_per_gpu(s)
    assert mem.weights + mem.gradients + mem.optimizer_states == 16 * psi


def test_sgd_keeps_only_the_fp32_master():
    s = scenario(DENSE, dtype="bf16", optimizer="sgd")
    assert memory_per_gpu(s).optimizer_states == 4 * count_params(s.model).total


def test_expert_parameters_shard_over_ep_and_replicate_over_edp():
    s = scenario(MOE, ep=4, zero=1, dtype="bf16")
    c = count_params(s.model)
    assert (s.dp, s.ep, s.edp) == (8, 4, 2)
    expert_local = c.expert // 4
    mem = memory_per_gpu(s)
    assert mem.weights == 2 * (c.non_expert + expert_local)
    assert mem.optimizer_states == 12 * (math.ceil(c.non_expert / 8) + math.ceil(expert_local / 2))
    stage3 = memory_per_gpu(scenario(MOE, ep=4, zero=3, dtype="bf16"))
    assert stage3.weights == 2 * (math.ceil(c.non_expert / 8) + math.ceil(expert_local / 2))


def test_cpu_offload_moves_optimizer_states_to_the_host():
    s = scenario(MOE, ep=8, zero=2, dtype="bf16", offload_optimizer="cpu")
    on_gpu = memory_per_gpu(scenario(MOE, ep=8, zero=2, dtype="bf16"))
    mem = memory_per_gpu(s)
    assert mem.optimizer_states == 0 and mem.weights == on_gpu.weights
    # ZeRO-Offload: fp32 master + two moments + an fp32 gradient copy = 16 B per partitioned parameter.
    per_gpu_host = on_gpu.optimizer_states // 12 * 16
    assert mem.host_bytes_per_node == per_gpu_host * 8


def gpt_layer(h: int, a: int) -> ModelConfig:
    return ModelConfig(
        num_layers=1,
        hidden_size=h,
        num_attention_heads=a,
        ffn_type="plain",
        ffn_hidden_size=4 * h,
        norm_type="layernorm",
    )


@pytest.mark.parametrize(("s", "b", "h", "a"), [(2048, 1, 4096, 32), (128, 4, 512, 8)])
def test_korthikanti_formula_is_reproduced(s, b, h, a):
    # Korthikanti et al. 2022, eq. (1): activations per layer = s b h (34 + 5 a s / h) bytes.
    m = gpt_layer(h, a)
    got = layer_activation_bytes(m, s * b, s, b, 2, None, flash=False, dropout=True)
    assert got == s * b * h * 34 + 5 * a * s * s * b
    # FlashAttention recomputes the softmax terms: only 5as^2b goes; without dropout the sbh masks too.
    assert layer_activation_bytes(m, s * b, s, b, 2, None, flash=True, dropout=True) == 34 * s * b * h
    assert layer_activation_bytes(m, s * b, s, b, 2, None) == 32 * s * b * h


def test_capacity_and_rows_per_rank():
    assert capacity(256, 4, 2, 1.25, 4) == math.ceil(2 * 256 * 1.25 / 4) == 160
    assert capacity(8, 64, 1, 1.0, 4) == 4  # min_capacity floor
    s = load_scenario(SCENARIOS / "cpu-2rank.yaml")  # 4 experts, top-2, cf 1.25, 256 tokens
    assert s.tokens_per_micro_batch == 256
    assert moe_rows_per_rank(s) == 4 * 160
    dropless = load_scenario(
        SCENARIOS / "cpu-2rank.yaml", ["routing.dispatch=dropless", "routing.capacity_factor=null"]
    )
    assert moe_rows_per_rank(dropless) == 2 * 256


def test_padded_dispatch_stores_more_than_dropless():
    padded = scenario_with_routing("capacity_padded", 2.0)
    dropless = scenario_with_routing("dropless", None)
    assert activation_bytes(padded) > activation_bytes(dropless)


def scenario_with_routing(dispatch: str, cf: float | None):
    s = scenario(MOE, ep=8, dtype="bf16")
    data = s.model_dump()
    data["routing"].update(dispatch=dispatch, capacity_factor=cf)
    return scenario_from_dict(data)


def test_activation_checkpointing_keeps_layer_inputs():
    full = scenario(MOE, ep=8, dtype="bf16")
    ckpt = scenario(MOE, ep=8, dtype="bf16", activation_checkpointing=True)
    tokens, d, layers = 16, 64, 2
    logits = tokens * 128 * 4
    per_layer = (activation_bytes(full) - logits) // layers  # both layers are MoE layers alike
    assert activation_bytes(ckpt) == layers * tokens * d * 2 + per_layer + logits
    assert activation_bytes(ckpt) < activation_bytes(full)


def test_128gpu_scenario_fits_an_h100_and_a_huge_model_does_not():
    s = load_scenario(SCENARIOS / "128gpu.yaml")
    mem = memory_per_gpu(s)
    assert mem.capacity_GiB == s.topology.gpu.hbm_GiB and mem.fits
    assert 5 < mem.weights / GiB < 8  # 1.54B non-expert + 29.0B / 16 experts, in bf16
    huge = load_scenario(SCENARIOS / "128gpu.yaml", ["model.num_experts=2048", "parallelism.ep=1"])
    assert not memory_per_gpu(huge).fits
    report = mem.as_dict()
    assert report["peak_GiB_per_gpu"] == pytest.approx(mem.total / GiB)


def test_a_sliding_window_and_sinks_store_no_more_activations():
    # FlashAttention keeps no s x s term; an eager softmax masks a full s x s matrix whatever the window.
    gpt_oss_like = {**MOE, "sliding_window": 4, "sliding_window_pattern": 2, "attention_sinks": True}
    gpt_oss_like |= {"attention_bias": True, "attention_out_bias": True, "swiglu_limit": 7.0}
    windowed, full = scenario(gpt_oss_like), scenario(MOE)
    assert activation_bytes(windowed) == activation_bytes(full)
    for flash in (True, False):
        args = (16, 16, 1, 2, 32)
        assert layer_activation_bytes(windowed.model, *args, flash=flash) == layer_activation_bytes(
            full.model, *args, flash=flash
        )


@pytest.mark.parametrize(("dtype", "recipe", "kept"), [("fp8", "delayed", 1.0), ("fp8", "blockwise", 1 + 4 / 128),
                                                       ("mxfp8", "delayed", 1 + 1 / 32)])  # fmt: skip
def test_fp8_training_keeps_gemm_inputs_quantized(dtype, recipe, kept):
    """TransformerEngine keeps a GEMM's quantized column-wise input for the weight gradient: per layer the
    QKV and output-projection inputs, each FFN's fc1 and fc2 inputs, at ``kept`` bytes instead of 2."""
    from sim.model.memory import layer_gemm_input_elements
    from sim.model.stage_memory import memory_per_stage

    sets = ["training.framework=megatron", "model.num_layers=4", "cluster.nodes=1", "parallelism.ep=4",
            "cluster.topology=dgx-b200"]  # fmt: skip
    bf16 = load_scenario(SCENARIOS / "128gpu.yaml", sets)
    fp8 = load_scenario(SCENARIOS / "128gpu.yaml", [*sets, f"training.dtype={dtype}", f"training.fp8_recipe={recipe}"])
    m, tokens = bf16.model, bf16.training.seq_len
    rows = tokens * m.top_k  # even routing: the rows a rank's experts receive
    d, h, hd, w = m.hidden_size, m.num_attention_heads, m.head_size, m.moe_ffn_hidden_size
    per_layer = tokens * (d + h * hd) + rows * (d + w)  # QKV and proj inputs; experts' fc1 and fc2 inputs
    assert layer_gemm_input_elements(m, tokens, rows) == per_layer
    drop = memory_per_stage(bf16)[0].activations - memory_per_stage(fp8)[0].activations
    assert drop == pytest.approx(4 * per_layer * (2 - kept), abs=4)
