"""Pipeline and tensor parallelism against closed forms: the schedules' checker, the 1F1B bubble
(p-1)/(m+p-1) and its division by v under interleaving, TP bytes per layer, p2p bytes per
micro-batch, and the in-flight micro-batches of each schedule's memory."""

from __future__ import annotations

import pytest
import yaml
from conftest import ROOT

from sim.api import load_scenario
from sim.engine.simulate import cost_model, simulate
from sim.frameworks import pipeline as P
from sim.frameworks.builder import build_program
from sim.frameworks.program import GroupComm, Kernels
from sim.model.stage_memory import in_flight, memory_per_stage

BIG = ROOT / "scenarios" / "128gpu.yaml"


@pytest.mark.parametrize("schedule,pp,vpp,m", [
    ("1f1b", 1, 1, 4), ("1f1b", 2, 1, 1), ("1f1b", 4, 1, 8), ("1f1b", 8, 1, 3), ("interleaved", 2, 2, 4),
    ("interleaved", 4, 2, 8), ("interleaved", 4, 3, 12), ("dualpipe", 2, 1, 4), ("dualpipe", 4, 1, 8),
    ("dualpipe", 8, 1, 20),
])  # fmt: skip
def test_every_schedule_passes_the_checker(schedule, pp, vpp, m):
    seqs = P.build(schedule, pp, vpp, m)
    P.check(schedule, pp, vpp, m, seqs)


def test_the_checker_catches_a_deadlock_and_a_missing_pass():
    seqs = P.build("1f1b", 4, 1, 8)
    bad = [list(s) for s in seqs]
    bad[3] = [bad[3][1], bad[3][0], *bad[3][2:]]  # the last stage runs B0 before F0
    with pytest.raises(AssertionError):
        P.check("1f1b", 4, 1, 8, bad)
    bad = [list(s) for s in seqs]
    bad[0] = [x for x in bad[0] if x != P.Instr("B", 0, 0)]
    with pytest.raises(AssertionError, match="wrong passes"):
        P.check("1f1b", 4, 1, 8, bad)
    bad = [list(s) for s in seqs]
    bad[1], bad[2] = bad[2], bad[1]  # ranks swapped: rank 1 waits for stage 2's gradients first
    with pytest.raises(AssertionError):
        P.check("1f1b", 4, 1, 8, bad)


def _ideal_topology(tmp_path):
    """dgx-h100 with free communication (huge links, no latency) and free kernel launches."""
    topo = yaml.safe_load((ROOT / "topologies" / "dgx-h100.yaml").read_text())
    topo["name"] = "ideal"
    topo["node"]["gpus_per_node"] = 4
    for sec in ("intra", "pcie_host"):
        topo["node"][sec].update(line_bw_GBps=1e8, latency_us=0.0)
    topo["scaleout"].update(nic_line_Gbps=1e9, latency_us=0.0, nics_per_node=4)
    path = tmp_path / "ideal.yaml"
    path.write_text(yaml.safe_dump(topo))
    return path


def _dense_pipeline(tmp_path, pp: int, m: int, vpp: int = 1, schedule: str | None = None):
    topo = _ideal_topology(tmp_path)
    over = ["model.num_experts=1", "model.top_k=1", "model.moe_ffn_hidden_size=null", "model.vocab_size=8",
            "model.num_layers=16", "model.hidden_size=1024", "model.num_attention_heads=8", "model.num_kv_heads=8",
            "model.head_dim=128", "model.ffn_hidden_size=4096", f"cluster.topology={topo}", "cluster.nodes=1",
            f"parallelism.pp={pp}", "parallelism.ep=1", "parallelism.zero_stage=0", f"parallelism.vpp={vpp}",
            f"training.grad_accum_steps={m}", "training.seq_len=4096", "training.optimizer=sgd"]  # fmt: skip
    if schedule:
        over.append(f"parallelism.pp_schedule={schedule}")
    return load_scenario(BIG, over)


@pytest.mark.parametrize("pp,m", [(4, 8), (2, 4), (4, 16)])
def test_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(tmp_path, pp, m):
    s = _dense_pipeline(tmp_path, pp, m)
    r = simulate(s, fidelity="full")
    b = r["breakdown_s"]
    frac = b["pipeline_bubble"] / (b["pipeline_bubble"] + b["compute"])
    assert frac == pytest.approx((pp - 1) / (m + pp - 1), rel=0.03)


def test_interleaving_divides_the_bubble_by_v(tmp_path):
    plain = simulate(_dense_pipeline(tmp_path, 4, 8), fidelity="full")["breakdown_s"]["pipeline_bubble"]
    inter = simulate(_dense_pipeline(tmp_path, 4, 8, vpp=2), fidelity="full")["breakdown_s"]["pipeline_bubble"]
    assert inter == pytest.approx(plain / 2, rel=0.05)


def test_tp_bytes_per_layer_and_p2p_bytes_per_micro_batch():
    s = load_scenario(BIG, ["parallelism.tp=2", "parallelism.pp=4", "model.first_dense_layers=1"])
    prog = build_program(s, cost_model(s))
    t, d = s.training.micro_batch_size * s.training.seq_len, s.model.hidden_size
    ops = prog.stages[0].chunks[0].fwd
    dense = [op for op in ops if isinstance(op, GroupComm) and op.layer == 0]
    # sequence parallelism: all-gather and reduce-scatter of the whole s x b x h activation around
    # attention and around the MLP (Korthikanti et al. 2022 sec. 4.2.2), bf16
    assert [op.kind for op in dense] == ["all_gather", "reduce_scatter"] * 2
    assert all(op.nbytes == t * d * 2 for op in dense)
    no_sp = load_scenario(BIG, ["parallelism.tp=2", "parallelism.sequence_parallel=false"])
    ops = build_program(no_sp, cost_model(no_sp)).stages[0].chunks[0].fwd
    assert [op.kind for op in ops if isinstance(op, GroupComm) and op.layer == 0] == ["all_reduce"]
    # p2p: each rank sends its sequence-parallel shard of the activations, t / tp x h x 2 bytes
    assert prog.stages[0].chunks[0].send_bytes == t // 2 * d * 2
    assert any(isinstance(op, Kernels) for op in ops)


def test_tp_collectives_of_the_embedding_head_and_loss():
    """Megatron's vocab-parallel embedding (its output reduced over TP: reduce-scattered under SP), the
    column-parallel LM head (its input all-gathered under SP, the gradient reduce-scattered back) and the
    vocab-parallel cross entropy (max, sum of exponentials and target logit all-reduced: 3 fp32 per token)."""
    s = load_scenario(BIG, ["parallelism.tp=2", "parallelism.pp=2"])
    prog = build_program(s, cost_model(s))
    t, d = s.training.micro_batch_size * s.training.seq_len, s.model.hidden_size
    first, last = prog.stages[0].chunks[0], prog.stages[-1].chunks[-1]
    n = s.model.num_layers

    def comms(ops, layer):
        return [(op.kind, op.nbytes) for op in ops if isinstance(op, GroupComm) and op.layer == layer]

    assert comms(first.fwd, -1) == [("reduce_scatter", t * d * 2)]
    assert comms(first.bwd, -1) == [("all_gather", t * d * 2)]
    assert comms(last.fwd, n) == [("all_gather", t * d * 2), ("all_reduce", 3 * 4 * t)]
    assert comms(last.bwd, n) == [("reduce_scatter", t * d * 2)]
    no_sp = load_scenario(BIG, ["parallelism.tp=2", "parallelism.sequence_parallel=false"])
    st = build_program(no_sp, cost_model(no_sp)).stages[0].chunks[0]
    assert comms(st.fwd, -1) == [("all_reduce", t * d * 2)] and comms(st.bwd, -1) == []
    assert comms(st.fwd, n) == [("all_reduce", 3 * 4 * t)] and comms(st.bwd, n) == [("all_reduce", t * d * 2)]


def test_in_flight_micro_batches_per_schedule():
    s = load_scenario(BIG, ["parallelism.pp=4", "training.grad_accum_steps=8"])
    assert [in_flight(s, r) for r in range(4)] == [4, 3, 2, 1]  # PipeDream-Flush: pp - r
    v = load_scenario(BIG, ["parallelism.pp=4", "parallelism.vpp=2", "training.grad_accum_steps=8"])
    assert [in_flight(v, r) for r in range(4)] == [(3 * 2 + 4 + 1) / 2, (2 * 2 + 4 + 1) / 2, (2 + 4 + 1) / 2, 5 / 2]
    d = load_scenario(BIG, ["parallelism.pp=4", "parallelism.pp_schedule=dualpipe", "training.grad_accum_steps=8"])
    # DeepSeek-V3 table 2: PP + 1 micro-batches of one stage, the rank's two stages (r, pp-1-r) counted once
    assert in_flight(d, 0) == 5 / 2
    stages = memory_per_stage(s)
    assert stages[0].activations > stages[-1].activations - stages[-1].activations // 2  # more in flight first
    dual = memory_per_stage(d)
    assert dual[0].weights > stages[0].weights  # DualPipe holds two stages' parameters
    # ... and PP + 1 = 5 stage-micro-batches of activations where 1F1B's first stage holds PP = 4
    # (rank 0 also runs the last stage: its fp32 logits, one micro-batch at a time)
    logits = d.training.micro_batch_size * d.training.seq_len * d.model.vocab_size * 4
    assert dual[0].activations - logits == pytest.approx(5 / 4 * stages[0].activations, rel=0.02)


@pytest.mark.parametrize("ep,etp", [(8, 1), (4, 2), (2, 2), (2, 4)])
def test_expert_tensor_parallelism_keeps_each_gpus_expert_flops(ep, etp):
    """Expert TP splits an expert's width over etp ranks, which first all-gather their tokens: each
    computes the rows its whole etp group routed to its experts on 1 / etp of the width, so with
    balanced routing a GPU's expert FLOPs per micro-batch are the same for every (ep, etp) folding of
    its stage: a replica's T k routed rows x 3 GEMMs of 2 h f FLOPs, over its tp GPUs (it was 1 / etp
    of that: each etp rank counted only its own tokens)."""
    import numpy as np

    from sim.frameworks.pricing import Pricer
    from sim.routing.plan import route_scenario

    over = ["parallelism.tp=4", f"parallelism.ep={ep}", f"parallelism.etp={etp}", "routing.generator=balanced",
            "routing.dispatch=dropless", "routing.capacity_factor=null", "training.grad_accum_steps=1"]  # fmt: skip
    s = load_scenario(BIG, over)
    pricer = Pricer(s, route_scenario(s), cost_model(s), [1.0] * s.world_size)
    q = np.arange(s.layout.stage_size)
    moe_layer = next(i for i in range(s.model.num_layers) if s.model.is_moe_layer(i))
    _, flops = pricer.price("experts", moe_layer, 0, 0, "fwd", q, 0)
    m = s.model
    tokens = s.training.micro_batch_size * s.training.seq_len  # one dp replica's, on its tp group of 4
    gemms = 3 if m.ffn_type == "gated" else 2
    per_gpu = tokens * m.top_k * gemms * 2 * m.hidden_size * m.moe_ffn_hidden_size / s.parallelism.tp
    assert flops == pytest.approx(np.full(len(q), per_gpu), rel=1e-12)
