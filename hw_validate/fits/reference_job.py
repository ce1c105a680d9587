"""Fits that simulate the reference job (:mod:`hw_validate.desync`) as it ran -- its routing trace,
the median over noise draws -- at two values of one calibration figure and solve for the value at
which the simulator's step matches the measured one: the in-job compute factor (``compute_scale``)
and the in-job cost of each blocking call (``call_overhead_us``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hw_validate.phases import BLOCKING, simulate_median, simulation_scenario
from sim.inputs.calibration import save_calibration

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


def optimizer_compute(phases: dict[str, float]) -> float:
    """Seconds of a step's optimizer phase outside its collectives."""
    return phases.get("optimizer", 0.0) - phases.get("optimizer_comm", 0.0)

