"""A rank's trace in time, for :mod:`hw_validate.profile_trace`: its collective calls (entry and
completion, NCCL's or gloo's), its profiled steps with their forward, backward and optimizer
windows, and the short idle gaps between consecutive ops.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from hw_validate.profile_ops import (
    _DT_NAMES,
    _GLOO,
    BYTES,
    COLLECTIVES,
    DTYPES,
    GLOO_START_US,
    SHORT_GAP_S,
    _dims,
    _dtype,
    _nccl_kind,
    _numel,
    _top_level,
)


@dataclass
class Call:
    """One collective call on one rank (seconds, the trace's clock)."""

    kind: str
    bytes: int
    ranks: int
    start_s: float
    end_s: float
    step: int

    @property
    def time_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Step:
    """One profiled step of one rank: its span and windows (seconds, the trace's clock)."""

    index: int
    start_s: float
    end_s: float
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)  # forward, backward, optimizer
    annotated: bool = False  # the windows came from record_function ranges, not from autograd
    events: dict[str, int] = field(default_factory=dict)  # CPU ops recorded in each window and in the step


def _steps(xs: list[dict]) -> list[Step]:
    """``ProfilerStep#N`` ranges (one step over the whole trace without them), with their windows."""
    marks = sorted((e for e in xs if re.fullmatch(r"ProfilerStep#\d+", str(e.get("name")))), key=lambda e: e["ts"])
    if marks:
        spans = [(int(e["name"].split("#")[1]), e["ts"], e["ts"] + e["dur"]) for e in marks]
    else:
        t0 = min(e["ts"] for e in xs)
        spans = [(0, t0, max(e["ts"] + e["dur"] for e in xs))]
    named = {n: sorted((e for e in xs if e.get("name") == n and e.get("cat") in ("user_annotation", "cpu_op")),
                       key=lambda e: e["ts"]) for n in ("forward", "backward", "optimizer")}  # fmt: skip
    autograd = sorted((e for e in xs if str(e.get("name", "")).startswith("autograd::engine::evaluate_function")),
                      key=lambda e: e["ts"])  # fmt: skip
    steps = []
    for idx, a, b in spans:
        st = Step(idx, a * 1e-6, b * 1e-6)
        inside = {n: [e for e in evs if a <= e["ts"] < b] for n, evs in named.items()}
        if all(inside.values()):
            st.annotated = True
            for n, evs in inside.items():
                st.windows[n] = (min(e["ts"] for e in evs) * 1e-6, max(e["ts"] + e["dur"] for e in evs) * 1e-6)
        else:
            bw = [e for e in autograd if a <= e["ts"] < b]
            if bw:
                b0, b1 = bw[0]["ts"], max(e["ts"] + e["dur"] for e in bw)
                st.windows = {"forward": (a * 1e-6, b0 * 1e-6), "backward": (b0 * 1e-6, b1 * 1e-6),
                              "optimizer": (b1 * 1e-6, b * 1e-6)}  # fmt: skip
        ops = [e["ts"] for e in xs if e.get("cat") == "cpu_op" and a <= e["ts"] < b]
        st.events = {"step": len(ops), **{n: sum(1 for t in ops if w0 * 1e6 <= t < w1 * 1e6) for n, (w0, w1) in st.windows.items()}}
        steps.append(st)
    return steps


def _step_of(t_us: float, steps: list[Step]) -> int:
    for st in steps:
        if st.start_s * 1e6 <= t_us < st.end_s * 1e6:
            return st.index
    return -1


def _calls(xs, ops, kernels, by_ext, world, steps) -> list[Call]:
    """Every collective call: NCCL's ``record_param_comms`` with its kernel, else gloo's ``c10d::``
    ops completed by their ``gloo:`` work."""
    out: list[Call] = []
    comms = [e for e in ops if e["name"] == "record_param_comms"]
    if comms:
        for e in comms:
            a = e.get("args") or {}
            kind = COLLECTIVES.get(str(a.get("Collective name", "")).lower())
            ks = by_ext.get(a.get("External id")) or []
            nccl = [k for k in ks if _nccl_kind(k["name"])]
            if kind is None and nccl:
                kind = _nccl_kind(nccl[0]["name"])
            if kind is None:
                continue
            bpe = BYTES.get(DTYPES.get(a.get("dtype"), _DT_NAMES.get(str(a.get("dtype")), "")), 4)
            nelems = max(int(a.get("In msg nelems") or 0), int(a.get("Out msg nelems") or 0))
            ranks = int(a.get("Group size") or world or 0)
            if nccl:
                s, t = min(k["ts"] for k in nccl), max(k["ts"] + k["dur"] for k in nccl)
            else:
                s, t = e["ts"], e["ts"] + e["dur"]
            out.append(Call(kind, nelems * bpe, ranks, s * 1e-6, t * 1e-6, _step_of(e["ts"], steps)))
        return out
    if kernels:  # NCCL kernels without record_param_comms: no sizes, nothing to fit
        return out
    gloo = sorted((e for e in xs if e.get("name") in _GLOO), key=lambda e: e["ts"])
    used: set[int] = set()
    for e in (e for e in ops if e["name"].startswith("c10d::")):
        kind = COLLECTIVES.get(e["name"].split("::", 1)[1])
        if kind is None:
            continue
        dims, bpe = _dims(e), BYTES.get(_dtype(e) or "fp32", 4)
        flat = [d for d in dims if isinstance(d, list)]
        flat = [x for d in flat for x in (d if d and isinstance(d[0], list) else [d])]
        nbytes = max((_numel(d) for d in flat), default=0) * bpe
        s, t = e["ts"], e["ts"] + e["dur"]
        work = next((g for g in gloo if _GLOO[g["name"]] == kind and s <= g["ts"] <= t + GLOO_START_US
                     and id(g) not in used), None)  # fmt: skip
        if work is not None:
            used.add(id(work))
            t = max(t, work["ts"] + work["dur"])
        out.append(Call(kind, nbytes, int(world or 0), s * 1e-6, t * 1e-6, _step_of(s, steps)))
    return out



def _gaps(ops: list[dict], kernels: list[dict]) -> list[float]:
    """Short idle gaps between consecutive ops: compute kernels on each stream on a GPU (not NCCL's),
    top-level ops of the busiest thread on CPU ranks (gaps over :data:`SHORT_GAP_S` are idle, not
    overhead)."""
    if kernels:
        lanes: dict[Any, list[dict]] = {}
        for k in (k for k in kernels if not _nccl_kind(k["name"])):  # compute streams only
            lanes.setdefault(((k.get("args") or {}).get("device"), (k.get("args") or {}).get("stream")), []).append(k)
    else:
        main = max({e["tid"] for e in ops}, key=lambda t: sum(1 for e in ops if e["tid"] == t))
        lanes = {main: _top_level([e for e in ops if e["tid"] == main])}
    gaps = []
    for evs in lanes.values():
        evs = sorted(evs, key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:], strict=False):
            g = (b["ts"] - (a["ts"] + a["dur"])) * 1e-6
            if 0 <= g <= SHORT_GAP_S:
                gaps.append(g)
    return gaps
