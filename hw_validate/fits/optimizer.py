"""Optimizer fits: one optimizer step's bytes per parameter and fixed overhead
(``optimizer_bytes_per_param``, ``optimizer_step_overhead_us``), and ZeRO's backward beyond plain
autograd (``zero_grad_hook_ns_per_param``, ``zero_grad_hook_overhead_us``)."""

from __future__ import annotations

import numpy as np


def fit_optimizer(rows: list[dict], hbm_Bps: float) -> tuple[float, float]:
    """(bytes per parameter at ``hbm_Bps``, fixed overhead s) of one Adam step: ``t = c + P x slope``."""
    p = np.array([r["params"] for r in rows], dtype=np.float64)
    t = np.array([r["time_s"] for r in rows], dtype=np.float64)
    if len(p) == 1:
        return float(t[0] / p[0] * hbm_Bps), 0.0
    w = 1.0 / t  # relative error
    A = np.stack([np.ones_like(p), p], axis=1) * w[:, None]
    from scipy.optimize import lsq_linear

    sol = lsq_linear(A, np.ones_like(p), bounds=([0.0, 1e-18], [np.inf, np.inf]))
    c, slope = float(sol.x[0]), float(sol.x[1])
    return slope * hbm_Bps, c


def fit_grad_hooks(rows: list[dict]) -> tuple[float, float] | None:
    """(seconds per parameter, fixed seconds) of ZeRO's backward beyond plain autograd
    (``zero_grad_hook_ns_per_param``, ``zero_grad_hook_overhead_us``) from the DeepSpeed optimizer
    rows' ``grad_hooks_s`` at ``model_params``: ``t = c + P x slope``, least squares on relative
    error, both >= 0. Each row gets ``fit_grad_hooks_s``."""
    use = [r for r in rows if r.get("grad_hooks_s") is not None and r.get("model_params")]
    if not use:
        return None
    from scipy.optimize import lsq_linear

    p = np.array([r["model_params"] for r in use], dtype=np.float64)
    t = np.maximum(np.array([r["grad_hooks_s"] for r in use], dtype=np.float64), 1e-9)
    if len(p) == 1:
        c, slope = 0.0, float(t[0] / p[0])
    else:
        A = np.stack([np.ones_like(p), p], axis=1) / t[:, None]
        sol = lsq_linear(A, np.ones_like(p), bounds=([0.0, 0.0], [np.inf, np.inf]))
        c, slope = float(sol.x[0]), float(sol.x[1])
    for r in use:
        r["fit_grad_hooks_s"] = c + slope * r["model_params"]
    return slope, c

