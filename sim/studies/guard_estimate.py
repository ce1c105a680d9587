"""The resource guard's estimate: the simulator's own peak memory and wall time for a scenario, read
off its :class:`Shape` before anything big is allocated (:mod:`sim.studies.guard` decides on it;
scenarios the lane engine runs take :mod:`sim.studies.guard_lanes` instead).

The estimate is a sum of closed forms over the arrays the simulator really allocates, each with a
constant calibrated by measured runs (peak RSS from ``/proc/self/status`` VmHWM, 2-core CI VM;
``tests/test_guard.py`` and the report of issue 9 list them):

* routing arrays: (MoE layers x micro-batches x world) x (E [+ E kept when capped] + ep + node
  slots) int32, plus the exact pools (65,536 tokens x E) and per-layer temporaries;
* the schedule: about 220 B per (layer, micro-batch, rank) of kernel arrays, 450 B more in the DES
  (per-rank Python lists of the engine);
* DES: one (world x world) float64 dispatch-byte matrix per (MoE layer, micro-batch) that the engine
  keeps (its per-group blocks are views of it), ``_cross``/``wait_on`` matrices, and the ring DAG
  of the data-parallel gradient reduction, which :func:`sim.network.comm.reduction_model` builds transfer
  by transfer: (n-1) x channels x n transfers (2x for all-reduce) at ~200 B each;
* analytic: the same ring DAG and a few world x world temporaries per (layer, micro-batch);
* time: under ps, 60 us + 0.55 us x ep^2 per EP-group all-to-all launch (4 per MoE layer and
  micro-batch, x6 hierarchical), ~5 us per other SimPy event (1.6 per rank, layer and micro-batch
  at ZeRO-2, 18.5 at ZeRO-3), ~1.5 us per ring-DAG transfer; the flow comm model ~3 ms x
  (1 + world/64) per all-to-all flow and cell.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

#: ranks up to which ``--comm-model auto`` picks ``flow`` (:data:`sim.network.comm.FLOW_AUTO_MAX_RANKS`)
FLOW_AUTO_MAX_RANKS = 8

# ---- calibrated constants (bytes, seconds) --------------------------------------------------------
BASE_BYTES = 100e6  # interpreter, numpy, simpy, networkx, pydantic, the scenario (62 MB after import)
POOL_TOKENS = 65536  # sim.routing.build.POOL_TOKENS
POOL_BYTES_PER_TOKEN_EXPERT = 21.0  # logits, scores, top-k of the pools: 171 MB at E=128, 339 MB at 256
ROUTE_TEMP_BYTES = 28.0  # per (micro, rank, feature column) while one layer is drawn
SUMMARY_BYTES = 20.0  # per (layer, micro, rank) and EP rank: int64 copies in the routing statistics
SCHEDULE_BYTES = 220.0  # per (layer, micro, rank): kernel seconds and FLOPs of every compute op
ENGINE_LIST_BYTES = 450.0  # per (layer, micro, rank): the DES engine's per-op Python lists
RING_TRANSFER_BYTES = 200.0  # peak per transfer of a ring DAG (arrays, paths, latency chain)
PROCESS_BYTES = 3000.0  # per rank: comm-stream process, its Store and events
GRAPH_BYTES_PER_GPU = 12000.0  # networkx graph: ~8 directed links per GPU with attribute dicts
ROUTE_S, ROUTE_S_PER_ELEM = 1.5, 5e-8  # pooled routing
EXACT_S_PER_ELEM = 6e-8  # exact routing, per (token x expert)
SUMMARY_S_PER_ELEM = 1.2e-8
SCHEDULE_S, SCHEDULE_S_PER_CELL = 0.5, 4e-6  # per (layer, micro, rank)
LAUNCH_S, LAUNCH_S_PER_EP2 = 60e-6, 0.55e-6  # one EP group's all-to-all launch under ps (ep^2 flows)
HIERARCHICAL_LAUNCH_FACTOR = 6.0  # two phases, relays, node bytes
EVENT_S = 5e-6  # any other SimPy event (gradient hand-overs, parameter gathers, timeouts)
#: SimPy events per (layer, micro-batch, rank) by ZeRO stage: gradient buckets (1, 2), gathers (3)
EVENTS_PER_RANK_LAYER = {0: 0.0, 1: 0.2, 2: 1.6, 3: 18.5}
RING_S_PER_TRANSFER = 1.5e-6
MATRIX_S_PER_ELEM = 3e-8  # per world^2 element and (MoE layer, micro-batch): dispatch matrices
FLOW_S_PER_FLOW = 3e-3  # flow comm model, per all-to-all flow and (MoE layer, micro-batch)
FLOW_RING_S_PER_TRANSFER = 2e-5  # flow comm model: a reduction transfer through the max-min network

GiB = float(1 << 30)


@dataclass(frozen=True)
class Shape:
    """What the estimate depends on, read off a scenario; ``nodes``, ``layers`` and ``micro`` can be
    varied to find what would fit."""

    nodes: int
    gpus_per_node: int
    ep: int
    experts: int
    layers: int
    first_dense: int
    moe_freq: int
    micro: int
    tokens: int  # per rank and micro-batch
    capped: bool
    a2a: str
    zero_stage: int
    recompute: bool  # activation checkpointing: the forward (all-to-alls included) runs twice
    buckets: int  # gradient buckets per reduction phase (non-expert + expert)
    faults: bool
    pool_tokens: int
    model_parallel: int = 1  # tp x cp x pp: routing covers one pipeline stage's tp x cp x dp ranks

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def routed_world(self) -> int:
        return max(self.world // self.model_parallel, 1)

    @property
    def moe_layers(self) -> int:
        if self.experts <= 1 or self.layers <= self.first_dense:
            return 0
        return -(-(self.layers - self.first_dense) // self.moe_freq)

    @property
    def slots(self) -> int:
        return -(-self.ep // self.gpus_per_node) + 1


def shape_of(s) -> Shape:
    """The :class:`Shape` of a loaded :class:`~sim.inputs.scenario.Scenario`."""
    from sim.model.params import count_params

    m, t, r = s.model, s.training, s.routing
    bpe = {"bf16": 2, "fp16": 2, "fp32": 4}.get(t.dtype, 2)  # FP8 recipes keep bf16 gradients
    bucket = s.collectives.reduce_bucket_elements * bpe
    counts = count_params(m)
    buckets = math.ceil(counts.non_expert * bpe / bucket) + math.ceil(counts.expert / s.ep * bpe / bucket)
    drift = r.generator == "skewed" and r.skew > 0 and r.drift > 0
    f = s.faults
    return Shape(
        nodes=s.cluster.nodes,
        gpus_per_node=s.gpus_per_node,
        ep=s.ep,
        experts=m.num_experts,
        layers=m.num_layers,
        first_dense=m.first_dense_layers,
        moe_freq=m.moe_layer_freq,
        micro=t.grad_accum_steps,
        tokens=s.tokens_per_micro_batch,
        capped=r.capacity_factor is not None,
        a2a=s.collectives.all_to_all,
        zero_stage=s.parallelism.zero_stage,
        recompute=t.recompute,
        buckets=max(buckets, 1),
        faults=bool(f.links or f.stragglers or (f.jitter is not None and f.jitter.kernel_cv > 0)),
        pool_tokens=max(POOL_TOKENS, (m.num_moe_layers if drift else 1) * 4096),
        model_parallel=s.parallelism.pp,
    )


@dataclass
class Estimate:
    """Peak memory (bytes) and wall time (seconds) of one run, with their largest parts."""

    engine: str
    comm_model: str | None
    world: int
    memory_bytes: float
    time_s: float
    memory_parts: dict[str, float] = field(default_factory=dict)
    time_parts: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        top = sorted(self.memory_parts.items(), key=lambda kv: -kv[1])[:3]
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in top if v > 0)
        return f"~{fmt_bytes(self.memory_bytes)} of memory ({parts}) and ~{fmt_time(self.time_s)}"

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def fmt_bytes(n: float) -> str:
    for unit, size in (("PiB", GiB * 2**20), ("TiB", GiB * 1024), ("GiB", GiB), ("MiB", 2.0**20)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n / 1024:.3g} KiB"


def fmt_time(s: float) -> str:
    if s >= 86400 * 365:
        return f"{s / (86400 * 365):.3g} years"
    for unit, size in (("days", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.3g} {unit}"
    return f"{s:.2g} s"


def _ring_transfers(n: int, channels: int) -> float:
    """Transfers of one ring reduce-scatter or all-gather DAG over n ranks (all-reduce: twice)."""
    return float(max(n - 1, 0)) * channels * n


def _rings(sh: Shape) -> tuple[float, float]:
    """(largest ring DAG, transfers of all ring DAGs built in a run) of the gradient and parameter
    collectives: one per collective kind and group (the data-parallel group of all ranks, and each
    of the ep expert-data-parallel groups)."""
    w, g, ep = sh.world, sh.gpus_per_node, sh.ep
    dp = _ring_transfers(w, g if sh.nodes > 1 and g > 1 else 1)
    edp_n = w // ep
    edp_ch = g // ep if ep < g and sh.nodes > 1 else 1
    edp = _ring_transfers(edp_n, max(edp_ch, 1))
    factor = 2.0 if sh.zero_stage == 0 else 1.0  # all-reduce, else reduce-scatter (+ all-gather)
    kinds = 1 if sh.zero_stage == 0 else 2
    peak = factor * max(dp, edp)
    total = kinds * factor * (dp + ep * edp)
    return peak, total


def estimate(s_or_shape, engine: str = "des", comm_model: str = "auto") -> Estimate:
    """Estimated peak memory and time of ``moesim simulate`` (``engine`` des | analytic) or of
    ``moesim route`` (``engine="route"``) on a scenario or a :class:`Shape`."""
    sh = s_or_shape if isinstance(s_or_shape, Shape) else shape_of(s_or_shape)
    w, ep, e = float(sh.world), sh.ep, sh.experts
    cells = float(sh.moe_layers * sh.micro)  # (MoE layer, micro-batch) pairs
    width = e * (2 if sh.capped else 1) + ep + sh.slots
    mem: dict[str, float] = {"base": BASE_BYTES}
    tim: dict[str, float] = {}
    w_all, w = w, float(sh.routed_world)  # routing: one pipeline stage's ranks
    if cells:
        from sim.routing.counts import WIDE_LIMIT

        wide = cells * w * e <= WIDE_LIMIT  # above it the plan keeps world x ep arrays only
        mem["routing arrays"] = 4.0 * cells * w * (width if wide else 2 * ep + e // max(ep, 1) + sh.slots)
        pool = POOL_BYTES_PER_TOKEN_EXPERT * sh.pool_tokens * e
        route_temp = pool + ROUTE_TEMP_BYTES * sh.micro * w * width
        summary_temp = SUMMARY_BYTES * cells * w * ep if wide else SUMMARY_BYTES * sh.micro * w * ep
        exact_work = cells * w * sh.tokens * e
        tim["routing"] = (
            EXACT_S_PER_ELEM * exact_work
            if exact_work <= (1 << 23)
            else ROUTE_S + ROUTE_S_PER_ELEM * cells * w * width
        )
        tim["routing statistics"] = SUMMARY_S_PER_ELEM * cells * w * width
    else:
        route_temp = summary_temp = 0.0
    if engine == "route":
        transient = {"routing pools": route_temp, "routing statistics": summary_temp}
        return _finish(sh, engine, None, mem, tim, transient)
    w = w_all
    cells_all = float(sh.layers * sh.micro)
    mem["schedule"] = SCHEDULE_BYTES * cells_all * w
    mem["cluster graph"] = GRAPH_BYTES_PER_GPU * w
    tim["schedule"] = SCHEDULE_S + SCHEDULE_S_PER_CELL * cells_all * w
    ring_peak, ring_total = _rings(sh)
    transient = {"routing pools": route_temp, "routing statistics": summary_temp}
    matrix = 8.0 * w * w
    faults = 2.0 if sh.faults else 1.0  # a faulty scenario also runs on the healthy cluster
    model = None
    if engine == "analytic":
        transient["ring DAG of the gradient reduction"] = RING_TRANSFER_BYTES * ring_peak
        transient["dispatch matrix temporaries"] = 5 * matrix if cells else 0.0
        tim["engine"] = faults * (RING_S_PER_TRANSFER * ring_total + 2 * MATRIX_S_PER_ELEM * cells * w * w)
    elif engine == "des":
        model = comm_model if comm_model in ("flow", "ps") else ("flow" if w <= FLOW_AUTO_MAX_RANKS else "ps")
        mem["per-(layer, micro-batch) dispatch matrices"] = matrix * cells
        mem["engine lists and processes"] = ENGINE_LIST_BYTES * cells_all * w + PROCESS_BYTES * w
        mem["rank x rank masks"] = (w * w if w <= 8192 else 0.0) + (4 * w * w if w <= 4096 else 0.0)
        transient["ring DAG of the gradient reduction"] = RING_TRANSFER_BYTES * ring_peak
        transient["dispatch matrix temporaries"] = 4 * matrix if cells else 0.0
        groups = w / ep
        launches = 4.0 * groups * cells * (1.5 if sh.recompute else 1.0)
        events = 3.0 * launches + EVENTS_PER_RANK_LAYER[sh.zero_stage] * w * cells_all
        if model == "ps":
            per_launch = LAUNCH_S + LAUNCH_S_PER_EP2 * ep * ep
            if sh.a2a == "hierarchical":
                per_launch *= HIERARCHICAL_LAUNCH_FACTOR
            engine_s = launches * per_launch + events * EVENT_S + RING_S_PER_TRANSFER * ring_total
        else:
            flows = w * max(ep - 1, 0) * cells * (2.0 if sh.a2a == "hierarchical" else 1.0)
            phases = sh.micro if sh.zero_stage >= 2 else 1
            gathers = 2 * cells_all if sh.zero_stage == 3 else 2
            ring_runs = (phases * sh.buckets + gathers) * ring_peak
            engine_s = FLOW_S_PER_FLOW * (1 + w / 64) * flows + FLOW_RING_S_PER_TRANSFER * ring_runs
            engine_s += events * EVENT_S
        tim["engine"] = faults * (engine_s + MATRIX_S_PER_ELEM * cells * w * w)
    else:
        raise ValueError(f"engine must be des, analytic or route, got {engine!r}")
    return _finish(sh, engine, model, mem, tim, transient)


def _finish(sh: Shape, engine: str, model, mem: dict, tim: dict, transient: dict) -> Estimate:
    # phases run one after another: the persistent parts add up, the transients do not
    engine_parts = {k: v for k, v in transient.items() if not k.startswith("routing")}
    routing_parts = {k: v for k, v in transient.items() if k.startswith("routing")}
    engine_peak = sum(v for k, v in mem.items() if k.startswith(("per-(layer", "engine", "rank x"))) + sum(
        engine_parts.values()
    )
    persistent = sum(v for k, v in mem.items() if not k.startswith(("per-(layer", "engine", "rank x")))
    peak = persistent + max([engine_peak, *routing_parts.values()])
    parts = {**mem, **transient}
    return Estimate(engine, model, sh.world, peak, sum(tim.values()), parts, tim)
