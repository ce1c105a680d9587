"""One step through the layout-aware engine: program, pricing, lanes (folded or full), result core.

:func:`layout_core` builds the :class:`~sim.frameworks.program.Program`, prices it lazily
(:class:`~sim.frameworks.pricing.Pricer`), runs :func:`sim.engine.fold.run_folded` and returns the
core of the result record (``sim.engine.simulate._assemble`` adds traffic, memory and parameters):
the step time, the breakdown (means over every rank of every stage), the pace-setting rank's
breakdown and compute spans, and what the simulator folded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.engine.fold import lane_means, run_folded
from sim.engine.lanes import KEYS
from sim.engine.window import window_of
from sim.frameworks.builder import build_program
from sim.frameworks.pricing import Pricer
from sim.hardware.cluster import LINK_KINDS, Cluster
from sim.hardware.costs import CostModel
from sim.inputs.scenario import Scenario

FIDELITIES = ("folded", "full", "estimate")


def layout_core(s: Scenario, plan, cost: CostModel, cluster: Cluster, factor: np.ndarray, fidelity: str,
                trace_ranks: set[int] | None = None, micro_window: bool = True) -> dict[str, Any]:  # fmt: skip
    """``micro_window``: let the folded and estimate fidelities simulate a steady-state window of
    the micro-batches where :func:`sim.engine.window.window_of` finds one; ``fidelity="full"`` never does."""
    if fidelity not in FIDELITIES:
        raise ValueError(f"fidelity must be one of {FIDELITIES}, got {fidelity!r}")
    window = window_of(s, fidelity) if micro_window else None
    program = build_program(s, cost, window.m_sim if window else None)
    pricer = Pricer(s, plan, cost, factor)
    from sim.hardware.faults import jitter_sampler

    f = run_folded(s, program, plan, cluster, pricer, fidelity, trace_ranks, jitter_sampler(s), window)
    res = f.result
    pp, n = res.end_s.shape
    ends = res.end_s.reshape(-1)
    waits = (res.by_key["imbalance_wait"] + res.by_key["pipeline_bubble"]).reshape(-1)
    last = np.flatnonzero(ends >= ends.max() * (1 - 1e-12))
    c = int(last[np.argmin(waits[last])])
    stage, pos = divmod(c, n)
    rank = int(res.positions[pos] + stage * s.layout.stage_size)
    means = lane_means(f, "by_key")
    crit = {k: float(res.by_key[k][stage, pos]) for k in KEYS}
    crit["grad_sync"] = float(res.grad_sync_s[stage, pos])
    sent, inter = _traffic(f)
    breakdown = {
        "compute": means["compute"],
        "a2a": means["a2a"],
        "grad_sync": means["grad_sync"],
        "optimizer": means["optimizer"],
        "exposed_comm": means["exposed_comm"],
        "imbalance_wait": means["imbalance_wait"],
        "pipeline_bubble": means["pipeline_bubble"],
        "tp_comm": means["tp_comm"],
    }
    w = res.by_key["imbalance_wait"]
    flat_w = w.reshape(-1)
    top = np.argsort(-flat_w, kind="stable")[:4]
    folded = {
        "lanes_total": f.lanes_total,
        "lanes_simulated": int(len(f.selected)),
        "lane_ranks": s.layout.lane_size,
        "stages": pp,
        "simulated_ranks": int(pp * n),
        "unsimulated_margin_s": None if not np.isfinite(f.margin_s) else float(f.margin_s),
        "what": (
            "every lane simulated" if f.estimate is None else
            f"{len(f.selected)} of {f.lanes_total} lanes followed by the DES (slowest by estimate + random); "
            "the others join data-parallel rendezvous by their estimate"
        ),
    }  # fmt: skip
    return {
        "step_time_s": float(ends.max()),
        "critical_rank": rank,
        "breakdown_s": breakdown,
        "critical_rank_breakdown_s": crit,
        "phases_s": {k: float(v[stage, pos]) for k, v in sorted(res.by_name.items())},
        "ranks": {
            "end_min_s": float(ends.min()),
            "end_max_s": float(ends.max()),
            "imbalance_wait_max_s": float(flat_w.max()),
            "imbalance_wait_mean_s": means["imbalance_wait"],
            "most_waiting": [
                {"rank": (g := int(res.positions[i % n] + (i // n) * s.layout.stage_size)),
                 "imbalance_wait_s": float(flat_w[i]), "waited_on": res.waited_on.get(g)}
                for i in top
            ],  # fmt: skip
        },
        "traffic_core": {"a2a_bytes": sent, "inter_node_bytes": inter},
        "link_bytes_by_kind": _link_bytes(f, cluster),
        "simulator": {"engine": "des", "comm_model": "ps", "events": res.events, "fidelity": fidelity,
                      "folded": folded,
                      "micro_window": None if res.window is None else res.window.report(float(ends.max()))},  # fmt: skip
        "_spans": res.spans,
    }


def _traffic(f) -> tuple[float, float]:
    """Mean all-to-all bytes sent per rank and the part crossing nodes, over every rank (the
    estimate pass counts every lane's bytes exactly: bytes do not depend on the timing model)."""
    src = f.estimate if f.estimate is not None else f.result
    return float(src.a2a_sent_bytes.mean()), float(src.a2a_inter_node_bytes.mean())


def _link_bytes(f, cluster: Cluster) -> dict[str, float]:
    lb = f.result.link_bytes
    scale = f.lanes_total / max(len(f.selected), 1)
    out = {}
    for code, kind in enumerate(LINK_KINDS):
        sel = cluster.link_kind_code == code
        if sel.any():
            out[kind] = float(lb[sel].sum()) * scale
    return out


__all__ = ["FIDELITIES", "layout_core"]
