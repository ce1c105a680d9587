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

This module holds :func:`fit_traces`, which runs every fit in turn; the per-op figures (medians, the
launch and memory fit, collective call times, the link fit) are :mod:`hw_validate.fits.profile_rows`'s,
the job's phases, desync profile and in-job solves :mod:`hw_validate.fits.profile_job`'s; their
public names stay importable from here.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from hw_validate.fits.compute import fit_attention, fit_gemm
from hw_validate.fits.profile_job import (  # noqa: F401  (the phases, desync and in-job solves: re-exported)
    SOLVE_ITERS,
    SOLVE_ROUNDS,
    SOLVE_TOL,
    _solve_in_job,
    desync_profile,
    in_job_residuals,
    measured_phases,
    solve_field,
)
from hw_validate.fits.profile_rows import (  # noqa: F401  (the per-op figures and their bounds: re-exported)
    DEGENERATE_BW_GBPS,
    FACTOR_KINDS,
    MAX_BYTES_FACTOR,
    OUTLIER_REL_ERR,
    _rel,
    attention_rows,
    call_times,
    comm_rows,
    fit_launch_memory,
    fit_links,
    medians,
)
from hw_validate.profile_trace import BYTES, RankTrace
from sim.inputs.calibration import Calibration


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


__all__ = ["call_times", "comm_rows", "desync_profile", "fit_launch_memory", "fit_traces", "measured_phases", "medians"]
