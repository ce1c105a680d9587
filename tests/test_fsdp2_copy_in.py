"""FSDP2's post-backward copy-in (torch ``_fully_shard/_fsdp_collectives.py`` ``foreach_reduce``): after
each block's backward, on the compute stream, the block's unsharded gradients are read (param dtype) and
copied into the reduce-scatter input (``reduce_dtype``). One kernel per layer backward, priced from the
layer's parameters on the rank; Megatron and DeepSpeed programs have none."""

from __future__ import annotations

import numpy as np
import pytest

from sim.engine.simulate import cost_model
from sim.frameworks.builder import build_program
from sim.frameworks.pricing import Pricer
from sim.frameworks.program import Kernels
from sim.model.params import rank_layer_params
from sim.studies.published import entries, scenario_of


def _scenario(eid: str):
    return scenario_of(next(e for e in entries() if e["id"] == eid))


def _copy_ins(prog) -> list[int]:
    return [k.layer for c in prog.stages[0].chunks for op in c.bwd if isinstance(op, Kernels)
            for k in op.kernels if k.name == "fsdp_grad_copy_in"]  # fmt: skip


def test_one_copy_in_per_layer_backward_and_its_bytes():
    s = _scenario("D6")  # Qwen3-30B-A3B, FSDP2 over 8 H100, EP8, reduce_dtype fp32
    assert s.training.framework == "fsdp2" and s.training.grad_reduce_dtype == "fp32"
    cost = cost_model(s)
    prog = build_program(s, cost)
    assert sorted(_copy_ins(prog)) == list(range(s.model.num_layers))
    p = Pricer(s, None, cost, [1.0] * s.world_size)
    q = np.arange(s.layout.stage_size)
    for layer in (0, s.model.num_layers - 1):
        ne, ex = rank_layer_params(s.model, layer, 1, 1, s.experts_per_rank)
        want = (ne + ex) * (2 + 4) / cost.hbm_Bps + cost.launch_s  # read bf16, write fp32
        f, _ = p.price("fsdp_grad_copy_in", layer, None, 0, "fwd", q, 0)
        b, _ = p.price("fsdp_grad_copy_in", layer, None, 0, "bwd", q, 0)
        w, _ = p.price("fsdp_grad_copy_in", layer, None, 0, "bwd_weight", q, 0)
        assert float(f[0]) == 0.0
        assert float(b[0]) == pytest.approx(want, rel=1e-12) and float(w[0]) == pytest.approx(want, rel=1e-12)


def test_megatron_has_no_copy_in():
    s = _scenario("D9")  # Megatron: gradients accumulate in the grad buffer inside the wgrad GEMMs
    assert _copy_ins(build_program(s, cost_model(s))) == []
