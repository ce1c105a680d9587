"""The per-op figures of ``moesim calibrate --from-profile`` (:mod:`hw_validate.fits.from_profile`):
the median of each op and size, the launch and memory-bandwidth fit of the memory-bound ops, the
attention ops per shape, and the collectives' call times (the last arriver's, or one rank's lower
quartile) fitted to a link and the other collectives' bytes factors.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import numpy as np

from hw_validate.fits.links import (
    LINK_FIT_KINDS,
    bench_cluster,
    fit_bytes_factor,
    fit_link,
    simulate_sweep,
    with_link,
)
from hw_validate.profile_trace import RankTrace
from sim.inputs.calibration import LinkFit
from sim.inputs.sections import Kind

#: a link row the first fit misses by more than this (relative) is refitted without (a call on a
#: one-rank group, which returns at once, looks like any other in a gloo trace)
OUTLIER_REL_ERR = 2.0
#: a fitted link faster than this (GB/s) means the sizes did not explain the call times
DEGENERATE_BW_GBPS = 1e6
#: the largest bytes factor kept (the calibration's bound)
MAX_BYTES_FACTOR = 1000.0
#: collectives a bytes factor can be fitted for on top of the link pair (the calibration's kinds)
FACTOR_KINDS = tuple(k for k in Kind.__args__ if k not in LINK_FIT_KINDS)


def _rel(pred: np.ndarray, t: np.ndarray) -> dict[str, Any]:
    err = np.abs(np.asarray(pred) / np.asarray(t) - 1.0)
    return {"fit_rel_err": float(np.median(err)), "fit_max_rel_err": float(err.max()), "points": int(err.size)}


def medians(rows: list[dict], keys: tuple[str, ...], value: str = "time_s") -> list[dict]:
    """One row per distinct ``keys``: the median of ``value`` and how many rows it came from."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[tuple(r[k] for k in keys)].append(r)
    return [{**dict(zip(keys, k, strict=True)), value: float(np.median([r[value] for r in g])), "calls": len(g)}
            for k, g in sorted(groups.items())]  # fmt: skip


def fit_launch_memory(rows: list[dict]) -> tuple[float, float, dict] | None:
    """``(launch_s, bytes_per_s, errors)``: ``t = launch + bytes / bw`` by least squares on relative
    error (both >= 0) over the median of each (op, bytes); None with fewer than two sizes."""
    from scipy.optimize import lsq_linear

    med = medians(rows, ("op", "bytes"))
    if len({r["bytes"] for r in med}) < 2:
        return None
    nb = np.array([r["bytes"] for r in med], dtype=np.float64)
    t = np.array([r["time_s"] for r in med], dtype=np.float64)
    A = np.stack([1.0 / t, nb / t], axis=1)
    scale = A.max(axis=0)
    sol = lsq_linear(A / scale, np.ones_like(t), bounds=([0.0, 1e-30], [np.inf, np.inf]))
    launch, inv_bw = (sol.x / scale).tolist()
    return launch, 1.0 / inv_bw, _rel(launch + nb * inv_bw, t)


def call_times(traces: list[RankTrace]) -> list[dict]:
    """One row per collective call: ``kind``, ``bytes``, ``ranks``, ``time_s``. With every rank's
    trace (the same calls in the same order on each), the last-arriving rank's entry-to-completion
    time; otherwise each call as its rank saw it, marked ``single``."""
    keyed = [defaultdict(list) for _ in traces]
    for i, tr in enumerate(traces):
        for c in tr.calls:
            if c.kind not in ("barrier", "broadcast"):
                keyed[i][(c.step, c.kind, c.bytes, c.ranks)].append(c)
    world = traces[0].world or len(traces)
    everyone = len(traces) > 1 and len(traces) == world and len({tr.rank for tr in traces}) == len(traces)
    rows = []
    for key in keyed[0]:
        step, kind, nbytes, ranks = key
        lists = [k.get(key, []) for k in keyed] if everyone else [keyed[0][key]]
        if everyone and len({len(x) for x in lists}) == 1:
            for calls in zip(*lists, strict=True):
                last = max(calls, key=lambda c: c.start_s)
                rows.append({"kind": kind, "bytes": nbytes, "ranks": ranks, "time_s": last.time_s, "single": False})
        else:
            rows += [{"kind": kind, "bytes": nbytes, "ranks": ranks, "time_s": c.time_s, "single": True} for c in lists[0]]
    return rows


def comm_rows(calls: list[dict]) -> list[dict]:
    """Per (kind, bytes): the lower quartile of the calls' times (the last arrivers' with every
    rank's trace, else one rank's own): the calls least disturbed by the job around them, as the
    microbenchmarks time isolated calls; the in-job surplus is ``call_overhead_us``'s. Sizes of 0
    bytes are left out."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in calls:
        if r["bytes"] > 0 and r["time_s"] > 0:
            groups[(r["kind"], r["bytes"], r["ranks"])].append(r)
    out = []
    for (kind, nbytes, ranks), g in sorted(groups.items()):
        t = [r["time_s"] for r in g]
        single = any(r["single"] for r in g)
        out.append({"kind": kind, "bytes": nbytes, "ranks": ranks, "calls": len(g), "time_s": float(np.percentile(t, 25)),
                    "stat": "p25 of one rank's calls" if single else "p25 of the last arrivers"})  # fmt: skip
    return out


def fit_links(rows: list[dict], topology, gpus_per_node: int | None) -> tuple[dict[str, LinkFit], dict, list[dict]]:
    """``(links, bytes factors, rows with fit_time_s)`` from :func:`comm_rows`: the rows of the most
    common group size, when that group fits in one node (``gpus_per_node``; unknown: assumed)."""
    if not rows:
        return {}, {}, []
    sizes = [r["ranks"] for r in rows if r["ranks"] >= 2]
    if not sizes:
        return {}, {}, []
    ranks = max(set(sizes), key=lambda s: (sizes.count(s), s))
    if gpus_per_node is not None and ranks > gpus_per_node:
        return {}, {}, []
    use = [r for r in rows if r["ranks"] == ranks]
    link_rows = [r for r in use if r["kind"] in LINK_FIT_KINDS]
    if len({(r["kind"], r["bytes"]) for r in link_rows}) < 2:
        return {}, {}, []
    cluster = bench_cluster(topology, ranks)
    fit, pred = fit_link(cluster, link_rows, "intra")
    err = np.abs(pred / np.array([r["time_s"] for r in link_rows]) - 1.0)
    keep = [r for r, e in zip(link_rows, err, strict=True) if e <= OUTLIER_REL_ERR]
    if len(keep) < len(link_rows) and len({(r["kind"], r["bytes"]) for r in keep}) >= 2:
        fit, _ = fit_link(cluster, keep, "intra")  # once, without the rows the first fit missed by > 3x
        for r in link_rows:
            r["outlier"] = r not in keep
    fitted = with_link(cluster, "intra", fit.alpha_us, fit.bw_GBps)
    factors = {}
    bytes_free = fit.bw_GBps > DEGENERATE_BW_GBPS  # the sizes did not explain the times: no factor to fit
    for kind in sorted({r["kind"] for r in use} & set(FACTOR_KINDS)) if not bytes_free else ():
        f = fit_bytes_factor(fitted, [r for r in use if r["kind"] == kind])
        if f <= MAX_BYTES_FACTOR:  # beyond: the links' bytes term is ~0, a factor says nothing
            factors[kind] = f
    fitted.collective_bytes_factor = dict(factors)
    pred = simulate_sweep(fitted, use)
    return {"intra": fit}, factors, [{**r, "fit_time_s": float(p)} for r, p in zip(use, pred, strict=True)]


def attention_rows(traces: list[RankTrace]) -> list[dict]:
    """Per attention shape: the median forward and backward seconds (NaN where absent)."""
    groups: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: {"fwd": [], "bwd": []})
    for tr in traces:
        for r in tr.attention:
            groups[(r["dtype"], r["batch"], r["heads"], r["seq"], r["head_dim"])][r["dir"]].append(r["time_s"])
    return [{"dtype": k[0], "batch": k[1], "heads": k[2], "seq": k[3], "head_dim": k[4],
             "fwd_s": float(np.median(v["fwd"])) if v["fwd"] else math.nan,
             "bwd_s": float(np.median(v["bwd"])) if v["bwd"] else math.nan,
             "calls": len(v["fwd"]) + len(v["bwd"])} for k, v in sorted(groups.items())]  # fmt: skip
