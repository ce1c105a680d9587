"""``moesim calibrate``: run the microbenchmarks as a real multi-rank job, fit the simulator's
models to them and write a calibration JSON (:mod:`sim.inputs.calibration`, ``moesim.calibration`` v1).

What is fitted, each through the simulator's own formula so that the fitted numbers reproduce the
measurements when the simulator uses them:

- ``links.intra``: alpha (per
  link) and bandwidth such that the simulator's all-to-all and ring all-reduce over the cluster of
  the benchmarked ranks give the measured times. The simulated time is linear in the link latency
  and in 1/bandwidth, so the fit is a non-negative linear least squares on relative error; the
  reported errors come from re-simulating every size with the fitted pair.
- ``gemm.<dtype>``: ``peak_TFLOPs``, ``m_half``, ``nk_half`` of :class:`sim.hardware.costs.CostModel`'s
  roofline ``max(2mnk / (peak h(m) h(n) h(k)), bytes / hbm) + launch`` (``h(x) = x / (x + c)``),
  least squares on log time (scipy), over the GEMM shapes the scenarios' layers produce (forward,
  input- and weight-gradient shapes, recorded from the simulator's schedule) plus a small grid.
- ``hbm_bw_GBps`` (the job's memory-bound ops -- add, GELU, LayerNorm, softmax, recorded by
  autograd -- over the scenarios' activation sizes, with the launch cost fixed), ``kernel_launch_us``
  (a tiny op recorded by autograd), ``attention_efficiency`` (scaled_dot_product_attention forward
  and backward against the fitted GEMM peak), ``optimizer_bytes_per_param`` and
  ``optimizer_step_overhead_us`` (DeepSpeed's ``engine.step()`` under the scenarios' ZeRO stage, its
  collectives taken off, with each rank stepping the scenarios' partition sizes; torch Adam on flat
  fp32 partitions when DeepSpeed is not installed).
- On >= 2 gloo ranks, from a short real job of a reference scenario (:mod:`hw_validate.desync`):
  the late wake-ups after blocking calls (``wake_delay_p``, ``wake_delay_cap_s``), the ranks'
  stalls (``pause_rate_per_s``, ``pause_mean_s``: each segment between calls against its median
  over the steps), the spread of the segments without them (``compute_noise_cv``), and the in-job
  compute factor (``compute_scale``: the job's forward and backward compute against the simulator's
  with the other figures, solved by simulating the job as it ran), then the in-job cost of each
  blocking call beyond its isolated time (``call_overhead_us``: the job's time in blocking calls
  against the simulator's, solved the same way with the compute scale in place).

Every item is timed in repetitions; the fits read the median (``stat="p25"``: the lower
quartile). Raw measurements (the nccl-tests-style table with algbw/busbw among them, each row's
model time ``fit_time_s``) are kept under ``sweeps``. One host is one node: there is no ``inter``
class to fit (a multi-node sweep is not implemented). The job is supervised: a rank that dies or a run past ``timeout_s`` is a
:class:`hw_validate.launch.JobError` with the log's last lines.

Here the run is driven; the measuring is :mod:`hw_validate.microbenchmarks`, the fitting
:mod:`hw_validate.calibrate_fit` (with :mod:`hw_validate.fits`), the report
:mod:`hw_validate.calibration_report`.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from hw_validate.calibrate_fit import STATS, CalibrationRun, desync_figures, fit_all
from hw_validate.desync import REFERENCE, profile_job
from hw_validate.fits.links import bench_cluster
from hw_validate.fits.reference_job import fit_call_overhead, fit_compute_scale
from hw_validate.microbenchmarks.runner import run_microbench
from hw_validate.microbenchmarks.spec import build_spec, scenario_shapes
from sim.errors import InputError
from sim.inputs.calibration import Calibration, save_calibration
from sim.reports.progress import part

LAUNCHERS = ("torchrun", "deepspeed")
BACKENDS = ("gloo", "nccl")


def check_writable(out: str | Path, field: str = "--out") -> None:
    """Bad input unless ``out`` can be created: not a folder, and its nearest existing parent a
    writable folder (checked before the job runs, so a long measurement is not thrown away)."""
    p = Path(out)
    if p.is_dir():
        raise InputError(f"'{out}' is a folder; give a file path such as calib.json", field=field)
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"cannot write '{out}': '{parent}' is not a folder", field=field)
    try:  # the permission bits do not tell (root, read-only mounts, /proc): try it
        fd, probe = tempfile.mkstemp(prefix=".moesim-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"cannot write '{out}': {exc.strerror or exc} in '{parent}'", field=field) from None


def calibrate(
    out: str | Path | None,
    nproc: int = 2,
    backend: str = "gloo",
    launcher: str = "torchrun",
    topology=None,
    scenarios: list[str | Path] = (),
    quick: bool = False,
    timeout_s: float = 900.0,
    echo: bool = True,
    stat: str = "median",
    progress=None,
    desync: str | Path | bool | None = "auto",
) -> CalibrationRun:
    """Measure, fit, write ``out`` (when given, atomically); see the module docstring.

    ``scenarios``: scenario files whose layers' GEMM, attention, activation and optimizer sizes are
    measured (besides a small grid); their first one's topology is the cluster the link fit runs on
    unless ``topology`` (a Topology, shipped name or YAML path) is given (default ``cpu-host`` for
    gloo, ``hgx-h200`` for nccl). ``stat``: which statistic of the repetitions the fits use
    (:data:`hw_validate.calibrate_fit.STATS`). ``progress``: callable taking one line of text
    (stages of the run); the job's own progress bar goes to stderr when ``echo``. Bad input is an
    :class:`~sim.errors.InputError` naming the CLI flag; a failed or hung job a :class:`JobError`.

    ``desync``: the reference scenario whose real job measures the ranks' drift between blocking
    calls (:mod:`hw_validate.desync`; its fit replaces the microbenchmarks' ``wake_delay_*`` and
    ``compute_noise_cv``). ``"auto"`` (default): ``scenarios/calibration/cpu-desync.yaml`` on gloo
    with >= 2 ranks, unless ``quick`` or DeepSpeed is not installed; None or False: never."""
    if backend not in BACKENDS:
        raise InputError(f"unknown backend '{backend}'; use one of {', '.join(BACKENDS)}", field="--backend")
    if launcher not in LAUNCHERS:
        raise InputError(f"unknown launcher '{launcher}'; use one of {', '.join(LAUNCHERS)}", field="--launcher")
    if not isinstance(nproc, int) or nproc < 1:
        raise InputError(f"must be a whole number >= 1, got {nproc}", field="--nproc")
    if stat not in STATS:
        raise InputError(f"unknown statistic '{stat}'; use one of {', '.join(STATS)}", field="--stat")
    if not timeout_s or timeout_s <= 0 or not math.isfinite(timeout_s):
        raise InputError(f"must be a positive number of seconds, got {timeout_s}", field="--timeout")
    if out is not None:
        check_writable(out)
    say = progress or (lambda line: None)
    for p in scenarios:
        if not Path(p).is_file():
            raise InputError(f"scenario file '{p}' does not exist", file=str(p), field="--scenario")
    accelerator = "cuda" if backend == "nccl" else "cpu"
    shapes = scenario_shapes(list(scenarios), accelerator) if scenarios else None
    if topology is None:
        if scenarios:
            from sim.api import load_scenario

            topology = load_scenario(scenarios[0]).topology
        else:
            topology = "cpu-host" if backend == "gloo" else "hgx-h200"
    try:
        bench_cluster(topology, nproc)  # a bad topology is bad input, before the job runs
    except InputError as exc:
        if exc.field in (None, "cluster.topology", "cluster.nodes", "cluster.gpus_per_node"):
            raise InputError(exc.message, file=exc.file, field="--topology") from None
        raise
    desync_path = _desync_scenario(desync, backend, nproc, quick)
    spec = build_spec(shapes, backend, quick)
    say(f"microbenchmarks: {nproc} {backend} ranks ({launcher}), {_count_items(spec, nproc)} items"
        f"{' (quick)' if quick else ''}")  # fmt: skip
    t0 = time.monotonic()
    stages = 3 if desync_path is not None else 2  # parts of the progress bar: measure, reference job, fit
    with part(0, stages, "microbenchmarks"):
        raw = run_microbench(spec, nproc, launcher, timeout_s, echo)
    say(f"measured in {time.monotonic() - t0:.1f} s")
    with tempfile.TemporaryDirectory(prefix="moesim-refjob-") as job_dir:
        if desync_path is not None:
            say(f"rank desync: a real job of {desync_path} on {nproc} ranks, per-call spans")
            with part(1, stages, "reference job"):
                raw["desync"] = profile_job(nproc, desync_path, timeout_s=timeout_s, echo=echo, job_dir=job_dir)
            say(f"desync job: {raw['desync']['calls']} blocking calls in {raw['desync']['job_wall_s']:.1f} s")
        say("fitting links, GEMM, memory, attention, optimizer, desync")
        t1 = time.monotonic()
        with part(stages - 1, stages, "fitting"):
            run = fit_all(raw, topology, spec, stat=stat)
            desync_fit = run.calibration.sweeps.get("desync")
            if desync_fit:
                fit_in_job_factors(run.calibration, desync_fit)
    run.calibration.sweeps["fit_wall_s"] = time.monotonic() - t1
    run.calibration.sweeps["job_wall_s"] = t1 - t0
    if scenarios:
        run.calibration.hardware["scenarios"] = [str(p) for p in scenarios]
    if out is not None:
        try:
            save_calibration(out, run.calibration)
        except OSError as exc:
            raise InputError(f"cannot write '{out}': {exc.strerror or exc}", field="--out") from None
        say(f"wrote {out}")
    return run


def fit_in_job_factors(calibration: Calibration, profile: dict) -> None:
    """Set ``compute_scale`` and then ``call_overhead_us`` of ``calibration`` (in place) from the
    reference job kept with ``profile`` (:mod:`hw_validate.fits.reference_job`), each fit recorded
    in ``profile`` (``compute``, ``call_overhead``); the job's temporary paths are dropped."""
    calibration.compute_scale = calibration.call_overhead_us = None
    scale = fit_compute_scale(calibration, profile)
    profile["compute"] = scale
    if scale is not None:
        calibration.compute_scale = scale["compute_scale"]
    overhead = fit_call_overhead(calibration, profile)
    profile.pop("job", None)  # temporary paths: not part of the record
    profile["call_overhead"] = overhead
    if overhead is not None:
        calibration.call_overhead_us = overhead["call_overhead_us"]


def refit_reference_job(calibration: Calibration, nproc: int, timeout_s: float = 900.0, echo: bool = False,
                        progress=None) -> Calibration:  # fmt: skip
    """A copy of ``calibration`` (a full one, with the microbenchmark sweeps) whose in-job figures
    come from a reference job run now: late wake-ups, compute noise and stalls (the desync profile,
    :func:`hw_validate.calibrate_fit.desync_figures`), then the compute scale and call overhead
    (:func:`fit_in_job_factors`). What moves a CPU-rank prediction with the machine's load is in
    these; the microbenchmark fits are kept (``moesim validate`` without ``--calibration``)."""
    from hw_validate.fits.cpu_ranks import fit_noise, fit_wake

    say = progress or (lambda line: None)
    cal = calibration.model_copy(deep=True)
    sweeps = cal.sweeps
    wake_rows, noise_rows = sweeps.get("wake") or [], sweeps.get("noise") or []
    loops_wake, loops_cv = fit_wake([dict(r) for r in wake_rows]), fit_noise([dict(r) for r in noise_rows])
    with tempfile.TemporaryDirectory(prefix="moesim-refjob-") as job_dir:
        say(f"reference job: {REFERENCE.name} on {nproc} ranks, per-call spans")
        t0 = time.monotonic()
        with part(0, 2, "reference job"):
            profile = profile_job(nproc, REFERENCE, timeout_s=timeout_s, echo=echo, job_dir=job_dir)
        say(f"reference job: {profile['calls']} blocking calls in {profile['job_wall_s']:.1f} s; fitting")
        wake, cv, pauses = desync_figures(profile, wake_rows, loops_wake, loops_cv)
        cal.wake_delay_p, cal.wake_delay_cap_s = wake if wake is not None else (None, None)
        cal.compute_noise_cv = cv
        cal.pause_rate_per_s, cal.pause_mean_s = pauses if pauses is not None else (None, None)
        with part(1, 2, "fitting"):
            fit_in_job_factors(cal, profile)
    sweeps["desync"] = profile
    sweeps["refit"] = {"job_wall_s": profile["job_wall_s"], "wall_s": time.monotonic() - t0,
                       "unix_s": time.time()}  # fmt: skip
    return cal


def _desync_scenario(desync, backend: str, nproc: int, quick: bool) -> Path | None:
    """The reference scenario of the desync job, or None when it does not run (see :func:`calibrate`)."""
    import importlib.util

    if desync is None or desync is False:
        return None
    usable = backend == "gloo" and nproc >= 2
    if desync == "auto":
        return REFERENCE if usable and not quick and importlib.util.find_spec("deepspeed") is not None else None
    path = REFERENCE if desync is True else Path(desync)
    if not path.is_file():
        raise InputError(f"scenario file '{desync}' does not exist", file=str(desync), field="--desync-scenario")
    if not usable:
        raise InputError("the desync job runs on >= 2 gloo ranks", field="--desync-scenario")
    return path


def _count_items(spec: dict[str, Any], nproc: int) -> int:
    c = spec.get("comm") or {}
    n_comm = len(c.get("kinds", ())) * len(c.get("sizes", ())) if nproc > 1 else 0
    per_dtype = len(spec.get("gemm", ())) + len(spec.get("attention", ()))
    return (n_comm + per_dtype * len(spec.get("dtypes", ())) + len(spec.get("memory_elements", ())) * len(spec.get("memory_ops", ())) + 1
            + len(spec.get("optimizer_params", ())))  # fmt: skip


__all__ = ["BACKENDS", "LAUNCHERS", "CalibrationRun", "calibrate", "check_writable", "fit_in_job_factors",
           "refit_reference_job"]
