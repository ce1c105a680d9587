"""The model, the synthetic task and upcycling in one process (EP 1: DeepSpeed's MoE layer runs
without a process group when ep_size is 1). The multi-rank upcycling check is in test_hw_jobs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("deepspeed")

from hw_validate.data import NextTokenTask, split  # noqa: E402
from hw_validate.dsconfig import gate_settings  # noqa: E402
from hw_validate.model import MoEFFN, build_model, init_experts  # noqa: E402
from hw_validate.upcycle import ROUTER_STD, load_dense, save_dense, train_dense, upcycle_  # noqa: E402
from sim.api import load_scenario  # noqa: E402
from sim.errors import InputError  # noqa: E402

CPU2 = Path(__file__).resolve().parents[2] / "scenarios" / "cpu-2rank.yaml"
DROPLESS = ["routing.capacity_factor=null", "routing.dispatch=dropless"]


def test_task_is_a_fixed_permutation_and_deterministic():
    task = NextTokenTask(vocab_size=50, seq_len=12, micro_batch_size=3, seed=7)
    b = task.batch(step=2, micro_batch=1, rank=0)
    x, y = split(b)
    assert b.shape == (3, 13) and torch.equal(y, task.perm[x])
    assert sorted(task.perm.tolist()) == list(range(50))
    assert torch.equal(b, NextTokenTask(50, 12, 3, seed=7).batch(2, 1, 0))
    assert not torch.equal(b, task.batch(2, 1, 1))  # another rank gets other sequences


def test_model_shapes_follow_the_scenario():
    s = load_scenario(CPU2, ["model.first_dense_layers=1", "model.num_layers=3"])
    m = build_model(s, gate_settings(s), ep_size=2)
    kinds = [isinstance(b.ffn, MoEFFN) for b in m.blocks]
    assert kinds == [False, True, True]
    moe = m.moe_layers()[0]
    assert len(moe.experts) == s.model.num_experts // 2  # local experts of one EP rank
    assert moe.gate.wg.weight.shape == (s.model.num_experts, s.model.hidden_size)
    logits, aux = build_model(s, None, dense=True)(torch.zeros((2, 5), dtype=torch.long))
    assert logits.shape == (2, 5, s.model.vocab_size) and float(aux) == 0.0


def test_expert_init_does_not_depend_on_the_ep_layout():
    s1 = load_scenario(CPU2, ["parallelism.ep=1"])
    s2 = load_scenario(CPU2)
    whole = build_model(s1, gate_settings(s1), ep_size=1)
    init_experts(whole, seed=3, ep_rank=0)
    half = build_model(s2, gate_settings(s2), ep_size=2)
    init_experts(half, seed=3, ep_rank=1)  # holds global experts 2 and 3
    for layer in range(2):
        a = whole.moe_layers()[layer].experts[2].state_dict()
        b = half.moe_layers()[layer].experts[0].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def _upcycled(overrides):
    s = load_scenario(CPU2, ["parallelism.ep=1", *overrides])
    dense, losses = train_dense(s, 3)
    moe = build_model(s, gate_settings(s), ep_size=1)
    init_experts(moe, 0, 0)
    info = upcycle_(moe, dense.state_dict(), seed=0)
    x, _ = split(NextTokenTask(s.model.vocab_size, s.training.seq_len, s.training.micro_batch_size).batch(0, 0, 0))
    with torch.no_grad():
        diff = (moe(x)[0] - dense(x)[0]).abs().max()
    return s, dense, moe, info, float(diff)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.top_k=1"],  # DeepSpeed top-1 weights by p; the model renormalises (p / p = 1)
        ["model.top_k=2"],
        ["model.top_k=3"],
        ["model.top_k=2", "model.num_shared_experts=1", "model.shared_expert_gate=true"],
    ],
)
def test_upcycled_model_equals_dense_parent_in_fp32(overrides):
    s, dense, moe, info, diff = _upcycled([*DROPLESS, *overrides])
    assert diff < 1e-5
    assert info["experts_copied"] == s.model.num_experts * s.model.num_moe_layers
    d = dense.state_dict()
    for i, layer in enumerate(moe.moe_layers()):
        for expert in layer.experts:
            for k, v in expert.state_dict().items():
                assert torch.equal(v, d[f"blocks.{i}.ffn.{k}"])
        w = layer.gate.wg.weight.detach()
        assert abs(float(w.mean())) < 0.003 and abs(float(w.std()) - ROUTER_STD) < 0.003


def test_top1_without_renormalisation_is_not_the_dense_model():
    *_, diff = _upcycled([*DROPLESS, "model.top_k=1", "model.norm_topk_prob=false"])
    assert diff > 1e-3  # the raw top-1 probability scales every expert output


def test_dense_checkpoint_round_trip_and_errors(tmp_path):
    s = load_scenario(CPU2)
    dense, losses = train_dense(s, 2)
    p = tmp_path / "dense.pt"
    save_dense(p, dense, s.name, 2, losses)
    blob = load_dense(p)
    assert blob["steps"] == 2 and blob["losses"] == losses
    assert all(torch.equal(blob["state_dict"][k], v) for k, v in dense.state_dict().items())
    with pytest.raises(InputError):
        load_dense(tmp_path / "missing.pt")
    other = load_scenario(CPU2, ["model.moe_ffn_hidden_size=64", "model.ffn_hidden_size=64", "parallelism.ep=1"])
    moe = build_model(other, gate_settings(other), ep_size=1)
    with pytest.raises(InputError) as e:
        upcycle_(moe, blob["state_dict"])
    assert "shape" in e.value.message


@pytest.mark.parametrize(
    "overrides",
    [[], ["model.first_dense_layers=1", "model.num_layers=3", "model.norm_type=rmsnorm"],
     ["model.attention_bias=true", "model.ffn_type=gated", "model.num_shared_experts=1", "model.shared_expert_gate=true"],
     ["model.linear_bias=true", "model.tie_word_embeddings=true"]],
)  # fmt: skip
def test_tensor_counts_match_the_real_model(overrides):
    """sim.model.params.layer_tensors / outer_tensors against the parameter tensors of the real
    DeepSpeed model (EP 1: every expert local), split as DeepSpeed splits its MoE param groups."""
    from deepspeed.moe.utils import is_moe_param

    from sim.model.params import layer_tensors, outer_tensors

    s = load_scenario(CPU2, ["parallelism.ep=1", *overrides])
    m = build_model(s, gate_settings(s), ep_size=1)
    expert = sum(1 for p in m.parameters() if is_moe_param(p))
    non_expert = sum(1 for p in m.parameters() if not is_moe_param(p))
    mc = s.model
    counts = [layer_tensors(mc, i) for i in range(mc.num_layers)]
    assert non_expert == outer_tensors(mc) + sum(c[0] for c in counts)
    assert expert == sum(c[1] * (mc.num_experts if mc.is_moe_layer(i) else 0) for i, c in enumerate(counts))
