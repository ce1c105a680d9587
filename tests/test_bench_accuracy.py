"""The accuracy record's repeated jobs: the median-error job is kept, every job is listed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("bench_accuracy", ROOT / "benchmarks" / "bench_accuracy.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def job(scenario: str, measured_ms: float, predicted_ms: float) -> dict:
    rel = (predicted_ms - measured_ms) / measured_ms
    return {
        "scenario": scenario,
        "measured": {"step_time_s": measured_ms / 1e3, "p10_s": {"step": measured_ms / 1e3},
                     "p90_s": {"step": measured_ms / 1e3}, "phases_s": {"forward": measured_ms / 2e3}},
        "predicted": {"step_time_s": predicted_ms / 1e3},
        "error": {"step_time_rel": rel, "phases_rel": {"forward": rel}, "worst_phase": "forward",
                  "worst_phase_abs_s": abs(predicted_ms - measured_ms) / 2e3},
    }  # fmt: skip


def test_median_job_is_the_middle_error_and_lists_every_job():
    runs = [job("a", 100, 50), job("a", 80, 60), job("a", 60, 58)]  # errors -50%, -25%, -3.3%
    pick = bench.median_job(runs)
    assert pick["measured"]["step_time_s"] == pytest.approx(0.080)
    assert [j["job"] for j in pick["repeats"]] == [1, 2, 3]
    assert [round(j["step_time_rel"], 4) for j in pick["repeats"]] == [-0.5, -0.25, round(-2 / 60, 4)]
    # an even count keeps the lower middle one; a single job carries no repeats
    assert bench.median_job(runs[:2])["error"]["step_time_rel"] == pytest.approx(-0.5)
    assert "repeats" not in bench.median_job(runs[:1])


def test_render_uses_the_median_jobs_for_the_summary():
    results = [bench.median_job([job("a", 100, 50), job("a", 80, 60), job("a", 60, 58)]),
               bench.median_job([job("b", 100, 95), job("b", 100, 110), job("b", 100, 130)])]  # fmt: skip
    record, md = bench.render("t", results, {"kind": "cpu", "machine": "m"})
    # medians: a -25%, b +10% -> median of |errors| 17.5%, max 25%
    assert record["summary"]["median_abs_step_error"] == pytest.approx(0.175)
    assert record["summary"]["max_abs_step_error"] == pytest.approx(0.25)
    assert record["summary"]["met"] is False
    assert len(record["rows"][0]["repeats"]) == 3
    assert "-50% (100/50), -25% (80/60), -3% (60/58)" in md
    assert "Each scenario ran 3 times" in md
    json.dumps(record)  # the record is plain JSON


def test_repeat_below_one_is_a_usage_error():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_accuracy.py"), "--repeat", "0"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "--repeat must be at least 1" in r.stderr
