"""Exact per-token routing: scores -> chosen experts, and what each token sends where.

A token's *features* are the indicator vectors the traffic model sums over a rank's batch:
which experts it uses (E columns, k ones), which EP-local ranks it reaches (``ep`` columns, one per
distinct destination rank) and which node slots (per node pattern of the EP groups, one per
distinct destination node). Summed over a batch they give expert counts, distinct tokens per
destination rank (DeepEP-style per-rank dedup) and per destination node (hierarchical all-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.inputs.scenario import ModelConfig
from sim.routing.gates import combine_weights, gate_scores
from sim.routing.policy import ExpertLayout, RoutingPolicy, select_experts, topk_mass


@dataclass
class RoutedTokens:
    """Chosen experts (tokens, k) and their raw gate scores; over the measured tokens, the retained
    mass numerator/denominator and the mean sum of final routing weights."""

    chosen: np.ndarray
    gate: np.ndarray
    kept_mass: float
    topk_mass: float
    mean_weight_sum: float


def route_tokens(
    logits: np.ndarray,
    model: ModelConfig,
    route_scale: float,
    policy: RoutingPolicy,
    bias: np.ndarray | None = None,
    mass_tokens: int | None = None,
) -> RoutedTokens:
    """Score and route every token exactly. Retained mass compares the chosen experts' unbiased
    scores with plain top-k, over about ``mass_tokens`` evenly strided tokens (all when None);
    routing weights follow ``model.norm_topk_prob`` and ``route_scale``."""
    scores = gate_scores(logits, model.score_function)
    chosen = select_experts(scores, model.top_k, policy, bias)
    gate = np.take_along_axis(scores, chosen, axis=-1)
    part = slice(None, None, max(1, len(logits) // mass_tokens) if mass_tokens else 1)
    kept_mass = float(gate[part].sum(dtype=np.float64))
    weights = combine_weights(scores[part], chosen[part], model.norm_topk_prob, route_scale)
    weight_sum = float(weights.sum(axis=1).mean())
    if policy.name == "topk" and bias is None:
        return RoutedTokens(chosen, gate, kept_mass, kept_mass, weight_sum)
    best = float(topk_mass(scores[part], model.top_k).sum())
    return RoutedTokens(chosen, gate, kept_mass, best, weight_sum)


@dataclass(frozen=True)
class FeatureColumns:
    """Column layout of token features: experts, EP-local ranks, then node slots of each pattern."""

    num_experts: int
    ep: int
    patterns: np.ndarray  # (patterns, ep) node slot of each EP-local rank
    pattern_of_group: np.ndarray  # (groups,)

    @classmethod
    def of(cls, layout: ExpertLayout) -> FeatureColumns:
        patterns, of_group = layout.patterns()
        return cls(layout.num_experts, layout.ep, patterns, of_group)

    @property
    def slots(self) -> np.ndarray:
        """Node slots of each pattern."""
        return self.patterns.max(axis=1) + 1

    @property
    def max_slots(self) -> int:
        return int(self.slots.max())

    def node_offset(self, p: int) -> int:
        return self.num_experts + self.ep + int(self.slots[:p].sum())

    @property
    def width(self) -> int:
        return self.num_experts + self.ep + int(self.slots.sum())


def token_features(chosen: np.ndarray, layout: ExpertLayout, cols: FeatureColumns) -> np.ndarray:
    """(tokens, cols.width) float32 0/1 indicators of experts, destination ranks and node slots."""
    n = chosen.shape[0]
    f = np.zeros((n, cols.width), dtype=np.float32)
    rows = np.repeat(np.arange(n), chosen.shape[1])
    flat = chosen.ravel()
    dst = flat // layout.experts_per_rank
    f[rows, flat] = 1.0
    f[rows, cols.num_experts + dst] = 1.0
    for p, slots in enumerate(cols.patterns):
        f[rows, cols.node_offset(p) + slots[dst]] = 1.0
    return f


def aggregate_batches(
    chosen: np.ndarray, kept: np.ndarray, layout: ExpertLayout, cols: FeatureColumns
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per rank: assigned and kept copies per expert, distinct kept tokens per dst rank and node slot.

    ``chosen``/``kept`` are (world, tokens, k): rank r's local batch.
    """
    w, s, k = chosen.shape
    e, ep, epr = layout.num_experts, layout.ep, layout.experts_per_rank
    bucket = (np.arange(w)[:, None, None] * e + chosen).ravel()
    assigned = np.bincount(bucket, minlength=w * e).reshape(w, e)
    kept_counts = np.bincount(bucket[kept.ravel()], minlength=w * e).reshape(w, e)
    dst = chosen // epr
    token = (np.arange(w)[:, None, None] * s + np.arange(s)[None, :, None]).repeat(k, axis=2)
    reach = np.zeros((w * s, ep), dtype=bool)
    reach[token[kept], dst[kept]] = True
    rank_tokens = reach.reshape(w, s, ep).sum(axis=1)
    slot_of = cols.patterns[cols.pattern_of_group[np.arange(w) // ep]]  # (world, ep)
    slot = np.take_along_axis(slot_of[:, None, :], dst.reshape(w, 1, s * k), axis=2).reshape(w, s, k)
    node_reach = np.zeros((w * s, cols.max_slots), dtype=bool)
    node_reach[token[kept], slot[kept]] = True
    node_tokens = node_reach.reshape(w, s, cols.max_slots).sum(axis=1)
    return assigned, kept_counts, rank_tokens, node_tokens


__all__ = ["FeatureColumns", "RoutedTokens", "aggregate_batches", "route_tokens", "token_features"]
