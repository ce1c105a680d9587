"""A GPU kind's ``sustained_compute_fraction``, fitted to dense training runs.

The GEMM curve and attention figure of a GPU description come from isolated microbenchmarks (a few
warm-up and timed calls of one kernel). Inside a training step the same kernels run back to back for
seconds at the GPU's power limit, between norms, casts and launches the microbenchmarks never see, and
every published MoE row of the development set was predicted 16-57% too fast with those rates. The
dense rows of ``validation/published/dense/`` (Megatron-Bridge's Llama 3 8B / 70B / 405B pre-training
on the same systems) have no router, dispatcher or all-to-all: what they measure beyond the model's
layout is the compute rate. Per GPU kind, :func:`fit_fraction` finds the fraction of the microbenchmark
rates (GEMMs and attention; memory-bound kernels and communication untouched) that makes the median
log error of that kind's dense rows zero (secant on the log of the fraction; the step time is
monotone in it). The result goes into ``topologies/gpus/<kind>.yaml`` by hand, with the rows named;
``benchmarks/fit_sustained.py`` records the fit and every row's error before and after.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from sim.studies.published import FOLDER, entries, measured_step_s, scenario_of

DENSE = FOLDER / "dense"
#: stop when the median |log error| of a kind's rows is below this (0.1%)
TOLERANCE = 1e-3


def dense_entries() -> list[dict[str, Any]]:
    return entries(DENSE)


def gpu_kind(entry: dict[str, Any]) -> str:
    return scenario_of(entry).topology.gpu.kind


def predicted_step_s(entry: dict[str, Any], fraction: float | None = None) -> float:
    """The simulated step of ``entry`` with the GPU's ``sustained_compute_fraction`` replaced by
    ``fraction`` (None: the description's own)."""
    from sim.engine.simulate import simulate

    s = scenario_of(entry)
    if fraction is not None:
        topo = s.topology
        gpu = topo.gpu.model_copy(update={"sustained_compute_fraction": fraction})
        s._topology = topo.model_copy(update={"gpu": gpu})
    return float(simulate(s)["step_time_s"])


@dataclass
class KindFit:
    kind: str
    fraction: float  # rounded to 3 digits
    rows: list[dict[str, Any]]  # id, measured, predicted at 1 and at the fraction, errors
    iterations: int


def _median_log_error(group: list[dict[str, Any]], fraction: float) -> tuple[float, list[float]]:
    preds = [predicted_step_s(e, fraction) for e in group]
    logs = [math.log(p / measured_step_s(e)) for e, p in zip(group, preds, strict=True)]
    return statistics.median(logs), preds


def fit_fraction(group: list[dict[str, Any]], max_iter: int = 12) -> KindFit:
    """The fraction (<= 1) that zeroes the median log error of ``group`` (one GPU kind's rows)."""
    x0, (g0, base) = 0.0, _median_log_error(group, 1.0)
    x, g, preds = x0, g0, base
    it = 0
    if g0 < -TOLERANCE:  # predicted too fast: lower the fraction (a step ~ 1 / fraction where compute-bound)
        x1 = max(x0 + g0, math.log(0.05))
        g1, preds = _median_log_error(group, math.exp(x1))
        x, g, it = x1, g1, 1
        while abs(g) > TOLERANCE and it < max_iter:
            slope = (g - g0) / (x - x0) if x != x0 else -1.0
            x0, g0 = x, g
            x = min(0.0, max(math.log(0.05), x - g / (slope if slope < 0 else -1.0)))
            g, preds = _median_log_error(group, math.exp(x))
            it += 1
    fraction = float(f"{math.exp(x):.3g}")
    _, final = _median_log_error(group, fraction)
    rows = []
    for e, p1, pf in zip(group, base, final, strict=True):
        meas = measured_step_s(e)
        rows.append({"id": e["id"], "title": e["title"], "measured_step_s": meas, "predicted_step_s_at_1": p1,
                     "error_at_1": p1 / meas - 1, "predicted_step_s": pf, "error": pf / meas - 1})  # fmt: skip
    return KindFit(gpu_kind(group[0]), fraction, rows, it)


def fit_all(ids: set[str] | None = None) -> list[KindFit]:
    """One :class:`KindFit` per GPU kind among the dense rows (``ids``: only those)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in dense_entries():
        if ids is None or e["id"] in ids:
            groups.setdefault(gpu_kind(e), []).append(e)
    return [fit_fraction(g) for _, g in sorted(groups.items())]


__all__ = ["DENSE", "TOLERANCE", "KindFit", "dense_entries", "fit_all", "fit_fraction", "gpu_kind",
           "predicted_step_s"]  # fmt: skip
