"""The compact routing plan (sim/routing/counts.py): per (layer, micro-batch, rank) arrays sized world x ep,
written while the routing is drawn, equal to sums of the E-wide counts on every builder; the E-wide
counts dropped above the limit; the engines' plan methods the same either way."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import SCENARIOS
from test_routing import _write_trace, scen

import sim.routing.counts as counts_module
from sim.api import load_scenario
from sim.engine.simulate import simulate
from sim.ioutil import dumps_json
from sim.reports.routing_plot import mean_dispatch_MB
from sim.routing.counts import CountsWriter
from sim.routing.plan import RoutingPlan, route_scenario
from sim.routing.policy import ExpertLayout
from sim.routing.pool import prefetched_noise
from sim.routing.threads import _openblas, single_blas_thread
from sim.routing.tokens import FeatureColumns

BIG = SCENARIOS / "128gpu.yaml"
SMALL_128 = ["cluster.nodes=4", "model.num_layers=3", "training.grad_accum_steps=2", "training.seq_len=1024"]


def _cases(tmp_path):
    """(label, scenario, method) on every builder, dropless and capacity-padded."""
    base = dict(nodes=4, gpn=2, ep=4, generator="skewed", skew=0.7)
    trace_path, _ = _write_trace(tmp_path, None)
    trace = dict(nodes=1, gpn=2, ep=2, experts=4, k=2, mbs=4, seq=64, accum=1)
    return [
        ("exact dropless", scen(**base), "exact"),
        ("exact capped padded", scen(**base, capacity_factor=1.0, dispatch="capacity_padded"), "exact"),
        ("exact padded without drops", scen(**base, dispatch="capacity_padded"), "exact"),
        ("pooled dropless", scen(**base, policy="node_limited:M=1"), "pooled"),
        ("pooled capped dropless", scen(**base, capacity_factor=1.0), "pooled"),
        ("pooled capped padded", scen(**base, capacity_factor=1.0, dispatch="capacity_padded"), "pooled"),
        ("pooled padded without drops", scen(**base, dispatch="capacity_padded"), "pooled"),
        ("pooled sequence types", scen(**base, sequence_correlation=0.3, capacity_factor=1.0), "pooled"),
        ("pooled one sequence per rank", scen(**base, mbs=1, seq=128, sequence_correlation=0.3), "pooled"),
        ("trace replay", scen(**trace, generator="trace", trace=str(trace_path)), "auto"),
        ("trace replay padded", scen(**trace, generator="trace", trace=str(trace_path), dispatch="capacity_padded"), "auto"),
        ("balanced", load_scenario(BIG, [*SMALL_128, "routing.generator=balanced"]), "auto"),
        ("balanced device-limited",
         load_scenario(BIG, [*SMALL_128, "routing.generator=balanced", "routing.policy=device_limited:M=2"]), "auto"),
        ("128gpu pooled", load_scenario(BIG, SMALL_128), "pooled"),
    ]  # fmt: skip


def _compact_plan(monkeypatch, s, method: str) -> RoutingPlan:
    """``s`` routed as above the limit: the compact arrays written as the layers are drawn."""
    with monkeypatch.context() as m:
        m.setattr(counts_module, "WIDE_LIMIT", 0)
        return route_scenario(s, method=method)


def test_compact_arrays_are_sums_of_the_wide_counts(tmp_path, monkeypatch):
    for label, s, method in _cases(tmp_path):
        wide, small = route_scenario(s, method=method), _compact_plan(monkeypatch, s, method)
        lay = wide.layout
        ep, epr, g = lay.ep, lay.experts_per_rank, lay.num_ep_groups
        kept, assigned = wide.kept.astype(np.int64), wide.assigned.astype(np.int64)
        lead = kept.shape[:2]
        a = small.arrays
        assert a.assigned is None and a.kept is None and wide.arrays.pair_copies is None, label
        per_peer = kept.reshape(*lead, lay.world, ep, epr).sum(axis=-1)
        np.testing.assert_array_equal(a.pair_copies, per_peer, err_msg=label)
        per_expert = kept.reshape(*lead, g, ep, lay.num_experts).sum(axis=3).reshape(*lead, lay.world, epr)
        np.testing.assert_array_equal(a.expert_rows, per_expert, err_msg=label)
        np.testing.assert_array_equal(a.rank_tokens, wide.arrays.rank_tokens, err_msg=label)
        np.testing.assert_array_equal(a.node_tokens, wide.arrays.node_tokens, err_msg=label)
        if a.group_max is not None:
            np.testing.assert_array_equal(
                a.group_max, assigned.reshape(*lead, g, -1).max(axis=-1), err_msg=label
            )
        assert (wide.padded is None) == (small.padded is None), label
        if wide.padded is not None:
            np.testing.assert_array_equal(wide.padded, small.padded, err_msg=label)
        for layer in range(wide.num_moe_layers):
            for micro in range(wide.micro_batches):
                np.testing.assert_array_equal(
                    wide.pair_copies(layer, micro), per_peer[layer, micro], err_msg=label
                )
                np.testing.assert_array_equal(
                    small.pair_copies(layer, micro, np.arange(2)), per_peer[layer, micro, :2]
                )
                np.testing.assert_array_equal(wide.expert_load(layer, micro), small.expert_load(layer, micro))
                np.testing.assert_array_equal(
                    wide.dispatch_tokens(layer, micro), small.dispatch_tokens(layer, micro)
                )
        assert dumps_json(wide.summary()) == dumps_json(small.summary()), label
        for key, value in wide.layer_stats().items():
            np.testing.assert_array_equal(value, small.layer_stats()[key], err_msg=f"{label}: {key}")
        assert wide.a2a_bytes() == small.a2a_bytes(), label


def test_statistics_equal_the_sums_over_the_wide_arrays():
    """layer_stats from the per-layer sums equal the same statistics computed over the whole arrays."""
    s = scen(nodes=4, gpn=2, ep=8, generator="skewed", skew=0.7, capacity_factor=1.0)
    plan = route_scenario(s, method="exact")
    lay = plan.layout
    kept = plan.kept.astype(np.int64)
    copies = kept.reshape(*kept.shape[:3], lay.ep, lay.experts_per_rank).sum(axis=-1)
    ranks = np.arange(lay.world)
    local = np.arange(lay.ep)[None, :] == (ranks % lay.ep)[:, None]
    total = copies.sum(axis=(1, 2, 3))
    recv = kept.reshape(*kept.shape[:2], lay.num_ep_groups, lay.ep, -1).sum(axis=3)  # (L, M, groups, E)
    load = recv.reshape(*kept.shape[:2], lay.world, -1).sum(axis=-1)
    st = plan.layer_stats()
    np.testing.assert_allclose(st["local_fraction"], (copies * local).sum(axis=(1, 2, 3)) / total, rtol=1e-15)
    np.testing.assert_allclose(
        st["max_over_mean_load"], (load.max(axis=-1) / load.mean(axis=-1)).mean(axis=1)
    )
    assert (st["assigned_copies"] == plan.assigned.sum(axis=(1, 2, 3))).all()
    assert (st["kept_copies"] == total).all()


def test_wide_counts_are_not_kept_above_the_limit(monkeypatch):
    s = scen(generator="skewed", skew=0.5)
    plan = route_scenario(s)
    size = plan.kept.size  # layers x micro x world x E
    monkeypatch.setattr(counts_module, "WIDE_LIMIT", size)
    assert route_scenario(s).arrays.kept is not None
    monkeypatch.setattr(counts_module, "WIDE_LIMIT", size - 1)
    over = route_scenario(s)
    assert over.arrays.kept is None and over.arrays.assigned is None
    with pytest.raises(ValueError, match="pair_copies"):
        _ = over.kept
    np.testing.assert_array_equal(over.pair_copies(1, 1), plan.pair_copies(1, 1))


def test_8192_gpus_decide_compact_without_touching_wide_arrays():
    """128gpu's layout at 1,024 nodes: the writer keeps world x ep arrays only (E-wide would be 1.6 GB)."""
    lay = ExpertLayout(world=8192, ep=16, num_experts=128, gpus_per_node=8)
    writer = CountsWriter(lay, FeatureColumns.of(lay), layers=48, micro=8, capped=True)
    assert not writer.wide and writer.assigned is None and writer.kept is None
    assert writer.pair_copies.shape == (48, 8, 8192, 16) and writer.expert_rows.shape == (48, 8, 8192, 8)
    nbytes = sum(
        x.nbytes for x in (writer.pair_copies, writer.expert_rows, writer.rank_tokens, writer.node_tokens)
    )
    assert nbytes < 0.6e9


def test_replaced_wide_counts_give_their_own_compact_arrays():
    """A plan whose E-wide counts are replaced (as tests that reshape loads do) answers from them."""
    plan = route_scenario(scen(generator="skewed", skew=0.5), method="exact")
    kept = plan.arrays.kept.copy()
    kept[0, 0, 0] = 0
    kept[0, 0, 0, 0] = plan.tokens_per_rank * plan.top_k
    changed = dataclasses.replace(plan, arrays=dataclasses.replace(plan.arrays, assigned=kept, kept=kept))
    assert changed.pair_copies(0, 0)[0, 0] == plan.tokens_per_rank * plan.top_k
    assert changed.pair_copies(0, 0)[0, 1:].sum() == 0
    assert plan.pair_copies(0, 0)[0, 1:].sum() > 0


def test_lane_engine_uses_the_compact_plan(monkeypatch):
    """Neither world x world matrices nor E-wide counts in the lane engine: the same step with them
    forbidden, dropless and padded."""
    for extra in ([], ["routing.capacity_factor=1.25", "routing.dispatch=capacity_padded"]):
        s = load_scenario(BIG, [*SMALL_128, *extra])
        expected = simulate(s)
        with monkeypatch.context() as m:
            m.setattr(counts_module, "WIDE_LIMIT", 0)
            plan = route_scenario(s)
            for name in ("dispatch_bytes", "dispatch_tokens", "dispatch_rank_tokens", "dispatch_node_tokens"):
                m.setattr(RoutingPlan, name, lambda *a, _n=name, **k: pytest.fail(f"lane engine called {_n}"))
            got = simulate(s, plan=plan)
        assert got["step_time_s"] == expected["step_time_s"]
        assert got["traffic"] == expected["traffic"]


def test_heatmap_from_group_blocks_equals_the_dispatch_matrices():
    for extra in ({}, {"capacity_factor": 1.0, "dispatch": "capacity_padded"}):
        plan = route_scenario(scen(nodes=4, gpn=2, ep=4, generator="skewed", skew=0.5, **extra))
        total = sum(
            plan.dispatch_bytes(layer, micro, plan.hidden_size, plan.bytes_per_elem)
            for layer in range(plan.num_moe_layers)
            for micro in range(plan.micro_batches)
        )
        full = total / (plan.num_moe_layers * plan.micro_batches) / 1e6
        np.testing.assert_allclose(mean_dispatch_MB(plan), full, rtol=1e-12)
        np.testing.assert_allclose(
            mean_dispatch_MB(plan, ranks=5), full[:4, :4], rtol=1e-12
        )  # whole EP groups


def test_prefetched_noise_is_the_sequential_stream():
    shape = (37, 11)
    expected = np.random.default_rng([3, 13])
    draws = [x.copy() for x in prefetched_noise(np.random.default_rng([3, 13]), shape, 5)]
    assert len(draws) == 5
    for got in draws:
        np.testing.assert_array_equal(got, expected.standard_normal(shape, dtype=np.float32))
    assert list(prefetched_noise(expected, shape, 0)) == []


def test_single_blas_thread_restores_the_thread_count():
    before = [get() for get, _ in _openblas()]
    with single_blas_thread():
        assert all(get() == 1 for get, _ in _openblas())
    assert [get() for get, _ in _openblas()] == before
