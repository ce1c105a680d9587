"""The desync profile (hw_validate/desync.py): per-call spans of a real job turned into the late
wake-up and compute-noise models. The fit is checked on spans built from a known model (closed
form: the exit spread and segment deviations are planted exactly), then on a real 2-rank job of the
reference scenario; calibrate's choice of when to run it, and the fit_all hand-over. The fits that
simulate the reference job are in test_fits_reference_job.py, the stalls' and wake-ups' own fits in
test_fits_cpu_ranks.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from hw_validate.desync import (
    BIN_EDGES_S,
    REFERENCE,
    aligned_calls,
    desync_rows,
    read_spans,
    reference_overrides,
)
from hw_validate.fits.cpu_ranks import PAUSE_MIN_S, fit_profile
from sim.api import load_scenario
from sim.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["dispatch", "combine", "dispatch_bwd", "combine_bwd", "grad_sync", "optimizer_comm"]


def plant(tmp: Path, p_every: int, cap_s: float, cv: float, steps: int = 40, world: int = 2,
          segs_s=(0.3e-3, 1.5e-3, 3e-3, 6e-3, 12e-3), base_s: float = 0.0, call_s: float = 2e-4) -> Path:  # fmt: skip
    """Spans of ``steps`` steps in which every ``p_every``-th call followed by each segment length
    has one rank leave late by min(longest next segment, cap_s) and every segment's ranks deviate by +-cv/sqrt(pi) (the mean
    |deviation| of two normal ranks of relative std cv), written as the job writes them."""
    t = np.zeros(world)
    recs = [[] for _ in range(world)]
    k = 0
    count = [0] * len(segs_s)
    dev = cv / math.sqrt(math.pi)  # 2 normal ranks of std cv: E|seg_r / mean - 1| = cv / sqrt(pi)
    for st in range(steps):
        spans = [[["forward", float(t[r]), float(t[r] + 1e-3)]] for r in range(world)]
        for i, name in enumerate(NAMES):
            seg = segs_s[(st + i) % len(segs_s)]
            sign = 1 if (st + i) % 2 else -1
            comp = np.array([seg * (1 + sign * dev), seg * (1 - sign * dev)])
            arrive = t + comp
            out = np.full(world, arrive.max() + call_s)
            out[(k + 1) % world] += base_s  # the same rank as a late wake-up: spreads add
            if i + 1 < len(NAMES):  # every p_every-th call before each segment length is late
                cls = (st + i + 1) % len(segs_s)
                count[cls] += 1
                if count[cls] % p_every == 0:
                    out[(k + 1) % world] += min(segs_s[cls] * (1 + dev), cap_s)
            k += 1
            for r in range(world):
                spans[r].append([name, float(arrive[r]), float(out[r])])
            t = out
        t = np.full(world, t.max() + 1e-3)  # the step's end
        for r in range(world):
            recs[r].append({"step": st, "spans": spans[r]})
    for r in range(world):
        (tmp / f"rank-{r}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs[r]))
    return tmp


def profile_of(d: Path, warmup: int = 0) -> dict:
    e, x, last, skipped = aligned_calls(read_spans(d, 2), warmup)
    rows, noise = desync_rows(e, x, last)
    return {"scenario": "planted", "ranks": 2, "calls": e.shape[1], "skipped_steps": skipped, "wake": rows, "noise": noise}


def test_fit_recovers_the_planted_wake_ups_and_noise(tmp_path):
    prof = profile_of(plant(tmp_path, p_every=4, cap_s=2.5e-3, cv=0.08))
    assert prof["calls"] == 40 * len(NAMES) and prof["skipped_steps"] == 0
    (p, cap), cv = fit_profile(prof)
    assert p == pytest.approx(0.25, abs=0.03)
    assert cap == pytest.approx(2.5e-3, rel=0.1)
    assert cv == pytest.approx(0.08, rel=0.02)
    # the rows are the bins of the longest next segment, each with its calls' spreads
    for r in prof["wake"][1:]:
        lo, hi = r["bin_s"]
        assert lo <= r["segment_s"] < (hi or math.inf) and r["calls"] == len(r["exit_spread_s"]) >= 8


def test_no_late_wake_ups_fit_p_zero_and_no_noise_cv_zero(tmp_path):
    prof = profile_of(plant(tmp_path, p_every=10**9, cap_s=1e-3, cv=0.0))
    # no late call planted: p 0
    (p, _), cv = fit_profile(prof)
    assert p < 0.02 and cv == pytest.approx(0.0, abs=1e-9)


def test_base_spread_is_subtracted(tmp_path):
    """A constant exit skew of the collective itself (base) is not a late wake-up."""
    d = plant(tmp_path, p_every=4, cap_s=2.5e-3, cv=0.0, base_s=3e-4)
    (p0, _), _ = fit_profile(profile_of(d))
    (p1, cap1), _ = fit_profile(profile_of(d), base_spread_s=3e-4)
    assert p1 == pytest.approx(0.25, abs=0.03) and cap1 == pytest.approx(2.5e-3, rel=0.1)
    assert p0 > p1  # without the base, the skew reads as more wake-ups


def test_warmup_and_mismatched_steps_are_left_out(tmp_path):
    d = plant(tmp_path, p_every=4, cap_s=2.5e-3, cv=0.05, steps=10)
    lines = (d / "rank-1.jsonl").read_text().splitlines()
    rec = json.loads(lines[5])
    rec["spans"] = rec["spans"][:-1]  # rank 1's step 5 lost its last call
    lines[5] = json.dumps(rec)
    (d / "rank-1.jsonl").write_text("\n".join(lines) + "\n")
    e, x, last, skipped = aligned_calls(read_spans(d, 2), warmup=2)
    assert skipped == 1 and e.shape == (2, 7 * len(NAMES)) and last.sum() == 7
    assert np.all(x >= e)
    with pytest.raises(FileNotFoundError, match="rank-2.jsonl"):
        read_spans(d, 3)


def test_reference_scenario_is_none_of_the_accuracy_shapes():
    ref = load_scenario(REFERENCE)
    assert ref.world_size == 2 and ref.routing.dispatch == "capacity_padded" and ref.parallelism.ep == 2
    shape = lambda s: (s.model.num_layers, s.model.hidden_size, s.model.num_experts, s.model.top_k,  # noqa: E731
                       s.training.micro_batch_size * s.training.seq_len)  # fmt: skip
    for f in sorted((ROOT / "scenarios" / "accuracy").glob("*.yaml")):
        assert shape(load_scenario(f)) != shape(ref), f.name
    four = load_scenario(REFERENCE, reference_overrides(4))
    assert four.world_size == 4 and four.parallelism.ep == 4
    assert BIN_EDGES_S[0] == 0 and math.isinf(BIN_EDGES_S[-1])


def test_when_calibrate_runs_the_desync_job(tmp_path):
    from hw_validate.calibrate import _desync_scenario

    pytest.importorskip("deepspeed")
    assert _desync_scenario("auto", "gloo", 2, quick=False) == REFERENCE
    assert _desync_scenario("auto", "gloo", 2, quick=True) is None
    assert _desync_scenario("auto", "nccl", 2, quick=False) is None
    assert _desync_scenario("auto", "gloo", 1, quick=False) is None
    assert _desync_scenario(None, "gloo", 2, quick=False) is None
    with pytest.raises(InputError) as e:
        _desync_scenario(str(tmp_path / "nope.yaml"), "gloo", 2, quick=False)
    assert e.value.field == "--desync-scenario"
    with pytest.raises(InputError):
        _desync_scenario(str(REFERENCE), "nccl", 2, quick=False)


def test_fit_all_takes_the_job_figures_and_keeps_the_loops(tmp_path):
    """fit_all: the desync profile's p, cap and cv replace the microbenchmarks'; both recorded."""
    from hw_validate.calibration_report import format_report
    from hw_validate.fits.cpu_ranks import fit_noise, fit_wake

    prof = profile_of(plant(tmp_path, p_every=2, cap_s=4e-3, cv=0.12))
    wake_rows = [{"segment_s": s, "exit_spread_s": [0.1 * min(s, 2e-3)] * 5} for s in (0.0, 1e-3, 2e-3, 4e-3)]
    noise_rows = [{"segment_s": 1e-3, "per_rank_s": [[1e-3, 1.02e-3], [0.98e-3, 1e-3]]}]
    loops = fit_wake([dict(r) for r in wake_rows]), fit_noise([dict(r) for r in noise_rows])
    raw = _minimal_raw(wake_rows, noise_rows, prof)
    from hw_validate.calibrate_fit import fit_all

    cal = fit_all(raw, "cpu-host", {}).calibration
    assert cal.wake_delay_p == pytest.approx(0.5, abs=0.04) and cal.wake_delay_cap_s == pytest.approx(4e-3, rel=0.1)
    assert cal.compute_noise_cv == pytest.approx(0.12, rel=0.02)
    mb = cal.sweeps["desync"]["microbench"]
    assert mb["wake_delay_p"] == pytest.approx(loops[0][0]) and mb["compute_noise_cv"] == pytest.approx(loops[1])
    text = format_report(cal)
    assert "rank desync in a real job (planted" in text and "the microbenchmark loops alone" in text


def _minimal_raw(wake_rows, noise_rows, desync) -> dict:
    """A microbenchmark result with just enough to fit (no collectives, one GEMM dtype)."""
    gemm = [{"dtype": "fp32", "m": m, "n": n, "k": k, "time_s": 2 * m * n * k / 5e10 + 5e-6, "p25_s": 0.0}
            for m in (64, 256, 1024) for n in (64, 256) for k in (64, 256)]  # fmt: skip
    return {"hardware": {"device": "cpu", "backend": "gloo", "world_size": 2}, "launch": {"fwd_op_s": 5e-6},
            "memory": [{"op": "add", "elements": e, "bytes": 12 * e, "time_s": 5e-6 + 12 * e / 5e10} for e in (1e4, 1e5, 1e6)],
            "gemm": gemm, "attention": [], "optimizer": [], "comm": [], "noise": noise_rows, "wake": wake_rows,
            "desync": desync}  # fmt: skip


@pytest.mark.slow
@pytest.mark.deepspeed
def test_real_reference_job_gives_a_profile(tmp_path):
    """A short real job of the reference scenario on 2 gloo ranks: every measured step's calls are
    aligned across the ranks, and the fit's figures are in their domains."""
    import os
    import time

    from hw_validate.desync import profile_job
    from hw_validate.launch import SHM_DIR

    t0 = time.time()
    prof = profile_job(2, REFERENCE, steps=6, timeout_s=600, echo=False, spans_dir=tmp_path / "spans")
    # DeepSpeed's CPU all-reduce buffers of the job are gone with it (hw_validate.launch.remove_shm_buffers)
    left = [f for f in SHM_DIR.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*") if f.stat().st_mtime >= t0]
    assert left == []
    # 3 MoE layers: 4 all-to-alls each, plus the gradient and optimizer reductions, per step
    per_step = prof["calls"] / (6 - load_scenario(REFERENCE).training.warmup_steps)
    assert prof["skipped_steps"] == 0 and per_step == int(per_step) and per_step >= 12 + 2
    assert sorted(p.name for p in (tmp_path / "spans").iterdir()) == ["rank-0.jsonl", "rank-1.jsonl"]
    assert prof["noise"]["cv"] is not None and 0 <= prof["noise"]["cv"] < 2
    wake, cv = fit_profile(prof)
    if wake is not None:  # too few calls in some bins of so short a job is possible
        assert 0 <= wake[0] <= 1 and 2.5e-4 <= wake[1] <= 3.2e-2
    # the stalls' fit reads the same segments (steps x calls - 1 per rank); with stalls seen the
    # noise cv is the spread without them
    pz = prof["pauses"]
    assert pz["segments"] == 2 * (prof["calls"] - (6 - load_scenario(REFERENCE).training.warmup_steps))
    if pz["rate_per_s"]:
        assert cv == pz["body_cv"] and 0 <= cv < 2 and pz["mean_s"] > PAUSE_MIN_S
    else:
        assert cv == prof["noise"]["cv"]
    assert prof["measured"]["phases_s"]["experts"] > 0 and prof["measured"]["step_time_s"] > 0


def test_remove_shm_buffers_takes_only_the_jobs_own(tmp_path):
    import os

    from hw_validate.launch import remove_shm_buffers

    uid = os.getuid()
    mine = [tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_12345_{r}" for r in (0, 1)]
    others = [tmp_path / f"deepspeed_allreduce_buffer_{uid}_127.0.0.1_123456_0",
              tmp_path / f"deepspeed_allreduce_buffer_{uid + 1}_127.0.0.1_12345_0", tmp_path / "other_12345_0"]  # fmt: skip
    for f in mine + others:
        f.write_bytes(b"x")
    assert remove_shm_buffers(12345, tmp_path) == 2
    assert not any(f.exists() for f in mine) and all(f.exists() for f in others)
    assert remove_shm_buffers(12345, tmp_path) == 0
