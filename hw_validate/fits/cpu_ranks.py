"""Fits of the host effects of CPU ranks (:mod:`sim.host.cpu_ranks`): the rank-to-rank spread of
compute segments (``compute_noise_cv``), the late wake-ups after a blocking call (``wake_delay_p``,
``wake_delay_cap_s``) and rank-local stalls (``pause_rate_per_s``, ``pause_mean_s``), from the
microbenchmark loops (:mod:`hw_validate.microbenchmarks.cpu_ranks`) or from the reference job's
per-call spans (:mod:`hw_validate.desync`)."""

from __future__ import annotations

import math

import numpy as np


def fit_noise(rows: list[dict]) -> float | None:
    """Relative standard deviation of one rank's compute-segment time (``compute_noise_cv``) from
    :func:`hw_validate.microbenchmarks.cpu_ranks.bench_noise` rows, each annotated in place with its
    own ``cv``.

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
    """``(wake_delay_p, wake_delay_cap_s)`` from :func:`hw_validate.microbenchmarks.cpu_ranks.bench_wake`
    rows, each annotated in place with ``mean_spread_s`` and ``fit_spread_s``.

    Model (:func:`sim.host.cpu_ranks.apply_wake_delay`): after a blocking call, with probability ``p`` one
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


#: a segment longer than its median over the steps by more than this (and than PAUSE_SIGMAS of the
#: segments' robust spread) holds a stall
PAUSE_MIN_S = 1e-3
PAUSE_SIGMAS = 4.0


def fit_pauses(seg: np.ndarray | None) -> dict:
    """Rank-local stalls in a job's segments (:func:`hw_validate.desync.step_segments`): each
    (rank, segment) is the same work every step, so its excess over its median across the steps is noise. The body of
    that excess is a relative spread (``sigma_rel``, from the median absolute deviation); an excess
    above ``max(PAUSE_MIN_S, PAUSE_SIGMAS sigma_rel median)`` is a stall, as the simulator models
    them (:func:`sim.host.cpu_ranks.apply_pauses`, exponential lengths). The rate and mean
    are of the stalls seen, so that the stalled time per second of compute is the measured one
    (stalls shorter than the threshold are part of the body's spread; a truncated-exponential fit
    that extrapolates them, tried on this VM's reference job, gave 1.5x the stalled time seen).
    Returns ``{"rate_per_s"`` (stalls per second of the segments' median time), ``"mean_s"``,
    ``"pauses"`` (seen), ``"segments"``, ``"sigma_rel"``, ``"body_cv"`` (the rank-to-rank spread
    estimator of :func:`hw_validate.desync.desync_rows` on the segments with their stalls taken
    out)``}``; rate and mean are None when no stall was seen."""
    out = {"rate_per_s": None, "mean_s": None, "pauses": 0, "segments": 0, "sigma_rel": None, "body_cv": None}
    if seg is None or seg.size == 0:
        return out
    med = np.median(seg, axis=1, keepdims=True)
    exc = seg - med
    rel = exc / np.maximum(med, 1e-9)
    sigma = float(1.4826 * np.median(np.abs(rel)))
    thr = np.broadcast_to(np.maximum(PAUSE_MIN_S, PAUSE_SIGMAS * sigma * med), seg.shape)
    hit = exc > thr
    medb = np.broadcast_to(med, seg.shape)
    out.update(pauses=int(hit.sum()), segments=int(seg.size), sigma_rel=sigma)
    busy = float(medb.sum())
    if hit.any() and busy > 0:  # the stalls seen: their count and mean keep the stalled time measured
        out.update(rate_per_s=float(hit.sum() / busy), mean_s=float(exc[hit].mean()))
    clean = np.where(hit, np.broadcast_to(med, seg.shape), seg).reshape(seg.shape[0], -1)
    world = seg.shape[0]
    if world > 1:
        mean = clean.mean(axis=0, keepdims=True)
        dev = float(np.abs(clean - mean).sum()) / float(mean.sum() * world)
        out["body_cv"] = dev / math.sqrt(2.0 * (world - 1) / (math.pi * world))
    return out


def fit_profile(profile: dict, base_spread_s: float | None = None) -> tuple[tuple[float, float] | None, float | None]:
    """``((wake_delay_p, wake_delay_cap_s) or None, compute_noise_cv or None)`` of a job profile
    (:func:`hw_validate.desync.profile_job`); ``base_spread_s`` replaces the zero-segment row when
    given."""
    rows = profile.get("wake") or []
    if base_spread_s is not None and rows and rows[0]["segment_s"] == 0:
        rows[0]["exit_spread_s"] = [float(base_spread_s)]
    pauses = profile.get("pauses") or {}
    cv = pauses["body_cv"] if pauses.get("rate_per_s") and pauses.get("body_cv") is not None else None
    return fit_wake(rows) if rows else None, cv if cv is not None else (profile.get("noise") or {}).get("cv")


def fit_pause_profile(profile: dict) -> tuple[float, float] | None:
    """``(pause_rate_per_s, pause_mean_s)`` of a job profile, or None when it saw no stall."""
    p = profile.get("pauses") or {}
    return (p["rate_per_s"], p["mean_s"]) if p.get("rate_per_s") and p.get("mean_s") else None
