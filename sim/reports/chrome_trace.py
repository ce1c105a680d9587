"""Chrome trace-event JSON of a simulated step (loads in ui.perfetto.dev and chrome://tracing).

One process per node (``pid`` = node), two threads per GPU (``tid`` = 2 x local index for the
compute stream, + 1 for the comm stream), one complete event (``"ph": "X"``) per span with
``ts``/``dur`` in microseconds, ``cat`` the breakdown category (compute, a2a, imbalance_wait,
exposed_comm, optimizer; grad_sync on the comm stream; ``extrapolated`` for the micro-batches the
steady-state window inserted, :mod:`sim.engine.window`) and the span's FLOPs or bytes, layer,
micro-batch and phase in ``args``. Spans on one stream never overlap (the engine runs one op at a
time per stream), and a rank's compute-stream spans tile ``[0, its end]``.

``flows=True`` adds flow events (``ph`` ``s``/``f``) at every all-to-all: an arrow from the traced
rank that arrived last (it waited for no one) to each traced peer of its EP group that sat waiting
for it. Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from sim.ioutil import _clean, atomic_write_text

STREAMS = ("compute", "comm")
A2A_NAMES = ("dispatch", "combine")
EXPOSED_NAMES = ("grad_sync_wait", "grad_norm_wait", "capacity_sync_wait", "param_gather_wait", "param_gather")


def category_of(name: str) -> str:
    """Breakdown key (``breakdown_s``) of a compute-stream span name."""
    if name in A2A_NAMES:
        return "a2a"
    if name in EXPOSED_NAMES:
        return "exposed_comm"
    if name in ("imbalance_wait", "optimizer", "pipeline_bubble"):
        return name
    if name == "extrapolated_micro_batches":  # the micro-batch window's jump: every category at once
        return "extrapolated"
    if name.startswith(("tp_", "etp_", "cp_")):
        return "tp_comm"
    return "compute"


def _tid(sp, gpus_per_node: int) -> tuple[int, int]:
    node, local = divmod(sp.rank, gpus_per_node)
    return node, 2 * local + STREAMS.index(sp.stream)


def trace_events(spans, gpus_per_node: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    seen: set[tuple[int, int]] = set()
    nodes: set[int] = set()
    for sp in spans:
        node, tid = _tid(sp, gpus_per_node)
        if (node, tid) not in seen:
            if node not in nodes:
                nodes.add(node)
                events.append({"ph": "M", "name": "process_name", "pid": node, "tid": 0,
                               "args": {"name": f"node {node}"}})  # fmt: skip
                events.append({"ph": "M", "name": "process_sort_index", "pid": node, "tid": 0,
                               "args": {"sort_index": node}})  # fmt: skip
            events.append({"ph": "M", "name": "thread_name", "pid": node, "tid": tid,
                           "args": {"name": f"rank {sp.rank} {sp.stream}"}})  # fmt: skip
            events.append({"ph": "M", "name": "thread_sort_index", "pid": node, "tid": tid,
                           "args": {"sort_index": tid}})  # fmt: skip
            seen.add((node, tid))
        cat = category_of(sp.name) if sp.stream == "compute" else "grad_sync"
        events.append({
            "ph": "X", "name": sp.name, "cat": cat, "pid": node, "tid": tid,
            "ts": sp.start * 1e6, "dur": (sp.end - sp.start) * 1e6, "args": {"rank": sp.rank, **sp.args},
        })  # fmt: skip
    return events


def flow_events(spans, gpus_per_node: int, ep: int) -> list[dict[str, Any]]:
    """Arrows last-arriver -> waiting peers at each all-to-all of the traced ranks."""
    waited = {(sp.rank, sp.end): sp.end - sp.start for sp in spans if sp.name == "imbalance_wait"}
    inst: dict[tuple, list] = defaultdict(list)
    for sp in spans:
        if sp.stream == "compute" and sp.name in A2A_NAMES:
            a = sp.args
            inst[(sp.name, a.get("phase"), a.get("layer"), a.get("micro"), sp.rank // ep, sp.start)].append(sp)
    out: list[dict[str, Any]] = []
    fid = 0
    for key in sorted(inst, key=lambda k: (k[5], k[4])):
        members = inst[key]
        if len(members) < 2:
            continue
        src = [sp for sp in members if (sp.rank, sp.start) not in waited]
        if not src:
            continue  # the rank everyone waited for is not traced
        s = min(src, key=lambda sp: sp.rank)
        spid, stid = _tid(s, gpus_per_node)
        for sp in members:
            w = waited.get((sp.rank, sp.start))
            if w is None:
                continue
            fid += 1
            pid, tid = _tid(sp, gpus_per_node)
            common = {"name": f"{sp.name} barrier", "cat": "a2a_wait", "id": fid, "ts": sp.start * 1e6}
            out.append({**common, "ph": "s", "pid": spid, "tid": stid, "args": {"last_arrival": s.rank}})
            out.append({**common, "ph": "f", "bp": "e", "pid": pid, "tid": tid,
                        "args": {"waited_us": w * 1e6, "rank": sp.rank}})  # fmt: skip
    return out


def write_chrome_trace(path: str | Path, spans, scenario, result: dict[str, Any], flows: bool = False) -> None:
    events = trace_events(spans, scenario.gpus_per_node)
    if flows:
        events += flow_events(spans, scenario.gpus_per_node, scenario.ep)
    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"scenario": scenario.name, "step_time_s": result["step_time_s"],
                      "engine": result["engine"], "policy": result.get("policy"),
                      "num_gpus": result.get("num_gpus"), "generator": "moesim"},  # fmt: skip
    }
    try:
        # compact (traces run to 10^5 events), keys sorted: same step, same bytes
        atomic_write_text(path, json.dumps(_clean(doc), sort_keys=True, separators=(",", ":"), allow_nan=False) + "\n")
    except OSError as exc:
        from sim.errors import InputError

        raise InputError(f"cannot write '{path}': {exc.strerror or exc}", field="--trace") from None


__all__ = ["A2A_NAMES", "category_of", "flow_events", "trace_events", "write_chrome_trace"]
