"""Fast routing: per-rank counts drawn from the moments of a pool of exactly routed tokens.

A rank's batch of S tokens sums S token feature vectors (:mod:`sim.routing.tokens`). When tokens
are i.i.d., the sum has mean ``S * m`` and covariance ``S * Sigma`` with ``m, Sigma`` the mean and
covariance of one token's features, and by the central limit theorem it is close to Gaussian when
S is large (hundreds of tokens and more). So: route a pool of P tokens per layer distribution
exactly, keep ``m`` and a square root of ``Sigma``, and draw every (layer, micro-batch, rank) count
vector as one correlated Gaussian vector, rounded and clipped to what counts can be. The joint
covariance keeps what matters for imbalance: a token's k experts are distinct, group-limited
policies cluster them on few nodes, and expert, rank and node counts move together.

With ``sequence_correlation`` the pool is J sequence *types* (latent preferences) of P/J tokens; a
sequence of the batch draws a type, the counts add ``seq_len * m_type`` per sequence and a
within-sequence Gaussian. Type means estimated from P/J tokens carry sampling noise
``tr(Sigma_w) / (P/J)`` which is removed by shrinking them towards the pool mean (empirical Bayes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.routing.policy import ExpertLayout
from sim.routing.tokens import FeatureColumns


@dataclass
class PoolMoments:
    """Per-token feature mean, within-sequence covariance square root and (shrunk) type means."""

    mean: np.ndarray
    sqrt_cov: np.ndarray
    type_means: np.ndarray | None


def pool_moments(features: np.ndarray, types: int = 1) -> PoolMoments:
    """Moments of a (P, D) feature pool whose rows are ``types`` contiguous equal blocks."""
    p, d = features.shape
    gram = (features.T @ features).astype(np.float64) / p
    if types == 1:
        mean = features.mean(axis=0, dtype=np.float64)
        cov = gram - np.outer(mean, mean)
        return PoolMoments(mean, _sqrt_psd(cov), None)
    per_type = p // types
    means = features.reshape(types, per_type, d).mean(axis=1, dtype=np.float64)
    mean = means.mean(axis=0)
    within = gram - means.T @ means / types
    dev = means - mean
    between = float((dev * dev).sum()) / (types - 1)
    noise = float(np.trace(within)) / per_type
    shrink = math.sqrt(max(0.0, 1.0 - noise / between)) if between > 0 else 0.0
    return PoolMoments(mean, _sqrt_psd(within), mean + shrink * dev)


def _sqrt_psd(cov: np.ndarray) -> np.ndarray:
    """L with L @ L.T = cov. The covariance is singular (a token's k expert indicators sum to k), so
    Cholesky runs on cov + 1e-9 I (10x faster than an eigen-decomposition); eigh if that fails."""
    sym = (cov + cov.T) / 2
    try:
        return np.linalg.cholesky(sym + 1e-9 * np.eye(len(sym))).astype(np.float32)
    except np.linalg.LinAlgError:
        w, v = np.linalg.eigh(sym)
        return (v * np.sqrt(np.clip(w, 0.0, None))).astype(np.float32)


def gaussian_features(
    moments: PoolMoments, noise: np.ndarray, tokens: int, seq_len: int, type_counts: np.ndarray | None
) -> np.ndarray:
    """(cells, D) summed features of ``tokens``-token batches; ``noise`` is (cells, D) standard normal."""
    x = (noise @ moments.sqrt_cov.T).astype(np.float64)
    x *= math.sqrt(tokens)
    if moments.type_means is None or type_counts is None:
        x += tokens * moments.mean
    else:
        x += seq_len * (type_counts @ moments.type_means)
    return x


def round_counts(
    x: np.ndarray,
    layout: ExpertLayout,
    cols: FeatureColumns,
    pattern_of_cell: np.ndarray,
    tokens: int,
    top_k: int,
    max_nodes: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integer counts from summed features: (cells, E) expert copies summing to tokens*k,
    (cells, ep) distinct tokens per EP-local rank and (cells, max_slots) per node slot, each clipped
    to the range the per-token constraints allow; ``max_nodes[p]`` (the most node slots of pattern
    p one pool token reached: M for a binding node limit) caps the nodes summed over slots."""
    cells = x.shape[0]
    e, ep, epr = layout.num_experts, layout.ep, layout.experts_per_rank
    rows = np.arange(cells)
    assigned = np.clip(np.rint(x[:, :e]), 0, tokens).astype(np.int64)
    short = tokens * top_k - assigned.sum(axis=1)
    biggest = assigned.argmax(axis=1)
    assigned[rows, biggest] += short
    copies = assigned.reshape(cells, ep, epr).sum(axis=2)
    low = -(-copies // min(top_k, epr))
    rank_tokens = np.clip(np.rint(x[:, e : e + ep]).astype(np.int64), low, np.minimum(copies, tokens))
    node_tokens = np.zeros((cells, cols.max_slots), dtype=np.int64)
    for p, slots in enumerate(cols.patterns):
        sel = np.flatnonzero(pattern_of_cell == p)
        if sel.size == 0:
            continue
        n = int(slots.max()) + 1
        starts = np.searchsorted(slots, np.arange(n))
        per_slot = np.add.reduceat(rank_tokens[sel], starts, axis=1)
        floor = np.maximum.reduceat(rank_tokens[sel], starts, axis=1)
        slot_experts = np.diff(np.append(starts, ep)) * epr
        copy_floor = -(-np.add.reduceat(copies[sel], starts, axis=1) // np.minimum(top_k, slot_experts))
        raw = np.rint(x[sel, cols.node_offset(p) : cols.node_offset(p) + n]).astype(np.int64)
        nodes = np.clip(raw, np.maximum(floor, copy_floor), np.minimum(per_slot, tokens))
        excess = np.maximum(nodes.sum(axis=1) - tokens * int(max_nodes[p]), 0)
        nodes[np.arange(sel.size), nodes.argmax(axis=1)] -= excess
        node_tokens[sel, :n] = nodes
    return assigned, rank_tokens, node_tokens


def survive(distinct: np.ndarray, copies: np.ndarray, kept_copies: np.ndarray) -> np.ndarray:
    """Distinct tokens of a destination left after drops: a token with c copies there loses all of
    them with probability d^c, d the destination's copy drop rate and c its mean copies per token
    (copies dropped independently: an approximation, token sets are not kept in the pooled path)."""
    drop = 1.0 - kept_copies / np.maximum(copies, 1)
    per_token = copies / np.maximum(distinct, 1)
    return np.rint(distinct * (1.0 - drop**per_token)).astype(np.int64)


def cap_counts(
    assigned: np.ndarray,
    rank_tokens: np.ndarray,
    node_tokens: np.ndarray,
    layout: ExpertLayout,
    cols: FeatureColumns,
    pattern_of_cell: np.ndarray,
    capacity: int,
    top_k: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Counts after capacity: every expert keeps min(assigned, C) copies (exact for DeepSpeed's
    orders); distinct tokens per rank and node slot follow :func:`survive`."""
    cells = assigned.shape[0]
    ep, epr = layout.ep, layout.experts_per_rank
    kept = np.minimum(assigned, capacity)
    copies = assigned.reshape(cells, ep, epr).sum(axis=2)
    kept_copies = kept.reshape(cells, ep, epr).sum(axis=2)
    low = -(-kept_copies // min(top_k, epr))
    rank_kept = np.clip(survive(rank_tokens, copies, kept_copies), low, np.minimum(kept_copies, rank_tokens))
    node_kept = np.zeros_like(node_tokens)
    for p, slots in enumerate(cols.patterns):
        sel = np.flatnonzero(pattern_of_cell == p)
        if sel.size == 0:
            continue
        n = int(slots.max()) + 1
        starts = np.searchsorted(slots, np.arange(n))
        slot_copies = np.add.reduceat(copies[sel], starts, axis=1)
        slot_kept = np.add.reduceat(kept_copies[sel], starts, axis=1)
        floor = np.maximum.reduceat(rank_kept[sel], starts, axis=1)
        upper = np.minimum(node_tokens[sel, :n], np.add.reduceat(rank_kept[sel], starts, axis=1))
        node_kept[sel, :n] = np.clip(survive(node_tokens[sel, :n], slot_copies, slot_kept), floor, upper)
    return kept, rank_kept, node_kept


__all__ = ["PoolMoments", "cap_counts", "survive", "gaussian_features", "pool_moments", "round_counts"]
