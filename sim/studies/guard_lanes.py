"""The resource guard's estimate for the layout-aware lane engine (the default for GPU scenarios).

Its costs grow with the distinct work of a step, not with GPUs squared (:mod:`sim.engine.fold`):
routing arrays of ``world x ep`` per MoE layer and micro-batch; the estimate pass touches every lane
once per op with vectorised arrays of a stage's ranks; the DES times the all-to-alls of the lanes it
follows, each by processor sharing over the group's ``ep (ep - 1)`` flows. Constants measured on the
2-core AMD EPYC VM of this project (1F1B and DP+EP layouts of scenarios/128gpu.yaml, 16-128 nodes):
see benchmarks/results/engine.md for the runs they are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.engine.fold import PACE_LANES, RANDOM_LANES
from sim.engine.window import window_of

BASE_BYTES = 150e6  # interpreter, numpy, simpy, networkx, pydantic, the engine's code
GRAPH_BYTES_PER_GPU = 12000.0  # networkx graph: ~8 directed links per GPU with attribute dicts
ROUTED_BYTES = 4.0  # int32 per (MoE layer, micro-batch, rank) and EP peer / local expert / node slot
POOL_BYTES = 180e6  # the routing pools' logits and features at E = 128 (measured peak)
LAYER_TEMP_BYTES = 32.0  # per (micro-batch, rank, feature column) while one layer is drawn
PRICED_BLOCKS = 512 * 4 * 8  # sim.frameworks.pricing.RECENT_BLOCKS x 4 arrays x 8 B, per stage rank
PRICED_CAP = float(1 << 28)  # sim.frameworks.pricing.RECENT_BYTES
ROUTE_S = 0.3  # fixed cost of drawing the routing
ROUTE_S_PER_CELL = 6e-8  # per (MoE layer, micro-batch, rank, feature column)
OP_S = 2.5e-5  # one op of one stage's pass, Python and numpy overheads
OP_S_PER_RANK = 2e-8  # and per simulated rank of the stage
EXACT_S = 5e-6  # one EP group's all-to-all by processor sharing, fixed part
EXACT_S_PER_FLOW = 2.3e-7  # and per flow (ep^2)
ESTIMATE_S = 1e-6  # one EP group's all-to-all by the estimate, fixed part
ESTIMATE_S_PER_FLOW = 4e-8  # and per flow


@dataclass(frozen=True)
class LaneShape:
    world: int
    stage: int  # ranks of a pipeline stage
    pp: int
    lanes: int  # per stage
    ep: int
    experts: int
    moe_layers: int
    layers: int
    micro: int
    recompute: bool
    full: bool
    engine_micro: int = 0  # micro-batches the engine's passes run (the steady-state window's), 0: micro

    @property
    def passes_micro(self) -> int:
        return self.engine_micro or self.micro

    @property
    def simulated_lanes(self) -> int:
        return self.lanes if self.full or self.lanes <= PACE_LANES + RANDOM_LANES else PACE_LANES + RANDOM_LANES


def lane_shape(s, fidelity: str) -> LaneShape:
    m, t, p = s.model, s.training, s.parallelism
    win = window_of(s, fidelity)
    return LaneShape(s.world_size, s.layout.stage_size, p.pp, s.layout.lanes, s.ep, m.num_experts,
                     m.num_moe_layers, m.num_layers, t.grad_accum_steps, t.recompute, fidelity == "full",
                     win.m_sim if win else 0)  # fmt: skip


def lane_costs(sh: LaneShape) -> tuple[dict[str, float], dict[str, float]]:
    """(memory bytes by part, seconds by part) of one lane-engine step."""
    cells = float(sh.moe_layers * sh.micro)
    epr = max(sh.experts // max(sh.ep, 1), 1)
    slots = -(-sh.ep // 8) + 1
    width = sh.experts + sh.ep + slots
    mem = {
        "base": BASE_BYTES,
        "cluster graph": GRAPH_BYTES_PER_GPU * sh.world,
        "routing arrays (world x ep)": ROUTED_BYTES * cells * sh.stage * (2 * sh.ep + epr + slots),
        "routing pools": POOL_BYTES * sh.experts / 128 + LAYER_TEMP_BYTES * sh.micro * sh.stage * width,
        "priced blocks": min(PRICED_BLOCKS * sh.stage, PRICED_CAP),
    }
    ops = sh.passes_micro * (sh.layers * (18 if sh.recompute else 12) + 4)  # ops of one pass pair, all stages
    a2a_calls = sh.passes_micro * sh.moe_layers * 4 * (1.5 if sh.recompute else 1.0)
    groups = sh.lanes * max(sh.stage // max(sh.lanes, 1) // max(sh.ep, 1), 1)  # EP groups per stage
    per_group_sim = groups / max(sh.lanes, 1) * sh.simulated_lanes
    flows = sh.ep * sh.ep
    tim = {
        "routing": ROUTE_S + ROUTE_S_PER_CELL * cells * sh.stage * width if cells else 0.0,
        "DES pass": ops * (OP_S + OP_S_PER_RANK * sh.simulated_lanes * sh.stage / max(sh.lanes, 1))
        + a2a_calls * per_group_sim * (EXACT_S + EXACT_S_PER_FLOW * flows),
    }
    if not sh.full and sh.lanes > sh.simulated_lanes:
        tim["estimate pass"] = ops * (OP_S + OP_S_PER_RANK * sh.stage) + a2a_calls * groups * (
            ESTIMATE_S + ESTIMATE_S_PER_FLOW * flows)  # fmt: skip
    return mem, tim


__all__ = ["LaneShape", "lane_costs", "lane_shape"]
