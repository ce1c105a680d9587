"""Read a PyTorch profiler (Kineto) trace of a training job: what ``moesim calibrate --from-profile``
fits (:mod:`hw_validate.fits.from_profile`).

A trace is the Chrome trace-event JSON ``torch.profiler`` exports (``export_chrome_trace``; ``.gz``
too), one file per rank. Its ``cpu_op`` events carry the input shapes and dtypes when the profiler
ran with ``record_shapes=True``; on GPUs each device ``kernel`` names the CPU op that launched it by
``args["External id"]`` and runs on ``args["stream"]``. What is read, per rank:

- **GEMMs**: ``aten::mm``, ``addmm``, ``bmm``, ``baddbmm`` with their (M, N, K) and dtype (a bmm of
  batch B is B GEMMs of a B-th of the time each), timed by their kernels on a GPU, by the op itself
  on CPU ranks;
- **attention**: the scaled-dot-product ops (flash, efficient, cuDNN, the CPU flash kernel) forward
  and backward, shapes (batch, heads, sequence, head dim) from the query;
- **memory-bound ops**: elementwise, activation, norm, softmax and copy ops, with the bytes they
  move (inputs read, one output written; fill/zero write only);
- **collectives**: ``record_param_comms`` (NCCL; with ``Collective name``, message sizes and the
  group's size) or the ``c10d::`` ops (gloo), each call's entry and completion: the NCCL kernel's
  span on a GPU; on CPU ranks the op, or the ``gloo:`` work on a gloo thread when that ends later
  (an async call waited on afterwards);
- **steps**: ``ProfilerStep#N`` ranges (the whole trace is one step without them), and in each the
  forward, backward and optimizer windows: ``record_function`` ranges named ``forward``,
  ``backward``, ``optimizer`` where the job has them (``hw_validate`` jobs do under ``--profile``),
  else from autograd: forward until the first ``autograd::engine::evaluate_function``, backward
  until the last one ends, the optimizer after;
- **idle gaps** between consecutive ops (kernels on one stream on a GPU, top-level ops of the main
  thread on CPU ranks);
- **the profiler's own cost** a step, where the job measured it (``hw_validate`` jobs write it at the
  top level, ``moesim.profiler_cost_per_step_s``: their profiled steps' timer against the others').

Bad input is an :class:`~sim.errors.InputError` naming the file and what is missing (exit 2).

This module reads the file and each class of event; what the op names mean (GEMMs, attention,
memory-bound ops, collectives, dtypes, bytes) is :mod:`hw_validate.profile_ops`'s, the calls, steps
and idle gaps in time are :mod:`hw_validate.profile_timeline`'s; their public names stay importable
from here.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hw_validate.profile_ops import (  # noqa: F401  (the op names, dtypes, shapes and bytes: re-exported)
    ATTENTION_BWD,
    ATTENTION_FWD,
    BYTES,
    COLLECTIVES,
    DTYPES,
    GEMM_OPS,
    GLOO_START_US,
    MEMORY_OPS,
    SHORT_GAP_S,
    _dims,
    _dtype,
    _innermost,
    _top_level,
    gemm_shape,
    memory_bytes,
)
from hw_validate.profile_timeline import (  # noqa: F401  (Call and Step: re-exported)
    Call,
    Step,
    _calls,
    _gaps,
    _steps,
)
from sim.errors import InputError


@dataclass
class RankTrace:
    """What one rank's trace holds, in the units the fits read (seconds, bytes)."""

    path: str
    rank: int | None
    world: int | None
    device: str  # "cuda" when the trace has device kernels, else "cpu"
    gemm: list[dict] = field(default_factory=list)  # dtype, m, n, k, time_s
    attention: list[dict] = field(default_factory=list)  # dtype, batch, heads, seq, head_dim, dir, time_s
    memory: list[dict] = field(default_factory=list)  # op, dtype, bytes, time_s
    calls: list[Call] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)  # short idle gaps between consecutive ops
    profiler_cost_s: float = 0.0  # what recording cost a step (hw_validate jobs measure it; else 0)
    counts: dict[str, int] = field(default_factory=dict)  # events seen per class (for the report)


def load_events(path: str | Path) -> tuple[list[dict], dict[str, Any]]:
    """``(events, top-level fields)`` of a Kineto JSON file (``.gz`` read as gzip); bad input exits 2."""
    p = Path(path)
    if not p.is_file():
        raise InputError("profiler trace not found", file=str(p), field="--from-profile")
    try:
        raw = p.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        doc = json.loads(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise InputError(f"cannot read the profiler trace: {exc}", file=str(p), field="--from-profile") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"not Kineto JSON (not valid JSON: {exc})", file=str(p), field="--from-profile") from None
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list) or not events:
        raise InputError("not a Kineto trace: no 'traceEvents' list (export it with torch.profiler's "
                         "export_chrome_trace)", file=str(p), field="--from-profile")  # fmt: skip
    return [e for e in events if isinstance(e, dict)], {k: v for k, v in doc.items() if k != "traceEvents"}


def read_trace(path: str | Path) -> RankTrace:
    """One rank's trace (see the module docstring)."""
    events, top = load_events(path)
    info = top.get("distributedInfo") or {}
    xs = [e for e in events if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float)) and isinstance(e.get("dur"), (int, float))]
    for e in xs:
        e["tid"] = str(e.get("tid"))
    ops = [e for e in xs if e.get("cat") == "cpu_op"]
    kernels = [e for e in xs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not ops and not kernels:
        raise InputError("no CPU ops or device kernels in the trace (cat 'cpu_op' / 'kernel' events): is it a "
                         "torch.profiler trace?", file=str(path), field="--from-profile")  # fmt: skip
    tr = RankTrace(str(path), info.get("rank"), info.get("world_size"), "cuda" if kernels else "cpu")
    by_ext: dict[Any, list[dict]] = {}
    for k in kernels:
        by_ext.setdefault((k.get("args") or {}).get("External id"), []).append(k)

    def timed(e: dict) -> float | None:
        """Seconds of an op: its kernels' summed time on a GPU trace, the op's own on CPU ranks."""
        if not kernels:
            return e["dur"] * 1e-6
        ks = by_ext.get((e.get("args") or {}).get("External id"))
        return sum(k["dur"] for k in ks) * 1e-6 if ks else None

    shapes_seen = False
    gemms = _top_level([e for e in ops if e["name"] in GEMM_OPS])
    for e in gemms:
        dims = _dims(e)
        shapes_seen |= bool(dims)
        shape, dt, t = gemm_shape(e["name"], dims), _dtype(e), timed(e)
        if shape is None or dt is None or t is None or t <= 0:
            continue
        b, m, n, k = shape
        if min(m, n, k) >= 2:  # vector products (a gate's per-token weights) are no GEMMs
            tr.gemm.append({"dtype": dt, "m": m, "n": n, "k": k, "time_s": t / b, "batch": b, "op": e["name"]})
    for e in _top_level([e for e in ops if e["name"] in ATTENTION_FWD | ATTENTION_BWD]):
        dims, dt, t = _dims(e), _dtype(e), timed(e)
        q = dims[0] if dims else None
        if not (isinstance(q, list) and len(q) == 4) or dt is None or t is None or t <= 0:
            continue
        b, h, s, d = q
        tr.attention.append({"dtype": dt, "batch": b, "heads": h, "seq": s, "head_dim": d, "time_s": t,
                             "dir": "bwd" if e["name"] in ATTENTION_BWD else "fwd"})  # fmt: skip
    for e in _innermost([e for e in ops if e["name"] in MEMORY_OPS]):
        dt, t = _dtype(e), timed(e)
        if dt is None or t is None or t <= 0:
            continue
        nb = memory_bytes(e["name"], e, BYTES[dt])
        if nb > 0:
            tr.memory.append({"op": e["name"], "dtype": dt, "bytes": nb, "time_s": t})
    tr.counts = {"cpu_ops": len(ops), "kernels": len(kernels), "gemm_ops": len(gemms), "gemm_with_shapes": len(tr.gemm),
                 "attention_ops": len(tr.attention), "memory_ops": len(tr.memory)}  # fmt: skip
    if gemms and not shapes_seen:
        raise InputError("the trace has GEMM ops but no input shapes: record it with "
                         "torch.profiler.profile(record_shapes=True)", file=str(path), field="--from-profile")  # fmt: skip
    tr.steps = _steps(xs)
    tr.profiler_cost_s = float((top.get("moesim") or {}).get("profiler_cost_per_step_s") or 0.0)
    tr.calls = _calls(xs, ops, kernels, by_ext, tr.world, tr.steps)
    tr.gaps_s = _gaps(ops, kernels)
    return tr



def read_traces(paths: list[str | Path]) -> list[RankTrace]:
    """Every rank's trace: files, or folders whose ``*.json`` / ``*.json.gz`` files are the ranks'."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted([*p.glob("*.json"), *p.glob("*.json.gz")])
            if not found:
                raise InputError("no *.json or *.json.gz trace in the folder", file=str(p), field="--from-profile")
            files += found
        else:
            files.append(p)
    traces = [read_trace(f) for f in files]
    if not any(t.gemm for t in traces):
        raise InputError("no GEMM with its shapes in the trace (aten::mm, addmm, bmm with record_shapes=True): "
                         "nothing to fit the kernel model on", file=str(files[0]), field="--from-profile")  # fmt: skip
    return traces


__all__ = ["Call", "RankTrace", "Step", "gemm_shape", "load_events", "memory_bytes", "read_trace", "read_traces"]
