"""The two ways of producing every (layer, micro-batch, rank) count: exact and pooled.

- ``exact``: every token of every rank gets its own logits and is routed and capacity-dropped one
  by one (DeepSpeed's order). Cost 3-6 s per million tokens at E = 128 on 2 cores: for small scenarios and as
  the reference the pooled path is tested against.
- ``pooled``: per distinct layer distribution, a pool of tokens is routed exactly and its feature
  moments drive one Gaussian draw per (layer, micro-batch, rank) (:mod:`sim.routing.pool`).

Random streams are keyed by ``routing.seed`` and never by the policy, so every policy sees the same
gate scores (and the same Gaussian noise): comparisons are paired.
"""

from __future__ import annotations

import numpy as np

from sim.errors import InputError
from sim.inputs.router_trace import load_trace
from sim.inputs.scenario import Scenario
from sim.routing.balance import aux_free_bias
from sim.routing.capacity import deepspeed_capacity, drop_order, keep_mask
from sim.routing.counts import CountsWriter, LayerCounts, PlanArrays
from sim.routing.gates import gate_scores, log_popularity, popularity_layer_groups, sample_logits
from sim.routing.policy import ExpertLayout, RoutingPolicy
from sim.routing.pool import CountDraw, feature_shift, pool_moments, prefetched_noise
from sim.routing.tokens import FeatureColumns, RoutedTokens, aggregate_batches, route_tokens, token_features

#: Pool tokens shared out over the distinct layer distributions, and the floor per distribution.
POOL_TOKENS = 65536
MIN_POOL_TOKENS = 4096
#: Sequence types (latent preferences) a pool holds when tokens of a sequence are correlated.
MAX_TYPES = 256
#: Pool tokens (spread over the pool) the retained gate mass is measured on (a ratio of sums).
MASS_TOKENS = 16384
#: Tokens the aux-free balancing steps route per update.
BALANCE_POOL_TOKENS = 8192


class _Setup:
    """What both paths share: shapes, popularity, per-distribution pools and balancing biases."""

    def __init__(self, scenario: Scenario, policy: RoutingPolicy, pool_tokens: int):
        self.policy = policy
        self.r, self.model = scenario.routing, scenario.model
        self.layout = ExpertLayout.of(scenario)
        self.cols = FeatureColumns.of(self.layout)
        self.layers = scenario.model.num_moe_layers
        self.micro = scenario.training.grad_accum_steps
        self.tokens = scenario.routed_tokens_per_rank
        self.seq_len = min(scenario.training.seq_len, self.tokens)  # a rank holds whole sequences or one shard
        self.rho = self.r.sequence_correlation
        self.mu = log_popularity(self.r, self.layers, self.model.num_experts)
        self.group_of_layer = popularity_layer_groups(self.r, self.layers)
        n_groups = int(self.group_of_layer.max()) + 1
        self.pool_size = max(MIN_POOL_TOKENS, pool_tokens // n_groups)
        self.types = min(MAX_TYPES, max(8, self.pool_size // 64)) if self.rho > 0 else 1
        self.pool_size -= self.pool_size % self.types
        self.first_layer = [int(np.flatnonzero(self.group_of_layer == g)[0]) for g in range(n_groups)]
        self.bias: list[np.ndarray | None] = [None] * n_groups
        self.balancing: list[float] | None = None
        self.logits = [self._pool_logits(g) for g in range(n_groups)]
        afb = self.r.aux_free_balancing
        if afb.enabled:
            for g, logits in enumerate(self.logits):
                stride = max(1, len(logits) // BALANCE_POOL_TOKENS)  # a spread over every sequence type
                scores = gate_scores(logits[::stride], self.model.score_function)
                self.bias[g], history = aux_free_bias(scores, self.model.top_k, policy, afb.gamma, afb.steps)
                if g == 0:
                    self.balancing = history

    def _pool_logits(self, g: int) -> np.ndarray:
        rng = np.random.default_rng([self.r.seed, 12, g])
        per_type = self.pool_size // self.types
        latent = (
            rng.standard_normal((self.types, self.model.num_experts), dtype=np.float32)
            if self.rho > 0
            else None
        )
        return sample_logits(rng, self.mu[self.first_layer[g]], self.pool_size, per_type, latent, self.rho)

    def route_pool(self, g: int) -> RoutedTokens:
        """Route distribution g's pool exactly (with its balancing bias)."""
        return route_tokens(
            self.logits[g], self.model, self.r.route_scale, self.policy, self.bias[g], MASS_TOKENS
        )

    def capacity(self) -> int | None:
        if self.r.capacity_factor is None:
            return None
        return deepspeed_capacity(
            self.tokens, self.model.num_experts, self.model.top_k, self.r.capacity_factor, self.r.min_capacity
        )

    def writer(self) -> CountsWriter:
        """Where the layers' counts go; kept copies are assigned ones without a capacity."""
        return CountsWriter(self.layout, self.cols, self.layers, self.micro, self.capacity() is not None)


def build_pooled(scenario: Scenario, policy: RoutingPolicy, pool_tokens: int = POOL_TOKENS) -> PlanArrays:
    """Counts of every (layer, micro-batch, rank) drawn from exact pools (see module docstring)."""
    st = _Setup(scenario, policy, pool_tokens)
    lay, cols, k, s_tok = st.layout, st.cols, st.model.top_k, st.tokens
    routed = [st.route_pool(g) for g in range(len(st.logits))]
    features = [token_features(rt.chosen, lay, cols) for rt in routed]
    moments = [pool_moments(f, st.types) for f in features]
    max_nodes = [_max_nodes(f, cols) for f in features]
    ranks = np.arange(lay.world)
    pattern_of_cell = np.tile(cols.pattern_of_group[ranks // lay.ep], st.micro)
    cells = st.micro * lay.world
    seqs = max(1, s_tok // st.seq_len)
    noise_rng = np.random.default_rng([st.r.seed, 13])
    type_rng = np.random.default_rng([st.r.seed, 17])
    writer = st.writer()
    group_max = st.r.dispatch == "capacity_padded" and st.capacity() is None  # buffers sized by the largest
    draw = CountDraw(lay, cols, pattern_of_cell, s_tok, k, st.capacity(), writer.wide, group_max)
    noises = prefetched_noise(noise_rng, (cells, cols.width), st.layers)
    for layer, noise in enumerate(noises):
        g = int(st.group_of_layer[layer])
        types = type_rng.integers(st.types, size=(cells, seqs)) if st.types > 1 else None
        shift = feature_shift(moments[g], s_tok, st.seq_len, types)
        writer.add(layer, draw.counts(noise, moments[g], shift, max_nodes[g]))
    retained = np.array([routed[g].kept_mass / routed[g].topk_mass for g in st.group_of_layer])
    weight_sum = np.array([routed[g].mean_weight_sum for g in st.group_of_layer])
    return writer.arrays(
        retained_gate_mass=retained, mean_weight_sum=weight_sum, sample_chosen=routed[0].chosen,
        balancing=st.balancing,
    )  # fmt: skip


def _max_nodes(features: np.ndarray, cols: FeatureColumns) -> np.ndarray:
    """Per node pattern, the most node slots any pool token reached."""
    return np.array(
        [
            features[:, cols.node_offset(p) : cols.node_offset(p) + int(n)].sum(axis=1).max()
            for p, n in enumerate(cols.slots)
        ]
    )


def build_from_trace(scenario: Scenario, policy: RoutingPolicy) -> PlanArrays:
    """Replay the last step of a router trace recorded by hw_validate (:mod:`sim.inputs.router_trace`)."""
    r = scenario.routing
    if policy.label != r.policy_string:
        raise InputError(
            f"generator: trace replays recorded choices of policy {r.policy_string}; it cannot apply "
            f"{policy.label}",
            field="--policy",
        )
    if r.aux_free_balancing.enabled:
        raise InputError("has no effect with generator: trace", field="routing.aux_free_balancing.enabled")
    assert r.trace is not None
    path = scenario.resolve_path(r.trace)
    trace = load_trace(path)
    m = scenario.model
    want = {
        "num_experts": m.num_experts,
        "top_k": m.top_k,
        "ep": scenario.ep,
        "world_size": scenario.world_size,
        "moe_layers": m.num_moe_layers,
        "tokens_per_micro_batch": scenario.tokens_per_micro_batch,
    }
    for key, value in want.items():
        if getattr(trace, key) != value:
            raise InputError(
                f"trace has {key} = {getattr(trace, key)} but the scenario needs {value}",
                file=str(path),
                field=key,
            )
    micro = scenario.training.grad_accum_steps
    if trace.micro_batches < micro:
        raise InputError(
            f"trace has {trace.micro_batches} micro-batches per step, the scenario {micro}",
            file=str(path),
            field="records",
        )
    layout = ExpertLayout.of(scenario)
    cols = FeatureColumns.of(layout)
    step = trace.num_steps - 1
    assigned = trace.assigned[step, :micro].swapaxes(0, 1).astype(np.int32)
    kept = trace.kept[step, :micro].swapaxes(0, 1).astype(np.int32)
    rank_tokens, node_tokens = estimate_distinct(kept, layout, cols, scenario.tokens_per_micro_batch, m.top_k)
    writer = CountsWriter(layout, cols, m.num_moe_layers, micro, capped=True)
    for layer in range(m.num_moe_layers):
        counts = LayerCounts.of(assigned[layer], kept[layer], rank_tokens[layer], node_tokens[layer], layout)
        writer.add(layer, counts)
    return writer.arrays()


def estimate_distinct(
    kept: np.ndarray, layout: ExpertLayout, cols: FeatureColumns, tokens: int, top_k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct tokens per destination rank and node slot from copy counts alone (traces lack token
    sets): a token misses a set receiving c of the tokens*k copies with probability (1 - c/(tokens*k))^k."""
    lead = kept.shape[:-1]
    ep, epr = layout.ep, layout.experts_per_rank
    copies = kept.reshape(*lead, ep, epr).sum(axis=-1).astype(np.int64)

    def distinct(c: np.ndarray, experts: np.ndarray | int) -> np.ndarray:
        est = np.rint(tokens * (1.0 - (1.0 - c / (tokens * top_k)) ** top_k)).astype(np.int64)
        return np.clip(est, -(-c // np.minimum(top_k, experts)), np.minimum(c, tokens))

    rank_tokens = distinct(copies, epr)
    node_tokens = np.zeros((*lead, cols.max_slots), dtype=np.int64)
    pattern_of_rank = cols.pattern_of_group[np.arange(layout.world) // ep]
    for p, slots in enumerate(cols.patterns):
        sel = np.flatnonzero(pattern_of_rank == p)
        n = int(slots.max()) + 1
        starts = np.searchsorted(slots, np.arange(n))
        slot_copies = np.add.reduceat(copies[..., sel, :], starts, axis=-1)
        node_tokens[..., sel, :n] = distinct(slot_copies, np.diff(np.append(starts, ep)) * epr)
    return rank_tokens.astype(np.int32), node_tokens.astype(np.int32)


def build_balanced(scenario: Scenario, policy: RoutingPolicy) -> PlanArrays:
    """``generator: balanced``: every expert gets exactly its share of every rank's token copies, as
    forced-balance benchmarks route. Token ``i`` takes experts ``perm[(i k + j) mod E]``, j < k: with
    ``balanced_pattern: contiguous`` ``perm`` is the identity (AutoModel's fake balanced gate: a token's
    experts are neighbours, so mostly on one rank), with ``spread`` a seeded permutation per layer and
    micro-batch (Megatron's ``moe_router_force_load_balancing`` spreads a token's experts at random).
    Every rank routes alike, so every lane does the same work."""
    r, m = scenario.routing, scenario.model
    lay = ExpertLayout.of(scenario)
    cols = FeatureColumns.of(lay)
    layers, micro = m.num_moe_layers, scenario.training.grad_accum_steps
    tokens, k, e = scenario.routed_tokens_per_rank, m.top_k, m.num_experts
    writer = CountsWriter(lay, cols, layers, micro, capped=False)
    assigned = np.zeros((micro, 1, e), dtype=np.int32)  # one layer; every rank alike
    rank_tokens = np.zeros((micro, 1, lay.ep), dtype=np.int32)
    node_tokens = np.zeros((micro, lay.world, cols.max_slots), dtype=np.int32)
    pattern_of_rank = cols.pattern_of_group[np.arange(lay.world) // lay.ep]
    i = np.arange(tokens)
    limited = policy.name != "topk"
    if limited:  # group-limited: M groups per token, k / M experts in each, both taken round-robin
        gs, mg = int(policy.group_size), int(policy.max_groups)
        if k % mg:
            raise InputError(f"generator: balanced with {policy.label} needs top_k ({k}) divisible by M ({mg})",
                             field="routing.max_groups")  # fmt: skip
        per, n_groups = k // mg, e // gs
    for layer in range(layers):
        for mb in range(micro):
            rng = np.random.default_rng([r.seed, 18, layer, mb])
            if limited:
                gperm = rng.permutation(n_groups) if r.balanced_pattern == "spread" else np.arange(n_groups)
                slot = i[:, None] * mg + np.arange(mg)[None, :]  # (tokens, M) group slots
                group = gperm[slot % n_groups]
                visit = slot // n_groups  # how often this group was taken before
                inner = (visit[:, :, None] * per + np.arange(per)[None, None, :]) % gs
                chosen = (group[:, :, None] * gs + inner).reshape(tokens, k)
            else:
                perm = rng.permutation(e) if r.balanced_pattern == "spread" else np.arange(e)
                chosen = perm[(i[:, None] * k + np.arange(k)[None, :]) % e]  # (tokens, k)
            assigned[mb, 0] = np.bincount(chosen.ravel(), minlength=e)
            dst = chosen // lay.experts_per_rank
            reach = np.zeros((tokens, lay.ep), dtype=bool)
            reach[np.repeat(i, k), dst.ravel()] = True
            rank_tokens[mb, 0] = reach.sum(axis=0)
            for p, slots in enumerate(cols.patterns):
                node_reach = np.zeros((tokens, cols.max_slots), dtype=bool)
                node_reach[np.repeat(i, k), slots[dst.ravel()]] = True
                node_tokens[mb, pattern_of_rank == p] = node_reach.sum(axis=0)
        every = np.broadcast_to(assigned, (micro, lay.world, e))
        ranks = np.broadcast_to(rank_tokens, (micro, lay.world, lay.ep))
        writer.add(layer, LayerCounts.of(every, every, ranks, node_tokens, lay))
    return writer.arrays(retained_gate_mass=np.ones(layers), mean_weight_sum=np.ones(layers))


def build_exact(scenario: Scenario, policy: RoutingPolicy, pool_tokens: int = POOL_TOKENS) -> PlanArrays:
    """Every token sampled, routed and capacity-dropped on its own rank, in DeepSpeed's order."""
    st = _Setup(scenario, policy, pool_tokens)
    lay, cols, k, s_tok, e = st.layout, st.cols, st.model.top_k, st.tokens, st.layout.num_experts
    w = lay.world
    cap = st.capacity()
    order = drop_order(k, st.r.drop_policy)
    writer = st.writer()
    mass = np.zeros((st.layers, 3))
    for layer in range(st.layers):
        g = int(st.group_of_layer[layer])
        counts = []
        for mb in range(st.micro):
            rng = np.random.default_rng([st.r.seed, 14, layer, mb])
            n_seq = w * max(1, s_tok // st.seq_len)
            latent = rng.standard_normal((n_seq, e), dtype=np.float32) if st.rho > 0 else None
            logits = sample_logits(rng, st.mu[layer], w * s_tok, st.seq_len, latent, st.rho)
            rt = route_tokens(logits, st.model, st.r.route_scale, policy, st.bias[g])
            chosen = rt.chosen.reshape(w, s_tok, k)
            if cap is None:
                kept = np.ones(chosen.shape, dtype=bool)
            else:
                drop_rng = np.random.default_rng([st.r.seed, 15, layer, mb])
                kept = keep_mask(chosen, rt.gate.reshape(w, s_tok, k), e, cap, order, drop_rng)
            counts.append(aggregate_batches(chosen, kept, lay, cols))
            mass[layer] += (rt.kept_mass, rt.topk_mass, rt.mean_weight_sum / st.micro)
        writer.add(layer, LayerCounts.of(*(np.stack(c) for c in zip(*counts, strict=True)), lay))
    retained, weight_sum = mass[:, 0] / mass[:, 1], mass[:, 2]
    return writer.arrays(
        retained_gate_mass=retained, mean_weight_sum=weight_sum, sample_chosen=st.route_pool(0).chosen,
        balancing=st.balancing,
    )  # fmt: skip


__all__ = [
    "POOL_TOKENS",
    "build_balanced",
    "build_exact",
    "build_from_trace",
    "build_pooled",
    "estimate_distinct",
]
