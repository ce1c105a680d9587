"""The token dispatcher fit: DeepSpeed's gate, sparse encode and decode priced per eager op and
per byte (``dispatcher_op_us``, ``dispatcher_bw_GBps``), as :mod:`sim.frameworks.dispatcher` prices
them."""

from __future__ import annotations

import numpy as np

from hw_validate.fits.compute import gemm_model_times
from sim.inputs.calibration import GemmFit


def fit_dispatcher(rows: list[dict], gemm: GemmFit | None, hbm_Bps: float, launch_s: float) -> tuple[float, float] | None:
    """(seconds per eager op, bytes/s) of the token dispatcher (``dispatcher_op_us``,
    ``dispatcher_bw_GBps``) from :func:`hw_validate.microbenchmarks.dispatcher.bench_dispatcher`
    rows, through the simulator's own pricing: every piece and direction ``t = ops x op_s + bytes /
    bw`` with the ops and bytes of :func:`sim.frameworks.dispatcher.dispatcher_work` (the gate's
    router GEMM, priced by the fitted GEMM model, taken off first). Least squares on relative error, with an op no cheaper
    than a launch (``kernel_launch_us``) and the gathers no faster than the streaming kernels
    (``hbm_bw_GBps``). Each row gets ``fit_<piece>_<fwd|bwd>_s`` and ``work`` (ops, bytes)."""
    from scipy.optimize import lsq_linear

    from sim.frameworks.dispatcher import DISPATCHER_PIECES, dispatcher_work

    eqs = []  # (row, field, ops, bytes, fixed s, measured s)
    for r in rows:
        fixed_f = fixed_b = 0.0
        if gemm is not None:  # router GEMM [S, d] @ [d, E]; backward: input and weight gradients
            p = (gemm.peak_TFLOPs * 1e12, gemm.m_half, gemm.nk_half)
            S, d, E, bpe = r["tokens"], r["d"], r["experts"], 4
            fixed_f = float(gemm_model_times(p, np.array([[S, E, d]], float), bpe, hbm_Bps, launch_s)[0])
            fixed_b = float(gemm_model_times(p, np.array([[S, d, E], [d, E, S]], float), bpe, hbm_Bps, launch_s).sum())
        r["work"] = {}
        for piece in DISPATCHER_PIECES:
            of, bf, ob, bb = dispatcher_work(piece, r["tokens"], r["d"], r["experts"], r["k"], float(r["slots"]),
                                             bool(r["drop_tokens"]), int(r["bytes_per_element"]))  # fmt: skip
            r["work"][piece] = {"fwd_ops": of, "fwd_bytes": float(bf), "bwd_ops": ob, "bwd_bytes": float(bb)}
            for direction, ops, nb, fixed in (("fwd", of, bf, fixed_f), ("bwd", ob, bb, fixed_b)):
                fx = fixed if piece == "gate" else 0.0
                t = float(r[f"{piece}_{direction}_s"])
                if t > 0:
                    eqs.append((r, f"fit_{piece}_{direction}_s", float(ops), float(nb), fx, t))
    if not eqs:
        return None
    t = np.array([e[5] for e in eqs])
    A = np.array([[e[2], e[3]] for e in eqs]) / t[:, None]
    y = np.array([(e[5] - e[4]) / e[5] for e in eqs])
    upper_inv_bw = np.inf
    lo = [launch_s, 1.0 / hbm_Bps if np.isfinite(hbm_Bps) else 0.0]
    sol = lsq_linear(A, y, bounds=(lo, [np.inf, upper_inv_bw]))
    op_s, inv_bw = float(sol.x[0]), float(sol.x[1])
    for r, field, ops, nb, fx, _ in eqs:
        r[field] = fx + ops * op_s + nb * inv_bw
    return op_s, (1.0 / inv_bw if inv_bw > 0 else hbm_Bps)


def dispatcher_errors(rows: list[dict]) -> np.ndarray:
    """Relative errors of the fitted dispatcher model over every piece and direction measured."""
    out = []
    for r in rows:
        for key in [k for k in r if k.startswith("fit_") and k.endswith("_s")]:
            m = r[key[4:]]
            if m > 0:
                out.append(r[key] / m - 1.0)
    return np.array(out)

