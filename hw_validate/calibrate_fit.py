"""From a microbenchmark result to a :class:`sim.inputs.calibration.Calibration`: the timings reduced
to one statistic of the repetitions (:func:`select_stat`), then every fit of :mod:`hw_validate.fits`
in turn, the reference job's figures (when ``moesim calibrate`` ran it) taking the place of the
microbenchmark loops' (:func:`fit_all`). The human report of the result is
:mod:`hw_validate.calibration_report`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from hw_validate.fits.compute import fit_attention, fit_gemm, fit_memory
from hw_validate.fits.cpu_ranks import fit_noise, fit_pause_profile, fit_profile, fit_wake
from hw_validate.fits.dispatcher import dispatcher_errors, fit_dispatcher
from hw_validate.fits.links import (
    LINK_FIT_KINDS,
    bench_cluster,
    comm_table,
    fit_bytes_factor,
    fit_link,
    simulate_sweep,
    with_link,
)
from hw_validate.fits.optimizer import fit_grad_hooks, fit_optimizer
from sim.inputs.calibration import Calibration, GemmFit, LinkFit


@dataclass
class CalibrationRun:
    """What :func:`fit_all` gives: the Calibration, the microbenchmark result it was fitted on
    (with the statistic selected) and a report of fit quality."""

    calibration: Calibration
    raw: dict[str, Any]
    report: dict[str, Any]


STATS = ("median", "p25")
#: per section: (field the fits read, field holding the lower quartile)
_STAT_FIELDS = {"comm": [("time_s", "p25_s")], "gemm": [("time_s", "p25_s")], "memory": [("time_s", "p25_s")],
                "optimizer": [("time_s", "p25_s"), ("grad_hooks_s", "grad_hooks_p25_s")],
                "attention": [("fwd_s", "fwd_p25_s"), ("bwd_s", "bwd_p25_s")],
                "launch": [("fwd_op_s", "fwd_op_p25_s"), ("bwd_op_s", "bwd_op_p25_s")],
                "dispatcher": [(f"{p}_{d}_s", f"{p}_{d}_p25_s") for p in ("gate", "encode", "decode")
                               for d in ("fwd", "bwd")]}  # fmt: skip


def select_stat(raw: dict[str, Any], stat: str = "median") -> dict[str, Any]:
    """A copy of a microbenchmark result whose time fields hold ``stat`` of the repetitions:
    ``p25`` (lower quartile: the machine with the least interference from other processes) or
    ``median``; the median stays under ``median_*`` for the record."""
    import copy

    if stat not in STATS:
        raise ValueError(f"stat must be one of {STATS}, got {stat!r}")
    out = copy.deepcopy(raw)
    for key, fields in _STAT_FIELDS.items():
        rows = out.get(key)
        for r in [rows] if isinstance(rows, dict) else rows or []:
            for f, q in fields:
                if f in r:
                    r["median_" + f] = r[f]
                    if stat == "p25" and q in r:
                        r[f] = r[q]
    out["stat"] = stat
    return out


def desync_figures(desync: dict[str, Any], wake_rows: list[dict], wake: tuple[float, float] | None,
                   noise_cv: float | None) -> tuple[tuple[float, float] | None, float | None, tuple[float, float] | None]:  # fmt: skip
    """``(wake, noise_cv, pauses)`` with the reference job's profile ``desync``
    (:func:`hw_validate.desync.profile_job`) in place of the microbenchmark loops' ``wake`` (p,
    cap) and ``noise_cv`` where it fits them (``wake_rows``: the loops' rows; their zero-segment
    spread is the collective's own exit skew). Both sets are recorded in ``desync`` (``microbench``,
    ``fit``), which the report prints."""
    base = next((r["mean_spread_s"] for r in wake_rows if r["segment_s"] == 0 and r.get("mean_spread_s") is not None), None)
    dwake, dcv = fit_profile(desync, base)
    pauses = fit_pause_profile(desync)
    desync["microbench"] = {"compute_noise_cv": noise_cv, "wake_delay_p": wake[0] if wake else None,
                            "wake_delay_cap_s": wake[1] if wake else None}  # fmt: skip
    desync["fit"] = {"compute_noise_cv": dcv, "wake_delay_p": dwake[0] if dwake else None,
                     "wake_delay_cap_s": dwake[1] if dwake else None,
                     "pause_rate_per_s": pauses[0] if pauses else None,
                     "pause_mean_s": pauses[1] if pauses else None}  # fmt: skip
    return (dwake if dwake is not None else wake), (dcv if dcv is not None else noise_cv), pauses


def fit_all(raw: dict[str, Any], topology, spec: dict[str, Any], stat: str = "median") -> CalibrationRun:
    """Every fit from a microbenchmark result (timings reduced to ``stat``, see :func:`select_stat`);
    the Calibration plus a report of fit quality."""
    from sim.model.dtypes import BYTES_PER_ELEMENT

    raw = select_stat(raw, stat)
    hw = raw["hardware"]
    launch_s = float(raw["launch"]["fwd_op_s"])
    hbm = fit_memory(raw["memory"], launch_s) if raw["memory"] else None
    hbm_Bps = hbm if hbm is not None else float("inf")
    for r in raw["memory"]:
        r["fit_time_s"] = launch_s + r["bytes"] / hbm_Bps
    report: dict[str, Any] = {"stat": stat, "kernel_launch_us": launch_s * 1e6,
                              "hbm_bw_GBps": hbm / 1e9 if hbm else None, "links": {}, "gemm": {}}  # fmt: skip
    gemm: dict[str, GemmFit] = {}
    gemm_rows: list[dict] = []
    for dtype in sorted({r["dtype"] for r in raw["gemm"]}):
        rows = [r for r in raw["gemm"] if r["dtype"] == dtype]
        fit, pred = fit_gemm(rows, BYTES_PER_ELEMENT[dtype], hbm_Bps, launch_s)
        gemm[dtype] = fit
        gemm_rows += [{**r, "fit_time_s": float(p)} for r, p in zip(rows, pred, strict=True)]
        report["gemm"][dtype] = fit.model_dump()
    att = fit_attention(raw["attention"], {d: g.peak_TFLOPs * 1e12 for d, g in gemm.items()}, hbm_Bps, launch_s)
    bpp, overhead = fit_optimizer(raw["optimizer"], hbm_Bps) if raw["optimizer"] and hbm else (None, None)
    noise_rows = raw.get("noise") or []
    noise_cv = fit_noise(noise_rows)
    wake_rows = raw.get("wake") or []
    wake = fit_wake(wake_rows)
    desync = raw.get("desync")
    pauses = None
    if desync:  # the reference job's calls (hw_validate.desync) replace the loops' figures
        wake, noise_cv, pauses = desync_figures(desync, wake_rows, wake, noise_cv)
    hooks = fit_grad_hooks(raw["optimizer"]) if raw["optimizer"] else None
    disp_rows = raw.get("dispatcher") or []
    disp = fit_dispatcher(disp_rows, gemm.get("fp32"), hbm_Bps, launch_s) if disp_rows else None
    if disp is not None:
        err = np.abs(dispatcher_errors(disp_rows))
        report["dispatcher"] = {"op_us": disp[0] * 1e6, "bw_GBps": disp[1] / 1e9, "fit_rel_err": float(np.median(err)),
                                "fit_max_rel_err": float(err.max()), "points": int(err.size)}  # fmt: skip
    links: dict[str, LinkFit] = {}
    table = comm_table(raw["comm"])
    factors: dict[str, float] = {}
    link_rows = [r for r in raw["comm"] if r["kind"] in LINK_FIT_KINDS]
    if link_rows:
        cluster = bench_cluster(topology, int(hw["world_size"]))
        fit, _ = fit_link(cluster, link_rows, "intra")
        links["intra"] = fit
        fitted = with_link(cluster, "intra", fit.alpha_us, fit.bw_GBps)
        for kind in sorted({r["kind"] for r in raw["comm"]} - set(LINK_FIT_KINDS)):
            factors[kind] = fit_bytes_factor(fitted, [r for r in raw["comm"] if r["kind"] == kind])
        fitted.collective_bytes_factor = dict(factors)
        pred = simulate_sweep(fitted, raw["comm"])
        for row, p in zip(table, pred, strict=True):
            row["fit_time_s"] = float(p)
        report["links"]["intra"] = fit.model_dump()
        report["collective_bytes_factor"] = dict(factors)
        # each collective alone (a diagnostic: how far one pair for both is from each one's own)
        report["links_by_kind"] = {}
        for kind in sorted({r["kind"] for r in raw["comm"]}):
            sub = [r for r in raw["comm"] if r["kind"] == kind]
            if len(sub) >= 2:
                report["links_by_kind"][kind] = fit_link(cluster, sub, "intra")[0].model_dump()
    report.update(attention_efficiency=att, optimizer_bytes_per_param=bpp, compute_noise_cv=noise_cv,
                  optimizer_step_overhead_us=overhead * 1e6 if overhead is not None else None)  # fmt: skip
    cal = Calibration(
        hardware={**hw, "topology": getattr(topology, "name", str(topology))},
        gemm=gemm,
        attention_efficiency=att,
        hbm_bw_GBps=hbm / 1e9 if hbm else None,
        kernel_launch_us=launch_s * 1e6,
        zero_grad_hook_ns_per_param=hooks[0] * 1e9 if hooks is not None else None,
        zero_grad_hook_overhead_us=hooks[1] * 1e6 if hooks is not None else None,
        dispatcher_op_us=disp[0] * 1e6 if disp is not None else None,
        dispatcher_bw_GBps=disp[1] / 1e9 if disp is not None else None,
        links=links,
        collective_bytes_factor=factors,
        optimizer_bytes_per_param=bpp,
        optimizer_step_overhead_us=overhead * 1e6 if overhead is not None else None,
        compute_noise_cv=noise_cv,
        wake_delay_p=wake[0] if wake is not None else None,
        wake_delay_cap_s=wake[1] if wake is not None else None,
        pause_rate_per_s=pauses[0] if pauses is not None else None,
        pause_mean_s=pauses[1] if pauses is not None else None,
        sweeps={
            "stat": stat,
            "comm": table,
            "links_by_kind": report.get("links_by_kind", {}),
            "gemm": gemm_rows,
            "attention": raw["attention"],
            "memory": raw["memory"],
            "launch": raw["launch"],
            "optimizer": raw["optimizer"],
            "dispatcher": disp_rows,
            "dispatcher_fit": report.get("dispatcher"),
            "noise": noise_rows,
            "wake": wake_rows,
            "desync": desync,
            "spec": {k: v for k, v in spec.items() if k != "gemm"},
            "wall_s": raw.get("wall_s"),
            "command": raw.get("command"),
        },
    )
    return CalibrationRun(cal, raw, report)
