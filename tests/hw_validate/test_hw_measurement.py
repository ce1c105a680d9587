"""Measurement JSON: statistics against independent computations, validation, atomic round trip;
failure diagnosis from run-folder files."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from hw_validate.diagnose import explain_exit, explain_timeout, innermost_frame, read_states
from hw_validate.measurement import build_measurement, load_measurement, stats, write_measurement
from sim.errors import InputError


def test_stats_match_independent_formulas():
    v = [0.5, 0.1, 0.4, 0.3, 0.2, 0.9, 0.7]
    s = stats(v)
    srt = sorted(v)
    assert s["median"] == pytest.approx(statistics.median(v))
    assert s["mean"] == pytest.approx(sum(v) / len(v))
    assert (s["min"], s["max"], s["n"]) == (0.1, 0.9, 7)
    # linear interpolation percentile: rank = p * (n - 1)
    def pct(p):
        r = p * (len(srt) - 1)
        lo = int(r)
        return srt[lo] + (r - lo) * (srt[min(lo + 1, len(srt) - 1)] - srt[lo])
    assert s["p10"] == pytest.approx(pct(0.1))
    assert s["p90"] == pytest.approx(pct(0.9))
    assert s["iqr"] == pytest.approx(pct(0.75) - pct(0.25))
    assert stats([])["n"] == 0 and stats([])["median"] is None


def _measurement(steps=4, world=2, warmup=1):
    per_step = {"step": [[0.1 * (i + 1) + 0.01 * r for r in range(world)] for i in range(steps)]}
    return build_measurement(
        scenario="x", scenario_file=None, overrides=[], environment={"world_size": world}, config={},
        steps=steps, warmup_steps=warmup, timing={"per_step": per_step}, loss={"per_step": [1.0] * steps},
        routing={}, upcycle=None, trace_file=None, created_unix_s=0.0,
    )  # fmt: skip


def test_summary_excludes_warmup_and_takes_slowest_rank(tmp_path):
    m = _measurement()
    assert m["measured_steps"] == [1, 2, 3]
    worst = [0.2 + 0.01, 0.3 + 0.01, 0.4 + 0.01]
    assert m["timing"]["summary"]["step"]["median"] == pytest.approx(statistics.median(worst))
    assert m["timing"]["summary_rank_mean"]["step"]["mean"] == pytest.approx(np.mean([0.205, 0.305, 0.405]))
    p = tmp_path / "m.json"
    write_measurement(p, m)
    assert load_measurement(p) == json.loads(p.read_text())
    assert not list(tmp_path.glob(".*tmp"))


def test_validation_names_the_field(tmp_path):
    m = _measurement()
    m["timing"]["per_step"]["step"] = m["timing"]["per_step"]["step"][:-1]
    with pytest.raises(InputError) as e:
        write_measurement(tmp_path / "m.json", m)
    assert e.value.field == "timing.per_step.step"
    assert not (tmp_path / "m.json").exists()
    (tmp_path / "bad.json").write_text('{"format": "moesim.measurement", "version": 9}')
    with pytest.raises(InputError) as e:
        load_measurement(tmp_path / "bad.json")
    assert e.value.field == "version"


def _rank_files(run, r, rc, t, step, lines):
    (run / "status").mkdir(parents=True, exist_ok=True)
    (run / "logs").mkdir(parents=True, exist_ok=True)
    if rc is not None:
        (run / "status" / f"rank{r}.exit.json").write_text(json.dumps({"rank": r, "returncode": rc, "time": t}))
    (run / "status" / f"rank{r}.json").write_text(json.dumps({"rank": r, "pid": 1, "step": step, "time": t}))
    (run / "logs" / f"rank{r}.log").write_text("\n".join(lines) + "\n")


def test_dead_rank_is_the_first_one_that_did_not_lose_a_peer(tmp_path):
    # rank 0 ended first but only because its peer vanished (gloo error); rank 2 is the cause
    _rank_files(tmp_path, 0, 1, 10.0, 3, ["RuntimeError: [../gloo/transport/tcp/pair.cc] Connection closed by peer"])
    _rank_files(tmp_path, 1, -15, 11.0, 3, ["step"])
    _rank_files(tmp_path, 2, 1, 10.5, 3, ["Traceback ...", "ValueError: boom"])
    rank, msg = explain_exit(read_states(tmp_path, 3), 1, tmp_path)
    assert rank == 2
    assert msg.startswith("rank 2 exited with status 1 at step 3") and "ValueError: boom" in msg
    assert "rank 1 signal 15" in msg


def test_hung_rank_is_the_one_outside_a_collective(tmp_path):
    dump_wait = ["Current thread 0x1 (most recent call first):",
                 '  File "/v/site-packages/torch/distributed/distributed_c10d.py", line 4000 in all_to_all_single',
                 '  File "/r/hw_validate/train_moe.py", line 200 in _run']  # fmt: skip
    dump_busy = ["Current thread 0x1 (most recent call first):",
                 '  File "/r/hw_validate/train_moe.py", line 90 in inject_fault']  # fmt: skip
    assert innermost_frame(dump_busy) == "/r/hw_validate/train_moe.py:90 in inject_fault"
    _rank_files(tmp_path, 0, None, 5.0, 2, dump_wait)
    _rank_files(tmp_path, 1, None, 5.0, 2, dump_busy)
    rank, msg = explain_timeout(read_states(tmp_path, 2), "job timed out after 30 s", tmp_path)
    assert rank == 1 and msg.startswith("job timed out after 30 s; rank 1 looks hung at step 2") and "rank 0" in msg and "waiting in a collective" in msg
