"""End of a real job: gather every rank's timings, routing counts and environment to rank 0 and
write the router trace and the Measurement file (both atomic; trace first, measurement last, so a
measurement on disk always has its trace beside it)."""

from __future__ import annotations

import os
import platform
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hw_validate.measurement import build_measurement, write_measurement
from hw_validate.router_trace import build_trace
from hw_validate.timing import PHASES
from sim.inputs.router_trace import save_trace, trace_from_records
from sim.inputs.scenario import Scenario

MEASUREMENT_FILE = "measurement.json"
TRACE_FILE = "router_trace.json"


def gather_array(a: np.ndarray, device: torch.device) -> np.ndarray:
    """All ranks' copies of ``a`` stacked on a new first axis (every rank gets them)."""
    t = torch.as_tensor(np.ascontiguousarray(a)).to(device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return np.stack([o.cpu().numpy() for o in out])


def gather_objects(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def local_environment(accelerator: str) -> dict[str, Any]:
    if accelerator == "cuda":
        device = torch.cuda.get_device_name(torch.cuda.current_device())
    else:
        device = f"cpu ({platform.processor() or platform.machine()})"
    return {"hostname": socket.gethostname(), "device": device, "threads": torch.get_num_threads()}


def environment(accelerator: str, per_rank: list[dict[str, Any]], launcher: str) -> dict[str, Any]:
    import deepspeed

    backend = str(dist.get_backend())
    if backend == "nccl":
        v = torch.cuda.nccl.version()
        backend_version = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    elif backend == "gloo":
        backend_version = f"gloo bundled with torch {torch.__version__}"
    else:
        backend_version = "unknown"
    return {
        "hostname": socket.gethostname(),
        "hostnames": [r["hostname"] for r in per_rank],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "accelerator": accelerator,
        "backend": backend,
        "backend_version": backend_version,
        "devices": [r["device"] for r in per_rank],
        "world_size": dist.get_world_size(),
        "threads_per_rank": per_rank[0]["threads"],
        "launcher": launcher,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES") or None,
    }


def finish(
    *,
    out_dir: Path,
    scenario: Scenario,
    overrides: list[str],
    accelerator: str,
    launcher: str,
    device: torch.device,
    phase_times: np.ndarray,  # (steps, phases) this rank
    comm: dict[str, np.ndarray],  # name -> (steps, k) this rank
    comm_keys: list[str],
    async_calls: int,
    counts: np.ndarray,  # (2, steps, micro, layers, experts) this rank
    losses: list[float],
    aux_losses: list[float],
    config: dict[str, Any],
    upcycle: dict[str, Any] | None,
    steps: int,
    warmup: int,
) -> Path | None:
    """Collective: every rank calls it; rank 0 writes and returns the measurement path."""
    times = gather_array(phase_times.astype(np.float64), device)  # (world, steps, P)
    comm_all = {k: gather_array(v.astype(np.int64), device) for k, v in comm.items()}
    gathered = gather_array(counts.astype(np.int64), device)
    envs = gather_objects(local_environment(accelerator))
    if dist.get_rank() != 0:
        return None
    trace = build_trace(
        gathered,
        scenario=scenario.name,
        top_k=scenario.model.top_k,
        ep=scenario.ep,
        tokens_per_micro_batch=scenario.tokens_per_micro_batch,
    )
    js = trace.to_json()
    trace_from_records(js, js["records"], file="(recorded trace)")  # the loader's invariants, before writing
    out_dir.mkdir(parents=True, exist_ok=True)
    save_trace(out_dir / TRACE_FILE, trace)
    per_step = {p: times[:, :, i].T.tolist() for i, p in enumerate(PHASES)}
    timing = {
        "clock": "cuda_event" if accelerator == "cuda" else "perf_counter",
        "sync": "dist.barrier before every step",
        "phases": list(PHASES),
        "per_step": per_step,
        "comm_bytes_per_step": {k: comm_all["bytes"][:, :, i].T.tolist() for i, k in enumerate(comm_keys)},
        "comm_calls_per_step": {k: comm_all["calls"][:, :, i].T.tolist() for i, k in enumerate(comm_keys)},
        "async_calls": int(async_calls),
    }
    assigned = trace.assigned.sum(axis=(1, 2, 3, 4))
    kept = trace.kept.sum(axis=(1, 2, 3, 4))
    total_a = int(assigned.sum())
    routing = {
        "dropped_fraction": (1.0 - float(kept.sum()) / total_a) if total_a else 0.0,
        "assigned_per_step": assigned.tolist(),
        "kept_per_step": kept.tolist(),
        "policy": scenario.routing.policy_string,
    }
    data = build_measurement(
        scenario=scenario.name,
        scenario_file=scenario.source,
        overrides=overrides,
        environment=environment(accelerator, envs, launcher),
        config=config,
        steps=steps,
        warmup_steps=warmup,
        timing=timing,
        loss={"per_step": losses, "aux_per_step": aux_losses},
        routing=routing,
        upcycle=upcycle,
        trace_file=TRACE_FILE,
        created_unix_s=time.time(),
    )
    path = out_dir / MEASUREMENT_FILE
    write_measurement(path, data)
    return path


def detect_launcher(argv: list[str]) -> str:
    if os.environ.get("MOESIM_LAUNCHER"):
        return os.environ["MOESIM_LAUNCHER"]
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    if any(a.startswith("--local_rank") for a in argv):
        return "deepspeed"
    return "unknown"
