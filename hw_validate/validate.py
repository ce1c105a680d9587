"""``moesim validate``: the real DeepSpeed job and the simulator side by side, phase by phase.

1. Run the scenario's real job (:func:`hw_validate.launch.run_job`): a Measurement JSON (per-phase
   seconds, median over the measured steps of the slowest rank) and the router trace it recorded.
2. Simulate the same scenario with the calibration (``calibration: C``) and the job's own routing
   decisions replayed (``routing.generator: trace``, ``routing.trace: router_trace.json``), with the
   dtype the job really ran (a CPU rank runs fp32 where bf16 was asked for).
3. Compare every phase: ``error_rel = (predicted - measured) / measured``.

Predicted phases come from the simulator's spans of every rank, named as the job's timers name
them (:mod:`hw_validate.timing`): forward compute spans keep their names (``attention``, ``route``,
``permute``, ``experts``, ``unpermute``, ...), backward ``attention``/``experts`` become
``attention_bwd``/``experts_bwd``; an all-to-all is ``dispatch``/``combine`` in forward and
``dispatch_bwd``/``combine_bwd`` in backward, *including* the time the rank waited at its barrier for
a slower peer (a real ``all_to_all_single`` returns only when its peers arrive, so the job's timer
includes that wait too); ``grad_sync`` is the comm stream's gradient reductions, ``optimizer_comm``
ZeRO's post-step parameter all-gather; ``forward`` ends with the last forward kernel, ``backward``
when the optimizer can start (reductions drained), ``optimizer`` is the optimizer plus its gather,
``step`` the rank's end. As in the Measurement, a phase's figure is the slowest rank's. When the
calibration carries rank noise (segment noise, stalls, late wake-ups), one simulated step is one
draw of it, as one step of the job is: the prediction is the median over :data:`PREDICT_DRAWS`
independent draws, of the step time and of each phase, as the measured side is the median over
the measured steps (``predicted.draws`` says how many were taken).

Result (``moesim validate --json``; ``format: moesim.validation``, version 1; seconds)::

    {"scenario", "scenario_file", "overrides", "steps",
     "measured":  {"step_time_s", "phases_s": {phase: median s}, "p10_s": {...}, "p90_s": {...},
                   "environment": {...}, "measurement_file", "dropped_fraction"},
     "predicted": {"step_time_s", "phases_s": {...}, "breakdown_s": {...}, "engine", "comm_model",
                   "draws"},
     "error":     {"step_time_rel", "phases_rel": {phase: rel | null}, "worst_phase",
                   "worst_phase_abs_s"},
     "phases": [{"phase", "measured_s", "predicted_s", "error_rel", "abs_error_s", "p10_s", "p90_s"}],
     "calibration": {"file", "quick", "computed": bool}, "reused_measurement": bool,
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

import numpy as np

from sim.errors import InputError
from sim.host.cpu_ranks import WAKE_KERNEL
from sim.ioutil import atomic_write_text, dumps_json

FORMAT = "moesim.validation"
VERSION = 1
KEY_FILE = "validate-key.json"
RESULT_FILE = "validation.json"
#: aggregate phases (each contains leaf phases); the others are leaves
AGGREGATES = ("step", "forward", "backward", "optimizer")
ORDER = (
    "step", "forward", "backward", "optimizer",
    "embedding", "attention", "route", "permute", "dispatch", "experts", "combine", "unpermute",
    "shared_experts", "mlp", "output", "forward_comm",
    "attention_bwd", "experts_bwd", "combine_bwd", "dispatch_bwd", "grad_sync", "optimizer_comm",
)  # fmt: skip
_BWD_NAMES = {"attention": "attention_bwd", "experts": "experts_bwd"}


# ---- the simulator's side -------------------------------------------------------------------------
def predicted_phases(spans: list, world: int) -> dict[str, float]:
    """Per-phase seconds from the engine's spans (every rank traced), slowest rank per phase."""
    per: list[dict[str, float]] = [dict.fromkeys(ORDER, 0.0) for _ in range(world)]
    fwd_end = [0.0] * world
    opt_start: list[float | None] = [None] * world
    end = [0.0] * world
    pending_wait = [0.0] * world
    last_comm = ["forward_comm"] * world  # the blocking call a late wake-up (``wake_wait``) follows
    for sp in sorted(spans, key=lambda x: (x.rank, x.stream != "compute", x.start)):
        r, p = sp.rank, per[sp.rank]
        dur = sp.end - sp.start
        end[r] = max(end[r], sp.end)
        if sp.stream == "comm":
            if sp.name == "grad_sync":
                p["grad_sync"] += dur
            elif sp.name == "grad_norm" or (sp.name == "param_gather" and opt_start[r] is not None):
                p["optimizer_comm"] += dur
            else:
                p["forward_comm"] += dur
            continue
        phase = sp.args.get("phase")
        if sp.name == "capacity_sync_wait":  # inside DeepSpeed's gate module: the job's route holds it
            p["route"] += dur
            last_comm[r] = "route"
            continue
        if sp.name == WAKE_KERNEL:  # a rank resuming late: the job's timer of the call it left holds it
            if opt_start[r] is not None:
                p["optimizer_comm"] += dur
            elif sp.args.get("layer") == -1:  # outside the layers: after the flushing gradient all-reduce
                p["grad_sync"] += dur
            else:
                p[last_comm[r]] += dur
            continue
        if sp.name == "imbalance_wait":  # belongs to the all-to-all that follows it
            pending_wait[r] += dur
            continue
        if sp.name in ("dispatch", "combine"):
            key = sp.name if phase != "bwd" else sp.name + "_bwd"
            p[key] += dur + pending_wait[r]
            pending_wait[r] = 0.0
            last_comm[r] = key
            if phase == "fwd":
                fwd_end[r] = max(fwd_end[r], sp.end)
            continue
        if sp.name in ("optimizer", "grad_norm_wait"):  # DeepSpeed's step() starts with the norm
            opt_start[r] = sp.start if opt_start[r] is None else min(opt_start[r], sp.start)
            continue
        if phase in ("fwd", "recompute"):
            if sp.name in p:
                p[sp.name] += dur
            if phase == "fwd":
                fwd_end[r] = max(fwd_end[r], sp.end)
        elif phase == "bwd" and sp.name in _BWD_NAMES:
            p[_BWD_NAMES[sp.name]] += dur
    for r in range(world):
        start_opt = opt_start[r] if opt_start[r] is not None else end[r]
        per[r]["forward"] = fwd_end[r]
        per[r]["backward"] = max(0.0, start_opt - fwd_end[r])
        per[r]["optimizer"] = max(0.0, end[r] - start_opt)
        per[r]["step"] = end[r]
    return {k: max(p[k] for p in per) for k in ORDER}


def simulation_scenario(scenario: str | Path, overrides: list[str], calibration: str | Path, trace: str | Path,
                        dtype: str | None = None):  # fmt: skip
    """The scenario as simulated: calibrated, routing replayed from ``trace``, the job's dtype."""
    from sim.api import load_scenario

    sets = [*overrides, f"calibration={Path(calibration).resolve()}", "routing.generator=trace",
            f"routing.trace={Path(trace).resolve()}"]  # fmt: skip
    s = load_scenario(scenario, sets)
    if dtype is not None and dtype != s.training.dtype:
        s = load_scenario(scenario, [*sets, f"training.dtype={dtype}"])
    return s


#: independent draws of the calibrated rank noise a prediction takes the median of (odd). The step
#: is heavy-tailed (stalls of several ms), so the median of few draws moves: on record 2026-12-06's
#: 18 jobs 9 draws and 33 draws differed by up to 7 ms a step (e16-top2-t1024: 185.2 vs 178.0 ms);
#: one draw of these scenarios takes ~16 ms to simulate
PREDICT_DRAWS = 65


def noise_draws(s, draws: int = PREDICT_DRAWS) -> int:
    """How many steps to simulate for ``s``: ``draws`` when its calibration has rank noise
    (segment noise, stalls, late wake-ups) on more than one rank, else 1 (every draw is the same)."""
    from sim.engine.simulate import cost_model

    cal = cost_model(s).calibration
    noisy = cal is not None and bool(cal.compute_noise_cv or (cal.pause_rate_per_s and cal.pause_mean_s)
                                     or (cal.wake_delay_p and cal.wake_delay_cap_s))  # fmt: skip
    return draws if noisy and s.world_size > 1 else 1


def simulate_median(s, draws: int = PREDICT_DRAWS) -> tuple[float, dict[str, float], dict[str, Any], list]:
    """``(step_s, phases_s, result, spans)`` of ``s`` simulated as the job is measured: one simulated
    step is one draw of the ranks' calibrated noise, the job's figure is the median over its steps,
    so this takes the median step time and each phase's median over :func:`noise_draws` draws
    (``result`` and ``spans``: draw 0's)."""
    from sim.engine.simulate import simulate

    steps, per, first = [], [], None
    for d in range(noise_draws(s, draws)):
        res = simulate(s, trace_ranks=set(range(s.world_size)), draw=d)
        spans = res.pop("_spans")
        per.append(predicted_phases(spans, s.world_size))
        steps.append(res["step_time_s"])
        if first is None:
            first = (res, spans)
    phases = {k: float(np.median([p[k] for p in per])) for k in per[0]}
    phases["step"] = float(np.median(steps))
    return phases["step"], phases, first[0], first[1]


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


# ---- the measured side ----------------------------------------------------------------------------
def measured_section(meas: dict[str, Any], path: Path) -> dict[str, Any]:
    summ = meas["timing"]["summary"]

    def get(phase: str, stat: str) -> float:
        v = summ.get(phase, {}).get(stat)
        return float(v) if v is not None else 0.0

    return {
        "step_time_s": get("step", "median"),
        "phases_s": {p: get(p, "median") for p in ORDER},
        "p10_s": {p: get(p, "p10") for p in ORDER},
        "p90_s": {p: get(p, "p90") for p in ORDER},
        "measured_steps": len(meas["measured_steps"]),
        "environment": meas["environment"],
        "dtype": meas["config"].get("dtype"),
        "dropped_fraction": meas.get("routing", {}).get("dropped_fraction"),
        "measurement_file": str(path),
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
        f"calibration {cal['file']}" + (" (quick, computed now)" if cal["computed"] else ""),
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


# ---- resumable measurements -----------------------------------------------------------------------
def job_key(scenario: str | Path, overrides: list[str], steps: int, nproc: int | None, launcher: str) -> dict:
    """What makes two measurements interchangeable: the scenario as loaded (less its calibration and
    routing source, which only the simulator reads), the overrides, steps, ranks and launcher."""
    from sim.api import load_scenario

    s = load_scenario(scenario, overrides)
    dump = s.model_dump(mode="json")
    dump.pop("calibration", None)
    text = json.dumps(dump, sort_keys=True, default=str)
    return {"scenario_sha256": hashlib.sha256(text.encode()).hexdigest(), "steps": steps,
            "nproc": nproc if nproc is not None else s.world_size, "launcher": launcher}  # fmt: skip


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
) -> dict[str, Any]:
    """Run, simulate, compare (module docstring). Raises :class:`InputError` on bad input and
    :class:`hw_validate.launch.JobError` when the job (or the calibration job) fails or hangs."""
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
                         keep is not None, overrides, echo, env, log, run_job, load_measurement)  # fmt: skip
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def _validate(scenario, scen, calibration, steps, warmup, nproc, launcher, timeout_s, work: Path, kept: bool,
              overrides, echo, env, log, run_job, load_measurement) -> dict[str, Any]:  # fmt: skip
    from hw_validate.launch import MEASUREMENT_FILE, TRACE_FILE

    computed = False
    if calibration is None:
        from hw_validate.calibrate import calibrate

        cal_path = work / "calibration.json"
        backend = "gloo" if scen.topology.gpu.kind == "cpu" else "nccl"
        log(f"validate: no --calibration: running a quick calibration ({backend}, {nproc or scen.world_size} "
            f"ranks) first -> {cal_path if kept else 'a temporary file'}")  # fmt: skip
        calibrate(cal_path, nproc=nproc or scen.world_size, backend=backend, topology=scen.topology,
                  scenarios=[scenario], quick=True, timeout_s=timeout_s, echo=echo)  # fmt: skip
        calibration, computed = cal_path, True
    key = job_key(scenario, overrides, steps, nproc, launcher)
    reused = kept and reusable(work, key)
    job: dict[str, Any]
    if reused:
        log(f"validate: reusing the finished measurement in {work} (same scenario, {steps} steps)")
        job = {"wall_s": None, "command": None}
    else:
        (work / KEY_FILE).unlink(missing_ok=True)
        extra = ["--warmup", str(warmup)]
        res = run_job(scenario, nproc, work, steps, overrides, timeout_s, launcher, extra, env=env, echo=echo)
        atomic_write_text(work / KEY_FILE, dumps_json(key))
        job = {"wall_s": res.wall_s, "command": res.command}
    meas_path, trace_path = work / MEASUREMENT_FILE, work / TRACE_FILE
    meas = load_measurement(meas_path)
    measured = measured_section(meas, meas_path)
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
        "calibration": {"file": str(calibration) if (kept or not computed) else "(temporary quick calibration)",
                        "quick": computed, "computed": computed},  # fmt: skip
        "reused_measurement": reused,
        "job": {**job, "launcher": launcher, "nproc": nproc or scen.world_size,
                "run_dir": str(work) if kept else None},  # fmt: skip
        "created_unix_s": time.time(),
    }
    if kept:
        atomic_write_text(work / RESULT_FILE, dumps_json(result))
    return result


__all__ = ["compare", "format_table", "measured_section", "predict", "predicted_phases", "validate"]
