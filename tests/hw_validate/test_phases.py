"""The simulator's spans read as the job's phases (hw_validate/phases.py), checked against
hand-computed values: the slowest rank per phase, barrier waits charged to the all-to-all that
follows, forward and backward names."""

from __future__ import annotations

from hw_validate.phases import predicted_phases
from sim.engine.des import Span


def test_spans_map_to_the_jobs_phase_names():
    sp = [
        Span(0, "compute", "attention", 0.0, 1.0, {"phase": "fwd"}),
        Span(0, "compute", "experts", 1.0, 2.0, {"phase": "fwd"}),
        Span(0, "compute", "imbalance_wait", 2.0, 2.5, {}),
        Span(0, "compute", "combine", 2.5, 3.0, {"phase": "fwd"}),
        Span(0, "compute", "output", 3.0, 3.25, {"phase": "fwd"}),
        Span(0, "compute", "output", 3.25, 3.5, {"phase": "bwd"}),
        Span(0, "compute", "combine", 3.5, 4.0, {"phase": "bwd"}),
        Span(0, "compute", "experts", 4.0, 6.0, {"phase": "bwd"}),
        Span(0, "compute", "dispatch", 6.0, 6.5, {"phase": "bwd"}),
        Span(0, "compute", "attention", 6.5, 8.5, {"phase": "bwd"}),
        Span(0, "comm", "grad_sync", 7.0, 9.0, {}),
        Span(0, "compute", "grad_sync_wait", 8.5, 9.0, {}),
        Span(0, "compute", "optimizer", 9.0, 9.75, {}),
        Span(0, "compute", "param_gather", 9.75, 10.0, {}),
        Span(0, "comm", "param_gather", 9.75, 10.0, {}),
        Span(1, "compute", "attention", 0.0, 1.5, {"phase": "fwd"}),
        Span(1, "compute", "optimizer", 9.0, 10.0, {}),
    ]
    p = predicted_phases(sp, 2)
    assert p["attention"] == 1.5  # the slowest rank's
    assert p["combine"] == 1.0  # 0.5 wait at the barrier + 0.5 transfer
    assert p["combine_bwd"] == 0.5 and p["dispatch_bwd"] == 0.5 and p["dispatch"] == 0.0
    assert p["experts"] == 1.0 and p["experts_bwd"] == 2.0 and p["attention_bwd"] == 2.0
    assert p["forward"] == 3.25 and p["backward"] == 9.0 - 1.5  # rank 1: forward ends at 1.5
    assert p["optimizer"] == 1.0 and p["step"] == 10.0
    assert p["grad_sync"] == 2.0 and p["optimizer_comm"] == 0.25
