"""Routing policies, capacity and drops, dispatch modes, balancing and trace replay."""

import numpy as np
import pytest

from sim.api import scenario_from_dict
from sim.errors import InputError
from sim.inputs.router_trace import RouterTrace, save_trace
from sim.ioutil import dumps_json
from sim.routing.capacity import deepspeed_capacity, keep_mask
from sim.routing.gates import gate_scores
from sim.routing.plan import route_scenario
from sim.routing.policy import ExpertLayout, RoutingPolicy, select_experts


def scen(nodes=2, gpn=4, ep=8, experts=32, k=4, mbs=2, seq=64, accum=2, layers=2, model=None, **routing):
    return scenario_from_dict(
        {
            "cluster": {"topology": "dgx-h100", "nodes": nodes, "gpus_per_node": gpn},
            "model": {
                "num_layers": layers,
                "hidden_size": 64,
                "num_experts": experts,
                "top_k": k,
                "moe_ffn_hidden_size": 32,
                **(model or {}),
            },
            "parallelism": {"ep": ep},
            "training": {"micro_batch_size": mbs, "seq_len": seq, "grad_accum_steps": accum},
            "routing": {"capacity_factor": None, "dispatch": "dropless", **routing},
        }
    )


def test_uniform_routing_keeps_one_over_ep_local():
    s = scen(layers=4, generator="uniform")
    out = route_scenario(s, method="exact").summary()["summary"]
    assert out["local_fraction"] == pytest.approx(1 / 8, abs=0.01)
    assert out["intra_node_fraction"] == pytest.approx(3 / 8, abs=0.015)  # 3 other ranks of 4 per node
    assert out["inter_node_fraction"] == pytest.approx(4 / 8, abs=0.015)
    assert out["retained_gate_mass"] == 1.0
    assert out["dropped_fraction"] == 0.0


def test_group_scores_hand_case():
    """Group A has the single best expert, group B the best pair: node-limited (sum of top k/M)
    picks B, device-limited (max) picks A."""
    scores = np.array([[0.9, 0.0, 0.01, 0.02, 0.5, 0.5, 0.1, 0.1]], dtype=np.float32)
    node = select_experts(scores, 2, RoutingPolicy("node_limited", 1, 4))
    device = select_experts(scores, 2, RoutingPolicy("device_limited", 1, 4))
    assert sorted(node[0].tolist()) == [4, 5]
    assert device[0].tolist() == [0, 3]
    assert select_experts(scores, 2, RoutingPolicy("topk", None, None))[0].tolist() == [0, 4]


@pytest.mark.parametrize(
    ("name", "m"), [("node_limited", 1), ("node_limited", 2), ("device_limited", 2), ("device_limited", 3)]
)
def test_limited_policies_never_exceed_m_groups(name, m):
    s = scen(nodes=4, gpn=2, ep=8, experts=32, k=6, skew=0.5, generator="skewed")
    plan = route_scenario(s, f"{name}:M={m}", method="exact")
    layout = ExpertLayout.of(s)
    tokens = plan.tokens_per_rank * layout.world * plan.micro_batches * plan.num_moe_layers
    spread = plan.arrays.node_tokens if name == "node_limited" else plan.arrays.rank_tokens
    assert spread.sum() <= m * tokens
    assert spread.sum() > (m - 0.5) * tokens  # the limit binds: 6 picks would spread wider
    pol = RoutingPolicy.resolve(s, f"{name}:M={m}")
    scores = gate_scores(np.random.default_rng(0).gumbel(size=(5000, 32)).astype(np.float32), "softmax")
    chosen = select_experts(scores, 6, pol)
    groups = chosen // pol.group_size
    assert max(len(set(row)) for row in groups.tolist()) == m
    assert (np.sort(chosen, 1)[:, 1:] != np.sort(chosen, 1)[:, :-1]).all()  # k distinct experts


@pytest.mark.parametrize("method", ["exact", "pooled"])
@pytest.mark.parametrize("policy", ["node_limited:M=4", "device_limited:M=8"])
def test_m_equal_all_groups_is_topk(method, policy):
    s = scen(nodes=4, gpn=2, ep=8, generator="skewed", skew=0.8)
    top = route_scenario(s, "topk", method=method)
    lim = route_scenario(s, policy, method=method)
    np.testing.assert_array_equal(top.kept, lim.kept)
    np.testing.assert_array_equal(top.arrays.node_tokens, lim.arrays.node_tokens)
    assert lim.summary()["summary"]["retained_gate_mass"] == pytest.approx(1.0)


def test_retained_mass_grows_with_m():
    s = scen(nodes=4, gpn=2, ep=8, generator="skewed", skew=0.5)
    mass = [
        route_scenario(s, f"device_limited:M={m}", method="exact").summary()["summary"]["retained_gate_mass"]
        for m in (1, 2, 4, 8)
    ]
    assert mass == sorted(mass)
    assert mass[0] < 0.9 and mass[-1] == pytest.approx(1.0)


def test_capacity_hand_cases():
    assert deepspeed_capacity(256, 4, 2, 1.25, 4) == 160  # cpu-2rank: ceil(256/4 * 2.5)
    assert deepspeed_capacity(256, 8, 2, 1.0, 4) == 64  # seed-4gpu
    assert deepspeed_capacity(8, 8, 1, 1.0, 4) == 4  # floored at min_capacity
    assert deepspeed_capacity(100, 3, 1, 1.0, 0) == 34  # ceil(33.33)


CHOSEN = np.array([[[0, 1], [0, 2], [1, 0], [1, 2], [2, 0]]])
GATE = np.array([[[0.6, 0.4], [0.5, 0.35], [0.7, 0.3], [0.55, 0.45], [0.8, 0.2]]])


@pytest.mark.parametrize(
    ("order", "expected"),
    [
        ("first_choice", [[1, 0], [1, 1], [1, 0], [1, 0], [1, 0]]),
        ("position", [[1, 1], [1, 1], [1, 0], [0, 1], [0, 0]]),
        ("probs", [[1, 0], [1, 0], [1, 0], [1, 1], [1, 0]]),
    ],
)
def test_drop_orders_hand_computed(order, expected):
    kept = keep_mask(CHOSEN, GATE, 3, 2, order)
    assert kept[0].astype(int).tolist() == expected


def test_random_token_selection_keeps_min_of_count_and_capacity():
    chosen = np.random.default_rng(0).integers(0, 4, size=(3, 50, 1))
    kept = keep_mask(chosen, np.zeros(chosen.shape), 4, 10, "random", np.random.default_rng(1))
    for b in range(3):
        counts = np.bincount(chosen[b, :, 0], minlength=4)
        assert (
            np.bincount(chosen[b, :, 0][kept[b, :, 0]], minlength=4).tolist()
            == np.minimum(counts, 10).tolist()
        )


@pytest.mark.parametrize("method", ["exact", "pooled"])
def test_padded_dispatch_sends_e_c_d_per_rank(method):
    s = scen(generator="skewed", skew=1.0, capacity_factor=1.0, dispatch="capacity_padded", seq=128)
    plan = route_scenario(s, method=method)
    c = deepspeed_capacity(256, 32, 4, 1.0, 4)
    assert plan.capacity_per_rank == c == 32
    for layer, mb in [(0, 0), (1, 1)]:
        b = plan.dispatch_bytes_per_rank(layer, mb, hidden=64, bytes_per_elem=2)
        assert (b == 32 * c * 64 * 2).all()
        assert (plan.expert_load(layer, mb) == 8 * c).all()
        assert (plan.kept[layer, mb] <= c).all()
    st = plan.summary()["summary"]
    assert 0.02 < st["dropped_fraction"] < 0.5
    assert st["dispatch_bytes_per_layer"] == pytest.approx(
        8 * 7 * 4 * c * 64 * 2
    )  # 8 ranks x 7 remote chunks


def test_no_drop_padded_capacity_is_group_max_and_dropless_sends_counts():
    s = scen(generator="skewed", skew=1.0, dispatch="capacity_padded")
    plan = route_scenario(s, method="exact")
    for layer in range(2):
        for mb in range(2):
            c = plan.assigned[layer, mb].max()
            assert plan.padded[layer, mb].tolist() == [c]
            assert (plan.dispatch_bytes_per_rank(layer, mb, 10, 4) == 32 * c * 10 * 4).all()
    drop = route_scenario(scen(generator="skewed", skew=1.0), method="exact")
    np.testing.assert_array_equal(drop.kept, plan.kept)  # same seed, same routing
    b = drop.dispatch_bytes_per_rank(0, 0, 10, 4)
    np.testing.assert_array_equal(b, drop.kept[0, 0].sum(axis=1) * 40)
    assert drop.summary()["summary"]["dropped_fraction"] == 0.0


@pytest.mark.parametrize("method", ["exact", "pooled"])
def test_counts_are_conserved(method):
    s = scen(
        nodes=4, gpn=2, ep=4, generator="skewed", skew=0.7, capacity_factor=1.0, policy="node_limited:M=1"
    )
    plan = route_scenario(s, method=method)
    tokens, k = plan.tokens_per_rank, plan.top_k
    assert (plan.assigned.sum(axis=-1) == tokens * k).all()
    assert (plan.kept <= plan.assigned).all()
    for layer, mb in [(0, 0), (1, 1)]:
        d = plan.dispatch_tokens(layer, mb)
        np.testing.assert_array_equal(d.sum(axis=1), plan.kept[layer, mb].sum(axis=1))
        blocks = d.reshape(2, 4, 2, 4)
        assert blocks[0, :, 1].sum() == 0 and blocks[1, :, 0].sum() == 0  # zero outside EP groups
        load = plan.expert_load(layer, mb)
        assert load.sum() == plan.kept[layer, mb].sum()
        distinct = plan.dispatch_rank_tokens(layer, mb)
        assert (distinct <= d).all() and (distinct <= tokens).all()
        nodes = plan.dispatch_node_tokens(layer, mb)
        assert nodes.shape == (8, 4)
        assert (nodes.sum(axis=1) <= tokens).all()  # M=1: each token reaches at most one node


def test_inter_node_bytes_once_per_node_and_routing_weights():
    """node_limited:M=1 sends each token to one node: the deduplicated inter-node bytes are the
    distinct tokens that leave their node (hidden 64 x 2 bytes)."""
    s = scen(nodes=4, gpn=2, ep=8, generator="skewed", skew=0.5)
    plan = route_scenario(s, "node_limited:M=1", method="exact")
    st = plan.summary()["summary"]
    assert st["mean_nodes_per_token"] == 1.0
    off_node_tokens = st["inter_node_fraction"] * 8 * 128  # per layer and micro-batch: 8 ranks x 128 tokens
    assert st["inter_node_dedup_bytes_per_layer"] == pytest.approx(off_node_tokens * 64 * 2)
    assert st["inter_node_dedup_bytes_per_layer"] < 0.5 * st["inter_node_dispatch_bytes_per_layer"]
    assert st["mean_routing_weight_sum"] == pytest.approx(1.0)
    v3 = scen(model={"score_function": "sigmoid", "norm_topk_prob": True}, route_scale=2.5)
    assert route_scenario(v3).summary()["summary"]["mean_routing_weight_sum"] == pytest.approx(2.5)
    raw = scen(model={"norm_topk_prob": False}, generator="uniform")
    weight = route_scenario(raw).summary()["summary"]["mean_routing_weight_sum"]
    assert 4 / 32 < weight < 1.0  # top-4 of 32 softmax probabilities, not renormalised


def test_same_seed_same_result_other_seed_differs():
    s = scen(generator="skewed", skew=0.5, sequence_correlation=0.3, capacity_factor=1.0)
    a = dumps_json(route_scenario(s).summary())
    b = dumps_json(route_scenario(s).summary())
    assert a == b
    other = scen(generator="skewed", skew=0.5, sequence_correlation=0.3, capacity_factor=1.0, seed=1)
    assert dumps_json(route_scenario(other).summary()) != a


def test_aux_free_balancing_shrinks_imbalance():
    base = {"generator": "skewed", "skew": 1.0}
    off = route_scenario(scen(**base), method="exact").summary()["summary"]
    on_plan = route_scenario(
        scen(**base, aux_free_balancing={"enabled": True, "gamma": 0.002, "steps": 60}), method="exact"
    )
    on = on_plan.summary()["summary"]
    history = on_plan.arrays.balancing
    assert len(history) == 61
    assert history[-1] < 0.7 * history[0]
    assert on["max_over_mean_expert_load"] < off["max_over_mean_expert_load"]
    assert on["retained_gate_mass"] < 1.0  # the bias trades router score for balance


def _write_trace(tmp_path, s, steps=2):
    rng = np.random.default_rng(0)
    shape = (steps, 1, 2, 2, 4)
    assigned = np.zeros(shape, dtype=np.int64)
    for idx in np.ndindex(shape[:-1]):
        assigned[idx] = rng.multinomial(256 * 2, [0.4, 0.3, 0.2, 0.1])
    kept = np.minimum(assigned, 160)
    trace = RouterTrace("cpu", 4, 2, 2, 2, 2, 256, assigned, kept)
    path = tmp_path / "trace.json"
    save_trace(path, trace)
    return path, trace


def test_trace_replay_uses_recorded_counts(tmp_path):
    base = scen(nodes=1, gpn=2, ep=2, experts=4, k=2, mbs=4, seq=64, accum=1)
    path, trace = _write_trace(tmp_path, base)
    s = scen(nodes=1, gpn=2, ep=2, experts=4, k=2, mbs=4, seq=64, accum=1, generator="trace", trace=str(path))
    plan = route_scenario(s)
    assert plan.method == "trace"
    np.testing.assert_array_equal(plan.kept[:, 0], trace.kept[-1, 0])
    np.testing.assert_array_equal(plan.assigned[:, 0], trace.assigned[-1, 0])
    st = plan.summary()["summary"]
    assert st["retained_gate_mass"] is None
    assert st["dropped_fraction"] == pytest.approx(1 - trace.kept[-1].sum() / trace.assigned[-1].sum())
    assert (plan.arrays.rank_tokens <= 256).all()
    with pytest.raises(InputError, match="cannot apply"):
        route_scenario(s, "device_limited:M=1")
    wrong = scen(
        nodes=1, gpn=2, ep=2, experts=4, k=2, mbs=2, seq=64, accum=1, generator="trace", trace=str(path)
    )
    with pytest.raises(InputError, match="tokens_per_micro_batch"):
        route_scenario(wrong)


def test_bad_policy_override_is_input_error():
    s = scen()
    with pytest.raises(InputError) as info:
        route_scenario(s, "node_limited:M=5")
    assert info.value.field == "--policy"
    with pytest.raises(InputError, match="top_k"):
        route_scenario(scen(k=6), "device_limited:M=1")  # 4 experts per rank < top_k 6
    with pytest.raises(InputError, match="not understood"):
        route_scenario(s, "nodelimited:M=1")
    with pytest.raises(InputError, match="divide one another"):
        route_scenario(scen(nodes=3, gpn=4, ep=3, experts=12, k=2), "node_limited:M=1")


def test_covariance_square_root_handles_singular_and_slightly_indefinite():
    from sim.routing.pool import _sqrt_psd

    v = np.random.default_rng(0).standard_normal((6, 3))
    singular = v @ v.T  # rank 3
    lower = _sqrt_psd(singular)
    np.testing.assert_allclose(lower @ lower.T, singular, atol=1e-4)
    w, q = np.linalg.eigh(singular)
    w[0] = -1e-3  # float error can make a covariance slightly indefinite: Cholesky fails, eigh clips
    root = _sqrt_psd((q * w) @ q.T)
    np.testing.assert_allclose(root @ root.T, (q * np.clip(w, 0, None)) @ q.T, atol=1e-4)
