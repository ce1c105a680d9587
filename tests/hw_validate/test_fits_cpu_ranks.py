"""The fits of CPU ranks' host effects (hw_validate/fits/cpu_ranks.py) on planted data: late wake-up
rows weighed by their calls, stalls and the body's spread recovered from segments drawn from the
simulator's own model, and that model (sim.host.cpu_ranks.apply_pauses) adding rate x mean of stall
time per second of compute."""

from __future__ import annotations

import math

import numpy as np
import pytest


def test_wake_fit_weighs_rows_by_their_calls():
    """A bin of few calls off the model moves the fit little; with equal counts it would pull it."""
    from hw_validate.fits.cpu_ranks import fit_wake

    p, cap = 0.4, 2e-3
    rows = [{"segment_s": 0.0, "exit_spread_s": [0.0]}]
    rows += [{"segment_s": s, "calls": 100, "exit_spread_s": [p * min(s, cap)] * 100} for s in (0.5e-3, 1e-3, 3e-3, 6e-3)]
    odd = {"segment_s": 10e-3, "exit_spread_s": [0.2e-3] * 10}
    (pw, cw) = fit_wake([*rows, {**odd, "calls": 10}])
    (pu, cu) = fit_wake([*rows, {**odd, "calls": 100, "exit_spread_s": [0.2e-3] * 100}])
    assert pw == pytest.approx(p, rel=0.1) and cw == pytest.approx(cap, rel=0.15)
    assert abs(pu * cu - p * cap) > abs(pw * cw - p * cap)


def _planted_segments(rate: float, mean: float, cv: float, steps: int = 400, seed: int = 5) -> np.ndarray:
    """(2, steps, 12) segments of 1-8 ms with lognormal noise ``cv`` and Poisson stalls of
    exponential length (the simulator's model, sim.frameworks.deepspeed.apply_pauses)."""
    rng = np.random.default_rng(seed)
    base = np.linspace(1e-3, 8e-3, 12)
    sigma = math.sqrt(math.log1p(cv**2))
    seg = base * rng.lognormal(-sigma**2 / 2, sigma, (2, steps, 12))
    n = rng.poisson(rate * np.broadcast_to(base, seg.shape))
    return seg + np.array([rng.exponential(mean, k).sum() for k in n.ravel()]).reshape(seg.shape)


def test_fit_pauses_recovers_the_stalled_time_of_planted_stalls():
    """Stalls of 5 ms mean (exponential) at 15 per second over segments with a 2% body: the fit
    sees those above 1 ms, and their rate x mean -- the stalled time per second of compute -- is
    the planted one within the sampling error, the body's cv comes back without them; no stalls:
    none found."""
    from hw_validate.desync import step_segments
    from hw_validate.fits.cpu_ranks import fit_pauses

    rate, mean = 15.0, 5e-3
    fit = fit_pauses(_planted_segments(rate, mean, 0.02))
    seen = math.exp(-1e-3 / mean)  # the share of exponential stalls above the 1 ms threshold
    assert fit["rate_per_s"] == pytest.approx(rate * seen, rel=0.1)
    assert fit["mean_s"] == pytest.approx(mean + 1e-3, rel=0.1)  # memoryless: threshold + mean
    assert fit["rate_per_s"] * fit["mean_s"] == pytest.approx(rate * mean, rel=0.12)
    assert fit["body_cv"] == pytest.approx(0.02, rel=0.25) and fit["sigma_rel"] < 0.05
    quiet = fit_pauses(_planted_segments(0.0, mean, 0.02))
    assert quiet["rate_per_s"] is None and quiet["pauses"] == 0 and quiet["body_cv"] == pytest.approx(0.02, rel=0.25)
    # step_segments: entry into call i+1 minus exit from call i within each step
    ent = np.array([[0.0, 2.0, 5.0, 10.0, 12.0, 15.0, 20.0, 22.0, 25.0]] * 2)
    ext = ent + 1.0
    last = np.array([False, False, True] * 3)
    assert step_segments(ent, ext, last).tolist() == [[[1.0, 2.0]] * 3] * 2
    assert step_segments(ent[:, :6], ext[:, :6], last[:6]) is None  # fewer than 3 steps


def test_apply_pauses_adds_rate_times_mean_of_stall_time_per_second():
    """Over many segments the stalls add rate x mean x the compute time (Poisson count, exponential
    lengths); rate 0 adds nothing; the same seed gives the same draws, and a rank's draws do not
    depend on how many ranks there are."""
    from sim.frameworks.ops import Compute
    from sim.host.cpu_ranks import apply_pauses

    def ops(world):
        return [Compute(["experts"], np.full((1, world), 4e-3), np.zeros((1, world)), "fwd", i, 0) for i in range(4000)]

    a, b = ops(2), ops(2)
    tail = apply_pauses(a, np.full(2, 0.01), 20.0, 3e-3, seed=11)
    apply_pauses(b, np.full(2, 0.01), 20.0, 3e-3, seed=11)
    added = sum(float(op.durs[:, 0].sum()) for op in a) - 4000 * 4e-3
    assert added == pytest.approx(20.0 * 3e-3 * 4000 * 4e-3, rel=0.06)
    assert all(np.array_equal(x.durs, y.durs) for x, y in zip(a, b, strict=True)) and tail[0] >= 0.01
    c = ops(3)
    apply_pauses(c, np.full(3, 0.01), 20.0, 3e-3, seed=11)
    assert all(np.array_equal(x.durs[:, :2], y.durs[:, :2]) for x, y in zip(a, c, strict=True))
    d = ops(2)
    assert np.array_equal(apply_pauses(d, np.full(2, 0.01), 0.0, 3e-3, seed=11), np.full(2, 0.01))
    assert all(np.all(op.durs == 4e-3) for op in d)
