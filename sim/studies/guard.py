"""Resource guard: refuse (exit 2, :class:`~sim.errors.InputError` on ``cluster.nodes``) a scenario
that would exhaust this machine, with the estimate and what to change, instead of being killed by
the kernel hours later.

The estimate is :func:`~sim.studies.guard_estimate.estimate` (closed forms over the arrays the
simulator really allocates, calibrated by measured runs), or for scenarios the lane engine runs
:mod:`sim.studies.guard_lanes`; its names stay importable from here. This module holds the machine
(``MemAvailable``, the time limit) and the decision.

A run is refused when the peak exceeds ``MEMORY_FRACTION`` of ``MemAvailable`` (``/proc/meminfo``)
or the time exceeds ``TIME_LIMIT_S`` (env ``MOESIM_TIME_LIMIT_S``); ``--force`` runs it anyway. A
refusal names what would fit: the largest node, layer or micro-batch count under the limits
(bisection over the estimate), and the analytic engine or the ps comm model where they fit.
"""

from __future__ import annotations

import dataclasses
import math
import os

from sim.errors import InputError
from sim.studies.guard_estimate import (  # noqa: F401  (the constants and GiB: re-exported)
    BASE_BYTES,
    ENGINE_LIST_BYTES,
    EVENT_S,
    EVENTS_PER_RANK_LAYER,
    EXACT_S_PER_ELEM,
    FLOW_AUTO_MAX_RANKS,
    FLOW_RING_S_PER_TRANSFER,
    FLOW_S_PER_FLOW,
    GRAPH_BYTES_PER_GPU,
    HIERARCHICAL_LAUNCH_FACTOR,
    LAUNCH_S,
    LAUNCH_S_PER_EP2,
    MATRIX_S_PER_ELEM,
    POOL_BYTES_PER_TOKEN_EXPERT,
    POOL_TOKENS,
    PROCESS_BYTES,
    RING_S_PER_TRANSFER,
    RING_TRANSFER_BYTES,
    ROUTE_S,
    ROUTE_S_PER_ELEM,
    ROUTE_TEMP_BYTES,
    SCHEDULE_BYTES,
    SCHEDULE_S,
    SCHEDULE_S_PER_CELL,
    SUMMARY_BYTES,
    SUMMARY_S_PER_ELEM,
    Estimate,
    GiB,
    Shape,
    estimate,
    fmt_bytes,
    fmt_time,
    shape_of,
)

MEMORY_FRACTION = 0.8
TIME_LIMIT_S = 3600.0


# ---- the machine -------------------------------------------------------------------------------
def available_memory_bytes() -> float | None:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux), else physical memory, else None (no check)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def time_limit_s() -> float:
    raw = os.environ.get("MOESIM_TIME_LIMIT_S")
    if raw:
        try:
            value = float(raw)
        except ValueError:
            raise InputError(
                f"must be a number of seconds, got {raw!r}", field="MOESIM_TIME_LIMIT_S"
            ) from None
        if value > 0 and math.isfinite(value):
            return value
        raise InputError(f"must be > 0, got {raw!r}", field="MOESIM_TIME_LIMIT_S")
    return TIME_LIMIT_S


# ---- the check ---------------------------------------------------------------------------------
def check_resources(
    scenario,
    engine: str = "des",
    comm_model: str = "auto",
    force: bool = False,
    available_bytes: float | None = None,
    limit_s: float | None = None,
    fidelity: str = "folded",
) -> Estimate:
    """Estimate the run; raise :class:`InputError` (exit 2) naming ``cluster.nodes`` with the estimate
    and what would fit when it exceeds ``MEMORY_FRACTION`` of the available memory or the time limit,
    unless ``force``. Returns the estimate. Scenarios the lane engine runs take its estimate
    (:mod:`sim.studies.guard_lanes`)."""
    if engine == "des":
        from sim.engine.simulate import uses_lane_engine

        if uses_lane_engine(scenario, fidelity, comm_model):
            return _check_lanes(scenario, fidelity, force, available_bytes, limit_s)
    sh = shape_of(scenario)
    est = estimate(sh, engine, comm_model)
    avail = available_memory_bytes() if available_bytes is None else available_bytes
    limit = time_limit_s() if limit_s is None else limit_s
    mem_cap = MEMORY_FRACTION * avail if avail is not None else math.inf
    if force or (est.memory_bytes <= mem_cap and est.time_s <= limit):
        return est

    def fits(x: Estimate) -> bool:
        return x.memory_bytes <= mem_cap and x.time_s <= limit

    what = (
        "moesim route"
        if engine == "route"
        else f"engine {engine}" + (f", {est.comm_model} comm model" if est.comm_model else "")
    )
    over = []
    if est.memory_bytes > mem_cap:
        over.append(
            f"{fmt_bytes(avail)} of memory is available here (limit {MEMORY_FRACTION:.0%}: {fmt_bytes(mem_cap)})"
        )
    if est.time_s > limit:
        over.append(f"the time limit is {fmt_time(limit)} (MOESIM_TIME_LIMIT_S)")
    options = []
    n = _largest(sh, "nodes", lambda x: fits(estimate(x, engine, comm_model)))
    if n:
        options.append(
            f"fewer nodes: --set cluster.nodes={n} or less ({estimate(dataclasses.replace(sh, nodes=n), engine, comm_model).describe()})"
        )
    if engine == "des":
        alt = estimate(sh, "analytic")
        if fits(alt):
            options.append(f"--engine analytic (mean-field, no barriers: {alt.describe()})")
        else:
            n_a = _largest(sh, "nodes", lambda x: fits(estimate(x, "analytic")))
            if n_a and n_a > (n or 0):
                options.append(f"--engine analytic with --set cluster.nodes={n_a} or less")
        if est.comm_model == "flow":
            ps = estimate(sh, "des", "ps")
            if fits(ps):
                options.append(f"--comm-model ps ({ps.describe()})")
    for attr, path in (("layers", "model.num_layers"), ("micro", "training.grad_accum_steps")):
        v = _largest(sh, attr, lambda x: fits(estimate(x, engine, comm_model)))
        if v:
            options.append(
                f"fewer {'layers' if attr == 'layers' else 'micro-batches'}: --set {path}={v} or less"
            )
    advice = (
        ("; to fit: " + "; ".join(options))
        if options
        else "; nothing smaller along nodes, layers or micro-batches fits"
    )
    a2a = "" if engine == "route" else f"{sh.a2a} all-to-all, "
    raise InputError(
        f"simulating {sh.nodes} nodes x {sh.gpus_per_node} GPUs = {sh.world:,} GPUs ({what}, {a2a}"
        f"{sh.moe_layers} MoE layers x {sh.micro} micro-batches) needs an estimated "
        f"{est.describe()}, but {' and '.join(over)}{advice}; or pass --force to run it anyway",
        file=scenario.source,
        field="cluster.nodes",
    )


def _check_lanes(scenario, fidelity: str, force: bool, available_bytes, limit_s) -> Estimate:
    from sim.studies.guard_lanes import lane_costs, lane_shape

    mem, tim = lane_costs(lane_shape(scenario, fidelity))
    est = Estimate("des-lanes", "ps", scenario.world_size, sum(mem.values()), sum(tim.values()), mem, tim)
    avail = available_memory_bytes() if available_bytes is None else available_bytes
    limit = time_limit_s() if limit_s is None else limit_s
    mem_cap = MEMORY_FRACTION * avail if avail is not None else math.inf
    if force or (est.memory_bytes <= mem_cap and est.time_s <= limit):
        return est
    hint = "; --fidelity folded follows only the lanes that can set the pace" if fidelity == "full" else ""
    raise InputError(
        f"simulating {scenario.world_size:,} GPUs (lane engine, fidelity {fidelity}) needs an estimated "
        f"{est.describe()}, but {fmt_bytes(avail or 0)} of memory is available here (limit {MEMORY_FRACTION:.0%}) "
        f"and the time limit is {fmt_time(limit)} (MOESIM_TIME_LIMIT_S){hint}; or pass --force to run it anyway",
        file=scenario.source, field="cluster.nodes",
    )  # fmt: skip


def _largest(sh: Shape, attr: str, ok) -> int | None:
    """The largest value below the current one of ``attr`` (nodes, layers, micro) for which
    ``ok(shape)`` holds, by bisection (every estimate grows with each of them); nodes keep the
    world a multiple of ep."""
    cur = getattr(sh, attr)

    def valid(v: int) -> bool:
        if attr == "nodes":
            w = v * sh.gpus_per_node
            return w >= sh.ep and w % sh.ep == 0
        if attr == "layers":
            return v > sh.first_dense
        return True

    def good(v: int) -> bool:
        return ok(dataclasses.replace(sh, **{attr: v}))

    lo, hi = 1, cur - 1
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        if good(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    if best is None:
        return None
    while best >= 1 and not valid(best):  # step down to the nearest valid layout
        best -= 1
    return best if best >= 1 and good(best) else None


__all__ = [
    "MEMORY_FRACTION",
    "TIME_LIMIT_S",
    "Estimate",
    "Shape",
    "available_memory_bytes",
    "check_resources",
    "estimate",
    "shape_of",
]
