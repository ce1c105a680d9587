"""``simulate(scenario)``: one training step, from a loaded scenario to the result record of
DESIGN.md (``step_time_s``, ``breakdown_s``, ``traffic``, ``memory``, ``params`` ...).

``engine="des"`` runs the SimPy engine (:mod:`sim.engine.des`) on every rank; ``engine="analytic"``
the closed form of :mod:`sim.engine.analytic` (mean loads, no barriers, no contention between groups).
Every rank's compute stream is tiled by ``compute + a2a + imbalance_wait + exposed_comm +
optimizer`` = the rank's end. ``breakdown_s`` is the mean over ranks (the ranks end together when
the step ends in a collective, so it sums to ``step_time_s``; ``imbalance_wait`` is then the mean
time a rank sat at all-to-all barriers for a slower peer); ``critical_rank_breakdown_s`` is the
same for the rank that set the pace. ``grad_sync`` is comm-stream busy time (mostly hidden behind
backward; the hidden part is in no sum).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.engine.step import build_step
from sim.hardware.costs import CostModel
from sim.hardware.faults import cluster_for
from sim.inputs.calibration import load_calibration
from sim.inputs.scenario import Scenario
from sim.model.dtypes import is_quantized
from sim.model.flops import model_flops_per_token
from sim.model.memory import memory_per_gpu, zero_memory_applies
from sim.model.params import count_params
from sim.network.comm import FLOW_AUTO_MAX_RANKS

ENGINES = ("des", "analytic")
COMM_MODELS = ("auto", "flow", "ps")


def cost_model(s: Scenario) -> CostModel:
    cal = load_calibration(s.resolve_path(s.calibration)) if s.calibration else None
    return CostModel(s.topology.gpu, cal)


def compute_factors(s: Scenario) -> np.ndarray:
    """Per-rank compute slowdown (stragglers from ``faults``), 1 everywhere on a healthy cluster."""
    from sim.hardware.faults import compute_factors as faulty

    return np.asarray(faulty(s), dtype=np.float64)


def _cluster(s: Scenario):
    """The scenario's cluster with its calibrated link figures (``calibration: links``) and then its
    faulty links (degraded, or failed and routed around)."""
    from sim.hardware.calibrated import apply_link_calibration
    from sim.hardware.faults import apply_faults

    cal = load_calibration(s.resolve_path(s.calibration)) if s.calibration else None
    return apply_faults(apply_link_calibration(cluster_for(s, faults=False), cal), s)


def has_faults(s: Scenario) -> bool:
    f = s.faults
    return bool(f.links or f.stragglers or (f.jitter is not None and f.jitter.kernel_cv > 0))


def resolve_comm_model(s: Scenario, comm_model: str) -> str:
    if comm_model not in COMM_MODELS:
        raise ValueError(f"comm model must be one of {COMM_MODELS}, got {comm_model!r}")
    if comm_model != "auto":
        return comm_model
    return "flow" if s.world_size <= FLOW_AUTO_MAX_RANKS else "ps"


def simulate(
    s: Scenario,
    engine: str = "des",
    comm_model: str = "auto",
    policy: str | None = None,
    trace_ranks: set[int] | None = None,
    plan=None,
    healthy: bool = True,
    draw: int = 0,
    fidelity: str = "folded",
    micro_window: bool = True,
) -> dict[str, Any]:
    """Simulate one step of ``s``; returns the JSON-ready result (and ``_spans`` when tracing).
    A scenario with ``faults`` is also run on the healthy cluster (``healthy=False`` skips it): the
    result's ``faults`` section gives the slowdown and who waited on whom. ``draw``: which
    independent draw of the calibrated rank noise (sim.engine.step.build_step; default 0).
    ``micro_window=False``: the folded fidelity simulates every micro-batch (no steady-state window,
    :mod:`sim.engine.window`).

    Which engine: CPU-rank scenarios (host effects, the validation path) and ``engine="analytic"``
    run the per-rank schedule of :mod:`sim.engine.step`; ``fidelity="full"`` of a DeepSpeed
    data + expert parallel layout the per-rank reference engine (:mod:`sim.engine.des`); everything
    else the layout-aware lane engine (:mod:`sim.engine.layout_step`), folded by default."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    from sim.routing.plan import route_scenario

    m = s.model
    if plan is None and m.num_moe_layers:
        plan = route_scenario(s, policy)
    cost = cost_model(s)
    factor = compute_factors(s)
    from sim.hardware.faults import jitter_sampler

    cluster = _cluster(s)
    if engine == "des" and uses_lane_engine(s, fidelity, comm_model):
        from sim.engine.layout_step import layout_core

        core = layout_core(s, plan, cost, cluster, factor, fidelity, trace_ranks, micro_window)
        spans = core.pop("_spans")
        out = _assemble(s, plan, None, core, engine)
        return _finish(s, out, spans, trace_ranks, healthy, plan, engine, comm_model, policy, draw, fidelity, micro_window)
    if engine == "analytic" and not s.topology.gpu.is_cpu_host and uses_lane_engine(s, "full"):
        from sim.errors import InputError

        raise InputError("the analytic engine covers DeepSpeed data + expert parallel layouts with direct or "
                         "hierarchical all-to-alls (no tp, cp, pp, etp, fp8, deepep/hybridep, megatron, fsdp2 or "
                         "a2a overlap); use --engine des", field="--engine")  # fmt: skip
    sched = build_step(s, plan, cost, factor, jitter_sampler(s), draw=draw)
    if engine == "analytic":
        from sim.engine.analytic import analytic_step

        core = analytic_step(s, sched, plan, cluster, cost)
        spans = None
    else:
        from sim.engine.des import Engine

        res = Engine(s, sched, plan, cluster, resolve_comm_model(s, comm_model), trace_ranks).run()
        core = _from_engine(s, res)
        spans = res.spans
    out = _assemble(s, plan, sched, core, engine)
    return _finish(s, out, spans, trace_ranks, healthy, plan, engine, comm_model, policy, draw, fidelity, micro_window)


def uses_lane_engine(s: Scenario, fidelity: str, comm_model: str = "auto") -> bool:
    """Whether ``s`` runs on the layout-aware lane engine (see :func:`simulate`); the ``flow`` comm
    model exists only in the per-rank engine, for DeepSpeed data + expert parallel layouts."""
    p = s.parallelism
    if s.topology.gpu.is_cpu_host and p.tp == p.cp == p.pp == 1:  # CPU ranks' host effects: per-rank engine
        return False
    plain = (p.tp == p.cp == p.pp == p.etp == 1 and s.training.framework == "deepspeed"
             and not is_quantized(s.training.dtype) and s.collectives.all_to_all in ("direct", "hierarchical")
             and not s.collectives.a2a_overlap and s.training.recompute_num_layers is None)  # fmt: skip
    if comm_model == "flow":
        if not plain:
            from sim.errors import InputError

            raise InputError("the flow comm model runs DeepSpeed data + expert parallel layouts only (no tp, cp, "
                             "pp, etp, fp8, deepep/hybridep or a2a overlap); use ps or auto", field="--comm-model")  # fmt: skip
        return False
    return not (fidelity == "full" and plain) or fidelity == "estimate"


def _finish(s, out, spans, trace_ranks, healthy, plan, engine, comm_model, policy, draw, fidelity, micro_window=True):
    if healthy and has_faults(s):
        from sim.hardware.faults import describe_faults, without_faults

        base = simulate(without_faults(s), engine, comm_model, policy, plan=plan, healthy=False, draw=draw,
                        fidelity=fidelity, micro_window=micro_window)
        out["faults"] = {
            "step_time_s": out["step_time_s"],
            "healthy_step_time_s": base["step_time_s"],
            "slowdown": out["step_time_s"] / base["step_time_s"] - 1 if base["step_time_s"] > 0 else 0.0,
            "healthy_breakdown_s": base["breakdown_s"],
            "links": describe_faults(cluster_for(s, faults=False), s) if s.faults.links else [],
            "stragglers": [{"rank": x.rank, "compute_factor": x.compute_factor} for x in s.faults.stragglers],
            "jitter_cv": s.faults.jitter.kernel_cv if s.faults.jitter is not None else 0.0,
        }
    if spans is not None and trace_ranks:
        out["_spans"] = spans
    return out


def _from_engine(s: Scenario, res) -> dict[str, Any]:
    # the critical rank: the last to finish; among ranks ending together (the step's final
    # collectives align them) the one that waited least at barriers, i.e. the one that set the pace
    ends, waits = res.rank_end_s, res.by_key["imbalance_wait"]
    last = np.flatnonzero(ends >= ends.max() * (1 - 1e-12))
    c = int(last[np.argmin(waits[last])])
    by_key = {k: float(v.mean()) for k, v in res.by_key.items()}
    crit = {k: float(v[c]) for k, v in res.by_key.items()}
    tokens = s.global_batch_size * s.training.seq_len
    world = s.world_size
    spread = res.rank_end_s
    sent = float(res.a2a_sent_bytes.mean())
    inter = float(res.a2a_inter_node_bytes.mean())
    waits = res.by_key["imbalance_wait"]
    top = np.argsort(-waits, kind="stable")[: min(4, world)]
    return {
        "step_time_s": res.step_time_s,
        "critical_rank": c,
        "breakdown_s": {
            "compute": by_key["compute"],
            "a2a": by_key["a2a"],
            "grad_sync": float(res.grad_sync_s.mean()),
            "optimizer": by_key["optimizer"],
            "exposed_comm": by_key["exposed_comm"],
            "imbalance_wait": by_key["imbalance_wait"],
            "pipeline_bubble": 0.0,
            "tp_comm": 0.0,
        },
        "critical_rank_breakdown_s": {**crit, "grad_sync": float(res.grad_sync_s[c]), "pipeline_bubble": 0.0,
                                      "tp_comm": 0.0},
        "phases_s": {k: float(v[c]) for k, v in sorted(res.by_name.items())},
        "ranks": {
            "end_min_s": float(spread.min()),
            "end_max_s": float(spread.max()),
            "imbalance_wait_max_s": float(waits.max()),
            "imbalance_wait_mean_s": float(waits.mean()),
            "most_waiting": [
                {"rank": int(r), "imbalance_wait_s": float(waits[r]), "waited_on": res.waited_on.get(int(r))}
                for r in top
            ],
        },
        "traffic_core": {"a2a_bytes": sent, "inter_node_bytes": inter},
        "link_bytes_by_kind": _by_kind(res.link_bytes, s),
        "simulator": {"engine": "des", "comm_model": res.comm_model, "events": res.events},
        "tokens": tokens,
    }


def _by_kind(link_bytes: np.ndarray, s: Scenario) -> dict[str, float]:
    from sim.hardware.cluster import LINK_KINDS

    cluster = cluster_for(s)
    out = {}
    for code, kind in enumerate(LINK_KINDS):
        sel = cluster.link_kind_code == code
        if sel.any():
            out[kind] = float(link_bytes[sel].sum())
    return out


def _memory(s: Scenario) -> dict[str, Any]:
    """The ``memory`` record: per stage for layouts (sim.model.stage_memory), else ZeRO's per GPU."""
    if zero_memory_applies(s):
        rec = memory_per_gpu(s).as_dict()
        rec["per_stage"] = [{"stage": 0, "peak_GiB_per_gpu": rec["peak_GiB_per_gpu"], "fits": rec["fits"],
                             "in_flight_micro_batches": 1.0}]  # fmt: skip
        return rec
    from sim.model.stage_memory import stage_memory_record

    return stage_memory_record(s)


def _assemble(s: Scenario, plan, sched, core: dict[str, Any], engine: str) -> dict[str, Any]:
    m, t = s.model, s.training
    world = s.world_size
    step = core["step_time_s"]
    tokens = s.global_batch_size * t.seq_len
    peak = s.topology.gpu.peak_flops(t.dtype)
    flops = model_flops_per_token(m, t.seq_len) * tokens
    counts = count_params(m)
    mem = _memory(s)
    summary = plan.summary()["summary"] if plan is not None else {}
    sent, inter = core["traffic_core"]["a2a_bytes"], core["traffic_core"]["inter_node_bytes"]
    out: dict[str, Any] = {
        "scenario": s.name,
        "engine": engine,
        "policy": plan.policy if plan is not None else None,
        "num_gpus": world,
        "step_time_s": step,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / step if step > 0 else 0.0,
        "tokens_per_s_per_gpu": tokens / step / world if step > 0 else 0.0,
        "mfu": flops / (step * world * peak) if step > 0 else 0.0,
        "model_flops_per_step": flops,
        "breakdown_s": core["breakdown_s"],
        "traffic": {
            "a2a_bytes": sent,
            "inter_node_bytes": inter,
            "inter_node_fraction": inter / sent if sent > 0 else 0.0,
            "max_over_mean_load": summary.get("max_over_mean_load", 1.0),
            "dropped_fraction": summary.get("dropped_fraction", 0.0),
            "retained_gate_mass": summary.get("retained_gate_mass"),
            "mean_nodes_per_token": summary.get("mean_nodes_per_token"),
            "units": "bytes per GPU per step, all-to-alls of forward and backward (sent off the GPU)",
        },
        "memory": mem,
        "params": {"total": counts.total, "active": counts.active},
        "layout": {**s.layout.describe(), "nodes": s.cluster.nodes, "gpus_per_node": s.gpus_per_node,
                   "zero_stage": s.parallelism.zero_stage, "framework": t.framework,
                   "pp_schedule": s.parallelism.schedule},  # fmt: skip
    }
    for k in ("critical_rank", "critical_rank_breakdown_s", "phases_s", "ranks", "link_bytes_by_kind", "simulator"):
        if k in core:
            out[k] = core[k]
    return out


__all__ = ["COMM_MODELS", "ENGINES", "compute_factors", "cost_model", "resolve_comm_model", "simulate"]
