"""The job as a whole for ``moesim calibrate --from-profile`` (:mod:`hw_validate.fits.from_profile`):
its forward, backward and optimizer phases and the blocking calls in them as the trace measured
them, every CPU rank's desync profile, and the fields solved by simulating the scenario as the job
ran (the optimizer's bytes per parameter; on CPU ranks the compute scale and call overhead).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from hw_validate.fits.optimizer import fit_optimizer
from hw_validate.fits.reference_job import optimizer_compute
from hw_validate.profile_trace import RankTrace
from sim.inputs.calibration import Calibration


def _inside(calls, a: float, b: float) -> float:
    return sum(max(0.0, min(c.end_s, b) - max(c.start_s, a)) for c in calls)


def measured_phases(traces: list[RankTrace]) -> dict[str, float] | None:
    """The job's phases as :mod:`hw_validate.fits.reference_job` reads a measurement: ``forward``,
    ``backward``, ``optimizer`` (the windows, less the profiler's cost where the job measured it,
    shared by the ops each window recorded) and the blocking calls inside them (``dispatch``:
    forward's, ``dispatch_bwd``: backward's, ``optimizer_comm``: the optimizer's); per step the
    slowest rank's, then the median over the steps. None when no step has windows."""
    per_step: dict[int, list[dict[str, float]]] = defaultdict(list)
    for tr in traces:
        calls = [c for c in tr.calls if c.kind != "barrier"]
        for st in tr.steps:
            if not st.windows:
                continue
            w = st.windows

            def span(n: str, st=st, w=w, tr=tr) -> float:
                """The window less its share (by recorded ops) of the profiler's cost a step."""
                cost = tr.profiler_cost_s * st.events.get(n, 0) / max(1, st.events.get("step", 0))
                return max(0.0, w[n][1] - w[n][0] - cost)

            per_step[st.index].append({
                "forward": span("forward"), "backward": span("backward"), "optimizer": span("optimizer"),
                "dispatch": _inside(calls, *w["forward"]), "dispatch_bwd": _inside(calls, *w["backward"]),
                "optimizer_comm": _inside(calls, *w["optimizer"]),
            })  # fmt: skip
    if not per_step:
        return None
    keys = ("forward", "backward", "optimizer", "dispatch", "dispatch_bwd", "optimizer_comm")
    slowest = [{k: max(r[k] for r in ranks) for k in keys} for ranks in per_step.values()]
    return {k: float(np.median([s[k] for s in slowest])) for k in keys}


def desync_profile(traces: list[RankTrace]) -> dict | None:
    """The desync profile (:func:`hw_validate.desync.profile_job`'s ``wake``, ``noise``, ``pauses``)
    of every rank's calls: each call's entry and completion per rank, aligned step by step; None
    without every rank's trace of a CPU job."""
    from hw_validate.desync import aligned_calls, desync_rows, step_segments
    from hw_validate.fits.cpu_ranks import fit_pauses

    world = traces[0].world or 0
    if len(traces) < 2 or len(traces) != world or traces[0].device != "cpu":
        return None
    records = []
    for tr in sorted(traces, key=lambda t: t.rank or 0):
        by_step: dict[int, list] = defaultdict(list)
        for c in tr.calls:
            if c.kind != "barrier" and c.step >= 0:
                by_step[c.step].append([c.kind, c.start_s, c.end_s])
        records.append([{"step": s, "spans": v} for s, v in sorted(by_step.items())])
    kinds = {c.kind for tr in traces for c in tr.calls} - {"barrier"}
    entries, exits, last, skipped = aligned_calls(records, blocking=kinds)
    if entries.shape[1] == 0:
        return None
    rows, noise = desync_rows(entries, exits, last)
    return {"scenario": "(profiler trace)", "ranks": len(traces), "steps": len(records[0]), "calls": int(entries.shape[1]),
            "skipped_steps": skipped, "wake": rows, "noise": noise, "pauses": fit_pauses(step_segments(entries, exits, last))}  # fmt: skip

#: rounds over the three simulated fits (each moves the others' phases a little: rank waits)
SOLVE_ROUNDS = 2
#: a solve stops when the simulated figure is within this of the trace's (relative)
SOLVE_TOL = 0.01
SOLVE_ITERS = 6


def solve_field(cal: Calibration, profile: dict, field: str, figure, x0: float, x1: float,
                lo: float = 0.0) -> tuple[float | None, float]:  # fmt: skip
    """``(value, relative residual)`` of calibration ``field`` at which the scenario simulated as the
    job ran (:func:`hw_validate.fits.reference_job._simulate_reference`) gives the trace's ``figure``
    (a function of the phases): the secant method from ``x0`` and ``x1``, kept at ``lo`` or above,
    until within :data:`SOLVE_TOL` (None when the trace's figure is not positive). Near-linear figures (the reference job's two-probe solve) take one step;
    the compute scale does not (stalls come per second of compute, the median over noise draws)."""
    from hw_validate.fits.reference_job import _simulate_reference

    target = figure(profile["measured"]["phases_s"])
    if not target > 0:
        return None, 0.0

    def f(x: float) -> float:
        (phases, _), = _simulate_reference(cal, profile, field, (x,))
        return figure(phases) - target

    f0, f1 = f(x0), f(x1)
    for _ in range(SOLVE_ITERS):
        if abs(f1) <= SOLVE_TOL * target or f1 == f0:
            break
        x0, x1, f0 = x1, max(lo, x1 - f1 * (x1 - x0) / (f1 - f0)), f1
        f1 = f(x1)
    return (x1 if f1 == f1 else None), (f1 / target if target > 0 else 0.0)


def _solve_in_job(cal: Calibration, scenario, overrides, router_trace, phases: dict, dtype: str | None, hbm: float,
                  cpu: bool) -> dict:  # fmt: skip
    """Solve, by simulating the scenario with ``cal`` (set in place), the optimizer's bytes per
    parameter for the trace's optimizer compute and, on CPU ranks, the compute scale for its
    forward+backward compute and the call overhead for its blocking time (:func:`solve_field`);
    the report's entries, each with the residual left as its error."""
    from hw_validate.fits.reference_job import blocking_time, compute_time

    prof = {"scenario": str(scenario), "overrides": list(overrides), "job": {"trace": str(router_trace) if router_trace else None},
            "measured": {"phases_s": phases, "dtype": dtype}}  # fmt: skip
    params, t_opt = _optimizer_params(scenario, overrides), optimizer_compute(phases)
    solves = []
    if params and t_opt > 0:
        probe, _ = fit_optimizer([{"params": params, "time_s": t_opt}], hbm)  # all of it per parameter
        cal.optimizer_step_overhead_us = 0.0
        solves.append(("optimizer_bytes_per_param", optimizer_compute, probe, 0.5 * probe, 1e-3 * probe,
                       "the optimizer window less its collectives (one size: overhead 0)"))  # fmt: skip
    if cpu:  # the calibration's bounds: a scale > 0, an overhead >= 0
        solves += [("compute_scale", compute_time, 1.0, 2.0, 1e-3, "the trace's forward+backward compute less its calls"),
                   ("call_overhead_us", blocking_time, 0.0, 1000.0, 0.0, "the trace's time in blocking calls")]  # fmt: skip
    fits: dict[str, Any] = {}
    for _ in range(SOLVE_ROUNDS):
        for field, figure, x0, x1, lo, what in solves:
            cur = getattr(cal, field)
            value, resid = solve_field(cal, prof, field, figure, cur if cur else x0, x1 if not cur else cur * 1.1 + 1e-3, lo)
            if value is None:
                continue
            setattr(cal, field, value)
            fits[field] = {"value": value, "measured_s": figure(phases), "points": 1, "fit_rel_err": abs(resid),
                           "fit_max_rel_err": abs(resid), "source": f"{what}, solved by simulating the scenario"}  # fmt: skip
    residual = in_job_residuals(cal, prof)
    for field, key in (("optimizer_bytes_per_param", "optimizer_compute"), ("compute_scale", "compute"),
                       ("call_overhead_us", "blocking")):  # fmt: skip
        if field in fits:
            fits[field].update(fit_rel_err=abs(residual[key]), fit_max_rel_err=abs(residual[key]))
    cal.sweeps["in_job"] = {"residual_rel": residual, "params_per_rank": params}
    return fits


def in_job_residuals(cal: Calibration, profile: dict) -> dict[str, float]:
    """The job simulated once more with ``cal`` as written: relative error of its optimizer compute,
    forward+backward compute and blocking time against the trace's (what the solved fits report as
    their error: the solves are linear, the median over noise draws only nearly so)."""
    import tempfile

    from hw_validate.fits.reference_job import blocking_time, compute_time
    from hw_validate.phases import simulate_median, simulation_scenario
    from sim.inputs.calibration import save_calibration

    with tempfile.TemporaryDirectory(prefix="moesim-profile-") as tmp:
        path = Path(tmp) / "calibration.json"
        save_calibration(path, cal)
        s = simulation_scenario(profile["scenario"], profile["overrides"], path, profile["job"]["trace"],
                                profile["measured"]["dtype"])  # fmt: skip
        _, phases, _, _ = simulate_median(s)
    m = profile["measured"]["phases_s"]
    return {name: (f(phases) - f(m)) / f(m) if f(m) > 0 else 0.0
            for name, f in (("optimizer_compute", optimizer_compute), ("compute", compute_time), ("blocking", blocking_time))}


def _optimizer_params(scenario, overrides) -> int | None:
    """Parameters the optimizer steps on one rank of the scenario (the simulator's own count)."""
    import numpy as np_

    from sim.api import load_scenario
    from sim.frameworks.deepspeed import build_schedule
    from sim.hardware.costs import CostModel
    from sim.routing.plan import route_scenario

    s = load_scenario(scenario, list(overrides))
    plan = route_scenario(s) if s.model.num_moe_layers else None
    sched = build_schedule(s, plan, CostModel(s.topology.gpu, None), np_.ones(s.world_size))
    return int(sched.stats["optimizer_params_per_rank"]) or None
