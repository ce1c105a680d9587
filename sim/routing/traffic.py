"""Traffic matrices and routing statistics from per-rank counts.

Counts are (..., world, ...) arrays (see :class:`sim.routing.plan.RoutingPlan`); expert
``e`` of rank r's EP group lives on EP-local rank ``e // (E / ep)``. Token *copies* count one per
(token, expert); *distinct* tokens count a token once per destination rank or node.
Definitions (all over kept copies, after capacity drops):
- local / intra-node / inter-node fraction: copies whose expert is on the source rank / another
  rank of the same node / another node;
- max-over-mean load: per (layer, micro-batch), the most loaded rank's (or expert's) received
  tokens over the mean, averaged over layers and micro-batches (the all-to-all barrier waits for it);
- ``touched(n)``: distinct experts a batch of n tokens uses; with i.i.d. uniform routing its mean is
  E * (1 - (1 - k/E)^n) (each expert is missed by one token with probability 1 - k/E).
"""

from __future__ import annotations

import numpy as np

from sim.routing.policy import ExpertLayout
from sim.routing.tokens import FeatureColumns


def rank_copies(kept: np.ndarray, layout: ExpertLayout) -> np.ndarray:
    """(..., world, ep) copies each source rank sends to each EP-local rank of its group."""
    lead = kept.shape[:-1]
    return kept.reshape(*lead, layout.ep, layout.experts_per_rank).sum(axis=-1, dtype=np.int64)


def group_matrix(per_dst: np.ndarray, layout: ExpertLayout) -> np.ndarray:
    """(world, world) matrix from (world, ep) per-EP-local-destination values; zero outside EP groups."""
    g, ep = layout.num_ep_groups, layout.ep
    out = np.zeros((g, ep, g, ep), dtype=per_dst.dtype)
    idx = np.arange(g)
    out[idx, :, idx, :] = per_dst.reshape(g, ep, ep)
    return out.reshape(layout.world, layout.world)


def node_matrix(node_tokens: np.ndarray, layout: ExpertLayout) -> np.ndarray:
    """(world, nodes) distinct tokens from (world, node slots) counts of each rank's EP group."""
    out = np.zeros((layout.world, layout.num_nodes), dtype=node_tokens.dtype)
    first = layout.first_node_of_group()[np.arange(layout.world) // layout.ep]
    for slot in range(node_tokens.shape[1]):
        ok = first + slot < layout.num_nodes
        out[np.flatnonzero(ok), first[ok] + slot] = node_tokens[ok, slot]
    return out


def received(kept: np.ndarray, layout: ExpertLayout) -> np.ndarray:
    """(..., world, experts_per_rank) tokens each local expert replica receives."""
    lead = kept.shape[:-2]
    g, ep, e = layout.num_ep_groups, layout.ep, layout.num_experts
    per_group = kept.reshape(*lead, g, ep, e).sum(axis=-2, dtype=np.int64)
    return per_group.reshape(*lead, layout.world, layout.experts_per_rank)


def locality_masks(layout: ExpertLayout, cols: FeatureColumns) -> tuple[np.ndarray, np.ndarray]:
    """(world, ep) bool masks: destination is the source rank itself / on the source's node."""
    ranks = np.arange(layout.world)
    local = np.arange(layout.ep)[None, :] == (ranks % layout.ep)[:, None]
    slots = cols.patterns[cols.pattern_of_group[ranks // layout.ep]]
    same_node = slots == slots[ranks, ranks % layout.ep][:, None]
    return local, same_node


def max_over_mean(load: np.ndarray) -> np.ndarray:
    """max / mean over the last axis (1 where nothing is loaded)."""
    mean = load.mean(axis=-1)
    return np.where(mean > 0, load.max(axis=-1) / np.where(mean > 0, mean, 1), 1.0)


def uniform_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Mean distinct experts hit by ``tokens`` i.i.d. uniformly routed tokens: E(1-(1-k/E)^n)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def measured_touched(
    chosen: np.ndarray, tokens: int, rng: np.random.Generator, reps: int = 256
) -> float | None:
    """Mean distinct experts over up to ``reps`` disjoint random batches of ``tokens`` pool tokens."""
    pool = chosen.shape[0]
    if tokens > pool:
        return None
    batches = min(reps, pool // tokens)
    pick = rng.permutation(pool)[: batches * tokens].reshape(batches, tokens)
    hit = np.zeros((batches, int(chosen.max()) + 1), dtype=bool)
    hit[np.arange(batches)[:, None, None], chosen[pick]] = True
    return float(hit.sum(axis=1).mean())


__all__ = [
    "group_matrix",
    "locality_masks",
    "max_over_mean",
    "measured_touched",
    "node_matrix",
    "rank_copies",
    "received",
    "uniform_touched",
]
