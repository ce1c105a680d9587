"""The token dispatcher's cost (DeepSpeed's gate less its GEMM, sparse encode, sparse decode):
priced by the simulator as ``ops x dispatcher_op_us + bytes / dispatcher_bw_GBps`` over the op
counts and bytes of ``sim.frameworks.deepspeed.dispatcher_work``; ``moesim calibrate`` fits the two constants
through that same function. Checked against the closed form on synthetic rows and in the schedule."""

from __future__ import annotations

import numpy as np
import pytest

from hw_validate.calibrate_fit import dispatcher_errors, fit_dispatcher
from sim.api import load_scenario
from sim.engine.simulate import cost_model, simulate
from sim.engine.step import build_step
from sim.frameworks.dispatcher import DISPATCHER_PIECES, GATE_OPS, PERMUTE_OPS, UNPERMUTE_OPS, dispatcher_work
from sim.frameworks.ops import Compute
from sim.inputs.calibration import Calibration, GemmFit
from sim.routing.plan import route_scenario
from tests.conftest import calibrated_scenario

SHAPES = [(256, 128, 4, 2, 160, True), (512, 128, 8, 1, 64, True), (512, 192, 8, 3, 207, False),
          (1024, 128, 16, 2, 256, True)]  # fmt: skip


def _rows(op_s, bw, gemm_s=None):
    rows = []
    for tokens, d, e, k, cap, drop in SHAPES:
        r = {"tokens": tokens, "d": d, "experts": e, "k": k, "capacity": cap, "slots": e * cap,
             "drop_tokens": drop, "bytes_per_element": 4}  # fmt: skip
        for piece in DISPATCHER_PIECES:
            of, bf, ob, bb = dispatcher_work(piece, tokens, d, e, k, e * cap, drop, 4)
            extra = gemm_s(r) if (gemm_s and piece == "gate") else (0.0, 0.0)
            r[f"{piece}_fwd_s"] = of * op_s + bf / bw + extra[0]
            r[f"{piece}_bwd_s"] = ob * op_s + bb / bw + extra[1]
        rows.append(r)
    return rows


def test_dispatcher_work_counts_deepspeeds_ops_and_bytes():
    """Closed forms: encode moves (2S + 2EC) d elements forward, (2S + 3EC) d backward; decode
    (2EC + 5kS + S) d and (3EC + 7kS) d; the gate reads/writes 3 S E fp32 values per op pass."""
    S, d, E, k, slots = 512, 128, 8, 2, 8 * 80
    assert dispatcher_work("encode", S, d, E, k, slots, True, 4) == (
        PERMUTE_OPS[0],
        (2 * S + 2 * slots) * d * 4,
        PERMUTE_OPS[1],
        (2 * S + 3 * slots) * d * 4,
    )
    assert dispatcher_work("decode", S, d, E, k, slots, True, 2) == (
        UNPERMUTE_OPS[0],
        (2 * slots + 5 * k * S + S) * d * 2,
        UNPERMUTE_OPS[1],
        (3 * slots + 7 * k * S) * d * 2,
    )
    assert dispatcher_work("gate", S, d, E, 3, slots, False, 4) == (
        *GATE_OPS[("k", False)][:1],
        3 * S * E * 4,
        GATE_OPS[("k", False)][1],
        3 * S * E * 4,
    )
    with pytest.raises(ValueError, match="unknown dispatcher piece"):
        dispatcher_work("scatter", S, d, E, k, slots, True, 4)


def test_fit_recovers_op_cost_and_bandwidth_exactly():
    """Rows made by the model itself (25 us per op, 4 GB/s): the fit returns both, every row's
    fitted time equals its measured time."""
    rows = _rows(25e-6, 4e9)
    op_s, bps = fit_dispatcher(rows, None, 30e9, 10e-6)
    assert op_s == pytest.approx(25e-6, rel=1e-6) and bps == pytest.approx(4e9, rel=1e-6)
    assert np.abs(dispatcher_errors(rows)).max() < 1e-6
    assert rows[0]["work"]["encode"]["fwd_ops"] == PERMUTE_OPS[0]


def test_fit_takes_the_router_gemm_off_the_gate():
    """The gate's timings include its router GEMM [S, d] @ [d, E] (backward: two GEMMs), priced by
    the fitted GEMM model at launch 0 and unbounded memory: the fit still recovers the constants."""
    g = GemmFit(peak_TFLOPs=0.1, m_half=0.0, nk_half=0.0)

    def gemm_s(r):
        fl = 2.0 * r["tokens"] * r["d"] * r["experts"] / 0.1e12
        return fl, 2 * fl

    rows = _rows(20e-6, 6e9, gemm_s)
    op_s, bps = fit_dispatcher(rows, g, float("inf"), 0.0)
    assert op_s == pytest.approx(20e-6, rel=1e-6) and bps == pytest.approx(6e9, rel=1e-6)


def test_fit_bounds_op_cost_by_a_launch_and_bandwidth_by_streaming():
    """Rows cheaper than the bounds allow (1 us per op, 100 GB/s) are fitted at the bounds: an op
    costs at least a launch (10 us), a gather moves at most the streaming bandwidth (30 GB/s)."""
    op_s, bps = fit_dispatcher(_rows(1e-6, 100e9), None, 30e9, 10e-6)
    assert op_s == pytest.approx(10e-6, rel=1e-9) and bps == pytest.approx(30e9, rel=1e-9)
    assert fit_dispatcher([], None, 30e9, 10e-6) is None


def _scenario(tmp_path, cal, name):
    return load_scenario(calibrated_scenario(cal, tmp_path, name))


def _durations(s):
    sched = build_step(s, route_scenario(s), cost_model(s), np.ones(s.world_size))
    out: dict = {}
    for op in sched.ops:
        if isinstance(op, Compute):
            for name, dur in zip(op.names, op.durs, strict=True):
                out.setdefault((name, op.phase), []).append(dur)
    return out


def test_schedule_prices_permute_and_unpermute_by_calibrated_op_cost(tmp_path):
    """Launch 0, unbounded bandwidths, 100 us per dispatcher op: permute costs exactly
    PERMUTE_OPS x 100 us forward and backward, unpermute UNPERMUTE_OPS x 100 us, and the gate adds
    GATE_OPS x 100 us to the route; without the dispatcher fields nothing but the launch is paid."""
    base = dict(kernel_launch_us=0.0, hbm_bw_GBps=1e9)
    plain = _durations(_scenario(tmp_path, Calibration(**base), "plain"))
    cal = _durations(
        _scenario(tmp_path, Calibration(**base, dispatcher_op_us=100.0, dispatcher_bw_GBps=1e9), "cal")
    )
    for name, (f, b) in (("permute", PERMUTE_OPS), ("unpermute", UNPERMUTE_OPS)):
        for phase, ops in (("fwd", f), ("bwd", b)):
            for dur in cal[(name, phase)]:
                assert dur == pytest.approx(np.full(2, ops * 100e-6), rel=1e-6)
            for dur in plain[(name, phase)]:
                assert dur == pytest.approx(np.zeros(2), abs=1e-9)
    gf, gb = GATE_OPS[(2, True)]
    for phase, ops in (("fwd", gf), ("bwd", gb)):
        for c, p in zip(cal[("route", phase)], plain[("route", phase)], strict=True):
            assert c - p == pytest.approx(np.full(2, ops * 100e-6), rel=1e-6)


def test_uncalibrated_dispatcher_is_launch_plus_streaming(tmp_path):
    """No dispatcher fields: the dispatcher costs what it did before they existed (one launch per
    op, bytes at the memory bandwidth); with them set to exactly those values, the step is the same."""
    cal = Calibration(kernel_launch_us=12.0, hbm_bw_GBps=20.0)
    same = Calibration(
        kernel_launch_us=12.0, hbm_bw_GBps=20.0, dispatcher_op_us=12.0, dispatcher_bw_GBps=20.0
    )
    a = simulate(_scenario(tmp_path, cal, "a"))
    b = simulate(_scenario(tmp_path, same, "b"))
    assert a["step_time_s"] == b["step_time_s"]
    slow = simulate(_scenario(tmp_path, Calibration(kernel_launch_us=12.0, hbm_bw_GBps=20.0,
                                                    dispatcher_op_us=50.0), "slow"))  # fmt: skip
    assert slow["step_time_s"] > a["step_time_s"]


def test_fit_grad_hooks_recovers_slope_and_overhead():
    """Rows made by t = 4 ms + 9 ns x P: the fit returns both and every row's fitted time."""
    from hw_validate.calibrate_fit import fit_grad_hooks

    rows = [{"model_params": p, "grad_hooks_s": 4e-3 + 9e-9 * p} for p in (2e5, 8e5, 3.2e6)]
    slope, c = fit_grad_hooks(rows)
    assert slope == pytest.approx(9e-9, rel=1e-6) and c == pytest.approx(4e-3, rel=1e-6)
    assert rows[1]["fit_grad_hooks_s"] == pytest.approx(4e-3 + 9e-9 * 8e5, rel=1e-9)
    assert fit_grad_hooks([{"params": 10, "time_s": 1.0}]) is None  # torch-Adam rows: no hooks timed


def _hook_ops(tmp_path, name, stage, **cal):
    s = load_scenario(
        calibrated_scenario(Calibration(**cal), tmp_path, name, edit=lambda d: d["parallelism"].update(zero_stage=stage))
    )
    sched = build_step(s, route_scenario(s), cost_model(s), np.ones(s.world_size))
    return s, sched, [op for op in sched.ops if isinstance(op, Compute) and op.names == ["grad_hooks"]]


def test_zero2_backward_pays_calibrated_gradient_hooks_per_parameter(tmp_path):
    """ZeRO-2 with zero_grad_hook_* calibrated: one grad_hooks op before every GradReady, each
    costing ns x the parameters it hands over (the sum over the step: ns x the rank's parameters),
    and the fixed overhead once, as the backward's epilogue (``zero_epilogue``) right after the
    flushing GradReady, where DeepSpeed copies the reduced gradients into the rank's partition.
    Uncalibrated or ZeRO-0/3: no such op."""
    from sim.frameworks.ops import GradReady

    s, sched, hooks = _hook_ops(
        tmp_path, "z2", 2, zero_grad_hook_ns_per_param=10.0, zero_grad_hook_overhead_us=500.0
    )
    ready = [op for op in sched.ops if isinstance(op, GradReady)]
    assert len(hooks) == len(ready) > 2
    params = sum(op.nonexpert + op.expert for op in ready)
    total = sum(float(op.durs[0, 0]) for op in hooks)
    assert total == pytest.approx(params * 10e-9, rel=1e-9)
    for i, op in enumerate(sched.ops):
        if isinstance(op, Compute) and op.names == ["grad_hooks"]:
            nxt = sched.ops[i + 1]
            assert isinstance(nxt, GradReady)
            assert float(op.durs[0, 1]) == pytest.approx((nxt.nonexpert + nxt.expert) * 10e-9, rel=1e-9)
    epi = [i for i, op in enumerate(sched.ops) if isinstance(op, Compute) and op.names == ["zero_epilogue"]]
    flush = [i for i, op in enumerate(sched.ops) if isinstance(op, GradReady) and op.flush]
    assert epi == [i + 1 for i in flush] and len(epi) == s.training.grad_accum_steps
    assert float(sched.ops[epi[0]].durs[0, 0]) == pytest.approx(500e-6, rel=1e-9)
    for stage in (0, 3):
        assert _hook_ops(tmp_path, f"z{stage}", stage, zero_grad_hook_ns_per_param=10.0)[2] == []
    assert _hook_ops(tmp_path, "none", 2)[2] == []
