"""CPU ranks' host effects in the lane engine (:mod:`sim.host.lane_host`): tensor- and pipeline-parallel
layouts on CPU ranks see the calibrated call overhead, late wake-ups, segment noise and stalls that the
per-rank engine applies to data + expert parallel ones. Closed forms on the TP-2 layout scenario."""

from __future__ import annotations

import pytest

from sim.api import load_scenario
from sim.engine.simulate import simulate
from sim.inputs.calibration import Calibration, load_calibration
from tests.conftest import ROOT, calibrated_scenario

TP = ROOT / "scenarios" / "accuracy" / "layout" / "tp2-sp.yaml"
LAYOUT_CAL = ROOT / "calibrations" / "cpu-host-2rank-layout.json"


def _run(tmp_path, name: str, **effects) -> dict:
    """tp2-sp with the layout calibration's device figures and only the named host effects."""
    base = load_calibration(LAYOUT_CAL)
    keep = {k: None for k in ("compute_noise_cv", "pause_rate_per_s", "pause_mean_s", "wake_delay_p",
                              "wake_delay_cap_s", "call_overhead_us")}  # fmt: skip
    cal = base.model_copy(update={**keep, **effects})
    return simulate(load_scenario(calibrated_scenario(cal, tmp_path, name, base=TP)))



def test_call_overhead_adds_exactly_once_per_call_followed_by_compute(tmp_path):
    """Only ``call_overhead_us``: every rank resumes that much later after each blocking TP collective
    that a compute segment follows, both ranks alike, so the step grows by overhead x those calls and
    tp_comm (the ranks' waits at the collectives included) does not move."""
    off = _run(tmp_path, "off")
    on = _run(tmp_path, "on", call_overhead_us=1000.0)
    extra = on["step_time_s"] - off["step_time_s"]
    calls = round(extra / 1e-3)
    assert calls > 0 and extra == pytest.approx(calls * 1e-3, rel=1e-9)
    # tp2-sp: per layer 2 all-gathers + 2 reduce-scatters each way, 4 layers: 32 calls, some back to back
    assert 16 <= calls <= 40
    assert on["breakdown_s"]["tp_comm"] == pytest.approx(off["breakdown_s"]["tp_comm"], rel=1e-12)
    assert on["breakdown_s"]["compute"] - off["breakdown_s"]["compute"] == pytest.approx(extra, rel=1e-9)


def test_certain_late_wakeups_make_the_peer_wait(tmp_path):
    """``wake_delay_p`` 1 with a long cap: after each blocking call one of the two ranks starts its next
    segment late by that segment's length, and the other waits for it at the next collective: tp_comm
    grows, and the step by at least as much as the waits."""
    off = _run(tmp_path, "off")
    on = _run(tmp_path, "wake", wake_delay_p=1.0, wake_delay_cap_s=1.0)
    grew = on["breakdown_s"]["tp_comm"] - off["breakdown_s"]["tp_comm"]
    assert grew > 0
    assert on["step_time_s"] - off["step_time_s"] >= grew * 0.5  # the mean over ranks: half the wait each


def test_same_seed_same_result_and_gpu_scenarios_untouched(tmp_path):
    a = _run(tmp_path, "a", compute_noise_cv=0.2, pause_rate_per_s=50.0, pause_mean_s=0.002,
             wake_delay_p=0.3, wake_delay_cap_s=0.004, call_overhead_us=300.0)  # fmt: skip
    b = _run(tmp_path, "b", compute_noise_cv=0.2, pause_rate_per_s=50.0, pause_mean_s=0.002,
             wake_delay_p=0.3, wake_delay_cap_s=0.004, call_overhead_us=300.0)  # fmt: skip
    assert a["step_time_s"] == b["step_time_s"] and a["breakdown_s"] == b["breakdown_s"]
    assert a["step_time_s"] > _run(tmp_path, "off")["step_time_s"]
    # a GPU scenario with the same calibration never builds the host effects
    gpu = calibrated_scenario(Calibration(call_overhead_us=1e6), tmp_path, "gpu", base=ROOT / "scenarios" / "128gpu.yaml")
    plain = simulate(load_scenario(ROOT / "scenarios" / "128gpu.yaml"))
    assert simulate(load_scenario(gpu))["step_time_s"] == plain["step_time_s"]
