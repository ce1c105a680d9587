"""Late wake-ups of CPU ranks after blocking collectives (``wake_delay_p``, ``wake_delay_cap_s``):
fitted from the microbenchmark's exit spreads against the model's closed form, inserted by the
schedule as a ``wake_wait`` kernel at the head of one rank's next segment, propagated by the
engines through the next rendezvous, and charged by ``moesim validate`` to the call it follows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hw_validate.calibrate_fit import fit_wake
from hw_validate.validate import predicted_phases
from sim.api import load_scenario
from sim.engine.simulate import cost_model, simulate
from sim.engine.spans import Span
from sim.engine.step import build_step
from sim.frameworks.ops import AllToAll, CapacitySync, Compute, Tail
from sim.host.cpu_ranks import WAKE_KERNEL, apply_wake_delay
from sim.inputs.calibration import Calibration
from sim.routing.plan import route_scenario
from tests.conftest import calibrated_scenario


def _rows(p: float, cap: float, base: float = 1e-4) -> list[dict]:
    """Exit spreads as the model makes them: 100 calls a segment, p of them late by min(seg, cap)."""
    out = []
    for seg in (0.0, 0.001, 0.002, 0.004, 0.008):
        late = round(100 * p) if seg > 0 else 0
        out.append({"segment_s": seg, "exit_spread_s": [base + min(seg, cap)] * late + [base] * (100 - late)})
    return out


def test_fit_wake_recovers_the_model():
    rows = _rows(0.3, 0.003)
    p, cap = fit_wake(rows)
    assert p == pytest.approx(0.3, rel=0.02)
    assert cap == pytest.approx(0.003, rel=0.05)  # the grid's step is ~6%
    assert rows[0]["mean_spread_s"] == pytest.approx(1e-4)
    assert rows[-1]["fit_spread_s"] == pytest.approx(1e-4 + p * cap)
    # a cap beyond every measured segment: the delay is the whole segment
    p2, cap2 = fit_wake(_rows(0.5, 1.0))
    assert p2 == pytest.approx(0.5, rel=0.02) and cap2 >= 0.008 * 0.999
    assert fit_wake([]) is None
    assert fit_wake(_rows(0.3, 0.003)[:2]) is None  # one non-zero segment: p and cap not separable


def _ops(world: int = 2):
    def comp(d):
        return Compute(["k"], np.full((1, world), d), np.zeros((1, world)), "fwd", 0, 0)

    a2a = AllToAll("dispatch", "dispatch", 0, 0, 0, "fwd")
    return [comp(0.005), a2a, comp(0.004), CapacitySync(0, 0, 0, "fwd"), comp(0.0005), a2a, comp(0.002)]


def _tail(world: int = 2) -> Tail:
    return Tail(optimizer_s=np.full(world, 0.003), offload_bytes=0.0, cpu_adam_s=0.0, gather_nonexpert=10,
                gather_expert=0, norm_reduce=True)  # fmt: skip


def test_apply_wake_delay_closed_form_and_deterministic():
    ops, tail = _ops(), _tail()
    apply_wake_delay(ops, tail, 1.0, 0.001, 7, [[0, 1]])
    heads = [op for op in ops if isinstance(op, Compute) and op.names[0] == WAKE_KERNEL]
    assert len(heads) == 3  # after each blocking call; not the first segment
    assert ops[0].names == ["k"]
    # min(next segment, cap) on exactly one rank of the group
    assert [sorted(op.durs[0].tolist()) for op in heads] == [[0.0, 0.001], [0.0, 0.0005], [0.0, 0.001]]
    assert sorted(tail.wake_norm_s.tolist()) == [0.0, 0.001] and sorted(tail.wake_gather_s.tolist()) == [0.0, 0.001]
    again_ops, again_tail = _ops(), _tail()
    apply_wake_delay(again_ops, again_tail, 1.0, 0.001, 7, [[0, 1]])
    assert [op.durs.tolist() for op in again_ops if isinstance(op, Compute)] == [
        op.durs.tolist() for op in ops if isinstance(op, Compute)
    ]
    none_ops, none_tail = _ops(), _tail()
    apply_wake_delay(none_ops, none_tail, 0.0, 0.001, 7, [[0, 1]])
    assert all(op.names == ["k"] for op in none_ops if isinstance(op, Compute))
    assert none_tail.wake_norm_s is None and none_tail.wake_gather_s is None
    # one-rank groups never wait for a peer
    solo, solo_tail = _ops(1), _tail(1)
    apply_wake_delay(solo, solo_tail, 1.0, 0.001, 7, [[0]])
    assert all(op.names == ["k"] for op in solo if isinstance(op, Compute)) and solo_tail.wake_norm_s is None


def test_p_hits_the_expected_fraction_of_calls():
    world, n = 2, 4000
    ops = []
    for _ in range(n):
        ops += [AllToAll("dispatch", "dispatch", 0, 0, 0, "fwd"),
                Compute(["k"], np.full((1, world), 0.01), np.zeros((1, world)), "fwd", 0, 0)]  # fmt: skip
    apply_wake_delay(ops, _tail(), 0.25, 0.002, 11, [[0, 1]])
    hits = sum(1 for op in ops if isinstance(op, Compute) and op.names[0] == WAKE_KERNEL)
    assert hits / n == pytest.approx(0.25, abs=0.02)  # 4000 draws: std 0.007


def _scenario(tmp_path, p, cap, name):
    return load_scenario(calibrated_scenario(Calibration(wake_delay_p=p, wake_delay_cap_s=cap), tmp_path, name))


def test_engine_step_grows_by_one_cap_per_late_wakeup(tmp_path):
    """2 identical ranks (no noise, uniform routing: no waits): each late wake-up holds one rank
    ``cap`` behind, the other waits for it at the next rendezvous, so the step grows by exactly
    ``cap`` per inserted ``wake_wait`` (cap shorter than every following segment) and per late tail call."""
    cap = 2e-6
    clean = _scenario(tmp_path, 0.0, cap, "clean")
    late = _scenario(tmp_path, 1.0, cap, "late")
    base = simulate(clean)
    assert base["breakdown_s"]["imbalance_wait"] == 0.0
    sched = build_step(late, route_scenario(late), cost_model(late), np.ones(late.world_size))
    inserted = [op for op in sched.ops if isinstance(op, Compute) and op.names[0] == WAKE_KERNEL]
    assert inserted and all(float(op.durs[0].max()) == cap for op in inserted)
    n = len(inserted) + (sched.tail.wake_norm_s is not None) + (sched.tail.wake_gather_s is not None)
    runs = [simulate(_scenario(tmp_path, 1.0, cap, f"late{i}")) for i in range(2)]
    assert json.dumps(runs[0]) == json.dumps(runs[1])  # deterministic
    assert runs[0]["step_time_s"] - base["step_time_s"] == pytest.approx(n * cap, rel=1e-6)
    # waiting, not compute
    assert runs[0]["breakdown_s"]["compute"] == pytest.approx(base["breakdown_s"]["compute"], rel=1e-12)


def test_validate_charges_the_wakeup_to_the_call_it_follows():
    def sp(name, start, end, stream="compute", **args):
        return Span(0, stream, name, start, end, args)

    spans = [sp("attention", 0.0, 1.0, phase="fwd"), sp("dispatch", 1.0, 1.5, phase="fwd"),
             sp(WAKE_KERNEL, 1.5, 1.8, phase="fwd"), sp("experts", 1.8, 2.0, phase="fwd"),
             sp("combine", 2.0, 2.1, phase="bwd"), sp(WAKE_KERNEL, 2.1, 2.2, phase="bwd"),
             sp("grad_norm_wait", 3.0, 3.1), sp(WAKE_KERNEL, 3.1, 3.4), sp("optimizer", 3.4, 4.0)]  # fmt: skip
    p = predicted_phases(spans, 1)
    assert p["dispatch"] == pytest.approx(0.8)
    assert p["combine_bwd"] == pytest.approx(0.2)
    assert p["optimizer_comm"] == pytest.approx(0.3)
    assert p["experts"] == pytest.approx(0.2)
