"""One MoE layer's forward and backward, timed as Megatron-Core's ``moe_perf`` harness times them
(``tests/functional_tests/test_cases/common/moe_perf``: one ``MoELayer``, CUDA events around its
forward and its backward on every rank).

The layer's ops are the MoE half of a transformer layer (:mod:`sim.frameworks.builder`): route,
permute, dispatch, [etp gather] experts [etp scatter], combine, unpermute, shared experts; no
attention, no embedding, no gradient reduction or optimizer. They run on the lane engine for one
micro-batch of the scenario; the forward ends where the F pass ends on a rank, the backward is the B
pass after it. The result is the mean over ranks (each rank times its own events).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.engine.lanes import LaneEngine
from sim.engine.simulate import _cluster, compute_factors, cost_model
from sim.errors import InputError
from sim.frameworks.builder import _Layers, _merge
from sim.frameworks.pipeline import Instr
from sim.frameworks.policies import policy_of
from sim.frameworks.pricing import Pricer
from sim.frameworks.program import Chunk, GroupComm, Kernels, Program, StageProgram, Tail
from sim.inputs.scenario import Scenario
from sim.model.dtypes import BYTES_PER_ELEMENT, storage_dtype
from sim.routing.plan import route_scenario


def _moe_only(ops: list) -> list:
    """Drop the attention block (and its TP collectives) from a layer's ops."""
    out = []
    for op in ops:
        if isinstance(op, GroupComm) and op.group == "tp":
            continue
        if isinstance(op, Kernels):
            ks = [k for k in op.kernels if k.name not in ("attention", "mlp")]
            if not ks:
                continue
            op = Kernels(ks, op.layer, op.phase)
        out.append(op)
    return _merge(out)


def layer_program(s: Scenario) -> Program:
    m = s.model
    layer = next((i for i in range(m.num_layers) if m.is_moe_layer(i)), None)
    if layer is None:
        raise InputError("moesim layer times an MoE layer; this model has none", file=s.source,
                         field="model.num_experts")  # fmt: skip
    if s.parallelism.pp > 1:
        raise InputError("moesim layer times one layer on one pipeline stage; set pp: 1", file=s.source,
                         field="parallelism.pp")  # fmt: skip
    layers = _Layers(s)
    fwd = _moe_only(layers.forward(layer))
    bwd = _moe_only(layers.backward(layer, "none"))
    chunk = Chunk(0, 0, 0, (layer,), fwd, bwd, [], 0.0, 0, 0)
    stage = StageProgram(0, [chunk], [Instr("F", 0, 0), Instr("B", 0, 0)], Tail(0, 0.0, [], [], 0, 0), {0: 0})
    bpe = BYTES_PER_ELEMENT[storage_dtype(s.training.dtype)]
    return Program([stage], "1f1b", 1, policy_of(s).grad_kind, bpe, bpe, s.training.framework)


def layer_times(s: Scenario, policy: str | None = None) -> dict[str, Any]:
    """Forward and backward seconds of one MoE layer of ``s`` (means over ranks, and their spread)."""
    program = layer_program(s)
    plan = route_scenario(s, policy)
    cost = cost_model(s)
    pricer = Pricer(s, plan, cost, compute_factors(s))
    lanes = np.arange(s.layout.lanes)
    eng = LaneEngine(s, program, plan, _cluster(s), pricer, lanes, exact=True)
    res = eng.run()
    f_end, b_end = eng.marks[0]
    fwd, bwd = f_end, b_end - f_end
    by_name = {k: float(v.mean()) for k, v in res.by_name.items()}
    return {
        "scenario": s.name,
        "forward_s": float(fwd.mean()),
        "backward_s": float(bwd.mean()),
        "forward_max_s": float(fwd.max()),
        "backward_max_s": float(bwd.max()),
        "a2a_s": float(res.by_key["a2a"].mean()),
        "imbalance_wait_s": float(res.by_key["imbalance_wait"].mean()),
        "compute_s": float(res.by_key["compute"].mean()),
        "compute_by_span_s": by_name,
        "tokens_per_rank": s.routed_tokens_per_rank,
        "dispatcher": s.collectives.all_to_all,
    }


__all__ = ["layer_program", "layer_times"]
