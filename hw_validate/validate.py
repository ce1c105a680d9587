"""``moesim validate``: the real DeepSpeed job and the simulator side by side, phase by phase.

1. Run the scenario's real job (:func:`hw_validate.launch.run_job`): a Measurement JSON (per-phase
   seconds, median over the measured steps of the slowest rank) and the router trace it recorded.
2. Simulate the same scenario with the calibration (``calibration: C``) and the job's own routing
   decisions replayed (``routing.generator: trace``, ``routing.trace: router_trace.json``), with the
   dtype the job really ran (a CPU rank runs fp32 where bf16 was asked for).
3. Compare every phase: ``error_rel = (predicted - measured) / measured``.

Predicted phases come from the simulator's spans of every rank, named as the job's timers name
them, the median over the calibrated rank noise's draws (:mod:`hw_validate.phases`).

Result (``moesim validate --json``; ``format: moesim.validation``, version 1; seconds)::

    {"scenario", "scenario_file", "overrides", "steps",
     "measured":  {"step_time_s", "phases_s": {phase: median s}, "p10_s": {...}, "p90_s": {...},
                   "environment": {...}, "measurement_file", "dropped_fraction"},
     "predicted": {"step_time_s", "phases_s": {...}, "breakdown_s": {...}, "engine", "comm_model",
                   "draws"},
     "error":     {"step_time_rel", "phases_rel": {phase: rel | null}, "worst_phase",
                   "worst_phase_abs_s"},
     "phases": [{"phase", "measured_s", "predicted_s", "error_rel", "abs_error_s", "p10_s", "p90_s"}],
     "calibration": {"file", "computed", "cached", "cache_created_unix_s", "refit"}, "reused_measurement": bool,
     "profile": the job's profiler traces (``--profile``) or null,
     "job": {"wall_s", "command", "launcher", "nproc", "run_dir"}}

``error_rel`` is null where the measured phase is 0 (it did not run, e.g. ``dispatch`` with ep = 1).
``worst_phase`` is the leaf phase (not forward/backward/optimizer/step) with the largest absolute
error in seconds: the one that moves the step most.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from hw_validate.phases import (
    AGGREGATES,
    ORDER,
    measured_section,
    noise_draws,
    predicted_phases,
    simulate_median,
    simulation_scenario,
)
from sim.errors import InputError
from sim.ioutil import atomic_write_text, dumps_json
from sim.reports.progress import part

FORMAT = "moesim.validation"
VERSION = 1
KEY_FILE = "validate-key.json"
RESULT_FILE = "validation.json"
#: with ``profile``: the job's profiler traces, under the kept folder (``calibrate --from-profile`` reads them)
PROFILE_DIR = "profile"


def predict(scenario: str | Path, overrides: list[str], calibration: str | Path, trace: str | Path,
            dtype: str | None = None) -> dict[str, Any]:  # fmt: skip
    """Simulate the step as the job ran it (median over noise draws); the ``predicted`` section."""
    s = simulation_scenario(scenario, overrides, calibration, trace, dtype)
    step, phases, res, _ = simulate_median(s)
    return {
        "step_time_s": step,
        "phases_s": phases,
        "breakdown_s": res["breakdown_s"],
        "engine": res["simulator"]["engine"],
        "comm_model": res["simulator"]["comm_model"],
        "dtype": s.training.dtype,
        "draws": noise_draws(s),
    }


def compare(measured: dict[str, Any], predicted: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(``error`` section, per-phase rows) of measured vs predicted."""
    rows, rel = [], {}
    for p in ORDER:
        m, q = measured["phases_s"][p], predicted["phases_s"][p]
        if m == 0.0 and q == 0.0:
            continue
        e = (q - m) / m if m > 0 else None
        rel[p] = e
        rows.append({"phase": p, "measured_s": m, "predicted_s": q, "error_rel": e, "abs_error_s": abs(q - m),
                     "p10_s": measured["p10_s"][p], "p90_s": measured["p90_s"][p]})  # fmt: skip
    leaves = [r for r in rows if r["phase"] not in AGGREGATES]
    worst = max(leaves, key=lambda r: r["abs_error_s"]) if leaves else None
    m, q = measured["step_time_s"], predicted["step_time_s"]
    error = {
        "step_time_rel": (q - m) / m if m > 0 else None,
        "phases_rel": rel,
        "worst_phase": worst["phase"] if worst else None,
        "worst_phase_abs_s": worst["abs_error_s"] if worst else None,
    }
    return error, rows


def format_table(result: dict[str, Any]) -> str:
    """The human table: phase, measured median (p10-p90), predicted, relative error."""
    env = result["measured"]["environment"]
    cal = result["calibration"]
    lines = [
        f"validate {result['scenario']}: {result['measured']['measured_steps']} measured steps on "
        f"{env.get('world_size')} x {(env.get('devices') or ['?'])[0]} ({env.get('backend')}); "
        f"calibration {cal['file']}" + _calibration_note(cal),
        f"{'phase':<15} {'measured ms':>12} {'p10..p90 ms':>17} {'predicted ms':>13} {'error':>8}",
    ]
    for r in result["phases"]:
        e = f"{100 * r['error_rel']:+7.1f}%" if r["error_rel"] is not None else "     n/a"
        band = f"{1e3 * r['p10_s']:.2f}..{1e3 * r['p90_s']:.2f}"
        lines.append(f"{r['phase']:<15} {1e3 * r['measured_s']:>12.3f} {band:>17} {1e3 * r['predicted_s']:>13.3f} {e}")
    err = result["error"]
    step = err["step_time_rel"]
    lines.append(
        f"step time error {100 * step:+.1f}%" if step is not None else "step time error n/a"
    )
    if err["worst_phase"]:
        lines[-1] += f"; worst phase {err['worst_phase']} ({1e3 * err['worst_phase_abs_s']:.2f} ms off)"
    return "\n".join(lines)


def _calibration_note(cal: dict[str, Any]) -> str:
    if cal.get("quick"):  # results written before the cache (issue 29)
        return " (quick, computed now)"
    if not cal.get("cached"):
        return ""
    made = "made now" if cal["computed"] else "cached"
    return f" ({made} full calibration of this machine" + (", in-job figures refitted now)" if cal["refit"] else ")")


# ---- resumable measurements -----------------------------------------------------------------------
def job_key(scenario: str | Path, overrides: list[str], steps: int, nproc: int | None, launcher: str,
            profile: bool = False) -> dict:  # fmt: skip
    """What makes two measurements interchangeable: the scenario as loaded (less its calibration and
    routing source, which only the simulator reads), the overrides, steps, ranks and launcher, and
    whether the profiler ran (its steps are slower)."""
    from sim.api import load_scenario

    s = load_scenario(scenario, overrides)
    dump = s.model_dump(mode="json")
    dump.pop("calibration", None)
    text = json.dumps(dump, sort_keys=True, default=str)
    key = {"scenario_sha256": hashlib.sha256(text.encode()).hexdigest(), "steps": steps,
           "nproc": nproc if nproc is not None else s.world_size, "launcher": launcher}  # fmt: skip
    if profile:
        key["profile"] = True
    return key


def reusable(keep: Path, key: dict) -> bool:
    """True when ``keep`` holds a finished measurement (and its trace) made with ``key``."""
    from hw_validate.launch import MEASUREMENT_FILE, TRACE_FILE
    from hw_validate.measurement import load_measurement

    kf = keep / KEY_FILE
    if not (kf.is_file() and (keep / MEASUREMENT_FILE).is_file() and (keep / TRACE_FILE).is_file()):
        return False
    try:
        if json.loads(kf.read_text(encoding="utf-8")) != key:
            return False
        load_measurement(keep / MEASUREMENT_FILE)
    except (OSError, ValueError, InputError):
        return False
    return True


# ---- the calibration when none is given -------------------------------------------------------------
def default_calibration(scenario: str | Path, scen, nproc: int, work: Path, timeout_s: float, echo: bool, log,
                        recalibrate: bool = False) -> dict[str, Any]:  # fmt: skip
    """The calibration of a validation given none (:mod:`hw_validate.calibration_cache`): the cached
    full calibration of this machine (made now the first time, or with ``recalibrate``) and, on
    >= 2 gloo ranks with DeepSpeed installed, its in-job figures refitted on a reference job run
    now, written to ``work/calibration.json``. Returns the ``calibration`` section of the result:
    ``{"file", "computed"`` (the cache was made now)``, "cached"`` (its path)``, "cache_created_unix_s",
    "refit"}``."""
    import importlib.util

    from hw_validate.calibrate import refit_reference_job
    from hw_validate.calibration_cache import cached_calibration
    from sim.inputs.calibration import load_calibration, save_calibration

    backend = "gloo" if scen.topology.gpu.kind == "cpu" else "nccl"
    refit = backend == "gloo" and nproc >= 2 and importlib.util.find_spec("deepspeed") is not None
    with part(0, 2 if refit else 1, "cached"):
        cached, made = cached_calibration(scenario, nproc, backend, timeout_s, echo, log, recalibrate)
    cal = load_calibration(cached)
    info = {"file": str(cached), "computed": made, "cached": str(cached),
            "cache_created_unix_s": (cal.hardware.get("cache") or {}).get("created_unix_s"), "refit": False}  # fmt: skip
    if not made:
        log(f"validate: no --calibration: the cached full calibration of this machine ({cached})")
    if refit:
        log("validate: refitting its in-job figures (compute scale, call overhead, stalls, wake-ups) on a reference "
            "job now, as the machine's load moves them")  # fmt: skip
        with part(1, 2, "refit"):
            cal = refit_reference_job(cal, nproc, timeout_s, echo=False)
        path = work / "calibration.json"
        save_calibration(path, cal)
        info.update(file=str(path), refit=True)
    return info


# ---- the whole thing ------------------------------------------------------------------------------
def validate(
    scenario: str | Path,
    calibration: str | Path | None = None,
    steps: int | None = None,
    nproc: int | None = None,
    launcher: str = "deepspeed",
    timeout_s: float = 900.0,
    keep: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    echo: bool = True,
    env: dict[str, str] | None = None,
    log=print,
    recalibrate: bool = False,
    profile: bool = False,
) -> dict[str, Any]:
    """Run, simulate, compare (module docstring). Without ``calibration``, the cached calibration of
    this machine with its in-job figures refitted now (:func:`default_calibration`; ``recalibrate``
    remakes the cached one). ``profile``: the job records profiler traces into ``keep/profile``
    (:data:`PROFILE_DIR`; needs ``keep``). Raises :class:`InputError` on bad input and
    :class:`hw_validate.launch.JobError` when the job (or a calibration job) fails or hangs."""
    from hw_validate.launch import LAUNCHERS, run_job
    from hw_validate.measurement import load_measurement
    from sim.api import load_scenario
    from sim.inputs.calibration import load_calibration

    overrides = list(overrides)
    scen = load_scenario(scenario, overrides)  # bad scenario: exit 2 before anything runs
    if steps is not None and steps < 1:
        raise InputError(f"must be >= 1, got {steps}", field="--steps")
    if launcher not in LAUNCHERS:
        raise InputError(f"unknown launcher '{launcher}'; use one of {', '.join(LAUNCHERS)}", field="--launcher")
    if timeout_s <= 0:
        raise InputError(f"must be > 0, got {timeout_s:g}", field="--timeout")
    if calibration is not None:
        load_calibration(calibration)  # missing or malformed: exit 2 before the job runs
    if profile and keep is None:
        raise InputError("the profiler traces are kept in the --keep folder: add --keep DIR", field="--profile")
    steps = scen.training.steps if steps is None else steps
    warmup = min(scen.training.warmup_steps, steps - 1)
    temp = None
    if keep is None:
        temp = Path(tempfile.mkdtemp(prefix="moesim-validate-"))
        work = temp
    else:
        work = Path(keep)
        work.mkdir(parents=True, exist_ok=True)
    try:
        return _validate(scenario, scen, calibration, steps, warmup, nproc, launcher, timeout_s, work,
                         keep is not None, overrides, echo, env, log, run_job, load_measurement, recalibrate,
                         profile)  # fmt: skip
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def _validate(scenario, scen, calibration, steps, warmup, nproc, launcher, timeout_s, work: Path, kept: bool,
              overrides, echo, env, log, run_job, load_measurement, recalibrate, profile) -> dict[str, Any]:  # fmt: skip
    from hw_validate.launch import MEASUREMENT_FILE, TRACE_FILE

    key = job_key(scenario, overrides, steps, nproc, launcher, profile)
    reused = kept and reusable(work, key)
    stages = (["calibration"] if calibration is None else []) + ([] if reused else ["real job"]) + ["simulate"]
    cal_info: dict[str, Any] = {"file": str(calibration), "computed": False, "cached": None, "refit": False}
    if calibration is None:
        with part(stages.index("calibration"), len(stages), "calibration"):
            cal_info = default_calibration(scenario, scen, nproc or scen.world_size, work, timeout_s, echo, log,
                                           recalibrate)  # fmt: skip
        calibration = Path(cal_info["file"])
        if not kept and cal_info["refit"]:
            cal_info["file"] = "(temporary: the cached calibration with the in-job figures refitted)"
    job: dict[str, Any]
    if reused:
        log(f"validate: reusing the finished measurement in {work} (same scenario, {steps} steps)")
        job = {"wall_s": None, "command": None}
    else:
        (work / KEY_FILE).unlink(missing_ok=True)
        extra = ["--warmup", str(warmup)] + (["--profile", str((work / PROFILE_DIR).resolve())] if profile else [])
        with part(stages.index("real job"), len(stages), "real job"):
            res = run_job(scenario, nproc, work, steps, overrides, timeout_s, launcher, extra, env=env, echo=echo)
        atomic_write_text(work / KEY_FILE, dumps_json(key))
        job = {"wall_s": res.wall_s, "command": res.command}
    meas_path, trace_path = work / MEASUREMENT_FILE, work / TRACE_FILE
    meas = load_measurement(meas_path)
    measured = measured_section(meas, meas_path)
    with part(len(stages) - 1, len(stages), "simulate"):
        predicted = predict(scenario, overrides, calibration, trace_path, measured["dtype"])
    error, rows = compare(measured, predicted)
    result = {
        "format": FORMAT,
        "version": VERSION,
        "scenario": scen.name,
        "scenario_file": str(scenario),
        "overrides": overrides,
        "steps": steps,
        "warmup_steps": warmup,
        "measured": measured,
        "predicted": predicted,
        "error": error,
        "phases": rows,
        "calibration": cal_info,
        "reused_measurement": reused,
        "profile": str(work / PROFILE_DIR) if profile else None,
        "job": {**job, "launcher": launcher, "nproc": nproc or scen.world_size,
                "run_dir": str(work) if kept else None},  # fmt: skip
        "created_unix_s": time.time(),
    }
    if kept:
        atomic_write_text(work / RESULT_FILE, dumps_json(result))
    return result


#: ``predicted_phases`` is part of validate's interface (tests/test_wake_delay.py imports it from here)
__all__ = ["compare", "format_table", "predict", "predicted_phases", "validate"]
