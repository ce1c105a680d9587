"""The fits of ``moesim calibrate`` (:mod:`hw_validate.calibrate`): microbenchmark results ->
:class:`sim.inputs.calibration.Calibration`, each through the simulator's own formula; and the human
report of a calibration (:func:`format_report`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from sim.hardware.calibrated import apply_link_calibration
from sim.inputs.calibration import Calibration, GemmFit, LinkFit


# ---- links -----------------------------------------------------------------------------------------
def bench_cluster(topology, nproc: int):
    """The one-node cluster of the benchmarked ranks on ``topology`` (a Topology, or a shipped name
    or YAML path); only its structure matters, the fitted class replaces its link figures."""
    from sim.hardware.cluster import build_cluster
    from sim.inputs.topology import Topology, load_topology

    topo = topology if isinstance(topology, Topology) else load_topology(str(topology))
    return build_cluster(topo, 1, nproc)


def simulate_sweep(cluster, rows: list[dict]) -> np.ndarray:
    """The simulator's time of every measured collective (``kind``, ``bytes``) on ``cluster``."""
    from sim.network.nccl_tests import measure

    out = np.zeros(len(rows))
    for kind in sorted({r["kind"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["kind"] == kind]
        got = measure(cluster, kind, "direct" if kind == "all_to_all" else "ring", [rows[i]["bytes"] for i in idx])
        for i, g in zip(idx, got, strict=True):
            out[i] = g["time_s"]
    return out


def _with_link(cluster, cls: str, alpha_us: float, bw_GBps: float):
    return apply_link_calibration(cluster, Calibration(links={cls: LinkFit(alpha_us=alpha_us, bw_GBps=bw_GBps)}))


def link_design(cluster, rows: list[dict], cls: str = "intra") -> tuple[np.ndarray, np.ndarray]:
    """The simulator's time of every row is ``a alpha + b / bw`` in the class's link latency alpha
    (s) and bandwidth bw (B/s): ``a`` (latencies on the critical path) and ``b`` (bytes on it) from
    two simulations, one with zero bytes cost and one with zero latency."""
    a = simulate_sweep(_with_link(cluster, cls, 1.0, 1e9), rows) / 1e-6  # s per s of link latency
    b = simulate_sweep(_with_link(cluster, cls, 0.0, 1.0), rows) * 1e9  # s x B/s
    return a, b


def fit_link(cluster, rows: list[dict], cls: str = "intra") -> tuple[LinkFit, np.ndarray]:
    """alpha (per link) and bandwidth of link class ``cls`` from measured collectives ``rows``
    (``kind``, ``bytes``, ``time_s``); returns the fit and the simulator's times with it.
    ``t = a alpha + b / bw`` is linear in (alpha, 1/bw): non-negative least squares on relative
    error. The reported errors come from re-simulating every row with the fitted pair."""
    from scipy.optimize import lsq_linear

    t = np.array([r["time_s"] for r in rows], dtype=np.float64)
    a, b = link_design(cluster, rows, cls)
    design = np.stack([a, b], axis=1) / t[:, None]
    scale = np.abs(design).max(axis=0)  # columns of order 1 (a ~ 1, b ~ bytes / t)
    sol = lsq_linear(design / scale, np.ones(len(t)), bounds=([0.0, 1e-30], [np.inf, np.inf]))
    x = sol.x / scale
    alpha_us = float(x[0]) * 1e6
    bw_GBps = 1.0 / float(x[1]) / 1e9
    pred = simulate_sweep(_with_link(cluster, cls, alpha_us, bw_GBps), rows)
    err = np.abs(pred / t - 1.0)
    fit = LinkFit(alpha_us=alpha_us, bw_GBps=bw_GBps, fit_rel_err=float(np.median(err)),
                  fit_max_rel_err=float(err.max()), points=len(t))  # fmt: skip
    return fit, pred


#: the collectives the shared link pair (alpha, bw) is fitted on; every other measured kind gets a
#: ``collective_bytes_factor`` on top of it (:func:`fit_bytes_factor`)
LINK_FIT_KINDS = ("all_to_all", "all_reduce")


def fit_bytes_factor(cluster, rows: list[dict]) -> float:
    """The factor ``f`` on the bytes of ``rows``' collective (one kind) that fits the simulator's
    times on ``cluster`` (links already fitted) to the measured ones: each time is ``lat + f bw``
    (``lat`` the time of a 1-byte call, ``bw`` the rest), so least squares on relative error is
    closed form, ``f = sum(b (1 - l)) / sum(b^2)`` with ``l = lat / t`` and ``b = bw / t``; at least
    0.05 (a kind cheaper than the links' model by more than 20x is a measurement problem)."""
    t = np.array([r["time_s"] for r in rows], dtype=np.float64)
    lat = simulate_sweep(cluster, [{**r, "bytes": 1} for r in rows])
    bw = simulate_sweep(cluster, rows) - lat
    lt, b = lat / t, bw / t
    return float(max(0.05, (b @ (1.0 - lt)) / (b @ b))) if (b @ b) > 0 else 1.0


def gemm_model_times(params: tuple[float, float, float], shapes: np.ndarray, bpe: int, hbm_Bps: float, launch_s: float) -> np.ndarray:
    """:meth:`sim.hardware.costs.CostModel.gemm_time` for every (m, n, k) row of ``shapes``."""
    peak, m_half, nk_half = params
    m, n, k = shapes[:, 0], shapes[:, 1], shapes[:, 2]
    rate = peak * (m / (m + m_half)) * (n / (n + nk_half)) * (k / (k + nk_half))
    return np.maximum(2.0 * m * n * k / rate, bpe * (m * k + k * n + m * n) / hbm_Bps) + launch_s


def fit_gemm(rows: list[dict], bpe: int, hbm_Bps: float, launch_s: float) -> tuple[GemmFit, np.ndarray]:
    """``peak_TFLOPs``, ``m_half``, ``nk_half`` by least squares on log time."""
    from scipy.optimize import least_squares

    shapes = np.array([[r["m"], r["n"], r["k"]] for r in rows], dtype=np.float64)
    t = np.array([r["time_s"] for r in rows], dtype=np.float64)
    flops = 2.0 * shapes.prod(axis=1)
    big = flops >= np.quantile(flops, 0.75)
    peak0 = float(np.max(flops[big] / np.maximum(t[big] - launch_s, 1e-9)))

    def resid(x):
        p = (math.exp(x[0]), math.exp(x[1]) - 1.0, math.exp(x[2]) - 1.0)
        return np.log(gemm_model_times(p, shapes, bpe, hbm_Bps, launch_s)) - np.log(t)

    best = None
    for m0, nk0 in ((16.0, 16.0), (128.0, 64.0), (512.0, 256.0)):
        x0 = np.array([math.log(peak0 * 1.3), math.log(m0 + 1), math.log(nk0 + 1)])
        sol = least_squares(resid, x0, bounds=([math.log(peak0 * 0.05), 0.0, 0.0], [math.log(peak0 * 50), 12.0, 12.0]))
        if best is None or sol.cost < best.cost:
            best = sol
    assert best is not None
    peak, m_half, nk_half = math.exp(best.x[0]), math.exp(best.x[1]) - 1.0, math.exp(best.x[2]) - 1.0
    pred = gemm_model_times((peak, m_half, nk_half), shapes, bpe, hbm_Bps, launch_s)
    err = np.abs(pred / t - 1.0)
    fit = GemmFit(peak_TFLOPs=peak / 1e12, m_half=m_half, nk_half=nk_half, fit_rel_err=float(np.median(err)),
                  fit_max_rel_err=float(err.max()), points=len(t))  # fmt: skip
    return fit, pred


def fit_memory(rows: list[dict], launch_s: float) -> float:
    """Bytes/s of an elementwise kernel: least squares of ``t = launch + bytes / bw`` on relative
    error, with the launch cost fixed (``kernel_launch_us``: the simulator adds it to every kernel);
    sizes that took less than a launch say nothing about bandwidth and are left out, unless all
    did (then the bandwidth is the largest bytes / time seen: a lower bound)."""
    nbytes = np.array([r["bytes"] for r in rows], dtype=np.float64)
    t = np.array([r["time_s"] for r in rows], dtype=np.float64)
    ok = t > launch_s * 1.05
    if not ok.any():
        return float(np.max(nbytes / t))
    nb, tt = nbytes[ok], t[ok]
    # minimise sum ((launch + x nbytes) / t - 1)^2 over x = 1 / bw
    x = float(np.sum(nb * (tt - launch_s) / tt**2) / np.sum(nb**2 / tt**2))
    return 1.0 / x


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> tuple[float, float]:
    """(core FLOPs, bytes) of one causal attention forward, as :mod:`sim.frameworks.deepspeed` counts them (fp32 bytes x bpe/4)."""
    pairs = seq * (seq + 1) // 2
    return 2.0 * heads * 2 * head_dim * pairs * batch, 4.0 * batch * seq * heads * head_dim


def fit_attention(rows: list[dict], peak_Bps: dict[str, float], hbm_Bps: float, launch_s: float) -> float | None:
    """Attention-core efficiency relative to the fitted GEMM peak (forward and 2.5x backward points)."""
    from sim.frameworks.kernels import ATTENTION_BWD_FACTOR
    from sim.model.dtypes import BYTES_PER_ELEMENT

    effs = []
    for r in rows:
        peak = peak_Bps.get(r["dtype"])
        if peak is None:
            continue
        flops, io = attention_flops(r["batch"], r["heads"], r["seq"], r["head_dim"])
        io *= BYTES_PER_ELEMENT[r["dtype"]]
        for f, nb, t in ((flops, io, r["fwd_s"]), (ATTENTION_BWD_FACTOR * flops, 2 * io, r["bwd_s"])):
            compute = t - launch_s
            if compute > nb / hbm_Bps and compute > 0:
                effs.append(f / compute / peak)
    if not effs:
        return None
    return float(min(1.0, math.exp(float(np.median(np.log(effs))))))


def fit_optimizer(rows: list[dict], hbm_Bps: float) -> tuple[float, float]:
    """(bytes per parameter at ``hbm_Bps``, fixed overhead s) of one Adam step: ``t = c + P x slope``."""
    p = np.array([r["params"] for r in rows], dtype=np.float64)
    t = np.array([r["time_s"] for r in rows], dtype=np.float64)
    if len(p) == 1:
        return float(t[0] / p[0] * hbm_Bps), 0.0
    w = 1.0 / t  # relative error
    A = np.stack([np.ones_like(p), p], axis=1) * w[:, None]
    from scipy.optimize import lsq_linear

    sol = lsq_linear(A, np.ones_like(p), bounds=([0.0, 1e-18], [np.inf, np.inf]))
    c, slope = float(sol.x[0]), float(sol.x[1])
    return slope * hbm_Bps, c


def fit_grad_hooks(rows: list[dict]) -> tuple[float, float] | None:
    """(seconds per parameter, fixed seconds) of ZeRO's backward beyond plain autograd
    (``zero_grad_hook_ns_per_param``, ``zero_grad_hook_overhead_us``) from the DeepSpeed optimizer
    rows' ``grad_hooks_s`` at ``model_params``: ``t = c + P x slope``, least squares on relative
    error, both >= 0. Each row gets ``fit_grad_hooks_s``."""
    use = [r for r in rows if r.get("grad_hooks_s") is not None and r.get("model_params")]
    if not use:
        return None
    from scipy.optimize import lsq_linear

    p = np.array([r["model_params"] for r in use], dtype=np.float64)
    t = np.maximum(np.array([r["grad_hooks_s"] for r in use], dtype=np.float64), 1e-9)
    if len(p) == 1:
        c, slope = 0.0, float(t[0] / p[0])
    else:
        A = np.stack([np.ones_like(p), p], axis=1) / t[:, None]
        sol = lsq_linear(A, np.ones_like(p), bounds=([0.0, 0.0], [np.inf, np.inf]))
        c, slope = float(sol.x[0]), float(sol.x[1])
    for r in use:
        r["fit_grad_hooks_s"] = c + slope * r["model_params"]
    return slope, c


def fit_dispatcher(rows: list[dict], gemm: GemmFit | None, hbm_Bps: float, launch_s: float) -> tuple[float, float] | None:
    """(seconds per eager op, bytes/s) of the token dispatcher (``dispatcher_op_us``,
    ``dispatcher_bw_GBps``) from :func:`hw_validate.microbench.bench_dispatcher` rows, through the
    simulator's own pricing: every piece and direction ``t = ops x op_s + bytes / bw`` with the
    ops and bytes of :func:`sim.frameworks.deepspeed.dispatcher_work` (the gate's router GEMM, priced by the
    fitted GEMM model, taken off first). Least squares on relative error, with an op no cheaper
    than a launch (``kernel_launch_us``) and the gathers no faster than the streaming kernels
    (``hbm_bw_GBps``). Each row gets ``fit_<piece>_<fwd|bwd>_s`` and ``work`` (ops, bytes)."""
    from scipy.optimize import lsq_linear

    from sim.frameworks.dispatcher import DISPATCHER_PIECES, dispatcher_work

    eqs = []  # (row, field, ops, bytes, fixed s, measured s)
    for r in rows:
        fixed_f = fixed_b = 0.0
        if gemm is not None:  # router GEMM [S, d] @ [d, E]; backward: input and weight gradients
            p = (gemm.peak_TFLOPs * 1e12, gemm.m_half, gemm.nk_half)
            S, d, E, bpe = r["tokens"], r["d"], r["experts"], 4
            fixed_f = float(gemm_model_times(p, np.array([[S, E, d]], float), bpe, hbm_Bps, launch_s)[0])
            fixed_b = float(gemm_model_times(p, np.array([[S, d, E], [d, E, S]], float), bpe, hbm_Bps, launch_s).sum())
        r["work"] = {}
        for piece in DISPATCHER_PIECES:
            of, bf, ob, bb = dispatcher_work(piece, r["tokens"], r["d"], r["experts"], r["k"], float(r["slots"]),
                                             bool(r["drop_tokens"]), int(r["bytes_per_element"]))  # fmt: skip
            r["work"][piece] = {"fwd_ops": of, "fwd_bytes": float(bf), "bwd_ops": ob, "bwd_bytes": float(bb)}
            for direction, ops, nb, fixed in (("fwd", of, bf, fixed_f), ("bwd", ob, bb, fixed_b)):
                fx = fixed if piece == "gate" else 0.0
                t = float(r[f"{piece}_{direction}_s"])
                if t > 0:
                    eqs.append((r, f"fit_{piece}_{direction}_s", float(ops), float(nb), fx, t))
    if not eqs:
        return None
    t = np.array([e[5] for e in eqs])
    A = np.array([[e[2], e[3]] for e in eqs]) / t[:, None]
    y = np.array([(e[5] - e[4]) / e[5] for e in eqs])
    upper_inv_bw = np.inf
    lo = [launch_s, 1.0 / hbm_Bps if np.isfinite(hbm_Bps) else 0.0]
    sol = lsq_linear(A, y, bounds=(lo, [np.inf, upper_inv_bw]))
    op_s, inv_bw = float(sol.x[0]), float(sol.x[1])
    for r, field, ops, nb, fx, _ in eqs:
        r[field] = fx + ops * op_s + nb * inv_bw
    return op_s, (1.0 / inv_bw if inv_bw > 0 else hbm_Bps)


def dispatcher_errors(rows: list[dict]) -> np.ndarray:
    """Relative errors of the fitted dispatcher model over every piece and direction measured."""
    out = []
    for r in rows:
        for key in [k for k in r if k.startswith("fit_") and k.endswith("_s")]:
            m = r[key[4:]]
            if m > 0:
                out.append(r[key] / m - 1.0)
    return np.array(out)


def fit_noise(rows: list[dict]) -> float | None:
    """Relative standard deviation of one rank's compute-segment time (``compute_noise_cv``) from
    :func:`hw_validate.microbench.bench_noise` rows, each annotated in place with its own ``cv``.

    Per call, each rank's deviation from the ranks' mean time, ``d_r = t_r / mean(t) - 1``; for
    independent normal noise of relative std ``s``, ``E|d_r| = s sqrt(2/pi) sqrt((W-1)/W)`` over
    ``W`` ranks, so ``s = mean|d_r| / sqrt(2 (W-1) / (pi W))`` (2 ranks: ``sqrt(pi)/2 E|t0-t1| /
    mean``). The mean absolute deviation is what the waits at a rendezvous follow; the fitted
    value is the mean over the segment lengths (the spread is proportional to the segment on
    the machines measured, so one relative figure serves every segment)."""
    cvs = []
    for r in rows:
        t = np.asarray(r["per_rank_s"], dtype=np.float64)  # (ranks, calls)
        world = t.shape[0]
        if world < 2 or t.shape[1] == 0:
            continue
        d = np.abs(t / t.mean(axis=0, keepdims=True) - 1.0)
        cv = float(d.mean() / math.sqrt(2.0 * (world - 1) / (math.pi * world)))
        r["cv"] = cv
        cvs.append(cv)
    return float(np.mean(cvs)) if cvs else None


def fit_wake(rows: list[dict]) -> tuple[float, float] | None:
    """``(wake_delay_p, wake_delay_cap_s)`` from :func:`hw_validate.microbench.bench_wake` rows,
    each annotated in place with ``mean_spread_s`` and ``fit_spread_s``.

    Model (:func:`sim.frameworks.deepspeed.apply_wake_delay`): after a blocking call, with probability ``p`` one
    rank resumes ``min(seg, cap)`` late, ``seg`` the compute segment that follows. So the mean exit
    spread at segment ``seg`` is ``base + p min(seg, cap)``, ``base`` the spread with nothing after
    the call (row ``segment_s`` 0: the collective's own exit skew, which the link fit already
    holds). Least squares weighted by each row's calls: for each ``cap`` on a grid (0.25-32 ms) ``p`` is closed form, clipped to
    [0, 1]; the pair with the smallest squared error wins (ties: the smaller cap). None without a
    zero-segment row and at least two longer ones."""
    base_rows = [r for r in rows if r["segment_s"] == 0 and r["exit_spread_s"]]
    longer = [r for r in rows if r["segment_s"] > 0 and r["exit_spread_s"]]
    for r in rows:
        r["mean_spread_s"] = float(np.mean(r["exit_spread_s"])) if r["exit_spread_s"] else None
    if not base_rows or len(longer) < 2:
        return None
    base = float(np.mean([r["mean_spread_s"] for r in base_rows]))
    seg = np.array([r["segment_s"] for r in longer])
    extra = np.array([r["mean_spread_s"] for r in longer]) - base
    # each row weighs as many calls as it holds: a job profile's bins (hw_validate.desync) hold
    # from 8 to 100+ calls, and the step pays every call; bench_wake's rows hold the same count
    w = np.array([float(r.get("calls") or len(r["exit_spread_s"])) for r in longer])
    best = None
    for cap in np.geomspace(2.5e-4, 3.2e-2, 85):
        f = np.minimum(seg, cap)
        p = float(np.clip((w * f @ extra) / (w * f @ f), 0.0, 1.0))
        sse = float((w * (p * f - extra) ** 2).sum())
        if best is None or sse < best[0] * (1 - 1e-9):
            best = (sse, p, float(cap))
    _, p, cap = best
    for r in rows:
        r["fit_spread_s"] = base + p * min(r["segment_s"], cap)
    return p, cap


def comm_table(rows: list[dict]) -> list[dict]:
    """nccl-tests-style rows: size, time, algbw, busbw (GB/s = 1e9 B/s)."""
    from sim.network.closed_form import bandwidths_GBps

    out = []
    for r in rows:
        algbw, busbw = bandwidths_GBps(r["kind"], r["ranks"], r["bytes"], r["time_s"])
        out.append({**r, "algbw_GBps": algbw, "busbw_GBps": busbw})
    return out


@dataclass
class CalibrationRun:
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
    if desync:  # the reference job's calls (hw_validate.desync) replace the loops' figures
        from hw_validate.desync import fit_pause_profile, fit_profile

        base = next((r["mean_spread_s"] for r in wake_rows if r["segment_s"] == 0 and r.get("mean_spread_s") is not None), None)
        dwake, dcv = fit_profile(desync, base)
        pauses = fit_pause_profile(desync)
        desync["microbench"] = {"compute_noise_cv": noise_cv, "wake_delay_p": wake[0] if wake else None,
                                "wake_delay_cap_s": wake[1] if wake else None}  # fmt: skip
        desync["fit"] = {"compute_noise_cv": dcv, "wake_delay_p": dwake[0] if dwake else None,
                         "wake_delay_cap_s": dwake[1] if dwake else None,
                         "pause_rate_per_s": pauses[0] if pauses else None,
                         "pause_mean_s": pauses[1] if pauses else None}  # fmt: skip
        wake = dwake if dwake is not None else wake
        noise_cv = dcv if dcv is not None else noise_cv
    else:
        pauses = None
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
        fitted = _with_link(cluster, "intra", fit.alpha_us, fit.bw_GBps)
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
        from hw_validate.desync import PAUSE_MIN_S, PAUSE_SIGMAS, describe

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
