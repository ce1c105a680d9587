"""Gate-score generators and score functions against their closed forms."""

import math

import numpy as np
import pytest

from sim.inputs.scenario import RoutingConfig
from sim.routing.gates import (
    GUMBEL_STD,
    combine_weights,
    gate_scores,
    log_popularity,
    popularity_layer_groups,
    sample_logits,
)


def _cfg(**kw) -> RoutingConfig:
    return RoutingConfig(**kw)


def test_uniform_and_zero_skew_have_no_popularity():
    assert not log_popularity(_cfg(generator="uniform", skew=2.0), 4, 16).any()
    assert not log_popularity(_cfg(generator="skewed", skew=0.0), 4, 16).any()
    assert popularity_layer_groups(_cfg(generator="skewed", skew=1.0, drift=0.0), 5).tolist() == [0] * 5
    assert popularity_layer_groups(_cfg(generator="skewed", skew=1.0, drift=0.3), 3).tolist() == [0, 1, 2]


def test_skew_is_the_log_popularity_sigma_and_drift_an_ar1_chain():
    mu = log_popularity(_cfg(generator="skewed", skew=0.5, drift=0.2, seed=3), 3, 20000)
    assert np.std(mu[0]) == pytest.approx(0.5, rel=0.03)
    assert np.std(mu[2]) == pytest.approx(0.5, rel=0.03)  # stationary
    assert np.corrcoef(mu[0], mu[1])[0, 1] == pytest.approx(0.8, abs=0.02)
    assert np.corrcoef(mu[0], mu[2])[0, 1] == pytest.approx(0.64, abs=0.02)
    same = log_popularity(_cfg(generator="skewed", skew=0.5, drift=0.0), 3, 64)
    assert (same == same[0]).all()
    independent = log_popularity(_cfg(generator="skewed", skew=0.5, drift=1.0), 2, 20000)
    assert abs(np.corrcoef(independent[0], independent[1])[0, 1]) < 0.03


def test_same_seed_same_popularity_other_seed_differs():
    a = log_popularity(_cfg(generator="skewed", skew=1.0, seed=7), 2, 32)
    b = log_popularity(_cfg(generator="skewed", skew=1.0, seed=7), 2, 32)
    c = log_popularity(_cfg(generator="skewed", skew=1.0, seed=8), 2, 32)
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c)


def test_gumbel_max_top1_frequency_is_softmax_of_popularity():
    """With rho = 0, argmax(mu + Gumbel) is a draw from softmax(mu) (Gumbel-max trick)."""
    mu = np.log(np.array([1.0, 2.0, 3.0, 4.0, 10.0]))
    n = 200_000
    x = sample_logits(np.random.default_rng(1), mu, n, n)
    freq = np.bincount(x.argmax(1), minlength=5) / n
    expected = np.exp(mu) / np.exp(mu).sum()
    sigma = np.sqrt(expected * (1 - expected) / n)
    assert (np.abs(freq - expected) < 5 * sigma).all()
    # the noise is standard Gumbel: mean Euler-Mascheroni, std pi/sqrt(6)
    noise = sample_logits(np.random.default_rng(2), np.zeros(4), n, n)
    assert noise.mean() == pytest.approx(0.5772, abs=0.01)
    assert noise.std() == pytest.approx(GUMBEL_STD, rel=0.01)


def test_sequence_correlation_is_the_within_sequence_logit_correlation():
    rho, seq_len, seqs, e = 0.4, 2, 100_000, 3
    rng = np.random.default_rng(4)
    latent = rng.standard_normal((seqs, e)).astype(np.float32)
    x = sample_logits(rng, np.zeros(e), seqs * seq_len, seq_len, latent, rho).reshape(seqs, seq_len, e)
    within = np.corrcoef(x[:, 0, 0], x[:, 1, 0])[0, 1]
    across = np.corrcoef(x[:-1, 0, 0], x[1:, 0, 0])[0, 1]
    assert within == pytest.approx(rho, abs=0.01)
    assert abs(across) < 0.01
    assert x.std() == pytest.approx(GUMBEL_STD, rel=0.01)


def test_score_functions_and_weights():
    logits = np.array([[1.0, 2.0, 3.0, -1.0]], dtype=np.float32)
    soft = gate_scores(logits.copy(), "softmax")
    np.testing.assert_allclose(soft, np.exp(logits) / np.exp(logits).sum(), rtol=1e-6)
    sig = gate_scores(logits.copy(), "sigmoid")
    np.testing.assert_allclose(sig, 1 / (1 + np.exp(-logits)), rtol=1e-6)
    chosen = np.array([[2, 1]])
    raw = combine_weights(sig, chosen, norm_topk_prob=False, route_scale=1.0)
    np.testing.assert_allclose(raw, [[1 / (1 + math.exp(-3)), 1 / (1 + math.exp(-2))]], rtol=1e-6)
    normed = combine_weights(sig, chosen, norm_topk_prob=True, route_scale=2.5)
    assert normed.sum() == pytest.approx(2.5)
    np.testing.assert_allclose(normed / 2.5, raw / raw.sum(), rtol=1e-6)
    with pytest.raises(ValueError):
        gate_scores(logits, "relu")
