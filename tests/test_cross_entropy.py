"""The loss's cost over the logits: fused (one kernel) or Megatron-LM's unfused vocab-parallel path,
counted byte by byte from megatron/core/tensor_parallel/cross_entropy.py (sim.frameworks.pricing)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import ROOT

from sim.api import load_scenario
from sim.engine.simulate import cost_model
from sim.errors import InputError
from sim.frameworks.pricing import Pricer

SCEN = ROOT / "scenarios" / "128gpu.yaml"
MEGATRON = ["training.framework=megatron", "model.num_layers=4", "cluster.nodes=1", "parallelism.ep=4"]


def _output(sets):
    s = load_scenario(SCEN, sets)
    pricer = Pricer(s, None, cost_model(s), [1.0] * s.world_size)
    q = np.arange(s.layout.stage_size)
    last = s.model.num_layers  # any layer index: the head block does not depend on it
    fwd, _ = pricer.price("output", last, None, 0, "fwd", q, 0)
    bwd, _ = pricer.price("output", last, None, 0, "bwd", q, 0)
    return s, pricer, float(fwd[0]), float(bwd[0])


@pytest.mark.parametrize("tp", [1, 2])
def test_unfused_loss_moves_38_and_14_bytes_per_logit(tp):
    over = MEGATRON + [f"parallelism.tp={tp}", "parallelism.sequence_parallel=true"] * (tp > 1)
    s, pricer, f_fused, b_fused = _output(over)
    _, _, f_unf, b_unf = _output(over + ["training.cross_entropy_fusion=false"])
    t = s.training
    # every token of the sequence (the head gathers it under sequence parallelism), vocab / tp logits each
    logits = t.micro_batch_size * t.seq_len * s.model.vocab_size / tp
    hbm, launch = pricer.cost.hbm_Bps, pricer.cost.launch_s
    # forward: .float() 2+4, max 4, -= 8, exp 8, sum 4, div_ 8 (6 kernels + gather/all-reduces: 8) vs 8 B, 2 kernels
    assert f_unf - f_fused == pytest.approx(logits * (38 - 8) / hbm + (8 - 2) * launch, rel=1e-9)
    # backward: mul_ 8 and the bf16 cast 4+2 (3 kernels) vs 8 B, 2 kernels
    assert b_unf - b_fused == pytest.approx(logits * (14 - 8) / hbm + (3 - 2) * launch, rel=1e-9)


def test_unfused_loss_is_megatron_only():
    with pytest.raises(InputError, match="training.cross_entropy_fusion"):
        load_scenario(SCEN, ["training.cross_entropy_fusion=false"])  # deepspeed
