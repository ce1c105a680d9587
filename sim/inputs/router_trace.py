"""Router trace files: per step, micro-batch, MoE layer and source rank, the tokens sent to each expert.

``hw_validate`` writes them from a real DeepSpeed job; ``routing.generator: trace`` replays them.

Format (JSON, ``format: moesim.router_trace``, ``version: 1``)::

    {
      "format": "moesim.router_trace", "version": 1,
      "scenario": "cpu-2rank",
      "num_experts": 4, "top_k": 2, "ep": 2, "world_size": 2,
      "moe_layers": 2, "tokens_per_micro_batch": 256,
      "records": [
        {"step": 0, "micro_batch": 0, "layer": 0, "rank": 0,
         "assigned": [130, 121, 127, 134],   # token-expert assignments chosen by the gate (before capacity)
         "kept": [128, 121, 127, 128]},      # after capacity drops (== assigned when dropless)
        ...
      ]
    }

``layer`` counts MoE layers only (0 .. moe_layers-1). ``rank`` is the global rank whose tokens
these are; expert ``e`` lives on EP rank ``e // (num_experts / ep)`` of that rank's EP group.
Invariants (checked on load): ``sum(assigned) == tokens_per_micro_batch * top_k``,
``0 <= kept <= assigned``, every (step, micro_batch, layer, rank) appears at most once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sim.errors import InputError
from sim.inputs.yamlio import parse_json, read_text
from sim.ioutil import atomic_write_text, dumps_json

FORMAT = "moesim.router_trace"
VERSION = 1
_HEADER = ("num_experts", "top_k", "ep", "world_size", "moe_layers", "tokens_per_micro_batch")


@dataclass
class RouterTrace:
    """A loaded trace. ``assigned`` and ``kept`` have shape (steps, micro_batches, layers, ranks, experts)."""

    scenario: str
    num_experts: int
    top_k: int
    ep: int
    world_size: int
    moe_layers: int
    tokens_per_micro_batch: int
    assigned: np.ndarray
    kept: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.assigned.shape[0])

    @property
    def micro_batches(self) -> int:
        return int(self.assigned.shape[1])

    def to_json(self) -> dict[str, Any]:
        records = []
        s_, m_, l_, r_, _ = self.assigned.shape
        for s in range(s_):
            for m in range(m_):
                for layer in range(l_):
                    for r in range(r_):
                        records.append(
                            {
                                "step": s,
                                "micro_batch": m,
                                "layer": layer,
                                "rank": r,
                                "assigned": self.assigned[s, m, layer, r].tolist(),
                                "kept": self.kept[s, m, layer, r].tolist(),
                            }
                        )
        head = {k: getattr(self, k) for k in _HEADER}
        return {"format": FORMAT, "version": VERSION, "scenario": self.scenario, **head, "records": records}


def save_trace(path: str | Path, trace: RouterTrace) -> None:
    """Write ``trace`` atomically."""
    atomic_write_text(path, dumps_json(trace.to_json()))


def trace_from_records(
    header: dict[str, Any], records: list[dict[str, Any]], file: str | None = None
) -> RouterTrace:
    """Build and check a :class:`RouterTrace` from a header and flat records."""
    for key in _HEADER:
        v = header.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise InputError(f"header field must be a positive integer (got {v!r})", file=file, field=key)
    experts, ranks, layers = header["num_experts"], header["world_size"], header["moe_layers"]
    if not records:
        raise InputError("trace has no records", file=file, field="records")
    steps = 1 + max(_int(r, "step", file) for r in records)
    micro = 1 + max(_int(r, "micro_batch", file) for r in records)
    cells = steps * micro * layers * ranks
    if cells > len(records):  # refused before allocating: a stray huge index would exhaust memory
        raise InputError(
            f"{len(records)} records, but steps 0-{steps - 1} x micro-batches 0-{micro - 1} x {layers} layers "
            f"x {ranks} ranks need exactly {cells} (one per step, micro-batch, layer and rank)",
            file=file,
            field="records",
        )
    shape = (steps, micro, layers, ranks, experts)
    assigned = np.full(shape, -1, dtype=np.int64)
    kept = np.full(shape, -1, dtype=np.int64)
    expected = header["tokens_per_micro_batch"] * header["top_k"]
    for i, rec in enumerate(records):
        where = f"records[{i}]"
        s, m, layer, r = (_int(rec, k, file, where) for k in ("step", "micro_batch", "layer", "rank"))
        if layer >= layers or r >= ranks:
            raise InputError(
                f"layer {layer} / rank {r} out of range ({layers} layers, {ranks} ranks)",
                file=file,
                field=where,
            )
        if assigned[s, m, layer, r, 0] != -1:
            raise InputError("duplicate (step, micro_batch, layer, rank)", file=file, field=where)
        a = _counts(rec.get("assigned"), experts, file, where)
        k = _counts(rec.get("kept", rec.get("assigned")), experts, file, where)
        if a.shape != (experts,) or k.shape != (experts,):
            raise InputError(f"assigned/kept must list {experts} counts", file=file, field=where)
        if (a < 0).any() or (k < 0).any() or (k > a).any():
            raise InputError("counts must satisfy 0 <= kept <= assigned", file=file, field=where)
        if int(a.sum()) != expected:
            raise InputError(
                f"assigned sums to {int(a.sum())}, expected tokens_per_micro_batch x top_k = {expected}",
                file=file,
                field=where,
            )
        assigned[s, m, layer, r] = a
        kept[s, m, layer, r] = k
    if (assigned[..., 0] < 0).any():
        missing = np.argwhere(assigned[..., 0] < 0)[0].tolist()
        raise InputError(
            f"no record for (step, micro_batch, layer, rank) = {tuple(missing)}", file=file, field="records"
        )
    return RouterTrace(
        scenario=str(header.get("scenario", "")),
        **{k: header[k] for k in _HEADER},
        assigned=assigned,
        kept=kept,
    )


def load_trace(path: str | Path) -> RouterTrace:
    """Read and validate a router trace file."""
    text = read_text(path, "router trace")
    data = parse_json(text, path)
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(f"not a router trace (expected format: {FORMAT})", file=str(path), field="format")
    if data.get("version") != VERSION:
        raise InputError(
            f"unsupported version {data.get('version')!r}; this moesim reads {VERSION}",
            file=str(path),
            field="version",
        )
    records = data.get("records")
    if not isinstance(records, list):
        raise InputError("records must be a list", file=str(path), field="records")
    return trace_from_records(data, records, file=str(path))


def _counts(value: Any, experts: int, file: str | None, where: str) -> np.ndarray:
    """A list of ``experts`` non-negative integer counts (bools, floats and strings are refused)."""
    if (
        not isinstance(value, list)
        or len(value) != experts
        or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**62 for v in value)
    ):
        raise InputError(
            f"assigned/kept must list {experts} non-negative integer counts", file=file, field=where
        )
    return np.asarray(value, dtype=np.int64)


def _int(rec: dict[str, Any], key: str, file: str | None, where: str = "records") -> int:
    v = rec.get(key) if isinstance(rec, dict) else None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise InputError(f"{key} must be a non-negative integer (got {v!r})", file=file, field=where)
    return v
