"""The file a pipeline- or tensor-parallel job writes: every rank's timed spans of every step, on one
clock, named as the simulator names its spans. No torch here (the driver reads it).

Format (``format: moesim.layout_measurement``, ``version: 1``; seconds; written atomically)::

    {"format", "version", "job": "pipeline" | "tensor_parallel",
     "scenario", "scenario_file", "overrides", "created_unix_s",
     "environment": {"hostname", "python", "torch", "backend", "world_size", "threads_per_rank",
                     "launcher", "cpu": "..."},
     "config": {"pp", "vpp", "tp", "schedule", "micro_batches", "micro_batch_size", "seq_len",
                "hidden_size", "num_layers", "dtype", "sequence_parallel", "p2p_bytes", "tp_bytes", ...},
     "steps": 10, "warmup_steps": 2, "measured_steps": [2, ..., 9],
     "clock": "time.perf_counter (CLOCK_MONOTONIC, one clock for every rank of the host)",
     "spans": [[[name, start_s, end_s, {args}], ...] per rank] per step,   # from the step's origin
     "loss": [per step],
     "sweep": [{"name": "p2p" | "tp_all_gather" | ..., "bytes", "first_exit_s", "last_exit_s", "reps"}]}

A step's origin is the earliest rank's exit from the barrier that starts it; every span is relative
to it. Span names: ``forward``/``backward`` (one pass of one micro-batch, args ``micro``, ``chunk``,
``stage``: the model stage), ``recv_wait`` (waiting for an activation or gradient, args ``dir``
F|B, ``micro``, ``chunk``, ``stage`` (the receiving one), ``blocked``: the data had not arrived
when the wait began), ``send_wait``, ``p2p_post`` (the ``isend``/``irecv`` calls of one batch),
``send_issue``/``recv_issue`` (zero-length marks when each op was posted, ``stage`` the sending
or receiving one), ``loss`` (``micro``), ``optimizer``, ``step`` (the rank's whole step); in
tensor-parallel jobs ``tp_all_gather``, ``tp_reduce_scatter``, ``tp_all_reduce`` (args ``phase``
fwd|bwd|optimizer, ``region`` attention|mlp|embedding|head|loss|norm_grads, ``layer``, ``bytes``:
the input's), the ``attention``/``mlp``/``embedding``/``head`` module windows (``phase``,
``layer``, ``comm_s``: the collectives inside), ``forward``, ``backward``. ``sweep``: the job's
collective (or p2p) timed alone after the training steps, every rank idle
(:func:`hw_validate.layout.timeline.collective_sweep`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sim.errors import InputError

FORMAT = "moesim.layout_measurement"
VERSION = 1
JOBS = ("pipeline", "tensor_parallel")
_REQUIRED = ("job", "scenario", "environment", "config", "steps", "warmup_steps", "measured_steps", "spans", "loss")


def check(data: Any, file: str | None = None) -> None:
    """Raise :class:`InputError` unless ``data`` is a layout measurement of this version."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(f"not a {FORMAT} file", file=file)
    if data.get("version") != VERSION:
        raise InputError(f"{FORMAT} version {data.get('version')!r}; this moesim reads version {VERSION}", file=file)
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise InputError(f"missing keys: {', '.join(missing)}", file=file)
    if data["job"] not in JOBS:
        raise InputError(f"job must be one of {JOBS}, got {data['job']!r}", file=file, field="job")
    world = data["environment"].get("world_size")
    for i, step in enumerate(data["spans"]):
        if len(step) != world:
            raise InputError(f"step {i} has spans of {len(step)} ranks, world size {world}", file=file, field="spans")


def load(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"cannot read: {e}", file=str(p)) from None
    check(data, str(p))
    return data


def measured_spans(data: dict[str, Any]) -> list[list[list]]:
    """The spans of the measured steps (warm-up left out): ``[step][rank] -> [[name, start, end, args]]``."""
    return [data["spans"][i] for i in data["measured_steps"]]


__all__ = ["FORMAT", "JOBS", "VERSION", "check", "load", "measured_spans"]
