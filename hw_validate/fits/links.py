"""Link fits: the latency (alpha, per link) and bandwidth of a link class such that the simulator's
collectives over the cluster of the benchmarked ranks give the measured times, and a bytes factor
for every other measured collective on top of that pair; plus the nccl-tests-style table of the
measured collectives (:func:`comm_table`)."""

from __future__ import annotations

import numpy as np

from sim.hardware.calibrated import apply_link_calibration
from sim.inputs.calibration import Calibration, LinkFit


def bench_cluster(topology, nproc: int):
    """The one-node cluster of the benchmarked ranks on ``topology`` (a Topology, or a shipped name
    or YAML path); only its structure matters, the fitted class replaces its link figures."""
    from sim.hardware.cluster import build_cluster
    from sim.inputs.topology import Topology, load_topology

    topo = topology if isinstance(topology, Topology) else load_topology(str(topology))
    return build_cluster(topo, 1, nproc)


def simulate_sweep(cluster, rows: list[dict]) -> np.ndarray:
    """The simulator's time of every measured collective (``kind``, ``bytes``) on ``cluster``."""
    from sim.network.nccl_tests import measure

    out = np.zeros(len(rows))
    for kind in sorted({r["kind"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["kind"] == kind]
        got = measure(cluster, kind, "direct" if kind == "all_to_all" else "ring", [rows[i]["bytes"] for i in idx])
        for i, g in zip(idx, got, strict=True):
            out[i] = g["time_s"]
    return out


def with_link(cluster, cls: str, alpha_us: float, bw_GBps: float):
    """``cluster`` with link class ``cls`` set to ``alpha_us`` and ``bw_GBps``."""
    return apply_link_calibration(cluster, Calibration(links={cls: LinkFit(alpha_us=alpha_us, bw_GBps=bw_GBps)}))


def link_design(cluster, rows: list[dict], cls: str = "intra") -> tuple[np.ndarray, np.ndarray]:
    """The simulator's time of every row is ``a alpha + b / bw`` in the class's link latency alpha
    (s) and bandwidth bw (B/s): ``a`` (latencies on the critical path) and ``b`` (bytes on it) from
    two simulations, one with zero bytes cost and one with zero latency."""
    a = simulate_sweep(with_link(cluster, cls, 1.0, 1e9), rows) / 1e-6  # s per s of link latency
    b = simulate_sweep(with_link(cluster, cls, 0.0, 1.0), rows) * 1e9  # s x B/s
    return a, b


def fit_link(cluster, rows: list[dict], cls: str = "intra") -> tuple[LinkFit, np.ndarray]:
    """alpha (per link) and bandwidth of link class ``cls`` from measured collectives ``rows``
    (``kind``, ``bytes``, ``time_s``); returns the fit and the simulator's times with it.
    ``t = a alpha + b / bw`` is linear in (alpha, 1/bw): non-negative least squares on relative
    error. The reported errors come from re-simulating every row with the fitted pair."""
    from scipy.optimize import lsq_linear

    t = np.array([r["time_s"] for r in rows], dtype=np.float64)
    a, b = link_design(cluster, rows, cls)
    design = np.stack([a, b], axis=1) / t[:, None]
    scale = np.abs(design).max(axis=0)  # columns of order 1 (a ~ 1, b ~ bytes / t)
    sol = lsq_linear(design / scale, np.ones(len(t)), bounds=([0.0, 1e-30], [np.inf, np.inf]))
    x = sol.x / scale
    alpha_us = float(x[0]) * 1e6
    bw_GBps = 1.0 / float(x[1]) / 1e9
    pred = simulate_sweep(with_link(cluster, cls, alpha_us, bw_GBps), rows)
    err = np.abs(pred / t - 1.0)
    fit = LinkFit(alpha_us=alpha_us, bw_GBps=bw_GBps, fit_rel_err=float(np.median(err)),
                  fit_max_rel_err=float(err.max()), points=len(t))  # fmt: skip
    return fit, pred


#: the collectives the shared link pair (alpha, bw) is fitted on; every other measured kind gets a
#: ``collective_bytes_factor`` on top of it (:func:`fit_bytes_factor`)
LINK_FIT_KINDS = ("all_to_all", "all_reduce")


def fit_bytes_factor(cluster, rows: list[dict]) -> float:
    """The factor ``f`` on the bytes of ``rows``' collective (one kind) that fits the simulator's
    times on ``cluster`` (links already fitted) to the measured ones: each time is ``lat + f bw``
    (``lat`` the time of a 1-byte call, ``bw`` the rest), so least squares on relative error is
    closed form, ``f = sum(b (1 - l)) / sum(b^2)`` with ``l = lat / t`` and ``b = bw / t``; at least
    0.05 (a kind cheaper than the links' model by more than 20x is a measurement problem)."""
    t = np.array([r["time_s"] for r in rows], dtype=np.float64)
    lat = simulate_sweep(cluster, [{**r, "bytes": 1} for r in rows])
    bw = simulate_sweep(cluster, rows) - lat
    lt, b = lat / t, bw / t
    return float(max(0.05, (b @ (1.0 - lt)) / (b @ b))) if (b @ b) > 0 else 1.0


def comm_table(rows: list[dict]) -> list[dict]:
    """nccl-tests-style rows: size, time, algbw, busbw (GB/s = 1e9 B/s)."""
    from sim.network.closed_form import bandwidths_GBps

    out = []
    for r in rows:
        algbw, busbw = bandwidths_GBps(r["kind"], r["ranks"], r["bytes"], r["time_s"])
        out.append({**r, "algbw_GBps": algbw, "busbw_GBps": busbw})
    return out

