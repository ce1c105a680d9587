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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from sim.routing.counts import LayerCounts
from sim.routing.policy import ExpertLayout
from sim.routing.tokens import FeatureColumns

#: Cells ((micro-batch, rank) pairs) drawn and rounded at a time.
CHUNK_ROWS = 4096


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


def feature_shift(moments: PoolMoments, tokens: int, seq_len: int, types: np.ndarray | None) -> np.ndarray:
    """The mean part of the summed features: ``tokens * m`` (D,), or with sequence types ``types``
    (cells, sequences) per cell ``seq_len`` times the sum of its sequences' type means (cells, D)."""
    if moments.type_means is None or types is None:
        return tokens * moments.mean
    cells, seqs = types.shape
    if seqs == 1:  # one-hot type counts: their product with the type means is a row lookup, exactly
        return seq_len * moments.type_means[types[:, 0]]
    n = moments.type_means.shape[0]
    counts = np.bincount((np.arange(cells)[:, None] * n + types).ravel(), minlength=cells * n)
    return seq_len * (counts.reshape(cells, n).astype(np.float64) @ moments.type_means)


def prefetched_noise(rng: np.random.Generator, shape: tuple[int, int], count: int) -> Iterator[np.ndarray]:
    """``count`` float32 standard normal arrays of ``shape`` drawn from ``rng`` in order, each by a
    worker thread while the previous one is used (the draw releases the GIL): the same numbers as
    drawing them in turn, in two buffers that alternate (one is valid until the next is asked for)."""
    bufs = [np.empty(shape, dtype=np.float32) for _ in range(min(count, 2))]

    def fill(i: int) -> np.ndarray:
        return rng.standard_normal(dtype=np.float32, out=bufs[i % 2])

    with ThreadPoolExecutor(max_workers=1) as worker:
        pending = worker.submit(fill, 0) if count else None
        for i in range(count):
            noise = pending.result()
            if i + 1 < count:
                pending = worker.submit(fill, i + 1)
            yield noise


class CountDraw:
    """Counts of every cell ((micro-batch, rank) pair) of one layer from its summed features
    ``x = sqrt(tokens) L noise + shift`` (L the covariance root, ``shift`` :func:`feature_shift`):
    expert copies rounded, clipped to [0, tokens] and topped up to tokens x k on the largest; distinct
    tokens per rank and node slot (:func:`_round_ranks_nodes`); capacity (:func:`_cap`).

    The float64 features go a chunk of cells (whole EP groups) at a time, in cache, and are reduced
    there to what the plan keeps (copies per rank, rows per expert; group maxima when ``group_max``);
    the E-wide int32 counts are written only when ``wide``. The buffers are the layer's and are reused
    by the next (fresh pages of a large array cost more than the arithmetic on it). Copies per rank
    are a 0/1 matrix product, exact on these integers."""

    def __init__(
        self,
        layout: ExpertLayout,
        cols: FeatureColumns,
        pattern_of_cell: np.ndarray,
        tokens: int,
        top_k: int,
        capacity: int | None,
        wide: bool,
        group_max: bool,
    ):
        cells, e, ep = len(pattern_of_cell), layout.num_experts, layout.ep
        self.layout, self.cols, self.pattern_of_cell = layout, cols, pattern_of_cell
        self.tokens, self.top_k, self.capacity = tokens, top_k, capacity
        self.chunk = max(1, CHUNK_ROWS // ep) * ep
        self._y = np.empty((cells, cols.width), dtype=np.float32)
        self._x = np.empty((min(self.chunk, cells), cols.width))
        self._assigned = np.empty((cells, e), dtype=np.int32) if wide else None
        self._kept = np.empty((cells, e), dtype=np.int32) if wide and capacity is not None else self._assigned
        self._rank_tokens = np.empty((cells, ep), dtype=np.int32)
        self._node_tokens = np.empty((cells, cols.max_slots), dtype=np.int32)
        self._copies = np.empty((cells, ep), dtype=np.int32)
        self._rows = np.empty((cells // ep, e), dtype=np.int32)  # per EP group and expert
        self._group_max = np.empty(cells // ep, dtype=np.int64) if group_max else None
        self._to_rank = np.repeat(np.eye(ep), layout.experts_per_rank, axis=0)  # (E, ep): expert -> its rank

    def counts(
        self, noise: np.ndarray, moments: PoolMoments, shift: np.ndarray, max_nodes: np.ndarray
    ) -> LayerCounts:
        """The layer's counts from its (cells, D) float32 standard normal ``noise`` (views of the
        buffers, valid until the next call)."""
        lay, tokens, top_k, cap = self.layout, self.tokens, self.top_k, self.capacity
        e, ep = lay.num_experts, lay.ep
        y = np.matmul(noise, moments.sqrt_cov.T, out=self._y)
        scale = np.float64(math.sqrt(tokens))
        for a in range(0, len(y), self.chunk):
            b = min(a + self.chunk, len(y))
            x = np.multiply(y[a:b], scale, out=self._x[: b - a], dtype=np.float64)
            x += shift if shift.ndim == 1 else shift[a:b]
            np.rint(x, out=x)
            xe = x[:, :e]
            np.clip(xe, 0, tokens, out=xe)
            short = tokens * top_k - xe.sum(axis=1)
            xe[np.arange(b - a), xe.argmax(axis=1)] += short
            groups = xe.reshape(-1, ep, e)  # (groups, ep, E) view
            if self._group_max is not None:
                self._group_max[a // ep : b // ep] = groups.max(axis=(1, 2))
            if self._assigned is not None:
                self._assigned[a:b] = xe
            sent = (xe @ self._to_rank).astype(np.int64)
            where = self.pattern_of_cell[a:b]
            ranks, nodes = _round_ranks_nodes(x[:, e:], sent, lay, self.cols, where, tokens, top_k, max_nodes)
            if cap is not None:
                np.minimum(xe, cap, out=xe)
                if self._kept is not None:
                    self._kept[a:b] = xe
                kept = (xe @ self._to_rank).astype(np.int64)
                ranks, nodes = _cap(sent, kept, ranks, nodes, lay, self.cols, where, top_k)
                sent = kept
            self._rows[a // ep : b // ep] = groups.sum(axis=1)
            self._rank_tokens[a:b], self._node_tokens[a:b], self._copies[a:b] = ranks, nodes, sent
        rows = self._rows.reshape(len(y), -1)  # (groups, E) is (world, experts_per_rank) per micro-batch
        total = len(y) * tokens * top_k  # every cell's copies were topped up to tokens x k
        return LayerCounts(
            self._rank_tokens, self._node_tokens, self._copies, rows, self._group_max, total, self._assigned, self._kept
        )


def _round_ranks_nodes(
    rest: np.ndarray,
    copies: np.ndarray,
    layout: ExpertLayout,
    cols: FeatureColumns,
    pattern_of_cell: np.ndarray,
    tokens: int,
    top_k: int,
    max_nodes: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct tokens per EP-local rank (cells, ep) and per node slot (cells, max_slots) from the
    rounded rank and node features ``rest`` (the columns after the experts') and the copies per rank,
    each clipped to the range the per-token constraints allow; ``max_nodes[p]`` (the most node slots
    of pattern p one pool token reached: M for a binding node limit) caps the nodes summed over slots."""
    cells = rest.shape[0]
    e, ep, epr = layout.num_experts, layout.ep, layout.experts_per_rank
    low = -(-copies // min(top_k, epr))
    rank_tokens = np.clip(rest[:, :ep].astype(np.int64), low, np.minimum(copies, tokens))
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
        at = cols.node_offset(p) - e
        raw = rest[sel, at : at + n].astype(np.int64)
        nodes = np.clip(raw, np.maximum(floor, copy_floor), np.minimum(per_slot, tokens))
        excess = np.maximum(nodes.sum(axis=1) - tokens * int(max_nodes[p]), 0)
        nodes[np.arange(sel.size), nodes.argmax(axis=1)] -= excess
        node_tokens[sel, :n] = nodes
    return rank_tokens, node_tokens


def survive(distinct: np.ndarray, copies: np.ndarray, kept_copies: np.ndarray) -> np.ndarray:
    """Distinct tokens of a destination left after drops: a token with c copies there loses all of
    them with probability d^c, d the destination's copy drop rate and c its mean copies per token
    (copies dropped independently: an approximation, token sets are not kept in the pooled path)."""
    drop = 1.0 - kept_copies / np.maximum(copies, 1)
    per_token = copies / np.maximum(distinct, 1)
    return np.rint(distinct * (1.0 - drop**per_token)).astype(np.int64)


def _cap(
    copies: np.ndarray,
    kept_copies: np.ndarray,
    rank_tokens: np.ndarray,
    node_tokens: np.ndarray,
    layout: ExpertLayout,
    cols: FeatureColumns,
    pattern_of_cell: np.ndarray,
    top_k: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct tokens per rank and node slot after capacity: every expert keeps min(assigned, C)
    copies (exact for DeepSpeed's orders), the distinct tokens follow :func:`survive`."""
    epr = layout.experts_per_rank
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
    return rank_kept, node_kept


__all__ = [
    "CHUNK_ROWS",
    "CountDraw",
    "PoolMoments",
    "feature_shift",
    "pool_moments",
    "prefetched_noise",
    "survive",
]
