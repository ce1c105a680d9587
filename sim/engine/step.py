"""The schedule of one step as the engine runs it: the framework's ops, then the host's effects.

:func:`build_step` asks the scenario's training framework for its ops
(:func:`sim.frameworks.deepspeed.build_schedule`), and on CPU ranks applies the calibrated host
effects (:func:`sim.host.cpu_ranks.apply_host_effects`). GPU scenarios run the framework's ops as built.
"""

from __future__ import annotations

import numpy as np

from sim.frameworks.deepspeed import build_schedule
from sim.frameworks.ops import Schedule
from sim.hardware.costs import CostModel
from sim.host.cpu_ranks import applies_to, apply_host_effects
from sim.inputs.scenario import Scenario
from sim.routing.plan import RoutingPlan


def build_step(
    s: Scenario, plan: RoutingPlan | None, cost: CostModel, compute_factor: np.ndarray, jitter=None, draw: int = 0
) -> Schedule:
    """The ops of one step of ``s``: ``compute_factor`` (world,) slows every kernel of a rank
    (stragglers), ``jitter(rank, n)`` draws per-kernel noise factors (faults); ``draw`` picks an
    independent draw of a CPU host's calibrated noise (default 0)."""
    sched = build_schedule(s, plan, cost, compute_factor, jitter)
    if applies_to(s, cost.calibration):
        apply_host_effects(sched, s, cost.calibration, draw)
    return sched


__all__ = ["build_step"]
