"""Expert capacity and token dropping, as DeepSpeed's ``deepspeed/moe/sharded_moe.py`` does them.

Each rank gates its own local batch of S = micro_batch_size x seq_len tokens:
- capacity ``C = max(ceil(S / E * capacity_factor * k), min_capacity)`` (``_capacity``; computed in
  float32 because ``capacity_factor * k`` is a float32 tensor there). ``top2gating`` passes
  ``capacity_factor * 2`` and ``topkgating`` ``capacity_factor * k``: the same formula.
- which copies an over-full expert keeps: k = 1 ``top1gating`` with random token selection (RTS);
  k = 2 ``top2gating``: all first choices in token order, then second choices; k >= 3
  ``topkgating``: the C highest gate probabilities (``drop_policy: probs``) or the first C tokens
  (``position``). In every case an expert keeps min(assigned, C) copies.
- ``drop_tokens=False`` (``capacity_factor: null`` here): no drops, and the padded buffer's capacity
  is the largest expert count, all-reduced (MAX) over the EP group.
"""

from __future__ import annotations

import numpy as np


def deepspeed_capacity(
    tokens: int, num_experts: int, top_k: int, capacity_factor: float, min_capacity: int
) -> int:
    """Tokens one expert accepts from one rank's batch (``sharded_moe._capacity``)."""
    factor = np.float32(capacity_factor * top_k)
    capacity = int(np.ceil(np.float32(tokens / num_experts) * factor))
    return max(capacity, int(min_capacity))


def drop_order(top_k: int, drop_policy: str) -> str:
    """The order DeepSpeed's gating keeps copies in for this k: random, first_choice, probs, position."""
    if top_k == 1:
        return "random"
    if top_k == 2:
        return "first_choice"
    return drop_policy


def keep_mask(
    chosen: np.ndarray,
    gate: np.ndarray,
    num_experts: int,
    capacity: int,
    order: str,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """(batches, tokens, k) bool: which copies survive capacity, each batch (rank) on its own.

    ``chosen`` (batches, tokens, k) holds expert ids best first; ``gate`` the same copies' gate
    probabilities (used by ``probs``). Within every (batch, expert) the ``capacity`` copies with the
    best priority are kept.
    """
    b, s, k = chosen.shape
    token = np.broadcast_to(np.arange(s)[None, :, None], chosen.shape)
    if order == "random":
        if rng is None:
            raise ValueError("random token selection needs an rng")
        key = -rng.random(chosen.shape)
    elif order == "first_choice":
        key = np.broadcast_to(np.arange(k)[None, None, :], chosen.shape) * s + token
    elif order == "position":
        key = token.astype(np.float64)
    elif order == "probs":
        key = -gate.astype(np.float64)
    else:
        raise ValueError(f"unknown drop order {order!r}")
    bucket = (np.arange(b)[:, None, None] * num_experts + chosen).ravel()
    sort = np.lexsort((np.asarray(key, dtype=np.float64).ravel(), bucket))
    sorted_bucket = bucket[sort]
    counts = np.bincount(sorted_bucket, minlength=b * num_experts)
    starts = np.cumsum(counts) - counts
    position = np.arange(sorted_bucket.size) - starts[sorted_bucket]
    kept = np.empty(bucket.size, dtype=bool)
    kept[sort] = position < capacity
    return kept.reshape(b, s, k)


def padded_capacity(assigned: np.ndarray, ep: int, tokens: int, top_k: int) -> np.ndarray:
    """``drop_tokens=False`` capacity per EP group: max expert count over the group's ranks.

    ``assigned`` is (..., world, experts); returns (..., groups). ``top1gating`` caps it at the
    batch size; ``top2gating``/``topkgating`` do not.
    """
    lead = assigned.shape[:-2]
    world, experts = assigned.shape[-2:]
    return group_padding(assigned.reshape(*lead, world // ep, ep * experts).max(axis=-1), tokens, top_k)


def group_padding(group_max: np.ndarray, tokens: int, top_k: int) -> np.ndarray:
    """:func:`padded_capacity` from the largest expert count of each EP group."""
    return np.minimum(group_max, tokens) if top_k == 1 else group_max


__all__ = ["deepspeed_capacity", "drop_order", "group_padding", "keep_mask", "padded_capacity"]
