"""Where the root module's parameters (embedding, LM head) are gathered under per-layer gathering:
the embedding lookup waits for its table (FSDP2 and ZeRO-3, both engines); FSDP2 keeps the root
gathered from forward to backward (torch's ``_fsdp_state._lazy_init``)."""

from __future__ import annotations

import pytest
from conftest import ROOT

from sim.api import load_scenario
from sim.engine.simulate import cost_model
from sim.frameworks.builder import build_program
from sim.frameworks.program import Kernels, ParamGather, WaitParams

SCEN = ROOT / "scenarios" / "128gpu.yaml"
BASE = ["model.num_layers=4", "cluster.nodes=1", "parallelism.ep=8", "training.grad_accum_steps=2"]


def _chunk(sets):
    s = load_scenario(SCEN, BASE + sets)
    prog = build_program(s, cost_model(s))
    return s, prog.stages[0].chunks[0]


def _kernel_at(ops, name):
    return next(k for k, op in enumerate(ops) if isinstance(op, Kernels) and op.kernels[0].name == name)


@pytest.mark.parametrize("sets", [["training.framework=fsdp2"], ["parallelism.zero_stage=3"]])
def test_embedding_waits_for_its_table(sets):
    _, ch = _chunk(sets)
    emb = _kernel_at(ch.fwd, "embedding")
    first_gather = next(k for k, op in enumerate(ch.fwd) if isinstance(op, ParamGather))
    wait = next(k for k, op in enumerate(ch.fwd) if isinstance(op, WaitParams))
    assert first_gather < wait < emb
    assert ch.fwd[wait].key == ch.fwd[first_gather].key == "f0"
    assert sum(isinstance(op, WaitParams) and op.key == "f0" for op in ch.fwd) == 1  # waited once


def test_fsdp2_keeps_the_head_gathered_for_backward():
    s, ch = _chunk(["training.framework=fsdp2"])
    last = s.model.num_layers - 1
    regathers = [op for op in ch.bwd if isinstance(op, ParamGather)]
    first = next(op for op in regathers if op.key == f"b{last}")
    from sim.frameworks.builder import _params

    params, _, head = _params(s)
    assert head > 0
    assert first.nonexpert == params[last][0]  # the last layer's own parameters, not the head's


def test_fsdp2_memory_adds_the_gathered_copies():
    """FSDP2's unsharded copies at the peak: the root (embedding, final norm, head) plus the largest
    adjacent pair of blocks (the one computing and the one prefetched) with reshard_after_forward,
    every block without it; experts only when they are sharded (edp > 1)."""
    from sim.model.params import count_params, layer_params
    from sim.model.stage_memory import fsdp2_gathered_bytes, memory_per_stage

    def block(m, i):
        lp = layer_params(m, i)
        return lp.attention + lp.dense_ffn + lp.shared_expert + lp.router + lp.norms

    for reshard in (True, False):
        s = load_scenario(SCEN, BASE + ["training.framework=fsdp2", f"training.reshard_after_forward={reshard}"])
        m = s.model
        assert s.edp == 1 and s.dp > 1
        c = count_params(m)
        root = c.embedding + c.norms - sum(layer_params(m, i).norms for i in range(m.num_layers))
        blocks = [block(m, i) for i in range(m.num_layers)]
        live = max(a + b for a, b in zip(blocks, blocks[1:], strict=False)) if reshard else sum(blocks)
        assert fsdp2_gathered_bytes(s, 0) == (root + live) * 2  # bf16
        deepspeed = load_scenario(SCEN, BASE + ["parallelism.zero_stage=3"])
        assert memory_per_stage(s)[0].weights - memory_per_stage(deepspeed)[0].weights == (root + live) * 2
