"""``moesim calibrate --from-profile``: the calibration fields a profiler trace of a training job
informs (:mod:`hw_validate.profile_trace` reads it), each fitted through the same formula as
``moesim calibrate``'s microbenchmarks and reported with its fit error. Fields the trace cannot
inform stay absent (the topology's defaults apply).

- ``kernel_launch_us``, ``hbm_bw_GBps``: the memory-bound ops, ``t = launch + bytes / bw`` (least
  squares on relative error over the median of each op and size), plus the median short idle gap
  between consecutive ops (the per-op framework overhead a launch stands for in the simulator);
- ``gemm.<dtype>``: the GEMMs, median time per shape, :func:`hw_validate.fits.compute.fit_gemm`;
- ``attention_efficiency``: the attention ops against the fitted GEMM peak
  (:func:`hw_validate.fits.compute.fit_attention`);
- ``links.intra`` and ``collective_bytes_factor``: the collectives of the most common group size
  within one node, through the simulator's collectives (:func:`hw_validate.fits.links.fit_link`).
  A call's time is the last-arriving rank's (entry to completion) when every rank's trace is
  given, as the microbenchmarks time isolated calls; from one rank's trace the lower quartile of
  its calls per size (it arrived last about half the time with two ranks);
- with ``--scenario`` (the job the trace is of): ``optimizer_bytes_per_param`` from the optimizer
  window less its collectives at the scenario's parameters per rank (one size: no separate
  overhead); on CPU ranks with every rank's trace, the late wake-ups, compute noise and stalls
  from the calls' entries and exits (:mod:`hw_validate.desync`'s estimators), then the in-job
  ``compute_scale`` and ``call_overhead_us`` by simulating the scenario as :mod:`hw_validate.fits.
  reference_job` does with the trace's forward+backward compute and blocking time as the measure.

Not informed by a trace: ``zero_grad_hook_*``, ``dispatcher_*``, ``cpu_adam_Gparams_per_s``,
``links.inter``/``host`` (a group spanning nodes is not split into link classes).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from hw_validate.fits.compute import fit_attention, fit_gemm
from hw_validate.fits.links import (
    LINK_FIT_KINDS,
    bench_cluster,
    fit_bytes_factor,
    fit_link,
    simulate_sweep,
    with_link,
)
from hw_validate.fits.optimizer import fit_optimizer
from hw_validate.fits.reference_job import optimizer_compute
from hw_validate.profile_trace import BYTES, RankTrace
from sim.inputs.calibration import Calibration, LinkFit
from sim.inputs.sections import Kind

#: a link row the first fit misses by more than this (relative) is refitted without (a call on a
#: one-rank group, which returns at once, looks like any other in a gloo trace)
OUTLIER_REL_ERR = 2.0
#: a fitted link faster than this (GB/s) means the sizes did not explain the call times
DEGENERATE_BW_GBPS = 1e6
#: the largest bytes factor kept (the calibration's bound)
MAX_BYTES_FACTOR = 1000.0
#: collectives a bytes factor can be fitted for on top of the link pair (the calibration's kinds)
FACTOR_KINDS = tuple(k for k in Kind.__args__ if k not in LINK_FIT_KINDS)


def _rel(pred: np.ndarray, t: np.ndarray) -> dict[str, Any]:
    err = np.abs(np.asarray(pred) / np.asarray(t) - 1.0)
    return {"fit_rel_err": float(np.median(err)), "fit_max_rel_err": float(err.max()), "points": int(err.size)}


def medians(rows: list[dict], keys: tuple[str, ...], value: str = "time_s") -> list[dict]:
    """One row per distinct ``keys``: the median of ``value`` and how many rows it came from."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[tuple(r[k] for k in keys)].append(r)
    return [{**dict(zip(keys, k, strict=True)), value: float(np.median([r[value] for r in g])), "calls": len(g)}
            for k, g in sorted(groups.items())]  # fmt: skip


def fit_launch_memory(rows: list[dict]) -> tuple[float, float, dict] | None:
    """``(launch_s, bytes_per_s, errors)``: ``t = launch + bytes / bw`` by least squares on relative
    error (both >= 0) over the median of each (op, bytes); None with fewer than two sizes."""
    from scipy.optimize import lsq_linear

    med = medians(rows, ("op", "bytes"))
    if len({r["bytes"] for r in med}) < 2:
        return None
    nb = np.array([r["bytes"] for r in med], dtype=np.float64)
    t = np.array([r["time_s"] for r in med], dtype=np.float64)
    A = np.stack([1.0 / t, nb / t], axis=1)
    scale = A.max(axis=0)
    sol = lsq_linear(A / scale, np.ones_like(t), bounds=([0.0, 1e-30], [np.inf, np.inf]))
    launch, inv_bw = (sol.x / scale).tolist()
    return launch, 1.0 / inv_bw, _rel(launch + nb * inv_bw, t)


def call_times(traces: list[RankTrace]) -> list[dict]:
    """One row per collective call: ``kind``, ``bytes``, ``ranks``, ``time_s``. With every rank's
    trace (the same calls in the same order on each), the last-arriving rank's entry-to-completion
    time; otherwise each call as its rank saw it, marked ``single``."""
    keyed = [defaultdict(list) for _ in traces]
    for i, tr in enumerate(traces):
        for c in tr.calls:
            if c.kind not in ("barrier", "broadcast"):
                keyed[i][(c.step, c.kind, c.bytes, c.ranks)].append(c)
    world = traces[0].world or len(traces)
    everyone = len(traces) > 1 and len(traces) == world and len({tr.rank for tr in traces}) == len(traces)
    rows = []
    for key in keyed[0]:
        step, kind, nbytes, ranks = key
        lists = [k.get(key, []) for k in keyed] if everyone else [keyed[0][key]]
        if everyone and len({len(x) for x in lists}) == 1:
            for calls in zip(*lists, strict=True):
                last = max(calls, key=lambda c: c.start_s)
                rows.append({"kind": kind, "bytes": nbytes, "ranks": ranks, "time_s": last.time_s, "single": False})
        else:
            rows += [{"kind": kind, "bytes": nbytes, "ranks": ranks, "time_s": c.time_s, "single": True} for c in lists[0]]
    return rows


def comm_rows(calls: list[dict]) -> list[dict]:
    """Per (kind, bytes): the lower quartile of the calls' times (the last arrivers' with every
    rank's trace, else one rank's own): the calls least disturbed by the job around them, as the
    microbenchmarks time isolated calls; the in-job surplus is ``call_overhead_us``'s. Sizes of 0
    bytes are left out."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in calls:
        if r["bytes"] > 0 and r["time_s"] > 0:
            groups[(r["kind"], r["bytes"], r["ranks"])].append(r)
    out = []
    for (kind, nbytes, ranks), g in sorted(groups.items()):
        t = [r["time_s"] for r in g]
        single = any(r["single"] for r in g)
        out.append({"kind": kind, "bytes": nbytes, "ranks": ranks, "calls": len(g), "time_s": float(np.percentile(t, 25)),
                    "stat": "p25 of one rank's calls" if single else "p25 of the last arrivers"})  # fmt: skip
    return out


def fit_links(rows: list[dict], topology, gpus_per_node: int | None) -> tuple[dict[str, LinkFit], dict, list[dict]]:
    """``(links, bytes factors, rows with fit_time_s)`` from :func:`comm_rows`: the rows of the most
    common group size, when that group fits in one node (``gpus_per_node``; unknown: assumed)."""
    if not rows:
        return {}, {}, []
    sizes = [r["ranks"] for r in rows if r["ranks"] >= 2]
    if not sizes:
        return {}, {}, []
    ranks = max(set(sizes), key=lambda s: (sizes.count(s), s))
    if gpus_per_node is not None and ranks > gpus_per_node:
        return {}, {}, []
    use = [r for r in rows if r["ranks"] == ranks]
    link_rows = [r for r in use if r["kind"] in LINK_FIT_KINDS]
    if len({(r["kind"], r["bytes"]) for r in link_rows}) < 2:
        return {}, {}, []
    cluster = bench_cluster(topology, ranks)
    fit, pred = fit_link(cluster, link_rows, "intra")
    err = np.abs(pred / np.array([r["time_s"] for r in link_rows]) - 1.0)
    keep = [r for r, e in zip(link_rows, err, strict=True) if e <= OUTLIER_REL_ERR]
    if len(keep) < len(link_rows) and len({(r["kind"], r["bytes"]) for r in keep}) >= 2:
        fit, _ = fit_link(cluster, keep, "intra")  # once, without the rows the first fit missed by > 3x
        for r in link_rows:
            r["outlier"] = r not in keep
    fitted = with_link(cluster, "intra", fit.alpha_us, fit.bw_GBps)
    factors = {}
    bytes_free = fit.bw_GBps > DEGENERATE_BW_GBPS  # the sizes did not explain the times: no factor to fit
    for kind in sorted({r["kind"] for r in use} & set(FACTOR_KINDS)) if not bytes_free else ():
        f = fit_bytes_factor(fitted, [r for r in use if r["kind"] == kind])
        if f <= MAX_BYTES_FACTOR:  # beyond: the links' bytes term is ~0, a factor says nothing
            factors[kind] = f
    fitted.collective_bytes_factor = dict(factors)
    pred = simulate_sweep(fitted, use)
    return {"intra": fit}, factors, [{**r, "fit_time_s": float(p)} for r, p in zip(use, pred, strict=True)]


def attention_rows(traces: list[RankTrace]) -> list[dict]:
    """Per attention shape: the median forward and backward seconds (NaN where absent)."""
    groups: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: {"fwd": [], "bwd": []})
    for tr in traces:
        for r in tr.attention:
            groups[(r["dtype"], r["batch"], r["heads"], r["seq"], r["head_dim"])][r["dir"]].append(r["time_s"])
    return [{"dtype": k[0], "batch": k[1], "heads": k[2], "seq": k[3], "head_dim": k[4],
             "fwd_s": float(np.median(v["fwd"])) if v["fwd"] else math.nan,
             "bwd_s": float(np.median(v["bwd"])) if v["bwd"] else math.nan,
             "calls": len(v["fwd"]) + len(v["bwd"])} for k, v in sorted(groups.items())]  # fmt: skip


# ---- the job's phases, for the fits that simulate the scenario ------------------------------------
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


# ---- everything --------------------------------------------------------------------------------
def fit_traces(traces: list[RankTrace], scenario: str | Path | None = None, overrides: list[str] = (),
               topology=None, router_trace: str | Path | None = None, progress=None) -> tuple[Calibration, dict]:  # fmt: skip
    """``(calibration, report)`` from the ranks' traces (module docstring); ``report["fits"]`` has
    one entry per field with its value, fit error and where it came from; ``report["absent"]`` the
    fields left to the topology."""
    from hw_validate.calibrate_fit import desync_figures

    say = progress or (lambda line: None)
    scen = None
    if scenario is not None:
        from sim.api import load_scenario

        scen = load_scenario(scenario, list(overrides))
    device = traces[0].device
    if topology is None:
        topology = scen.topology if scen is not None else ("cpu-host" if device == "cpu" else "hgx-h200")
    fits: dict[str, Any] = {}
    mem_rows = [r for tr in traces for r in tr.memory]
    gaps = [g for tr in traces for g in tr.gaps_s]
    gap_s = float(np.median(gaps)) if gaps else 0.0
    lm = fit_launch_memory(mem_rows) if mem_rows else None
    launch_s = hbm = None
    if lm is not None:
        op_s, hbm, err = lm
        launch_s = op_s + gap_s
        fits["hbm_bw_GBps"] = {"value": hbm / 1e9, **err, "source": "memory-bound ops: t = launch + bytes / bw"}
        fits["kernel_launch_us"] = {"value": launch_s * 1e6, "op_intercept_us": op_s * 1e6, "median_gap_us": gap_s * 1e6,
                                    "gaps": len(gaps), **err,
                                    "source": "the memory fit's intercept + the median short idle gap between ops"}  # fmt: skip
    # a kernel's (an op's) own fixed time is the intercept; the gap to the next one is the
    # simulator's per-kernel cost on top of it (kernel_launch_us = both)
    hbm_Bps, launch = (hbm if hbm else math.inf), (lm[0] if lm is not None else 0.0)
    gemm, gemm_rows = {}, []
    for dtype in sorted({r["dtype"] for tr in traces for r in tr.gemm}):
        rows = medians([r for tr in traces for r in tr.gemm if r["dtype"] == dtype], ("dtype", "m", "n", "k"))
        if len(rows) < 3:
            continue
        fit, pred = fit_gemm(rows, BYTES[dtype], hbm_Bps, launch)
        gemm[dtype] = fit
        gemm_rows += [{**r, "fit_time_s": float(p), "fit_launch_s": launch} for r, p in zip(rows, pred, strict=True)]
        fits[f"gemm.{dtype}"] = {"value": fit.model_dump(), "fit_rel_err": fit.fit_rel_err,
                                 "fit_max_rel_err": fit.fit_max_rel_err, "points": fit.points,
                                 "source": "GEMM ops with their shapes, median time per shape"}  # fmt: skip
    att_rows = attention_rows(traces)
    att = fit_attention(att_rows, {d: g.peak_TFLOPs * 1e12 for d, g in gemm.items()}, hbm_Bps, launch) if gemm else None
    if att is not None:
        fits["attention_efficiency"] = {"value": att, "points": len(att_rows), **_attention_spread(att_rows, gemm, hbm_Bps, launch, att),
                                        "source": "attention ops (forward and backward) against the GEMM peak"}  # fmt: skip
    calls = call_times(traces)
    crow = comm_rows(calls)
    gpn = scen.gpus_per_node if scen is not None else None
    links, factors, crow_fit = fit_links(crow, topology, gpn)
    for cls, f in links.items():
        fits[f"links.{cls}"] = {"value": {"alpha_us": f.alpha_us, "bw_GBps": f.bw_GBps}, "fit_rel_err": f.fit_rel_err,
                                "fit_max_rel_err": f.fit_max_rel_err, "points": f.points,
                                "source": f"collectives of {crow_fit[0]['ranks']} ranks ({crow_fit[0]['stat']})"}  # fmt: skip
    for kind, f in factors.items():
        sub = [r for r in crow_fit if r["kind"] == kind]
        fits[f"collective_bytes_factor.{kind}"] = {"value": f, **_rel([r["fit_time_s"] for r in sub], [r["time_s"] for r in sub]),
                                                   "source": f"{kind} calls against the fitted links"}  # fmt: skip
    hw = {"device": device, "backend": "nccl" if device == "cuda" else "gloo", "world_size": traces[0].world or len(traces),
          "source": "profiler trace", "traces": [tr.path for tr in traces], "topology": getattr(topology, "name", str(topology))}  # fmt: skip
    cal = Calibration(hardware=hw, gemm=gemm, attention_efficiency=att, hbm_bw_GBps=hbm / 1e9 if hbm else None,
                      kernel_launch_us=launch_s * 1e6 if launch_s is not None else None, links=links,
                      collective_bytes_factor=factors)  # fmt: skip
    desync = desync_profile(traces)
    if desync is not None:
        say("fitting the ranks' desync (late wake-ups, noise, stalls) on every rank's calls")
        wake, cv, pauses = desync_figures(desync, [], None, None)
        cal.wake_delay_p, cal.wake_delay_cap_s = wake if wake is not None else (None, None)
        cal.compute_noise_cv = cv
        cal.pause_rate_per_s, cal.pause_mean_s = pauses if pauses is not None else (None, None)
        fits["desync"] = {"value": desync["fit"], "calls": desync["calls"], **_wake_err(desync),
                          "source": "every rank's call entries and exits"}  # fmt: skip
    phases = measured_phases(traces)
    if scen is not None and phases is not None and hbm:
        say("fitting the optimizer step (and on CPU ranks the in-job compute scale and call overhead) by "
            "simulating the scenario")  # fmt: skip
        fits.update(_solve_in_job(cal, scenario, overrides, router_trace, phases, _job_dtype(traces), hbm, device == "cpu"))
    cal.sweeps.update(source="profile", comm=crow_fit or crow, gemm=gemm_rows, attention=att_rows,
                      memory=medians(mem_rows, ("op", "bytes")) if mem_rows else [], phases=phases, desync=desync)  # fmt: skip
    absent = sorted(k for k, v in cal.model_dump().items() if v in (None, {}, []) and k not in ("sweeps",))
    report = {"fits": fits, "absent": absent, "traces": [tr.path for tr in traces],
              "counts": [tr.counts for tr in traces], "calls": len(calls)}  # fmt: skip
    return cal, report


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


def _attention_spread(rows, gemm, hbm_Bps, launch, eff) -> dict:
    """Relative errors of the fitted efficiency's attention times against the measured ones."""
    from hw_validate.fits.compute import attention_flops
    from sim.frameworks.kernels import ATTENTION_BWD_FACTOR

    pred, meas = [], []
    for r in rows:
        g = gemm.get(r["dtype"])
        if g is None:
            continue
        flops, _ = attention_flops(r["batch"], r["heads"], r["seq"], r["head_dim"])
        for f, t in ((flops, r["fwd_s"]), (ATTENTION_BWD_FACTOR * flops, r["bwd_s"])):
            if t == t:  # not NaN
                pred.append(launch + f / (eff * g.peak_TFLOPs * 1e12))
                meas.append(t)
    return _rel(np.array(pred), np.array(meas)) if meas else {}


def _wake_err(desync: dict) -> dict:
    """The late wake-up fit's errors over the segment bins (the mean exit spread per bin)."""
    rows = [r for r in desync.get("wake", [])[1:] if r.get("fit_spread_s") and r.get("mean_spread_s")]
    if not rows:
        return {"fit_rel_err": None, "points": 0}
    return _rel([r["fit_spread_s"] for r in rows], [r["mean_spread_s"] for r in rows])


def _job_dtype(traces: list[RankTrace]) -> str | None:
    dts = [r["dtype"] for tr in traces for r in tr.gemm]
    return statistics.mode(dts) if dts else None


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


__all__ = ["call_times", "comm_rows", "desync_profile", "fit_launch_memory", "fit_traces", "measured_phases", "medians"]
