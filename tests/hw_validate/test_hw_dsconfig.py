"""ds_config and gate settings derived from scenarios (no DeepSpeed job: pure functions)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hw_validate.dsconfig import build_ds_config, check_batch, gate_settings
from sim.api import load_scenario
from sim.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
SEED = ROOT / "scenarios" / "seed-4gpu.yaml"
CPU2 = ROOT / "scenarios" / "cpu-2rank.yaml"


def test_seed_example_batch_precision_and_offload():
    s = load_scenario(SEED)
    cpu = build_ds_config(s, 4, "cpu")
    cfg = cpu.ds_config
    # the original example's numbers, now consistent: 8 x 2 x 4 = 64
    assert (cfg["train_batch_size"], cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]) == (64, 8, 2)
    assert cfg["zero_optimization"]["stage"] == 2
    assert cfg["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert cfg["optimizer"]["type"] == "Adam" and "torch_adam" not in cfg["optimizer"]["params"]  # -> DeepSpeedCPUAdam
    assert "moe" not in cfg  # DeepSpeed has no such section
    assert cpu.dtype == "bf16" and cpu.dtype_requested == "fp16" and "fp16" not in cfg and cfg["bf16"]["enabled"]
    assert any("fp16" in n and "bf16" in n for n in cpu.notices)
    gpu = build_ds_config(s, 4, "cuda")
    assert gpu.dtype == "fp16" and gpu.ds_config["fp16"]["enabled"] and not gpu.notices
    check_batch(cfg, 4)
    with pytest.raises(InputError):
        check_batch(cfg, 2)


def test_fp32_without_offload_uses_torch_adam():
    s = load_scenario(CPU2)
    st = build_ds_config(s, 2, "cpu")
    assert st.dtype == "fp32" and "bf16" not in st.ds_config and "fp16" not in st.ds_config
    assert st.ds_config["optimizer"]["params"]["torch_adam"] is True
    assert "offload_optimizer" not in st.ds_config["zero_optimization"]
    assert st.train_batch_size == 4 * 1 * 2


def test_world_size_mismatch_names_the_field():
    s = load_scenario(SEED)
    with pytest.raises(InputError) as e:
        build_ds_config(s, 2, "cpu")
    assert e.value.field == "cluster.gpus_per_node" and "4" in e.value.message


def test_gate_settings_capacity_and_dropless():
    g = gate_settings(load_scenario(CPU2))
    assert (g.k, g.capacity_factor, g.min_capacity, g.drop_tokens) == (2, 1.25, 4, True)
    d = gate_settings(load_scenario(CPU2, ["routing.capacity_factor=null", "routing.dispatch=dropless"]))
    assert d.drop_tokens is False


def test_offload_needs_zero_and_adam():
    s = load_scenario(SEED, ["parallelism.zero_stage=0"])
    with pytest.raises(InputError) as e:
        build_ds_config(s, 4, "cpu")
    assert e.value.field == "training.offload_optimizer"
    s = load_scenario(SEED, ["training.optimizer=sgd"])
    with pytest.raises(InputError) as e:
        build_ds_config(s, 4, "cpu")
    assert e.value.field == "training.optimizer"
