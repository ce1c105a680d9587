"""The human report of a calibration (``moesim calibrate`` prints it): the nccl-tests-style table of
the measured collectives with the fitted model's time, every fitted number with its error, and
where the reference job's figures (:mod:`hw_validate.desync`) replaced the microbenchmark loops'."""

from __future__ import annotations

import numpy as np

from hw_validate.desync import describe
from hw_validate.fits.cpu_ranks import PAUSE_MIN_S, PAUSE_SIGMAS
from sim.inputs.calibration import Calibration


def _us(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e6:.1f}"


def format_report(cal: Calibration) -> str:
    """Human summary: the nccl-tests-style table (time = the statistic the fit used, algbw and busbw
    from it; the lower quartile; the fitted model's time) and every fitted number with its error."""
    hw = cal.hardware
    stat = cal.sweeps.get("stat", "median")
    lines = [
        f"calibration of {hw.get('device_name')} x {hw.get('world_size')} ranks ({hw.get('backend')}, "
        f"{hw.get('threads_per_rank')} threads per rank, torch {hw.get('torch')}, host {hw.get('host')})"
    ]
    comm = cal.sweeps.get("comm") or []
    if comm:
        gap = (cal.sweeps.get("spec") or {}).get("comm", {}).get("gap_s", 0.0)
        how = (f"isolated calls after {gap * 1e3:g} ms of compute, the last-arriving rank's time"
               if gap else "the slowest rank's, each")
        shown = "mean" if stat == "median" and comm[0].get("stat") == "mean" else stat
        lines.append(f"# time = {shown} of the repetitions ({how}); GB/s = 1e9 B/s")
        lines.append(f"# {'collective':<11} {'size (B)':>10} {'time (us)':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"
                     f" {'p25 (us)':>9} {'model (us)':>10}")  # fmt: skip
        for r in comm:
            lines.append(
                f"  {r['kind']:<11} {r['bytes']:>10d} {_us(r['time_s']):>10} {r['algbw_GBps']:>11.3f} "
                f"{r['busbw_GBps']:>11.3f} {_us(r.get('p25_s')):>9} {_us(r.get('fit_time_s')):>10}"
            )
    for cls, f in cal.links.items():
        lines.append(
            f"link {cls}: alpha {f.alpha_us:.2f} us per link, bw {f.bw_GBps:.3f} GB/s; fit error median "
            f"{100 * (f.fit_rel_err or 0):.1f}%, max {100 * (f.fit_max_rel_err or 0):.1f}% over {f.points} sizes"
        )
    for kind, f in (cal.sweeps.get("links_by_kind") or {}).items():
        lines.append(f"  ({kind} alone: alpha {f['alpha_us']:.2f} us, bw {f['bw_GBps']:.3f} GB/s, "
                     f"max error {100 * (f.get('fit_max_rel_err') or 0):.1f}%)")  # fmt: skip
    for kind, f in (cal.collective_bytes_factor or {}).items():
        err = [abs(r["fit_time_s"] / r["time_s"] - 1) for r in comm if r["kind"] == kind and r.get("fit_time_s")]
        lines.append(f"{kind}: the link fit with {f:.2f}x the bytes"
                     + (f"; fit error median {100 * float(np.median(err)):.1f}%, max {100 * max(err):.1f}% over "
                        f"{len(err)} sizes" if err else ""))  # fmt: skip
    for d, g in cal.gemm.items():
        lines.append(
            f"GEMM {d}: peak {g.peak_TFLOPs * 1e3:.2f} GFLOP/s, m_half {g.m_half:.1f}, nk_half {g.nk_half:.1f}; "
            f"fit error median {100 * (g.fit_rel_err or 0):.1f}%, max {100 * (g.fit_max_rel_err or 0):.1f}% "
            f"over {g.points} shapes"
        )

    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines.append(
        f"memory {num(cal.hbm_bw_GBps, '.2f')} GB/s, kernel launch {num(cal.kernel_launch_us, '.2f')} us, "
        f"attention efficiency {num(cal.attention_efficiency, '.3f')}, optimizer "
        f"{num(cal.optimizer_bytes_per_param, '.1f')} B/param + {num(cal.optimizer_step_overhead_us, '.0f')} us per step"
    )
    if cal.zero_grad_hook_ns_per_param is not None:
        lines.append(f"ZeRO backward beyond autograd (gradient hooks, bucket copies): "
                     f"{cal.zero_grad_hook_ns_per_param:.2f} ns per parameter + {cal.zero_grad_hook_overhead_us:.0f} us")
    df = cal.sweeps.get("dispatcher_fit")
    if cal.dispatcher_op_us is not None and df:
        lines.append(
            f"token dispatcher (DeepSpeed gate, sparse encode/decode): {cal.dispatcher_op_us:.2f} us per op, "
            f"{cal.dispatcher_bw_GBps:.2f} GB/s; fit error median {100 * df['fit_rel_err']:.1f}%, "
            f"max {100 * df['fit_max_rel_err']:.1f}% over {df['points']} timings"
        )
    noise = cal.sweeps.get("noise") or []
    desync = cal.sweeps.get("desync")
    from_job = bool(desync and desync.get("fit"))  # the reference job's figures were used
    if from_job:
        fit = desync["fit"]
        wake = (fit["wake_delay_p"], fit["wake_delay_cap_s"]) if fit.get("wake_delay_p") is not None else None
        lines.append(describe(desync, (wake, fit.get("compute_noise_cv"))) + " -- used")
        ps = desync.get("pauses") or {}
        if fit.get("pause_rate_per_s"):
            lines.append(f"  rank stalls: {fit['pause_rate_per_s']:.1f} per second of compute, mean "
                         f"{fit['pause_mean_s'] * 1e3:.2f} ms ({ps.get('pauses')} of {ps.get('segments')} segments "
                         f"over their median by > max({PAUSE_MIN_S * 1e3:g} ms, {PAUSE_SIGMAS:g} sigma); sigma "
                         f"{ps.get('sigma_rel') or 0:.3f}); compute noise cv above without them "
                         f"(with them {(desync.get('noise') or {}).get('cv') or 0:.3f})")  # fmt: skip
        mb = desync.get("microbench") or {}
        parts = []
        if mb.get("compute_noise_cv") is not None:
            parts.append(f"compute noise cv {mb['compute_noise_cv']:.3f}")
        if mb.get("wake_delay_p") is not None:
            parts.append(f"late wake-ups p {mb['wake_delay_p']:.3f}, cap {mb['wake_delay_cap_s'] * 1e3:.2f} ms")
        if parts:
            lines.append("  (the microbenchmark loops alone: " + "; ".join(parts) + ")")
        cs = desync.get("compute")
        if cs:
            used = " -- used" if cal.compute_scale is not None else ""
            lines.append(f"in-job compute of the reference job's forward and backward: measured "
                         f"{cs['measured_compute_s'] * 1e3:.2f} ms, modelled {cs['predicted_compute_s'] * 1e3:.2f} ms "
                         f"at scale 1 (of which ZeRO hooks {cs['predicted_hooks_s'] * 1e3:.2f} ms, not scaled): "
                         f"compute scale {cs['compute_scale']:.3f}{used}")  # fmt: skip
        co = desync.get("call_overhead")
        if co:
            used = " -- used" if cal.call_overhead_us is not None else ""
            lines.append(f"in-job blocking calls of the reference job: measured {co['measured_blocking_s'] * 1e3:.2f} ms a "
                         f"step, modelled {co['predicted_blocking_s'] * 1e3:.2f} ms from the isolated calls (+"
                         f"{co['predicted_per_ms_s'] * 1e3:.2f} ms per ms of overhead a call): call overhead "
                         f"{co['call_overhead_us']:.0f} us{used}")  # fmt: skip
    elif cal.compute_noise_cv is not None:
        each = ", ".join(f"{r['segment_s'] * 1e3:g} ms {r['cv']:.3f}" for r in noise if "cv" in r)
        lines.append(f"compute noise: cv {cal.compute_noise_cv:.3f} of a rank's segment time" + (f" ({each})" if each else ""))
    if cal.wake_delay_p is not None and cal.wake_delay_cap_s is not None and not from_job:
        wk = cal.sweeps.get("wake") or []
        each = ", ".join(f"{r['segment_s'] * 1e3:g} ms {r['mean_spread_s'] * 1e3:.2f}" for r in wk
                         if r.get("mean_spread_s") is not None)  # fmt: skip
        lines.append(f"late wake-ups after a blocking call: p {cal.wake_delay_p:.3f}, cap {cal.wake_delay_cap_s * 1e3:.2f} ms"
                     + (f" (mean exit spread by following segment: {each})" if each else ""))  # fmt: skip
    return "\n".join(lines)


def format_profile_report(cal: Calibration, report: dict) -> str:
    """Human summary of ``moesim calibrate --from-profile``: what was read, every field fitted with its
    fit error and where it came from, and the fields the trace left to the topology."""
    hw = cal.hardware
    counts = report.get("counts") or [{}]
    lines = [f"calibration from {len(report['traces'])} profiler trace(s) of a {hw.get('device')} job "
             f"({hw.get('world_size')} ranks, {hw.get('backend')}); rank 0's trace: {counts[0].get('cpu_ops', 0)} CPU ops, "
             f"{counts[0].get('kernels', 0)} kernels, {counts[0].get('gemm_with_shapes', 0)} GEMMs with shapes, "
             f"{counts[0].get('attention_ops', 0)} attention ops, {counts[0].get('memory_ops', 0)} memory-bound ops; "
             f"{report.get('calls', 0)} collective calls"]  # fmt: skip
    for name, f in report["fits"].items():
        v = f["value"]
        if isinstance(v, dict):
            shown = ", ".join(f"{k} {x:.4g}" for k, x in v.items() if isinstance(x, (int, float)) and not k.startswith("fit_")
                              and k != "points")  # fmt: skip
        else:
            shown = f"{v:.4g}"
        err = f.get("fit_rel_err")
        how = (f"fit error median {100 * err:.1f}%, max {100 * (f.get('fit_max_rel_err') or err):.1f}% over "
               f"{f.get('points', '?')} points" if err is not None else "solved for one measured figure (no residual)")  # fmt: skip
        lines.append(f"  {name:<32} {shown}; {how} ({f['source']})")
    if report.get("absent"):
        lines.append("not in the trace (the topology's figures apply): " + ", ".join(report["absent"]))
    return "\n".join(lines)
