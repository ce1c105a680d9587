"""Published GPU measurements (``validation/published/*.yaml``) predicted by the simulator.

Each entry holds a public measurement, its source and the moesim scenario of the run
(validation/published/README.md). Three kinds:

- ``training``: a step of a real training run; the measured step is ``step_time_s``, or
  ``global batch x seq / (tokens/s/GPU x GPUs)`` when only the throughput is published; predicted by
  ``simulate``;
- ``layer``: one MoE layer's forward and backward (Megatron-Core's ``moe_perf``); predicted by
  :func:`sim.studies.layer.layer_times`;
- ``a2a``: an all-to-all kernel's bandwidth as its benchmark defines it (DeepEP and HybridEP count the
  received token copies, deduplicated per rank, own rank included, over the kernel time; nccl-tests
  its bus bandwidth); predicted from the simulator's time of the same transfer.

One hardware description per GPU kind serves every entry; nothing here is tuned per entry.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from sim.api import scenario_from_dict
from sim.errors import InputError
from sim.studies.published_row import TARGET, Row

FOLDER = Path(__file__).resolve().parents[2] / "validation" / "published"


def entries(folder: Path = FOLDER) -> list[dict[str, Any]]:
    out = []
    for path in sorted(folder.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        doc["_path"] = path
        out.append(doc)
    return out


def scenario_of(entry: dict[str, Any]):
    data = dict(entry["scenario"])
    return scenario_from_dict(data, source=str(entry["_path"]), base_dir=entry["_path"].parent)


def measured_step_s(entry: dict[str, Any]) -> float:
    m = entry["measured"]
    if "step_time_s" in m:
        return float(m["step_time_s"])
    sc = entry["scenario"]
    t = sc["training"]
    gpus = int(entry["run"]["gpus"])
    gbs = int(t["global_batch_size"])
    return gbs * int(t["seq_len"]) / (float(m["tokens_per_s_per_gpu"]) * gpus)


def _training(entry) -> list[Row]:
    from sim.engine.simulate import simulate

    s = scenario_of(entry)
    r = simulate(s)
    meas = measured_step_s(entry)
    pred = r["step_time_s"]
    extra = {"breakdown_s": r["breakdown_s"], "memory_fits": r["memory"]["fits"]}
    return [
        Row(entry["id"], "training", entry["title"], "step_time_s", meas, pred, pred / meas - 1, extra=extra)
    ]


def _layer(entry) -> list[Row]:
    from sim.studies.layer import layer_times

    s = scenario_of(entry)
    r = layer_times(s)
    m = entry["measured"]
    rows = []
    for metric, key in (("forward_ms", "forward_s"), ("backward_ms", "backward_s")):
        pred = r[key] * 1e3
        rows.append(Row(entry["id"], "layer", entry["title"], metric, float(m[metric]), pred,
                        pred / float(m[metric]) - 1))  # fmt: skip
    return rows


def _a2a(entry) -> list[Row]:
    from sim.studies.a2a_bench import a2a_rows

    return a2a_rows(entry)


def predict(entry: dict[str, Any]) -> list[Row]:
    kind = entry["kind"]
    fn = {"training": _training, "layer": _layer, "a2a": _a2a}.get(kind)
    if fn is None:
        raise InputError(
            f"unknown kind {kind!r}; one of training, layer, a2a", file=str(entry["_path"]), field="kind"
        )
    try:
        return fn(entry)
    except InputError as exc:  # a mechanism the simulator lacks: report it, keep going
        return [
            Row(
                entry["id"],
                kind,
                entry.get("title", ""),
                "-",
                float("nan"),
                None,
                None,
                note=f"not simulated: {exc}",
            )
        ]


def summary(rows: list[Row]) -> dict[str, Any]:
    out = {}
    for kind in TARGET:
        errs = [abs(r.error) for r in rows if r.kind == kind and r.error is not None]
        out[kind] = {
            "rows": len([r for r in rows if r.kind == kind]),
            "predicted": len(errs),
            "median_abs_error": statistics.median(errs) if errs else None,
            "max_abs_error": max(errs) if errs else None,
            "within_target": sum(e <= TARGET[kind] for e in errs),
            "target": TARGET[kind],
        }
    return out


def as_json(rows: list[Row]) -> list[dict[str, Any]]:
    return [
        {"id": r.id, "kind": r.kind, "metric": r.metric, "measured": None if np.isnan(r.measured) else r.measured,
         "predicted": r.predicted, "error": r.error, "within_target": r.within, "note": r.note, **r.extra}
        for r in rows
    ]  # fmt: skip


__all__ = [
    "FOLDER",
    "TARGET",
    "Row",
    "as_json",
    "entries",
    "measured_step_s",
    "predict",
    "scenario_of",
    "summary",
]
