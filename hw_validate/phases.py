"""The job's phases on both sides, shared by ``moesim validate`` (:mod:`hw_validate.validate`) and the
fits that simulate the reference job (:mod:`hw_validate.fits.reference_job`, :mod:`hw_validate.desync`):
the phase names, the simulator's figure of each phase from its spans, the scenario simulated as the
job ran (calibrated, its routing replayed, its dtype) and the median over noise draws a measurement is
compared with, and the measured side read off a Measurement JSON.

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
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sim.host.cpu_ranks import WAKE_KERNEL

#: aggregate phases (each contains leaf phases); the others are leaves
AGGREGATES = ("step", "forward", "backward", "optimizer")
ORDER = (
    "step", "forward", "backward", "optimizer",
    "embedding", "attention", "route", "permute", "dispatch", "experts", "combine", "unpermute",
    "shared_experts", "mlp", "output", "forward_comm",
    "attention_bwd", "experts_bwd", "combine_bwd", "dispatch_bwd", "grad_sync", "optimizer_comm",
)  # fmt: skip
_BWD_NAMES = {"attention": "attention_bwd", "experts": "experts_bwd"}
#: the job's phases that are one blocking collective each on CPU ranks (hw_validate/timing.py)
BLOCKING = ("dispatch", "combine", "dispatch_bwd", "combine_bwd", "grad_sync", "optimizer_comm", "forward_comm")


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


def simulation_scenario(scenario: str | Path, overrides: list[str], calibration: str | Path, trace: str | Path | None,
                        dtype: str | None = None):  # fmt: skip
    """The scenario as simulated: calibrated, routing replayed from ``trace`` (None: the scenario's
    own routing), the job's dtype."""
    from sim.api import load_scenario

    sets = [*overrides, f"calibration={Path(calibration).resolve()}"]
    if trace is not None:
        sets += ["routing.generator=trace", f"routing.trace={Path(trace).resolve()}"]
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


# ---- the measured side ----------------------------------------------------------------------------
def measured_section(meas: dict[str, Any], path: Path) -> dict[str, Any]:
    """The ``measured`` section of a validation from a Measurement JSON (``meas``, read from ``path``):
    each phase's median, p10 and p90 over the measured steps (0 where the job has no such phase)."""
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
