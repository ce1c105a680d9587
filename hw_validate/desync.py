"""How far CPU ranks drift apart between blocking gloo calls in a real training step.

::

    python -m hw_validate.desync [--nproc 2] [--scenario scenarios/calibration/cpu-desync.yaml]
        [--steps 16] [--spans DIR] [--json OUT]

On CPU ranks every collective blocks, so a step is a chain of compute segments and rendezvous:
each call waits for the last rank, and each rank's lateness at a call is what happened to it since
the previous one. Two things make the ranks late, and the simulator models both
(:func:`sim.frameworks.deepspeed.apply_wake_delay`, :func:`sim.frameworks.deepspeed.apply_segment_noise`):

* **late wake-ups** -- a rank leaves a call late (gloo's completion wakes its thread on a core the
  peer has just resumed computing on): the spread of the ranks' exits from the call, which grows
  with the compute segment that follows, up to a cap (``wake_delay_p``, ``wake_delay_cap_s``);
* **compute noise** -- the same segment takes different times on the ranks
  (``compute_noise_cv``, relative to the segment).

The microbenchmarks (:func:`hw_validate.microbench.bench_wake`, ``bench_noise``) measure both on
tight loops with one process group. Measured on this VM (2 ranks, 2 vCPUs, 2026-12-04), a real
DeepSpeed job drifts about twice as much: ~10 gloo threads a rank over several process groups, the
harness's hooks and Python's eager ops between the calls. In an e8-top1-t512 job the mean exit
spread was 0.8-1.0 ms after 2-5 ms segments (the loops: 0.4-0.7 ms), and the rank-to-rank
spread of the segments cv 0.06 (the GEMM loop: 0.025). So ``moesim calibrate`` on CPU ranks also
runs a short real job of a *reference* scenario (``scenarios/calibration/cpu-desync.yaml``, a
shape none of the validated scenarios has) with per-call spans (``MOESIM_TIMING_SPANS``), and fits
the same two models to what the job's calls show:

* per blocking call (all-to-alls, gradient and optimizer reductions, the capacity all-reduce):
  the ranks' exit spread and the longest following segment of the step (entry into the next call
  minus exit from this one, per rank); binned by segment, the mean spread per bin is fitted by
  :func:`hw_validate.calibrate_fit.fit_wake` (the spread with nothing after a call, the
  collective's own exit skew, comes from ``bench_wake`` when it ran, else 0);
* per segment between two calls: each rank's deviation from the ranks' mean,
  ``cv = sum |seg_r - mean| / sum mean / sqrt(2 (W-1) / (pi W))`` -- the estimator of
  :func:`hw_validate.calibrate_fit.fit_noise`, weighted by segment length so that it matches the
  total wait a step pays. Capacity-padded dispatch gives every rank the same expert shapes, so
  the deviation is noise, not routing.

Nothing here imports torch: the job runs under :func:`hw_validate.launch.run_job`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from sim.errors import InputError

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "scenarios" / "calibration" / "cpu-desync.yaml"
#: the job's phases that are one blocking collective each on CPU ranks (hw_validate/timing.py)
BLOCKING = ("dispatch", "combine", "dispatch_bwd", "combine_bwd", "grad_sync", "optimizer_comm", "forward_comm")
#: bins of the segment after a call (seconds); a bin needs MIN_CALLS calls to be a row of the fit
BIN_EDGES_S = (0.0, 0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3, math.inf)
MIN_CALLS = 8


def read_spans(span_dir: str | Path, world: int) -> list[list[dict]]:
    """Every rank's step records (``{"step": n, "spans": [[phase, start_s, end_s], ...]}``)."""
    out = []
    for r in range(world):
        path = Path(span_dir) / f"rank-{r}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"no spans of rank {r}: {path} is missing")
        with open(path) as f:
            out.append([json.loads(line) for line in f if line.strip()])
    return out


def aligned_calls(records: list[list[dict]], warmup: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """``(entries, exits, last, skipped)``: (world, calls) entry and exit times of the blocking
    calls of every step after ``warmup`` (the same calls on every rank, in start order), ``last``
    (calls,) true for a step's last call (no segment after it inside the step), and how many steps
    were skipped because the ranks' call sequences differ (a step cut short)."""
    world = len(records)
    by_step = [{rec["step"]: rec["spans"] for rec in recs} for recs in records]
    steps = sorted(set.intersection(*(set(s) for s in by_step)))
    ent, ext, last, skipped = [], [], [], 0
    for st in steps:
        if st < warmup:
            continue
        calls = [sorted((s for s in by_step[r][st] if s[0] in BLOCKING), key=lambda s: s[1]) for r in range(world)]
        names = [[c[0] for c in cs] for cs in calls]
        if any(n != names[0] for n in names) or not names[0]:
            skipped += 1
            continue
        ent.append(np.array([[c[1] for c in cs] for cs in calls]))
        ext.append(np.array([[c[2] for c in cs] for cs in calls]))
        flag = np.zeros(len(names[0]), dtype=bool)
        flag[-1] = True
        last.append(flag)
    if not ent:
        return np.zeros((world, 0)), np.zeros((world, 0)), np.zeros(0, dtype=bool), skipped
    return np.hstack(ent), np.hstack(ext), np.concatenate(last), skipped


def desync_rows(entries: np.ndarray, exits: np.ndarray, last: np.ndarray,
                base_spread_s: float = 0.0) -> tuple[list[dict], dict]:  # fmt: skip
    """``(wake_rows, noise)`` from aligned calls (see the module docstring): rows in
    :func:`~hw_validate.calibrate_fit.fit_wake`'s format (a ``segment_s`` 0 row holding
    ``base_spread_s``, then one per segment bin with at least :data:`MIN_CALLS` calls), and the
    length-weighted compute-noise estimate ``{"cv", "segments", "mean_segment_s"}``."""
    world = entries.shape[0]
    nxt = np.flatnonzero(~last)  # calls followed by a segment inside the step
    seg = entries[:, nxt + 1] - exits[:, nxt]  # (world, n): each rank's compute until the next call
    spread = exits[:, nxt].max(axis=0) - exits[:, nxt].min(axis=0)
    longest = seg.max(axis=0)
    rows = [{"segment_s": 0.0, "exit_spread_s": [float(base_spread_s)], "source": "bench_wake"}]
    for lo, hi in zip(BIN_EDGES_S, BIN_EDGES_S[1:], strict=False):
        sel = (longest >= lo) & (longest < hi)
        if sel.sum() >= MIN_CALLS:
            rows.append({"segment_s": float(longest[sel].mean()), "bin_s": [lo, hi if math.isfinite(hi) else None],
                         "calls": int(sel.sum()), "exit_spread_s": spread[sel].tolist()})  # fmt: skip
    noise = {"cv": None, "segments": int(seg.shape[1]), "mean_segment_s": float(seg.mean()) if seg.size else None}
    if world > 1 and seg.size:
        mean = seg.mean(axis=0, keepdims=True)
        dev = float(np.abs(seg - mean).sum()) / float(mean.sum() * world)
        noise["cv"] = dev / math.sqrt(2.0 * (world - 1) / (math.pi * world))
    return rows, noise


#: a segment longer than its median over the steps by more than this (and than PAUSE_SIGMAS of the
#: segments' robust spread) holds a stall
PAUSE_MIN_S = 1e-3
PAUSE_SIGMAS = 4.0


def step_segments(entries: np.ndarray, exits: np.ndarray, last: np.ndarray) -> np.ndarray | None:
    """(world, steps, calls - 1) compute segments between consecutive calls of each step (entry
    into call i + 1 minus exit from call i), over the steps with the most common call count; None
    when fewer than 3 such steps."""
    ends = np.flatnonzero(last)
    if ends.size == 0:
        return None
    starts = np.concatenate([[0], ends[:-1] + 1])
    lens = ends - starts + 1
    n = int(np.bincount(lens).argmax())
    keep = [(a, b) for a, b, ln in zip(starts, ends, lens, strict=True) if ln == n]
    if len(keep) < 3 or n < 2:
        return None
    return np.stack([entries[:, a + 1 : b + 1] - exits[:, a:b] for a, b in keep], axis=1)


def fit_pauses(seg: np.ndarray | None) -> dict:
    """Rank-local stalls in a job's segments (:func:`step_segments`): each (rank, segment) is the
    same work every step, so its excess over its median across the steps is noise. The body of
    that excess is a relative spread (``sigma_rel``, from the median absolute deviation); an excess
    above ``max(PAUSE_MIN_S, PAUSE_SIGMAS sigma_rel median)`` is a stall, as the simulator models
    them (:func:`sim.frameworks.deepspeed.apply_pauses`, exponential lengths). The rate and mean
    are of the stalls seen, so that the stalled time per second of compute is the measured one
    (stalls shorter than the threshold are part of the body's spread; a truncated-exponential fit
    that extrapolates them, tried on this VM's reference job, gave 1.5x the stalled time seen).
    Returns ``{"rate_per_s"`` (stalls per second of the segments' median time), ``"mean_s"``,
    ``"pauses"`` (seen), ``"segments"``, ``"sigma_rel"``, ``"body_cv"`` (the rank-to-rank spread
    estimator of :func:`desync_rows` on the segments with their stalls taken out)``}``; rate and
    mean are None when no stall was seen."""
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
    (:func:`profile_job`); ``base_spread_s`` replaces the zero-segment row when given."""
    from hw_validate.calibrate_fit import fit_wake

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


def reference_overrides(nproc: int, num_experts: int = 8) -> list[str]:
    """``--set`` overrides that put the reference scenario on ``nproc`` ranks (EP over as many
    ranks as divide its experts)."""
    return [f"cluster.gpus_per_node={nproc}", f"parallelism.ep={math.gcd(num_experts, nproc)}"]


def profile_job(nproc: int = 2, scenario: str | Path = REFERENCE, steps: int | None = None,
                timeout_s: float = 900.0, echo: bool = True, spans_dir: str | Path | None = None,
                launcher: str = "deepspeed", job_dir: str | Path | None = None) -> dict:  # fmt: skip
    """Run ``scenario``'s real job on ``nproc`` CPU ranks with per-call spans and return its desync
    profile: ``{"scenario", "overrides", "ranks", "steps", "calls", "skipped_steps", "wake": rows,
    "noise": {...}, "measured": {"step_time_s", "phases_s"}, "job_wall_s"}``. ``spans_dir``: keep
    the spans there (default: a temporary folder); ``job_dir``: keep the job's measurement and
    router trace there (``"job": {"measurement", "trace"}`` in the profile; what
    :func:`fit_compute_scale` reads). A failed or hung job is a
    :class:`~hw_validate.launch.JobError`; a missing scenario an InputError."""
    from hw_validate.launch import run_job
    from hw_validate.measurement import load_measurement
    from hw_validate.validate import measured_section
    from sim.api import load_scenario

    if nproc < 2:
        raise InputError(f"the desync profile needs >= 2 ranks, got {nproc}", field="--nproc")
    if not Path(scenario).is_file():
        raise InputError(f"scenario file '{scenario}' does not exist", file=str(scenario), field="--desync-scenario")
    base = load_scenario(scenario)
    overrides = reference_overrides(nproc, base.model.num_experts) if nproc != base.world_size else []
    scen = load_scenario(scenario, overrides)
    with tempfile.TemporaryDirectory(prefix="moesim-desync-") as tmp:
        spans = Path(spans_dir) if spans_dir is not None else Path(tmp) / "spans"
        spans.mkdir(parents=True, exist_ok=True)
        for old in spans.glob("rank-*.jsonl"):
            old.unlink()
        env = dict(os.environ, MOESIM_TIMING_SPANS=str(spans))
        env.setdefault("DS_ACCELERATOR", "cpu")
        out = Path(job_dir) if job_dir is not None else Path(tmp) / "job"
        res = run_job(scenario, nproc, out_dir=out, steps=steps, overrides=overrides,
                      timeout_s=timeout_s, launcher=launcher, env=env, echo=echo)  # fmt: skip
        records = read_spans(spans, nproc)
        meas = measured_section(load_measurement(res.measurement), res.measurement)
    entries, exits, last, skipped = aligned_calls(records, scen.training.warmup_steps)
    rows, noise = desync_rows(entries, exits, last)
    pauses = fit_pauses(step_segments(entries, exits, last))
    prof = {"scenario": str(scenario), "overrides": overrides, "ranks": nproc,
            "steps": len(records[0]) if records else 0, "calls": int(entries.shape[1]), "skipped_steps": skipped,
            "wake": rows, "noise": noise, "pauses": pauses, "job_wall_s": res.wall_s,
            "measured": {"step_time_s": meas["step_time_s"], "phases_s": meas["phases_s"], "dtype": meas["dtype"]}}  # fmt: skip
    if job_dir is not None:
        prof["job"] = {"measurement": str(res.measurement), "trace": str(res.trace)}
    return prof


#: the blocking collectives inside the job's forward and backward phases (the rest is compute)
FWD_BWD_COMM = tuple(p for p in BLOCKING if p != "optimizer_comm")


def compute_time(phases: dict[str, float]) -> float:
    """Seconds of compute in a step's forward and backward: the two phases less the blocking
    collectives inside them (which hold the late wake-ups and the waits for the peer)."""
    return phases.get("forward", 0.0) + phases.get("backward", 0.0) - sum(phases.get(p, 0.0) for p in FWD_BWD_COMM)


def fit_compute_scale(calibration, profile: dict) -> dict | None:
    """The calibration's ``compute_scale`` from the reference job of ``profile`` (kept with
    ``job_dir``): simulate the job as it ran (its routing trace; the median over noise draws, as
    :func:`hw_validate.validate.predict` does) with compute scales 1 and 2, and solve for the scale
    at which the step's modelled forward and backward compute (:func:`compute_time`) equals the
    measured one. The scale multiplies the compute blocks only, so what the two runs differ by is
    the kernels' share; ZeRO's gradient hooks (timed inside a real engine) and anything else not
    scaled cancel out. Returns ``{"compute_scale", "measured_compute_s", "predicted_compute_s"``
    (at scale 1)``, "predicted_hooks_s"}``, or None when the profile has no kept job or the fit is
    degenerate (no kernel time, or a non-positive scale)."""
    measured = profile.get("measured") or {}
    runs = _simulate_reference(calibration, profile, "compute_scale", (1.0, 2.0))
    if runs is None:
        return None
    preds = [compute_time(phases) for phases, _ in runs]
    per: dict[int, float] = {}
    for sp in runs[0][1]:
        if sp.name == "grad_hooks" and sp.stream == "compute":
            per[sp.rank] = per.get(sp.rank, 0.0) + sp.end - sp.start
    hooks = max(per.values(), default=0.0)
    m_c, (p1, p2) = compute_time(measured["phases_s"]), preds
    if not p2 - p1 > 0:
        return None
    scale = 1.0 + (m_c - p1) / (p2 - p1)
    if not scale > 0:
        return None
    return {"compute_scale": float(scale), "measured_compute_s": float(m_c),
            "predicted_compute_s": float(p1), "predicted_hooks_s": float(hooks)}  # fmt: skip


def _simulate_reference(calibration, profile: dict, field: str, values: tuple[float, ...]) -> list | None:
    """The reference job of ``profile`` simulated as it ran (its routing trace, the median over noise
    draws as :func:`hw_validate.validate.predict` takes it) with calibration ``field`` set to each of
    ``values``: ``[(phases_s, spans of draw 0), ...]``, or None when the profile kept no job."""
    from hw_validate.validate import simulate_median, simulation_scenario
    from sim.inputs.calibration import save_calibration

    job = profile.get("job") or {}
    measured = profile.get("measured") or {}
    if not job or not measured:
        return None
    out = []
    with tempfile.TemporaryDirectory(prefix="moesim-refsim-") as tmp:
        for value in values:
            path = Path(tmp) / f"calibration-{value:g}.json"
            save_calibration(path, calibration.model_copy(update={field: value}))
            s = simulation_scenario(profile["scenario"], profile.get("overrides") or [], path, job["trace"],
                                    measured.get("dtype"))  # fmt: skip
            _, phases, _, spans = simulate_median(s)
            out.append((phases, spans))
    return out


def blocking_time(phases: dict[str, float]) -> float:
    """Seconds of a step inside blocking collectives (every phase of :data:`BLOCKING`)."""
    return sum(phases.get(p, 0.0) for p in BLOCKING)


#: the two per-call overheads the reference job is simulated at to solve for ``call_overhead_us``
OVERHEAD_PROBE_US = (0.0, 1000.0)


def fit_call_overhead(calibration, profile: dict) -> dict | None:
    """The calibration's ``call_overhead_us`` from the reference job of ``profile``: simulate the
    job as it ran with no per-call overhead and with 1 ms, and solve for the overhead at which the
    step's modelled time in blocking collectives (:func:`blocking_time`: the calls, the waits for
    the peer, the late wake-ups) equals the measured one; the model is linear in it (every rank
    resumes that much later after every call). Fitted after ``compute_scale``, on the calibration
    as it will be used. Returns ``{"call_overhead_us", "measured_blocking_s",
    "predicted_blocking_s"`` (without the overhead)``, "predicted_per_ms_s"`` (what 1 ms a call
    adds)``}``, or None when the profile kept no
    job or the fit is degenerate; a negative solution (the isolated calls already cost more than
    the job's) gives 0."""
    measured = profile.get("measured") or {}
    runs = _simulate_reference(calibration, profile, "call_overhead_us", OVERHEAD_PROBE_US)
    if runs is None:
        return None
    (p0, _), (p1, _) = runs
    b0, b1, m_b = blocking_time(p0), blocking_time(p1), blocking_time(measured["phases_s"])
    if not b1 - b0 > 0:
        return None
    us = max(0.0, OVERHEAD_PROBE_US[1] * (m_b - b0) / (b1 - b0))
    return {"call_overhead_us": float(us), "measured_blocking_s": float(m_b), "predicted_blocking_s": float(b0),
            "predicted_per_ms_s": float(b1 - b0)}  # fmt: skip


def describe(profile: dict, fit: tuple[tuple[float, float] | None, float | None]) -> str:
    wake, cv = fit
    bins = ", ".join(f"{r['segment_s'] * 1e3:.1f} ms {np.mean(r['exit_spread_s']) * 1e3:.2f}"
                     for r in profile.get("wake", [])[1:])  # fmt: skip
    head = (f"rank desync in a real job ({Path(profile['scenario']).name}, {profile['ranks']} ranks, "
            f"{profile['calls']} blocking calls): ")  # fmt: skip
    w = f"late wake-ups p {wake[0]:.3f}, cap {wake[1] * 1e3:.2f} ms" if wake else "late wake-ups: too few calls to fit"
    n = f"compute noise cv {cv:.3f}" if cv is not None else "compute noise: none measured"
    return head + f"{w}; {n} (mean exit spread by following segment: {bins})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hw_validate.desync", description=__doc__.split("\n\n")[1])
    ap.add_argument("--nproc", type=int, default=2, help="CPU ranks (default 2)")
    ap.add_argument("--scenario", default=str(REFERENCE), help="reference scenario (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=None, help="steps of the job (default: the scenario's)")
    ap.add_argument("--spans", default=None, metavar="DIR", help="keep the job's per-call spans in DIR")
    ap.add_argument("--timeout", type=float, default=900.0, metavar="S")
    ap.add_argument("--json", default=None, metavar="OUT", help="write the profile and its fit to OUT")
    args = ap.parse_args(argv)
    from hw_validate.launch import JobError
    from sim.ioutil import write_json

    try:
        prof = profile_job(args.nproc, args.scenario, args.steps, args.timeout, echo=False, spans_dir=args.spans)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    fit = fit_profile(prof)
    print(describe(prof, fit))
    if args.json:
        write_json(args.json, {**prof, "fit": {"wake_delay_p": fit[0][0] if fit[0] else None,
                                               "wake_delay_cap_s": fit[0][1] if fit[0] else None,
                                               "compute_noise_cv": fit[1]}})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
