"""CPU ranks' host effects in the lane engine (:mod:`sim.engine.lanes`), the same calibrated figures
:mod:`sim.host.cpu_ranks` applies to the per-rank engine's schedule, so that tensor-, pipeline- and
context-parallel layouts on CPU ranks see them too:

- **segment noise** (``compute_noise_cv``): every compute segment (one ``Kernels`` op: the kernels
  between two communication calls) of a rank is scaled by its own lognormal draw (mean 1);
- **stalls** (``pause_rate_per_s``, ``pause_mean_s``): a segment of ``d`` s gets ``Poisson(rate d)``
  stalls of exponential length;
- **late wake-ups and the call overhead** (``wake_delay_p``, ``wake_delay_cap_s``,
  ``call_overhead_us``): after each blocking collective (TP / CP collectives, all-to-alls, capacity
  syncs) every rank resumes ``call_overhead_us`` later, and with probability ``p`` one rank of each
  group resumes later still, by ``min(the group's next segment, cap)``: a ``wake_wait`` at the head
  of its next segment.

The ranks then arrive at their next collective at different times, and the early ones wait there:
what a CPU job's per-rank collective spans hold beyond the transfer. Draws come from streams per
global rank (noise, stalls) and one stream for the wake-ups, seeded by the routing seed, so the same
scenario gives the same result. GPU scenarios never build one (:func:`~sim.host.cpu_ranks.applies_to`).
"""

from __future__ import annotations

import numpy as np

from sim.host.cpu_ranks import NOISE_SEED, PAUSE_SEED, WAKE_SEED
from sim.inputs.calibration import Calibration
from sim.inputs.scenario import Scenario


class LaneHost:
    """Host effects of the simulated ranks ``q + r S`` of every stage ``r`` of a lane engine."""

    def __init__(self, s: Scenario, cal: Calibration, q: np.ndarray, stage_size: int, stages: int):
        seed = s.routing.seed
        self.cv = float(cal.compute_noise_cv or 0.0)
        self.sigma = float(np.sqrt(np.log1p(self.cv**2)))
        self.rate, self.mean = float(cal.pause_rate_per_s or 0.0), float(cal.pause_mean_s or 0.0)
        self.p, self.cap = float(cal.wake_delay_p or 0.0), float(cal.wake_delay_cap_s or 0.0)
        self.overhead_s = float(cal.call_overhead_us or 0.0) * 1e-6
        ranks = [q + r * stage_size for r in range(stages)]
        self.noise = [[np.random.default_rng(np.random.SeedSequence(seed + NOISE_SEED, spawn_key=(int(g),)))
                       for g in rs] for rs in ranks]  # fmt: skip
        self.pauses = [[np.random.default_rng(np.random.SeedSequence(seed + PAUSE_SEED, spawn_key=(int(g),)))
                        for g in rs] for rs in ranks]  # fmt: skip
        self.wake = np.random.default_rng(np.random.SeedSequence([seed + WAKE_SEED, 0x57A4E]))
        #: per stage: the overhead every rank resumes late by, and the groups whose late draw is pending
        self.pending: list[tuple[float, np.ndarray | None] | None] = [None] * stages

    def segment(self, r: int, secs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the segment's seconds with noise and stalls, the wake-up delay at its head) per rank."""
        out = np.array(secs, dtype=np.float64)
        for i in range(len(out)):
            d = out[i]
            if d <= 0:
                continue
            if self.cv > 0:
                d = d * self.noise[r][i].lognormal(-0.5 * self.sigma**2, self.sigma)
            if self.rate > 0 and self.mean > 0:
                n = int(self.pauses[r][i].poisson(self.rate * d))
                if n:
                    d = d + float(self.pauses[r][i].gamma(n, self.mean))
            out[i] = d
        delay = np.zeros(len(out))
        pend, self.pending[r] = self.pending[r], None
        if pend is not None:
            overhead, ids = pend
            delay += overhead
            if ids is not None and self.p > 0 and self.cap > 0:
                for g in np.unique(ids):
                    members = np.flatnonzero(ids == g)
                    if len(members) > 1 and self.wake.random() < self.p:
                        late = members[int(self.wake.integers(len(members)))]
                        delay[late] += min(float(out[members].max()), self.cap)
        return out, delay

    def blocking_call(self, r: int, ids: np.ndarray) -> None:
        """A blocking collective over the groups ``ids`` (per rank) has just ended on stage ``r``."""
        self.pending[r] = (self.overhead_s, ids)


__all__ = ["LaneHost"]
