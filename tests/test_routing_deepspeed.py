"""The router against reference implementations on identical logits: DeepSpeed's own gating
(``deepspeed.moe.sharded_moe.top1gating`` / ``top2gating`` / ``topkgating``) for capacity, drops and
weights, and torch transcriptions of DeepSeek-V3's ``Gate`` and DeepSeek-V2's ``MoEGate`` for the
group-limited policies. The only test file that imports torch."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
sharded_moe = pytest.importorskip("deepspeed.moe.sharded_moe")

from sim.routing.capacity import deepspeed_capacity, drop_order, keep_mask, padded_capacity  # noqa: E402
from sim.routing.gates import combine_weights, gate_scores  # noqa: E402
from sim.routing.policy import RoutingPolicy, select_experts  # noqa: E402

TOPK = RoutingPolicy("topk", None, None)


def _logits(tokens: int, experts: int, seed: int, skew: float = 0.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    mu = skew * rng.standard_normal(experts)
    return (rng.standard_normal((tokens, experts)) + mu).astype(np.float32)


def _ours(logits: np.ndarray, k: int, capacity: int, order: str, rng=None):
    scores = gate_scores(logits.copy(), "softmax")
    chosen = select_experts(scores, k, TOPK)
    gate = np.take_along_axis(scores, chosen, axis=1)
    kept = keep_mask(chosen[None], gate[None], logits.shape[1], capacity, order, rng)[0]
    return scores, chosen, kept, _dense(chosen, kept, logits.shape[1])


def _dense(chosen: np.ndarray, kept: np.ndarray, experts: int) -> np.ndarray:
    out = np.zeros((chosen.shape[0], experts), dtype=bool)
    rows = np.repeat(np.arange(chosen.shape[0]), chosen.shape[1])
    out[rows[kept.ravel()], chosen.ravel()[kept.ravel()]] = True
    return out


@pytest.mark.parametrize(
    ("tokens", "experts", "k", "cf", "policy", "skew"),
    [
        (256, 8, 3, 1.0, "probs", 1.0),
        (256, 8, 3, 1.0, "position", 1.0),
        (512, 16, 4, 1.25, "probs", 0.7),
        (512, 16, 4, 0.5, "position", 0.0),
        (100, 6, 3, 1.1, "probs", 0.5),
    ],
)
def test_topkgating_capacity_drops_and_weights(tokens, experts, k, cf, policy, skew):
    logits = _logits(tokens, experts, seed=tokens + k, skew=skew)
    cap = deepspeed_capacity(tokens, experts, k, cf, 4)
    _, combine, dispatch, counts = sharded_moe.topkgating(
        torch.from_numpy(logits.copy()), k, cf, 4, drop_policy=policy
    )
    assert combine.shape[-1] == cap
    scores, chosen, kept, dense = _ours(logits, k, cap, drop_order(k, policy))
    np.testing.assert_array_equal(counts.numpy(), np.bincount(chosen.ravel(), minlength=experts))
    np.testing.assert_array_equal(dispatch.any(-1).numpy(), dense)
    assert (dense.sum(axis=0) == np.minimum(counts.numpy(), cap)).all()
    assert dense.sum() < tokens * k  # the cases do drop tokens
    # DeepSpeed renormalises the kept gates of every token (over the kept copies only)
    kept_gate = np.where(kept, np.take_along_axis(scores, chosen, axis=1), 0.0)
    ours = np.zeros((tokens, experts))
    np.put_along_axis(ours, chosen, kept_gate / np.maximum(kept_gate.sum(1, keepdims=True), 1e-7), axis=1)
    np.testing.assert_allclose(combine.sum(-1).numpy(), ours, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("tokens", "experts", "cf"), [(256, 8, 1.0), (128, 4, 0.75), (300, 16, 1.5)])
def test_top2gating_first_choices_first(tokens, experts, cf):
    logits = _logits(tokens, experts, seed=experts, skew=1.0)
    cap = deepspeed_capacity(tokens, experts, 2, cf, 4)
    _, combine, dispatch, _ = sharded_moe.top2gating(
        torch.from_numpy(logits.copy()), cf, 4, top2_2nd_expert_sampling=False
    )
    assert combine.shape[-1] == cap
    _, _, _, dense = _ours(logits, 2, cap, drop_order(2, "probs"))
    np.testing.assert_array_equal(dispatch.any(-1).numpy(), dense)
    assert dense.sum() < tokens * 2


def test_top1gating_random_token_selection_keeps_min_count_capacity():
    tokens, experts, cf = 256, 8, 1.0
    logits = _logits(tokens, experts, seed=3, skew=1.0)
    cap = deepspeed_capacity(tokens, experts, 1, cf, 4)
    _, combine, dispatch, counts = sharded_moe.top1gating(torch.from_numpy(logits.copy()), cf, 4)
    assert combine.shape[-1] == cap
    _, chosen, _, dense = _ours(logits, 1, cap, "random", np.random.default_rng(0))
    np.testing.assert_array_equal(counts.numpy(), np.bincount(chosen.ravel(), minlength=experts))
    np.testing.assert_array_equal(dispatch.any(-1).sum(0).numpy(), dense.sum(0))
    # RTS keeps a random subset: same counts, only among the tokens that chose the expert
    assert not (dispatch.any(-1).numpy() & ~_dense(chosen, np.ones_like(chosen, bool), experts)).any()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_no_drop_capacity_is_max_count(k):
    tokens, experts = 200, 8
    logits = _logits(tokens, experts, seed=k, skew=1.0)
    t = torch.from_numpy(logits.copy())
    if k == 1:
        out = sharded_moe.top1gating(t, 1.0, 4, drop_tokens=False)
    elif k == 2:
        out = sharded_moe.top2gating(t, 1.0, 4, drop_tokens=False, top2_2nd_expert_sampling=False)
    else:
        out = sharded_moe.topkgating(t, k, 1.0, 4, drop_tokens=False)
    chosen = select_experts(gate_scores(logits.copy(), "softmax"), k, TOPK)
    assigned = np.bincount(chosen.ravel(), minlength=experts)[None, :]
    assert out[1].shape[-1] == padded_capacity(assigned, 1, tokens, k)[0]
    assert out[2].any(-1).sum() == tokens * k  # nothing dropped


@pytest.mark.parametrize(
    ("tokens", "experts", "k", "cf", "minc"),
    [
        (4096, 128, 8, 1.0, 4),
        (4096, 128, 8, 1.25, 4),
        (1000, 7, 2, 1.3, 4),
        (10, 64, 2, 1.0, 4),
        (777, 33, 5, 0.9, 0),
    ],
)
def test_capacity_formula_matches_float32_arithmetic(tokens, experts, k, cf, minc):
    gates = torch.zeros(tokens, experts)
    expected = sharded_moe._capacity(gates, torch.tensor(cf * k), torch.tensor(minc))
    assert deepspeed_capacity(tokens, experts, k, cf, minc) == int(expected)


def _v3_gate(
    x: torch.Tensor, bias, n_groups: int, topk_groups: int, k: int, score_func: str, route_scale: float
):
    """DeepSeek-V3 inference/model.py Gate.forward, transcribed (group score: top-2 sum with bias,
    else max; here generalised to top k // topk_groups as Megatron's group_limited_topk)."""
    scores = x.softmax(dim=-1, dtype=torch.float32) if score_func == "softmax" else x.sigmoid()
    original = scores
    if bias is not None:
        scores = scores + bias
    if n_groups > 1:
        grouped = scores.view(x.size(0), n_groups, -1)
        group_scores = grouped.topk(k // topk_groups, dim=-1)[0].sum(dim=-1)
        idx = group_scores.topk(topk_groups, dim=-1)[1]
        mask = scores.new_ones(x.size(0), n_groups, dtype=bool).scatter_(1, idx, False)
        scores = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
    indices = torch.topk(scores, k, dim=-1)[1]
    weights = original.gather(1, indices)
    if score_func == "sigmoid":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * route_scale, indices


def _v2_gate(x: torch.Tensor, n_group: int, topk_group: int, k: int):
    """DeepSeek-V2 modeling_deepseek.py MoEGate, topk_method group_limited_greedy, transcribed."""
    scores = x.softmax(dim=-1, dtype=torch.float32)
    group_scores = scores.view(x.size(0), n_group, -1).max(dim=-1).values
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1).expand(x.size(0), n_group, scores.size(1) // n_group).reshape(x.size(0), -1)
    )
    tmp = scores.masked_fill(~score_mask.bool(), 0.0)
    return torch.topk(tmp, k=k, dim=-1, sorted=False)[1]


@pytest.mark.parametrize(
    ("score_func", "with_bias"), [("sigmoid", True), ("sigmoid", False), ("softmax", True)]
)
def test_node_limited_matches_deepseek_v3_gate(score_func, with_bias):
    tokens, experts, groups, m, k, scale = 2000, 64, 8, 4, 8, 2.5
    logits = _logits(tokens, experts, seed=11, skew=0.5)
    bias = np.random.default_rng(5).normal(0, 0.05, experts).astype(np.float32) if with_bias else None
    w_ref, idx_ref = _v3_gate(
        torch.from_numpy(logits.copy()),
        None if bias is None else torch.from_numpy(bias),
        groups,
        m,
        k,
        score_func,
        scale,
    )
    scores = gate_scores(logits.copy(), score_func)
    chosen = select_experts(scores, k, RoutingPolicy("node_limited", m, experts // groups), bias)
    np.testing.assert_array_equal(np.sort(chosen, 1), np.sort(idx_ref.numpy(), 1))
    ours_w = combine_weights(scores, chosen, norm_topk_prob=score_func == "sigmoid", route_scale=scale)
    order = np.argsort(chosen, 1)
    ref_order = np.argsort(idx_ref.numpy(), 1)
    np.testing.assert_allclose(
        np.take_along_axis(ours_w, order, 1), np.take_along_axis(w_ref.numpy(), ref_order, 1), rtol=1e-5
    )


@pytest.mark.parametrize("m", [1, 2, 3, 8])
def test_device_limited_matches_deepseek_v2_gate(m):
    tokens, experts, devices, k = 2000, 64, 8, 6
    logits = _logits(tokens, experts, seed=m, skew=0.5)
    ref = _v2_gate(torch.from_numpy(logits.copy()), devices, m, k).numpy()
    scores = gate_scores(logits.copy(), "softmax")
    chosen = select_experts(scores, k, RoutingPolicy("device_limited", m, experts // devices))
    np.testing.assert_array_equal(np.sort(chosen, 1), np.sort(ref, 1))
