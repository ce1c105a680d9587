"""Calibrated rank-to-rank compute noise (``compute_noise_cv``): fitted from the microbenchmark's
per-rank segment times against the closed form of the mean absolute deviation, and drawn by the
simulator once per compute segment and rank, so that the ranks wait for each other at every
rendezvous."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from hw_validate.calibrate_fit import fit_noise
from sim.api import load_scenario
from sim.engine.simulate import cost_model, simulate
from sim.engine.step import build_step
from sim.frameworks.ops import Compute
from sim.hardware.faults import KernelJitter
from sim.inputs.calibration import Calibration
from sim.routing.plan import route_scenario
from tests.conftest import SCENARIOS, calibrated_scenario

CPU2 = SCENARIOS / "cpu-2rank.yaml"


def test_fit_noise_two_ranks_closed_form():
    """2 ranks, one 20% slower on every call: mean 1.1, |d| = 0.1/1.1 for both, so
    cv = |d| / sqrt(1/pi) = sqrt(pi) * 0.1 / 1.1."""
    rows = [{"segment_s": 0.001, "per_rank_s": [[1.0] * 10, [1.2] * 10]}]
    cv = fit_noise(rows)
    assert cv == pytest.approx(math.sqrt(math.pi) * 0.1 / 1.1, rel=1e-12)
    assert rows[0]["cv"] == cv


def test_fit_noise_recovers_normal_spread_over_ranks():
    """4 ranks with independent normal relative noise of std 0.15: the estimator's (W-1)/W factor
    makes it unbiased for any rank count (within sampling error of 4000 draws)."""
    g = np.random.default_rng(3)
    rows = [{"segment_s": s, "per_rank_s": (s * (1 + 0.15 * g.standard_normal((4, 1000)))).tolist()}
            for s in (0.001, 0.01)]  # fmt: skip
    assert fit_noise(rows) == pytest.approx(0.15, rel=0.05)
    assert fit_noise([]) is None
    assert fit_noise([{"segment_s": 0.001, "per_rank_s": [[1.0, 2.0]]}]) is None  # one rank: no spread


def _with_cv(tmp_path, cv, name):
    return load_scenario(calibrated_scenario(Calibration(compute_noise_cv=cv), tmp_path, name))


def _schedule(s):
    return build_step(s, route_scenario(s), cost_model(s), np.ones(s.world_size))


def test_segment_noise_scales_whole_segments_with_lognormal_draws(tmp_path):
    clean, noisy = _with_cv(tmp_path, 0.0, "clean"), _with_cv(tmp_path, 0.3, "noisy")
    a, b = _schedule(clean), _schedule(noisy)
    ratios = []
    for oa, ob in zip(a.ops, b.ops, strict=True):
        if isinstance(oa, Compute):
            r = ob.durs / oa.durs  # (kernels, ranks)
            ok = oa.durs > 0
            # one factor per segment and rank: every kernel of the segment scaled alike
            col = np.where(ok, r, np.nan)
            assert np.nanmax(col, axis=0) == pytest.approx(np.nanmin(col, axis=0), rel=1e-12)
            ratios.append(np.nanmean(col, axis=0))
    f = np.array(ratios)
    # the same draws as KernelJitter's streams for this seed: rank r's first factors, in op order
    j = KernelJitter(0.3, noisy.routing.seed + 7919)
    for r in range(noisy.world_size):
        assert f[:, r] == pytest.approx(j(r, len(f) + 1)[: len(f)], rel=1e-12)
    assert b.tail.optimizer_s[0] != a.tail.optimizer_s[0]


def test_noise_makes_ranks_wait_and_is_deterministic(tmp_path):
    clean = simulate(_with_cv(tmp_path, 0.0, "clean"))
    none = simulate(load_scenario(CPU2))
    assert clean["step_time_s"] == none["step_time_s"]  # cv 0: no draws at all
    assert clean["breakdown_s"]["imbalance_wait"] == 0.0
    runs = [simulate(_with_cv(tmp_path, 0.2, f"n{i}")) for i in range(2)]
    assert json.dumps(runs[0]["breakdown_s"]) == json.dumps(runs[1]["breakdown_s"])
    noisy = runs[0]
    assert noisy["breakdown_s"]["imbalance_wait"] > 0
    assert noisy["step_time_s"] > clean["step_time_s"]


def test_tail_segments_draw_their_own_noise_and_stalls():
    """The tail's segments (optimizer step, each group's gradient norm) each draw one factor after
    the ops' draws; a (world,) tail draws exactly as one row of a (segments, world) tail."""
    from sim.host.cpu_ranks import apply_pauses, apply_segment_noise

    def ops():
        return [Compute(["k"], np.full((1, 2), 1e-3), np.zeros((1, 2)), "fwd", 0, 0) for _ in range(3)]

    def noise(r, n):
        return np.arange(1, n + 1, dtype=float) * (r + 1)

    tail = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    o = ops()
    got = apply_segment_noise(o, tail, noise)
    assert got.tolist() == [[4.0, 8.0], [10.0, 20.0], [18.0, 36.0]]  # draws 4, 5, 6 (x rank + 1)
    assert [float(op.durs[0, 1]) for op in o] == pytest.approx([2e-3, 4e-3, 6e-3])
    assert apply_segment_noise(ops(), tail[0], noise).tolist() == [4.0, 8.0]
    # stalls: a 1-D tail is the 2-D tail's first row; rows draw in turn on each rank's stream
    one = apply_pauses(ops(), np.array([0.5, 0.5]), 40.0, 0.01, seed=3)
    two = apply_pauses(ops(), np.array([[0.5, 0.5], [0.5, 0.5]]), 40.0, 0.01, seed=3)
    assert two.shape == (2, 2) and two[0].tolist() == one.tolist()
    assert (two > 0.5).all() and two[1].tolist() != two[0].tolist()  # 20 stalls expected per row
