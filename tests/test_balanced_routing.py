"""``routing.generator: balanced``: every expert gets exactly its share, as forced-balance benchmarks
route; ``contiguous`` keeps a token's experts together (AutoModel's fake balanced gate)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import SCENARIOS

from sim.api import load_scenario
from sim.errors import InputError
from sim.routing.plan import route_scenario

BIG = SCENARIOS / "128gpu.yaml"
SMALL = ["cluster.nodes=2", "model.num_layers=2", "training.grad_accum_steps=2", "training.seq_len=1024",
         "routing.generator=balanced"]  # fmt: skip


@pytest.mark.parametrize("pattern", ["spread", "contiguous"])
def test_every_expert_gets_exactly_its_share(pattern):
    s = load_scenario(BIG, [*SMALL, f"routing.balanced_pattern={pattern}"])
    plan = route_scenario(s)
    t, k, e = s.routed_tokens_per_rank, s.model.top_k, s.model.num_experts
    assert (plan.kept == t * k // e).all()  # 1024 x 8 / 128 = 64 copies per expert from every rank
    rows = plan.expert_load(0, 0)
    assert (rows == s.ep * t * k // e).all()  # every local expert computes the same rows
    assert plan.summary()["summary"]["max_over_mean_load"] == 1.0


def test_contiguous_keeps_a_tokens_experts_on_one_rank():
    s = load_scenario(BIG, [*SMALL, "routing.balanced_pattern=contiguous"])
    plan = route_scenario(s)
    t = s.routed_tokens_per_rank
    # 8 experts per rank, top-8 starting at 8 i: every token's experts sit on exactly one rank
    assert plan.summary()["summary"]["mean_ranks_per_token"] == pytest.approx(1.0)
    assert plan.arrays.rank_tokens[0, 0, 0].sum() == t
    spread = route_scenario(load_scenario(BIG, SMALL))
    assert spread.summary()["summary"]["mean_ranks_per_token"] > 5  # random spread over 16 ranks


def test_balanced_lanes_are_identical_and_seeded():
    s = load_scenario(BIG, SMALL)
    a, b = route_scenario(s), route_scenario(s)
    assert np.array_equal(a.arrays.rank_tokens, b.arrays.rank_tokens)
    assert (a.arrays.rank_tokens == a.arrays.rank_tokens[:, :, :1]).all()  # every rank routes alike


def test_balanced_group_limited_needs_k_divisible_by_m():
    s = load_scenario(BIG, [*SMALL, "routing.policy=device_limited:M=3"])
    with pytest.raises(InputError, match="divisible by M"):
        route_scenario(s)


def test_balanced_group_limited_reaches_m_groups_and_stays_balanced():
    s = load_scenario(BIG, [*SMALL, "routing.policy=device_limited:M=4"])
    plan = route_scenario(s)
    t, k, e = s.routed_tokens_per_rank, s.model.top_k, s.model.num_experts
    assert (plan.kept == t * k // e).all()
    assert plan.summary()["summary"]["mean_ranks_per_token"] == pytest.approx(4.0)
