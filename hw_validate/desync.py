"""How far CPU ranks drift apart between blocking gloo calls in a real training step.

::

    python -m hw_validate.desync [--nproc 2] [--scenario scenarios/calibration/cpu-desync.yaml]
        [--steps 16] [--spans DIR] [--json OUT]

On CPU ranks every collective blocks, so a step is a chain of compute segments and rendezvous:
each call waits for the last rank, and each rank's lateness at a call is what happened to it since
the previous one. Two things make the ranks late, and the simulator models both
(:func:`sim.host.cpu_ranks.apply_wake_delay`, :func:`sim.host.cpu_ranks.apply_segment_noise`):

* **late wake-ups** -- a rank leaves a call late (gloo's completion wakes its thread on a core the
  peer has just resumed computing on): the spread of the ranks' exits from the call, which grows
  with the compute segment that follows, up to a cap (``wake_delay_p``, ``wake_delay_cap_s``);
* **compute noise** -- the same segment takes different times on the ranks
  (``compute_noise_cv``, relative to the segment).

The microbenchmarks (:func:`hw_validate.microbenchmarks.cpu_ranks.bench_wake`, ``bench_noise``)
measure both on tight loops with one process group. Measured on this VM (2 ranks, 2 vCPUs, 2026-12-04), a real
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
  :func:`hw_validate.fits.cpu_ranks.fit_wake` (the spread with nothing after a call, the
  collective's own exit skew, comes from ``bench_wake`` when it ran, else 0);
* per segment between two calls: each rank's deviation from the ranks' mean,
  ``cv = sum |seg_r - mean| / sum mean / sqrt(2 (W-1) / (pi W))`` -- the estimator of
  :func:`hw_validate.fits.cpu_ranks.fit_noise`, weighted by segment length so that it matches the
  total wait a step pays. Capacity-padded dispatch gives every rank the same expert shapes, so
  the deviation is noise, not routing.

The fits of what the job shows are :mod:`hw_validate.fits.cpu_ranks` (wake-ups, noise, stalls) and
:mod:`hw_validate.fits.reference_job` (the in-job compute scale and call overhead, from the job kept
with ``job_dir``). Nothing here imports torch: the job runs under :func:`hw_validate.launch.run_job`.
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

from hw_validate.fits.cpu_ranks import fit_pauses, fit_profile
from hw_validate.phases import BLOCKING
from sim.errors import InputError

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "scenarios" / "calibration" / "cpu-desync.yaml"
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


def aligned_calls(records: list[list[dict]], warmup: int = 0,
                  blocking=BLOCKING) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:  # fmt: skip
    """``(entries, exits, last, skipped)``: (world, calls) entry and exit times of the blocking
    calls (spans named in ``blocking``) of every step after ``warmup`` (the same calls on every rank,
    in start order), ``last`` (calls,) true for a step's last call (no segment after it inside the
    step), and how many steps were skipped because the ranks' call sequences differ (a step cut
    short)."""
    world = len(records)
    by_step = [{rec["step"]: rec["spans"] for rec in recs} for recs in records]
    steps = sorted(set.intersection(*(set(s) for s in by_step)))
    ent, ext, last, skipped = [], [], [], 0
    for st in steps:
        if st < warmup:
            continue
        calls = [sorted((s for s in by_step[r][st] if s[0] in blocking), key=lambda s: s[1]) for r in range(world)]
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
    :func:`~hw_validate.fits.cpu_ranks.fit_wake`'s format (a ``segment_s`` 0 row holding
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
    :func:`hw_validate.fits.reference_job.fit_compute_scale` reads). A failed or hung job is a
    :class:`~hw_validate.launch.JobError`; a missing scenario an InputError."""
    from hw_validate.launch import run_job
    from hw_validate.measurement import load_measurement
    from hw_validate.phases import measured_section
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



def describe(profile: dict, fit: tuple[tuple[float, float] | None, float | None]) -> str:
    """One line: the profile's fit (``fit`` as :func:`~hw_validate.fits.cpu_ranks.fit_profile` gives it)
    and the mean exit spread of its calls by following segment."""
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
