"""Folding: follow the lanes that can set the pace with the DES, account for all of them.

The lanes of a stage do identical work up to routing randomness, stragglers and faulty links
(:attr:`sim.inputs.layout.Layout.lanes`). The default fidelity:

1. **estimate pass**: every lane at once, all-to-alls by the estimate of
   :mod:`sim.engine.a2a_timing` (no SimPy cost per group), recording every lane's arrival at every
   data-parallel rendezvous;
2. **selection**: the ``PACE_LANES`` lanes that end last in the estimate (the slowest critical paths;
   a degraded or failed link slows the estimate of the lanes whose paths cross it), every lane holding
   a straggler, and ``RANDOM_LANES`` others drawn with the routing seed;
3. **DES pass**: the selected lanes with the exact all-to-all model; at each data-parallel rendezvous
   the others arrive when the estimate says, shifted by the median amount the simulated lanes moved
   between the two passes at that rendezvous (:class:`VirtualLanes`).

Results: the step ends at the last of the simulated lanes (the others' shifted estimates are checked
and reported, ``folded.unsimulated_margin_s``); per-rank means combine the lanes exactly where
simulated, and for the others their estimate corrected by the random sample's mean difference
between the passes (a control variate). With every lane selected this is the full simulation.
``fidelity: full`` simulates every lane with the exact model; ``estimate`` runs the estimate pass
alone (every lane, all-to-alls by their link-load bound): a ranking for searches such as ``moesim plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.engine.lanes import KEYS, LaneEngine, LaneResult

#: Lanes followed by the DES: the slowest by the estimate, and a random sample of the rest.
PACE_LANES = 4
RANDOM_LANES = 12


class VirtualLanes:
    """Arrivals of the lanes a DES run does not simulate, from the estimate pass."""

    def __init__(self, record: dict, simulated: np.ndarray, total: int):
        self.record = record
        self.sim = np.asarray(simulated)
        self.rest = np.setdiff1d(np.arange(total), self.sim)
        self.margin = -np.inf  # how close an unsimulated lane came to setting a launch (s; < 0: never)

    def others(self, key: tuple, per_lane_des: np.ndarray) -> np.ndarray:
        """Per group, the latest arrival among the unsimulated lanes at rendezvous ``key``."""
        est = self.record.get(key)
        if est is None or not len(self.rest):
            return np.full(per_lane_des.shape[1], -np.inf)
        shift = float(np.median(per_lane_des - est[self.sim]))
        mine = est[self.rest].max(axis=0) + shift
        self.margin = max(self.margin, float((mine - per_lane_des.max(axis=0)).max()))
        return mine


@dataclass
class Folded:
    result: LaneResult  # the DES run (selected lanes)
    estimate: LaneResult | None  # the estimate pass (every lane), None at full fidelity
    lanes_total: int
    selected: np.ndarray
    margin_s: float


def select_lanes(est: LaneResult, s, total: int) -> np.ndarray:
    """The pace-setting lanes of the estimate (a faulty link slows its lanes' estimate), the lanes
    holding a straggler, and a seeded random few."""
    end = est.end_s.max(axis=0).reshape(total, -1).max(axis=1)  # per lane, its last rank's end
    order = np.argsort(-end, kind="stable")
    chosen = list(order[:PACE_LANES])
    L = s.layout.lane_size
    chosen += [(x.rank % s.layout.stage_size) // L for x in s.faults.stragglers]
    rest = np.setdiff1d(np.arange(total), chosen)
    if len(rest):
        rng = np.random.default_rng([s.routing.seed, 0xF01D])
        chosen += list(rng.choice(rest, size=min(RANDOM_LANES, len(rest)), replace=False))
    return np.unique(np.asarray(chosen, dtype=np.int64))


def run_folded(s, program, plan, cluster, pricer, fidelity: str, trace_ranks=None, jitter=None,
               window=None) -> Folded:  # fmt: skip
    """``window``: the steady-state micro-batch window (:mod:`sim.engine.window`) of both passes;
    ``program`` is then the shortened step."""
    total = s.layout.lanes
    everything = np.arange(total)
    if fidelity == "estimate":  # the estimate pass alone: every lane, no processor-sharing all-to-alls
        res = LaneEngine(s, program, plan, cluster, pricer, everything, exact=False, trace_ranks=trace_ranks,
                         window=window).run()  # fmt: skip
        return Folded(res, None, total, everything, -np.inf)
    if fidelity == "full" or total <= PACE_LANES + RANDOM_LANES:
        res = LaneEngine(s, program, plan, cluster, pricer, everything, exact=True, trace_ranks=trace_ranks,
                         jitter=jitter, window=window).run()  # fmt: skip
        return Folded(res, None, total, everything, -np.inf)
    est = LaneEngine(s, program, plan, cluster, pricer, everything, exact=False, record=True, window=window).run()
    chosen = select_lanes(est, s, total)
    virtual = VirtualLanes(est.record, chosen, total)
    res = LaneEngine(s, program, plan, cluster, pricer, chosen, exact=True, virtual=virtual,
                     trace_ranks=trace_ranks, jitter=jitter, window=window).run()  # fmt: skip
    return Folded(res, est, total, chosen, virtual.margin)


def lane_means(f: Folded, values: str) -> dict[str, float]:
    """Mean over every rank of every stage of each :data:`KEYS` category (and grad_sync)."""
    res, est = f.result, f.estimate
    out = {}
    L = len(res.positions) // max(len(f.selected), 1)
    for k in (*KEYS, "grad_sync"):
        des = res.grad_sync_s if k == "grad_sync" else res.by_key[k]  # (pp, n)
        if est is None:
            out[k] = float(des.mean())
            continue
        e = est.grad_sync_s if k == "grad_sync" else est.by_key[k]
        per_lane_e = e.reshape(e.shape[0], f.lanes_total, -1).mean(axis=(0, 2))
        per_lane_d = des.reshape(des.shape[0], len(f.selected), L).mean(axis=(0, 2))
        diff = float(np.mean(per_lane_d - per_lane_e[f.selected]))  # every simulated lane: less variance
        others = np.setdiff1d(np.arange(f.lanes_total), f.selected)
        total = per_lane_d.sum() + (per_lane_e[others] + diff).sum()
        out[k] = float(total / f.lanes_total)
    return out


__all__ = ["PACE_LANES", "RANDOM_LANES", "Folded", "VirtualLanes", "lane_means", "run_folded", "select_lanes"]
