"""Seeded gate-score generators and router score functions.

Router logits of token t for expert e at MoE layer l are modelled as

    x[t, e] = mu[l, e] + sqrt(rho) * h[seq(t), e] + sqrt(1 - rho) * G[t, e]

with G standard Gumbel noise and h ~ N(0, pi^2/6) (the Gumbel variance), so ``rho`` =
``routing.sequence_correlation`` is the correlation of two tokens' logits within one sequence.
With rho = 0, top-k of x is sampling k experts without replacement with weights exp(mu) (the
Gumbel-max trick, Plackett-Luce), so exp(mu) *is* the expert popularity; top-1 picks e with
probability softmax(mu)[e].
- ``mu`` is 0 for ``generator: uniform``; for ``skewed`` it is ``skew * g`` with g ~ N(0, 1) per
  expert: log-normal popularity with sigma = ``skew`` (0 = uniform). From layer to layer g follows
  an AR(1) chain with correlation ``1 - drift`` (0 = the same popular experts in every layer,
  1 = independent layers).

Scores are ``softmax(x)`` (Mixtral, DeepSpeed, Qwen) or ``sigmoid(x)`` (DeepSeek-V3), and the
routing weights of the chosen experts are renormalised to sum to 1 or not (``norm_topk_prob``),
then scaled by ``route_scale`` (DeepSeek-V3 ``inference/model.py`` ``Gate``: 2.5).
"""

from __future__ import annotations

import math

import numpy as np

from sim.inputs.scenario import RoutingConfig

#: Standard deviation of the standard Gumbel distribution, pi / sqrt(6).
GUMBEL_STD = math.pi / math.sqrt(6.0)


def log_popularity(routing: RoutingConfig, num_layers: int, num_experts: int) -> np.ndarray:
    """(layers, experts) log-popularity ``mu``; zeros for ``uniform`` or ``skew: 0``."""
    mu = np.zeros((num_layers, num_experts))
    if routing.generator != "skewed" or routing.skew == 0:
        return mu
    rng = np.random.default_rng([routing.seed, 11])
    keep = 1.0 - routing.drift
    fresh = math.sqrt(max(0.0, 1.0 - keep * keep))
    g = rng.standard_normal(num_experts)
    for layer in range(num_layers):
        mu[layer] = routing.skew * g
        g = keep * g + fresh * rng.standard_normal(num_experts)
    return mu


def popularity_layer_groups(routing: RoutingConfig, num_layers: int) -> np.ndarray:
    """Index of the distinct logit distribution of each layer: all 0 when layers are identical in law."""
    same = routing.generator != "skewed" or routing.skew == 0 or routing.drift == 0
    return np.zeros(num_layers, dtype=np.int64) if same else np.arange(num_layers)


def sample_logits(
    rng: np.random.Generator,
    mu: np.ndarray,
    n_tokens: int,
    seq_len: int,
    seq_latent: np.ndarray | None = None,
    rho: float = 0.0,
) -> np.ndarray:
    """float32 logits (n_tokens, E) of sequence-major tokens; ``seq_latent`` (n_tokens/seq_len, E) ~ N(0, 1)."""
    x = rng.standard_exponential((n_tokens, mu.shape[-1]), dtype=np.float32)
    np.maximum(x, np.finfo(np.float32).tiny, out=x)  # float32 draws can be exactly 0
    np.log(x, out=x)
    np.negative(x, out=x)  # -log(Exp(1)) is standard Gumbel
    if rho > 0:
        if seq_latent is None:
            raise ValueError("rho > 0 needs seq_latent")
        x *= np.float32(math.sqrt(1.0 - rho))
        scale = np.float32(math.sqrt(rho) * GUMBEL_STD)
        x.reshape(-1, seq_len, mu.shape[-1])[...] += scale * seq_latent[:, None, :]
    x += mu.astype(np.float32)
    return x


def gate_scores(logits: np.ndarray, score_function: str) -> np.ndarray:
    """Router affinities: ``softmax`` over experts or elementwise ``sigmoid`` (float32)."""
    if score_function == "softmax":
        s = logits - logits.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
        return s
    if score_function == "sigmoid":
        return (1.0 / (1.0 + np.exp(-logits))).astype(logits.dtype, copy=False)
    raise ValueError(f"unknown score_function {score_function!r}")


def combine_weights(
    scores: np.ndarray, chosen: np.ndarray, norm_topk_prob: bool, route_scale: float = 1.0
) -> np.ndarray:
    """(tokens, k) routing weights of the chosen experts: gathered scores, renormalised if asked, scaled."""
    w = np.take_along_axis(scores, chosen, axis=-1).astype(np.float64)
    if norm_topk_prob:
        w /= np.maximum(w.sum(axis=-1, keepdims=True), np.finfo(np.float32).eps)
    return w * route_scale


__all__ = [
    "GUMBEL_STD",
    "combine_weights",
    "gate_scores",
    "log_popularity",
    "popularity_layer_groups",
    "sample_logits",
]
