"""Dense Llama 3 configs of validation/published/models (the dense calibration rows) against their
published parameter counts, and Megatron's block recompute (recompute_num_layers) against the closed form."""

from __future__ import annotations

import pytest
from conftest import ROOT

from sim.api import load_scenario
from sim.engine.simulate import simulate
from sim.inputs.hfconfig import model_fields_from_hf
from sim.inputs.sections import ModelConfig
from sim.model.params import count_params
from sim.model.stage_memory import memory_per_stage

MODELS = ROOT / "validation" / "published" / "models"
ROW = ROOT / "validation" / "published" / "dense" / "DENSE-H100-8B.yaml"


@pytest.mark.parametrize("name,params", [("Llama-3-8B", 8_030_261_248), ("Llama-3-70B", 70_553_706_496),
                                         ("Llama-3.1-405B", 405_853_388_800)])  # fmt: skip
def test_published_parameter_counts(name, params):
    m = ModelConfig(**model_fields_from_hf(str(MODELS / name / "config.json")))
    c = count_params(m)
    assert c.total == c.active == params and c.expert == 0


def _scenario(tmp_path, recompute: str, layers: int | None):
    import yaml

    doc = yaml.safe_load(ROW.read_text())["scenario"]
    doc["model"]["hf_config"] = str(MODELS / "Llama-3-8B" / "config.json")
    doc["training"]["activation_checkpointing"] = recompute
    doc["training"].pop("recompute_num_layers", None)
    if layers is not None:
        doc["training"]["recompute_num_layers"] = layers
    doc["training"]["grad_accum_steps"] = 2
    doc["training"].pop("global_batch_size", None)
    path = tmp_path / f"s-{recompute}-{layers}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_scenario(path)


def test_block_recompute_adds_the_forward_of_n_layers(tmp_path):
    none, full = (simulate(_scenario(tmp_path, r, None))["step_time_s"] for r in ("none", "full"))
    five = simulate(_scenario(tmp_path, "full", 5))["step_time_s"]
    # 32 identical layers: recomputing 5 of them adds 5/32 of what recomputing all 32 adds
    assert five - none == pytest.approx((full - none) * 5 / 32, rel=0.02)
    mem = [memory_per_stage(_scenario(tmp_path, r, n))[0].activations
           for r, n in (("none", None), ("full", 5), ("full", None))]  # fmt: skip
    assert mem[0] > mem[1] > mem[2]


def test_recompute_num_layers_needs_full_checkpointing(tmp_path, capsys):
    from sim.cli.main import main

    bad = _scenario(tmp_path, "full", 5)
    path = tmp_path / "s-full-5.yaml"
    assert bad is not None
    code = main(["simulate", str(path), "--set", "training.activation_checkpointing=selective"])
    assert code == 2
    assert "training.recompute_num_layers" in capsys.readouterr().err


def test_megatron_param_gather_starts_with_the_step_on_every_stage(tmp_path):
    """Megatron's distributed optimizer (overlap_param_gather, align_param_gather): every chunk's first bucket
    is gathered from the step's start, not when the stage's first input arrives, and the rest layer by layer."""
    import json

    from sim.cli.main import main
    from sim.frameworks.builder import build_program
    from sim.frameworks.program import ParamGather, WaitParams

    row = ROOT / "validation" / "published" / "dense" / "DENSE-H100-70B.yaml"
    s = load_scenario(row)
    from sim.engine.simulate import cost_model

    prog = build_program(s, cost_model(s))
    for st in prog.stages:
        for ch in st.chunks:
            gathers = [op for op in ch.fwd if isinstance(op, ParamGather)]
            waits = [op for op in ch.fwd if isinstance(op, WaitParams)]
            assert gathers[0].at_step_start and not any(g.at_step_start for g in gathers[1:])
            assert len(gathers) == len(waits) == len(ch.layers)  # one bucket per layer
            assert all(g.first_micro_only for g in gathers)
    trace = tmp_path / "t.json"
    ranks = ",".join(str(r * s.layout.stage_size) for r in range(s.parallelism.pp))
    assert main(["simulate", str(row), "--trace", str(trace), "--trace-ranks", ranks]) == 0
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    first = {}
    for e in events:
        if e.get("ph") == "X" and e["name"] == "param_gather":
            first[e["pid"]] = min(first.get(e["pid"], float("inf")), e["ts"])
    assert len(first) == s.parallelism.pp and set(first.values()) == {0}
