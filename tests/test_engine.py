"""The step simulator: exact small timelines, and the effects the issue names, checked by value."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import yaml
from conftest import ROOT, run_cli

from sim.api import load_scenario
from sim.engine.des import STREAM_KEYS
from sim.engine.simulate import cost_model, simulate
from sim.engine.step import build_step
from sim.frameworks.ops import AllToAll, Compute
from sim.hardware.faults import cluster_for
from sim.ioutil import dumps_json
from sim.model.dtypes import ceil_div
from sim.model.memory import memory_per_gpu
from sim.model.params import count_params, layer_params, layer_tensors, outer_tensors
from sim.network.closed_form import ps_flow_times_s
from sim.network.collectives import all_to_all_dag
from sim.network.comm import Comm, reduction_model
from sim.routing.plan import route_scenario

BASE = ROOT / "scenarios" / "cpu-2rank.yaml"
BIG = ROOT / "scenarios" / "128gpu.yaml"
SMALL_128 = ["model.num_layers=2", "training.grad_accum_steps=1", "training.seq_len=1024"]


def tiny(*overrides: str):
    return load_scenario(BASE, list(overrides))


def multi_node(nodes: int = 4, *extra: str):
    """128gpu's model, shrunk, on ``nodes`` DGX-H100 nodes with EP across all of them."""
    return load_scenario(BIG, [*SMALL_128, f"cluster.nodes={nodes}", f"parallelism.ep={8 * nodes}", *extra])


def test_two_rank_timeline_is_the_schedule_exactly():
    s = tiny("model.num_layers=1", "routing.capacity_factor=null", "routing.dispatch=dropless")
    r = simulate(s, comm_model="flow", trace_ranks={0, 1})
    spans = [sp for sp in r["_spans"] if sp.rank == 0 and sp.stream == "compute"]
    names = [sp.name for sp in spans]
    fwd = ["embedding", "attention", "route", "permute", "dispatch", "experts", "combine", "unpermute", "output"]
    bwd = ["output", "unpermute", "combine", "experts", "dispatch", "permute", "route", "attention", "embedding"]
    no_wait = [n for n in names if n not in ("imbalance_wait", "grad_sync_wait")]
    assert no_wait[: len(fwd) + len(bwd)] == fwd + bwd
    # ZeRO-2 as DeepSpeed steps: per parameter group (non-expert, experts) the partition's norm,
    # then its fp32 all-reduce over dp = 2, then the update; the non-expert partitions all-gathered
    # over dp = 2 after it (edp = 1: no expert-data-parallel norm or gather)
    tail = ["optimizer", "grad_norm_wait", "optimizer", "grad_norm_wait", "optimizer", "param_gather"]
    assert no_wait[len(fwd) + len(bwd) :] == tail
    norms = [sp for sp in spans if sp.name == "grad_norm_wait"]
    per_byte, latency, _ = reduction_model(cluster_for(s), "all_reduce", [0, 1], "ring")
    assert [n.end - n.start for n in norms] == pytest.approx([latency + 4 * per_byte] * 2, rel=1e-9)
    # the partial norms: per gradient tensor of the rank's partition 3 eager ops (+3 per group)
    # and 20 bytes per parameter (fp32 read, fp64 written and read); closed form from the counts
    m, cost = s.model, cost_model(s)
    ne_t, ex_t = layer_tensors(m, 0)
    lp = layer_params(m, 0)
    ne_params = count_params(m).total - lp.expert
    parts = [(ceil_div(outer_tensors(m) + ne_t, 2), ceil_div(ne_params, 2)), (ex_t * s.experts_per_rank, lp.expert // 2)]
    got_norm = [sp.end - sp.start for sp in spans if sp.name == "optimizer"][:2]
    want = [(3 * t + 3) * cost.dispatcher_op_s + p * 20 / cost.hbm_Bps for t, p in parts]
    assert got_norm == pytest.approx(want, rel=1e-12)
    # spans tile the rank's time: contiguous, starting at 0, ending at the step time
    for a, b in zip(spans, spans[1:], strict=False):
        assert b.start == pytest.approx(a.end, abs=1e-15)
    assert spans[0].start == 0.0
    # compute spans equal the schedule's kernels; an all-to-all equals the closed form
    plan = route_scenario(s)
    sched = build_step(s, plan, cost_model(s), np.ones(2))
    kernels = [(n, float(op.durs[i, 0])) for op in sched.ops if isinstance(op, Compute) for i, n in enumerate(op.names)]
    got = [(sp.name, sp.end - sp.start) for sp in spans if sp.name not in ("dispatch", "combine")]
    for (n1, d1), (n2, d2) in zip(kernels, got, strict=False):
        assert n1 == n2 and d1 == pytest.approx(d2, rel=1e-12)
    cl = cluster_for(s)
    pair = plan.dispatch_bytes(0, 0, s.model.hidden_size, 4)
    first = next(sp for sp in spans if sp.name == "dispatch")
    path = cl.path(0, 1)
    lat = float(cl.link_latency_s[list(path)].sum())
    bw = float(cl.link_bw_Bps[list(path)].min())
    expect = max(pair[0, 1], pair[1, 0]) / bw + lat  # each direction on its own links: the larger ends last
    assert first.end - first.start == pytest.approx(expect, rel=1e-9)


def test_breakdown_tiles_the_step_on_the_critical_rank():
    for s in (tiny(), multi_node(2, "routing.skew=1.0")):
        r = simulate(s)
        keys = ("compute", "a2a", "imbalance_wait", "exposed_comm", "optimizer")
        assert set(STREAM_KEYS) == set(keys)
        crit = r["critical_rank_breakdown_s"]
        assert sum(crit[k] for k in keys) == pytest.approx(r["step_time_s"], rel=1e-9)
        # every rank ends with the post-step collectives, so the mean tiles the step as well
        assert r["ranks"]["end_min_s"] == pytest.approx(r["step_time_s"], rel=1e-9)
        assert sum(r["breakdown_s"][k] for k in keys) == pytest.approx(r["step_time_s"], rel=1e-9)


def test_skewed_routing_raises_imbalance_wait_and_step_time():
    flat = simulate(multi_node(2, "routing.generator=uniform"))
    skew = simulate(multi_node(2, "routing.generator=skewed", "routing.skew=1.5"))
    assert skew["traffic"]["max_over_mean_load"] > flat["traffic"]["max_over_mean_load"] + 0.2
    assert skew["ranks"]["imbalance_wait_max_s"] > 2 * flat["ranks"]["imbalance_wait_max_s"]
    assert skew["step_time_s"] > 1.05 * flat["step_time_s"]


def test_node_limited_routing_cuts_inter_node_bytes_and_a2a_time():
    # a token crosses the fabric once per destination node with the hierarchical all-to-all
    s = multi_node(4, "routing.generator=uniform", "collectives.all_to_all=hierarchical")
    top = simulate(s, policy="topk")
    one = simulate(s, policy="node_limited:M=1")
    assert one["traffic"]["inter_node_bytes"] < 0.5 * top["traffic"]["inter_node_bytes"]
    assert one["breakdown_s"]["a2a"] < 0.8 * top["breakdown_s"]["a2a"]
    # uniform top-8 over 4 nodes: a token reaches a given other node with probability 1-(1-1/4)^8
    d = multi_node(4, "routing.generator=uniform")  # direct: every copy off the node crosses
    direct = simulate(d, policy="topk")["traffic"]
    assert direct["inter_node_fraction"] == pytest.approx((3 / 4) / (31 / 32), rel=0.03)
    per_node = 1 - (3 / 4) ** 8
    copies_per_node = 8 / 4
    assert top["traffic"]["inter_node_bytes"] / direct["inter_node_bytes"] == pytest.approx(
        per_node / copies_per_node, rel=0.05
    )


def test_capacity_padded_moves_E_C_d_per_rank():
    s = tiny("routing.capacity_factor=1.25", "routing.dispatch=capacity_padded")
    r = simulate(s)
    m, ep = s.model, s.ep
    cap = math.ceil(s.tokens_per_micro_batch * m.top_k * 1.25 / m.num_experts)
    per_a2a = m.num_experts * cap * m.hidden_size * 4 * (ep - 1) / ep  # off-rank share of E x C x d
    n_a2a = 4 * m.num_moe_layers * s.training.grad_accum_steps
    assert r["traffic"]["a2a_bytes"] == pytest.approx(n_a2a * per_a2a, rel=1e-12)


def test_more_bandwidth_is_never_slower(tmp_path):
    topo = yaml.safe_load((ROOT / "topologies" / "dgx-h100.yaml").read_text())
    topo["name"] = "dgx-h100-fast"
    topo["scaleout"]["nic_line_Gbps"] *= 2
    topo["node"]["intra"]["line_bw_GBps"] *= 2
    (tmp_path / "fast.yaml").write_text(yaml.safe_dump(topo))
    base = multi_node(2, "routing.skew=0.5")
    fast = multi_node(2, "routing.skew=0.5", f"cluster.topology={tmp_path / 'fast.yaml'}")
    a, b = simulate(base), simulate(fast)
    assert b["step_time_s"] < a["step_time_s"]
    assert b["breakdown_s"]["a2a"] < a["breakdown_s"]["a2a"]  # PCIe to the NIC now limits it


def test_zero_stage_changes_memory_as_the_accounting_says():
    prev = None
    for stage in (0, 1, 2, 3):
        s = multi_node(2, f"parallelism.zero_stage={stage}")
        r = simulate(s)
        acc = memory_per_gpu(s).as_dict()
        assert {k: v for k, v in r["memory"].items() if k != "per_stage"} == acc
        assert r["memory"]["per_stage"] == [{"stage": 0, "peak_GiB_per_gpu": acc["peak_GiB_per_gpu"],
                                             "fits": acc["fits"], "in_flight_micro_batches": 1.0}]  # fmt: skip
        if prev is not None:
            assert r["memory"]["peak_GiB_per_gpu"] < prev
        prev = r["memory"]["peak_GiB_per_gpu"]


def test_zero2_all_reduces_buckets_and_zero3_reduce_scatters_and_gathers():
    """DeepSpeed 0.19's ZeRO-2 all-reduces each gradient bucket (use_multi_rank_bucket_allreduce)
    and all-gathers the updated partitions after the step; ZeRO-3 reduce-scatters the same bytes and
    gathers every layer's parameters. Bandwidth-bound ring: the all-reduce (2(n-1)/n S/B) takes
    exactly twice the reduce-scatter ((n-1)/n S/B)."""

    def comm(stage):
        r = simulate(multi_node(2, f"parallelism.zero_stage={stage}"), trace_ranks={0})
        return [sp for sp in r["_spans"] if sp.rank == 0 and sp.stream == "comm"]

    z2, z3 = comm(2), comm(3)
    assert sorted((sp.name, sp.args["kind"]) for sp in z2) == [
        ("grad_norm", "all_reduce"), ("grad_norm", "all_reduce"), ("grad_sync", "all_reduce"),
        ("param_gather", "all_gather")]  # fmt: skip
    # the fp32 norm of each parameter group (non-expert, experts) over the dp group
    assert [sp.args["bytes"] for sp in z2 if sp.name == "grad_norm"] == [4.0, 4.0]
    (ar,) = [sp for sp in z2 if sp.name == "grad_sync"]
    (rs,) = [sp for sp in z3 if sp.args["kind"] == "reduce_scatter"]
    assert ar.args["bytes"] == rs.args["bytes"]
    assert ar.end - ar.start == pytest.approx(2 * (rs.end - rs.start), rel=1e-3)
    assert sum(sp.args["kind"] == "all_gather" for sp in z3) >= 3  # per-layer gathers, forward and backward


def test_same_seed_same_json_bit_for_bit():
    s = multi_node(2, "routing.skew=1.0")
    assert dumps_json(simulate(s)) == dumps_json(simulate(s))
    other = multi_node(2, "routing.skew=1.0", "routing.seed=7")
    assert dumps_json(simulate(other)) != dumps_json(simulate(s))


def test_des_matches_analytic_on_uniform_routing_without_contention():
    for s in (tiny(), multi_node(2, "routing.generator=uniform")):
        des, ana = simulate(s), simulate(s, engine="analytic")
        assert des["step_time_s"] == pytest.approx(ana["step_time_s"], rel=0.10)
        assert ana["breakdown_s"]["imbalance_wait"] == 0.0


def test_des_shows_the_imbalance_penalty_analytic_cannot():
    s = multi_node(2, "routing.generator=skewed", "routing.skew=1.5")
    des, ana = simulate(s), simulate(s, engine="analytic")
    # more than 5% of the step outside the exposed gradient sync, which both engines price alike
    assert des["breakdown_s"]["exposed_comm"] == pytest.approx(ana["breakdown_s"]["exposed_comm"], rel=0.01)
    outside = ana["step_time_s"] - ana["breakdown_s"]["exposed_comm"]
    assert des["step_time_s"] - ana["step_time_s"] > 0.05 * outside
    assert des["breakdown_s"]["imbalance_wait"] > 0 == ana["breakdown_s"]["imbalance_wait"]


def test_flow_and_ps_comm_models_agree_on_a_small_cluster():
    s = multi_node(2, "routing.generator=uniform", "model.num_layers=1")
    flow, ps = simulate(s, comm_model="flow"), simulate(s, comm_model="ps")
    assert ps["breakdown_s"]["a2a"] == pytest.approx(flow["breakdown_s"]["a2a"], rel=0.05)
    assert ps["step_time_s"] == pytest.approx(flow["step_time_s"], rel=0.05)


def test_cached_direct_all_to_all_equals_processor_sharing_closed_form():
    import simpy

    s = multi_node(2)
    cl = cluster_for(s)
    rng = np.random.default_rng(3)
    groups = [list(range(16))]
    pair = rng.integers(1, 10_000_000, size=(16, 16)).astype(float)
    for direction in ("dispatch", "combine"):
        comm = Comm(simpy.Environment(), cl, "ps")
        fast = comm.direct_a2a((0,), groups, [pair], direction)
        dag = all_to_all_dag(cl, groups[0], pair, "direct", None, direction)
        t = ps_flow_times_s(cl, dag)
        ref = np.zeros(cl.world_size)
        np.maximum.at(ref, dag.src, t)
        np.maximum.at(ref, dag.dst, t)
        for r in groups[0]:
            assert fast[r] == pytest.approx(ref[r], rel=1e-12)


def test_schedule_counts_all_to_alls_and_flops():
    s = tiny("training.grad_accum_steps=2")
    sched = build_step(s, route_scenario(s), cost_model(s), np.ones(2))
    a2a = [op for op in sched.ops if isinstance(op, AllToAll)]
    assert len(a2a) == 4 * s.model.num_moe_layers * 2
    fwd = sum(float(op.flops[:, 0].sum()) for op in sched.ops if isinstance(op, Compute) and op.phase == "fwd")
    bwd = sum(float(op.flops[:, 0].sum()) for op in sched.ops if isinstance(op, Compute) and op.phase == "bwd")
    assert bwd == pytest.approx(2 * fwd, rel=1e-12)


def test_activation_checkpointing_recomputes_forward():
    a = simulate(tiny())
    b = simulate(tiny("training.activation_checkpointing=true"))
    fwd_compute = a["phases_s"]["attention"]
    assert b["breakdown_s"]["compute"] > a["breakdown_s"]["compute"] + 0.2 * fwd_compute


def test_cpu_offload_moves_optimizer_to_host():
    gpu = simulate(multi_node(2))
    cpu = simulate(multi_node(2, "training.offload_optimizer=cpu"))
    assert cpu["breakdown_s"]["optimizer"] > 10 * gpu["breakdown_s"]["optimizer"]
    assert cpu["memory"]["optimizer_GiB"] == 0.0


def test_cli_simulate_json_and_errors(tmp_path):
    out = tmp_path / "r.json"
    p = run_cli("simulate", str(BASE), "--json", str(out), "--trace", str(tmp_path / "t.json"))
    assert p.returncode == 0, p.stderr
    r = json.loads(out.read_text())
    for k in ("step_time_s", "tokens_per_s", "mfu", "num_gpus", "breakdown_s", "traffic", "memory", "params"):
        assert k in r
    assert "step time" in p.stdout and "breakdown" in p.stdout
    bad = run_cli("simulate", str(BASE), "--trace", str(tmp_path / "t.json"), "--trace-ranks", "0,9")
    assert bad.returncode == 2 and "--trace-ranks" in bad.stderr
    bad = run_cli("simulate", str(BASE), "--set", "parallelism.ep=3")
    assert bad.returncode == 2 and "parallelism.ep" in bad.stderr


@pytest.mark.parametrize("extra", [["routing.skew=1.5"], ["parallelism.zero_stage=3"], ["collectives.overlap_comm=false"]])
def test_vectorised_group_streams_equal_one_process_per_rank(extra):
    from sim.engine.des import Engine
    from sim.engine.simulate import _cluster

    s = multi_node(2, "parallelism.ep=8", *extra)
    plan = route_scenario(s)
    sched = build_step(s, plan, cost_model(s), np.ones(s.world_size))
    a = Engine(s, sched, plan, _cluster(s), "ps", trace_ranks={0, 9}).run()
    b = Engine(s, sched, plan, _cluster(s), "ps", trace_ranks={0, 9}, per_rank=True).run()
    # the same events in the same order; sums of the same times may differ in the last bit, as the
    # vectorised path adds a group's clocks as arrays and the per-rank one as scalars
    assert a.step_time_s == pytest.approx(b.step_time_s, rel=1e-12)
    for k in STREAM_KEYS:
        np.testing.assert_allclose(a.by_key[k], b.by_key[k], rtol=1e-12, atol=1e-15)
    sa = [(x.rank, x.name) for x in a.spans]
    assert sa == [(x.rank, x.name) for x in b.spans]
    np.testing.assert_allclose([(x.start, x.end) for x in a.spans], [(x.start, x.end) for x in b.spans],
                               rtol=1e-12, atol=1e-15)  # fmt: skip


@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
def test_reduction_model_is_exact_at_any_size(kind):
    from sim.network.closed_form import estimate_time_s
    from sim.network.collectives import reduction_dag
    from sim.network.comm import reduction_model

    cl = cluster_for(multi_node(2))
    group = list(range(0, 16, 2))
    per_byte, latency, _ = reduction_model(cl, kind, group, "ring")
    for nbytes in (1e3, 3.3e6, 7e8):
        ref = estimate_time_s(cl, reduction_dag(cl, kind, group, nbytes, "ring"))
        assert latency + per_byte * nbytes == pytest.approx(ref, rel=1e-9)


@pytest.mark.parametrize("comm_model", ["ps", "flow"])
def test_dropfree_gate_all_reduces_the_capacity_over_the_ep_group(comm_model):
    """DeepSpeed's drop_tokens=False gate all-reduces (MAX) its capacity over the EP group in every
    MoE layer's forward: one blocking 8-byte all-reduce between route and permute per MoE layer
    and micro-batch, costing the ring's closed form when both ranks arrive together; none when
    the capacity factor bounds the buffers."""
    s = tiny("routing.capacity_factor=null", "routing.dispatch=capacity_padded")
    r = simulate(s, comm_model=comm_model, trace_ranks={0, 1})
    waits = [sp for sp in r["_spans"] if sp.name == "capacity_sync_wait"]
    per_rank = s.model.num_moe_layers * s.training.grad_accum_steps
    assert sorted(sp.rank for sp in waits) == [0] * per_rank + [1] * per_rank
    per_byte, latency, _ = reduction_model(cluster_for(s), "all_reduce", [0, 1], "ring")
    for sp in waits:
        assert sp.end - sp.start == pytest.approx(latency + 8 * per_byte, rel=1e-9)
        assert sp.args["phase"] == "fwd"
    names = [sp.name for sp in r["_spans"] if sp.rank == 0 and sp.stream == "compute"]
    i = names.index("capacity_sync_wait")
    assert names[i - 1] == "route" and names[i + 1] == "permute"
    capped = simulate(tiny("routing.capacity_factor=1.25", "routing.dispatch=capacity_padded"), trace_ranks={0, 1})
    assert not [sp for sp in capped["_spans"] if sp.name == "capacity_sync_wait"]
