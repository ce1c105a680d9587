"""Auxiliary-loss-free load balancing (DeepSeek-V3, arXiv 2412.19437 section 2.1.2).

Every expert carries a bias added to its affinity for *selection only*; after each training step
the bias of every overloaded expert drops by gamma and that of every underloaded one rises by gamma.
Here a step's load is measured on a fixed pool of exactly routed tokens of the layer's distribution,
so ``steps`` simulated warm-up steps give the bias the measured step routes with, and the history of
max/mean expert load shows the imbalance shrinking.
"""

from __future__ import annotations

import numpy as np

from sim.routing.policy import RoutingPolicy, select_experts


def aux_free_bias(
    scores: np.ndarray, top_k: int, policy: RoutingPolicy, gamma: float, steps: int
) -> tuple[np.ndarray, list[float]]:
    """Bias after ``steps`` updates on the pool ``scores`` (tokens, E), and max/mean expert load
    before each update and after the last (``steps + 1`` values)."""
    num_experts = scores.shape[1]
    bias = np.zeros(num_experts, dtype=np.float32)
    history: list[float] = []
    for step in range(steps + 1):
        chosen = select_experts(scores, top_k, policy, bias if step else None)
        load = np.bincount(chosen.ravel(), minlength=num_experts).astype(np.float64)
        history.append(float(load.max() / load.mean()))
        if step < steps:
            bias += np.float32(gamma) * np.sign(load.mean() - load).astype(np.float32)
    return bias, history


__all__ = ["aux_free_bias"]
