"""The Measurement JSON a real DeepSpeed job writes: what ran, where, and how long each phase took.

Format (``format: moesim.measurement``, ``version: 1``; seconds everywhere; written atomically)::

    {
      "format": "moesim.measurement", "version": 1,
      "scenario": "cpu-2rank", "scenario_file": "scenarios/cpu-2rank.yaml", "overrides": [],
      "created_unix_s": 1733212345.6,
      "environment": {
        "hostname": "...", "hostnames": ["...", ...],            # per rank
        "python": "3.11.7", "torch": "2.13.0+cpu", "deepspeed": "0.19.8",
        "accelerator": "cpu" | "cuda", "backend": "gloo" | "nccl" | "ccl", "backend_version": "...",
        "devices": ["cpu", ...] | ["NVIDIA H100 80GB HBM3", ...],  # per rank
        "world_size": 2, "threads_per_rank": 1, "launcher": "deepspeed" | "torchrun" | "unknown",
        "glibc_tunables": "glibc.malloc...." | null             # CPU ranks: hw_validate.jit_ops.CPU_MALLOC_TUNABLES
      },
      "config": {                                                # what the job really did
        "dtype": "fp32", "dtype_requested": "fp32", "zero_stage": 2, "offload_optimizer": "none",
        "micro_batch_size": 4, "grad_accum_steps": 1, "train_batch_size": 8, "seq_len": 64,
        "tokens_per_micro_batch": 256, "num_experts": 4, "top_k": 2, "ep": 2, "edp": 1, "dp": 2,
        "moe_layers": 2, "capacity_factor": 1.25, "min_capacity": 4, "drop_tokens": true,
        "aux_loss_coef": 0.01, "init": "random" | "upcycle", "params": {...}, "ds_config": {...},
        "notices": ["..."]
      },
      "steps": 10, "warmup_steps": 2, "measured_steps": [2, 3, ..., 9],
      "timing": {
        "clock": "perf_counter" | "cuda_event", "sync": "dist.barrier before every step",
        "phases": ["attention", "route", ...],                   # see hw_validate.timing
        "per_step": {"<phase>": [[rank0, rank1, ...], ...]},      # [step][rank], every step
        "summary": {"<phase>": {"median", "p10", "p90", "iqr", "mean", "min", "max", "n"}},
        "summary_rank_mean": {...same keys...},
        "comm_bytes_per_step": {"dispatch": [[...]], ...},       # [step][rank], largest buffer per call
        "comm_calls_per_step": {...}, "async_calls": 0
      },
      "loss": {"per_step": [...], "aux_per_step": [...]},         # CE mean over ranks and micro-batches
      "routing": {"dropped_fraction": 0.03, "assigned_per_step": [...], "kept_per_step": [...]},
      "upcycle": null | {"checkpoint": "...", "router_std": 0.02, "step0_max_abs_diff": 1e-7, ...},
      "trace_file": "router_trace.json"
    }

``summary`` statistics are over the measured steps (warm-up excluded) of the *slowest rank's* time
(the step is synchronous, so the maximum over ranks is what the step pays); ``summary_rank_mean``
uses the mean over ranks. p10/p90 are numpy's linear-interpolation percentiles, ``iqr = p75 - p25``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from sim.errors import InputError
from sim.inputs.yamlio import parse_json, read_text
from sim.ioutil import atomic_write_text, dumps_json

FORMAT = "moesim.measurement"
VERSION = 1
_REQUIRED = ("scenario", "environment", "config", "steps", "warmup_steps", "measured_steps", "timing", "loss")


def stats(values: list[float] | np.ndarray) -> dict[str, float | int]:
    """median, p10, p90, IQR, mean, min, max and n of ``values`` (empty: n = 0, the rest None)."""
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        return {"n": 0, "median": None, "p10": None, "p90": None, "iqr": None, "mean": None, "min": None, "max": None}
    p10, p25, p50, p75, p90 = np.percentile(v, [10, 25, 50, 75, 90])
    return {
        "n": int(v.size),
        "median": float(p50),
        "p10": float(p10),
        "p90": float(p90),
        "iqr": float(p75 - p25),
        "mean": float(v.mean()),
        "min": float(v.min()),
        "max": float(v.max()),
    }


def summarise(per_step: dict[str, list[list[float]]], measured: list[int]) -> tuple[dict, dict]:
    """(summary of the per-step max over ranks, summary of the per-step mean over ranks)."""
    worst, mean = {}, {}
    for phase, rows in per_step.items():
        a = np.asarray(rows, dtype=float)[measured] if measured else np.zeros((0, 1))
        worst[phase] = stats(a.max(axis=1) if a.size else [])
        mean[phase] = stats(a.mean(axis=1) if a.size else [])
    return worst, mean


def build_measurement(
    *,
    scenario: str,
    scenario_file: str | None,
    overrides: list[str],
    environment: dict[str, Any],
    config: dict[str, Any],
    steps: int,
    warmup_steps: int,
    timing: dict[str, Any],
    loss: dict[str, Any],
    routing: dict[str, Any],
    upcycle: dict[str, Any] | None,
    trace_file: str | None,
    created_unix_s: float,
) -> dict[str, Any]:
    """Assemble a Measurement mapping; fills ``measured_steps`` and the timing summaries."""
    measured = list(range(min(warmup_steps, steps), steps))
    worst, mean = summarise(timing["per_step"], measured)
    timing = {**timing, "summary": worst, "summary_rank_mean": mean}
    return {
        "format": FORMAT,
        "version": VERSION,
        "scenario": scenario,
        "scenario_file": scenario_file,
        "overrides": list(overrides),
        "created_unix_s": created_unix_s,
        "environment": environment,
        "config": config,
        "steps": steps,
        "warmup_steps": warmup_steps,
        "measured_steps": measured,
        "timing": timing,
        "loss": loss,
        "routing": routing,
        "upcycle": upcycle,
        "trace_file": trace_file,
    }


def write_measurement(path: str | Path, data: dict[str, Any]) -> None:
    """Validate and write atomically (temp file + fsync + rename)."""
    check_measurement(data, str(path))
    atomic_write_text(path, dumps_json(data))


def load_measurement(path: str | Path) -> dict[str, Any]:
    """Read and validate a Measurement file; :class:`InputError` names the file and field."""
    p = Path(path)
    data = parse_json(read_text(p, "measurement file"), p)
    check_measurement(data, str(p))
    return data


def check_measurement(data: Any, file: str | None = None) -> None:
    """Structural checks: format, version, required keys, per-step arrays of ``steps`` x ranks."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise InputError(f"not a measurement (expected format: {FORMAT})", file=file, field="format")
    if data.get("version") != VERSION:
        raise InputError(f"unsupported version {data.get('version')!r}; this moesim reads {VERSION}", file=file, field="version")
    for key in _REQUIRED:
        if key not in data:
            raise InputError("missing", file=file, field=key)
    steps, world = data["steps"], data["environment"].get("world_size")
    if not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps must be a positive integer (got {steps!r})", file=file, field="steps")
    if not isinstance(world, int) or world < 1:
        raise InputError(f"world_size must be a positive integer (got {world!r})", file=file, field="environment.world_size")
    per_step = data["timing"].get("per_step")
    if not isinstance(per_step, dict) or not per_step:
        raise InputError("per_step must map phases to [step][rank] seconds", file=file, field="timing.per_step")
    for phase, rows in per_step.items():
        a = np.asarray(rows, dtype=float)
        if a.shape != (steps, world):
            raise InputError(f"shape {a.shape}, expected ({steps}, {world})", file=file, field=f"timing.per_step.{phase}")
        if not np.isfinite(a).all() or (a < 0).any():
            raise InputError("times must be finite and >= 0", file=file, field=f"timing.per_step.{phase}")
    losses = data["loss"].get("per_step")
    if not isinstance(losses, list) or len(losses) != steps:
        raise InputError(f"per_step must list {steps} losses", file=file, field="loss.per_step")
