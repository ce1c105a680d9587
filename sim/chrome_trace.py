"""Chrome trace-event JSON of a simulated step (loads in ui.perfetto.dev and chrome://tracing).

One process per node (``pid`` = node), two threads per GPU (``tid`` = 2 x local index for the
compute stream, + 1 for the comm stream), one complete event (``"ph": "X"``) per span with
``ts``/``dur`` in microseconds and the span's FLOPs, bytes, layer, micro-batch and phase in
``args``. Spans on one stream never overlap (the engine runs one op at a time per stream).
Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.ioutil import atomic_write_text, dumps_json

STREAMS = ("compute", "comm")


def trace_events(spans, gpus_per_node: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    seen: set[tuple[int, int]] = set()
    for sp in spans:
        node, local = divmod(sp.rank, gpus_per_node)
        tid = 2 * local + STREAMS.index(sp.stream)
        if (node, tid) not in seen:
            if not any(p == node for p, _ in seen):
                events.append({"ph": "M", "name": "process_name", "pid": node, "tid": 0,
                               "args": {"name": f"node {node}"}})  # fmt: skip
            events.append({"ph": "M", "name": "thread_name", "pid": node, "tid": tid,
                           "args": {"name": f"rank {sp.rank} {sp.stream}"}})  # fmt: skip
            seen.add((node, tid))
        events.append({
            "ph": "X", "name": sp.name, "cat": sp.stream, "pid": node, "tid": tid,
            "ts": sp.start * 1e6, "dur": (sp.end - sp.start) * 1e6, "args": {"rank": sp.rank, **sp.args},
        })  # fmt: skip
    return events


def write_chrome_trace(path: str | Path, spans, scenario, result: dict[str, Any]) -> None:
    doc = {
        "traceEvents": trace_events(spans, scenario.gpus_per_node),
        "displayTimeUnit": "ms",
        "otherData": {"scenario": scenario.name, "step_time_s": result["step_time_s"],
                      "engine": result["engine"], "generator": "moesim"},  # fmt: skip
    }
    atomic_write_text(path, dumps_json(doc))


__all__ = ["trace_events", "write_chrome_trace"]
