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
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sim.errors import InputError

DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "c10::Float8_e4m3fn": "fp8",
          "c10::Float8_e5m2": "fp8"}  # fmt: skip
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation"}
_SDPA = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_flash_attention",
         "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
         "aten::_flash_attention_forward", "aten::_efficient_attention_forward")  # fmt: skip
ATTENTION_FWD = set(_SDPA)
ATTENTION_BWD = {n + "_backward" for n in _SDPA}
#: memory-bound ops and how many tensors they write (0: in place on their first input, which is
#: then also written; "w": write only)
MEMORY_OPS = {
    **dict.fromkeys(("aten::add", "aten::mul", "aten::div", "aten::sub", "aten::gelu", "aten::silu", "aten::relu",
                     "aten::sigmoid", "aten::exp", "aten::neg", "aten::rsqrt", "aten::native_layer_norm",
                     "aten::_softmax", "aten::gelu_backward", "aten::silu_backward", "aten::threshold_backward",
                     "aten::native_layer_norm_backward", "aten::_softmax_backward_data", "aten::where",
                     "aten::_fused_rms_norm", "aten::_fused_rms_norm_backward"), 1),
    **dict.fromkeys(("aten::add_", "aten::mul_", "aten::div_", "aten::sub_", "aten::addcmul_", "aten::addcdiv_",
                     "aten::lerp_", "aten::sqrt_", "aten::copy_"), 0),
    **dict.fromkeys(("aten::fill_", "aten::zero_"), "w"),
}  # fmt: skip
#: c10d op or ``Collective name`` -> the collective kind the link fit knows
COLLECTIVES = {"alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all": "all_to_all",
               "all_to_allv": "all_to_all", "allreduce_": "all_reduce", "allreduce": "all_reduce",
               "all_reduce": "all_reduce", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
               "all_gather_into_tensor": "all_gather", "_allgather_base": "all_gather", "allgather": "all_gather",
               "all_gather": "all_gather", "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
               "reduce_scatter": "reduce_scatter", "reduce_scatter_": "reduce_scatter", "barrier": "barrier",
               "broadcast_": "broadcast", "broadcast": "broadcast"}  # fmt: skip
_NCCL_KINDS = (("alltoall", "all_to_all"), ("sendrecv", "all_to_all"), ("allreduce", "all_reduce"),
               ("allgather", "all_gather"), ("reducescatter", "reduce_scatter"), ("broadcast", "broadcast"))  # fmt: skip
_GLOO = {"gloo:all_to_all": "all_to_all", "gloo:all_reduce": "all_reduce", "gloo:all_gather": "all_gather",
         "gloo:reduce_scatter": "reduce_scatter", "gloo:barrier": "barrier", "gloo:broadcast": "broadcast"}  # fmt: skip
#: a gloo thread starts a call's work at most this long after the c10d op returned (microseconds)
GLOO_START_US = 300.0
#: gaps between consecutive ops longer than this are idle time, not per-op overhead (seconds)
SHORT_GAP_S = 100e-6


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


def _dims(e: dict) -> list:
    return (e.get("args") or {}).get("Input Dims") or []


def _types(e: dict) -> list:
    return (e.get("args") or {}).get("Input type") or []


def _numel(d) -> int:
    return int(np.prod(d)) if isinstance(d, list) and all(isinstance(x, int) for x in d) else 0


def _dtype(e: dict) -> str | None:
    for t in _types(e):
        if t in DTYPES:
            return DTYPES[t]
    return None


def gemm_shape(name: str, dims: list) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) of a GEMM op from its input dims, or None when they are not there."""
    try:
        if name == "aten::mm":
            (m, k), (_, n) = dims[0], dims[1]
            return 1, m, n, k
        if name in ("aten::addmm", "aten::_addmm_activation"):
            (m, k), (_, n) = dims[1], dims[2]
            return 1, m, n, k
        if name == "aten::bmm":
            (b, m, k), (_, _, n) = dims[0], dims[1]
            return b, m, n, k
        if name == "aten::baddbmm":
            (b, m, k), (_, _, n) = dims[1], dims[2]
            return b, m, n, k
    except (IndexError, TypeError, ValueError):
        return None
    return None


def memory_bytes(name: str, e: dict, bpe: int) -> int:
    """Bytes a memory-bound op moves: every tensor input read and its output written (in place: the
    first input written back; fill and zero: written only)."""
    tensors = [_numel(d) for d, t in zip(_dims(e), _types(e), strict=False) if t in DTYPES and isinstance(d, list)]
    if not tensors:
        return 0
    writes = MEMORY_OPS[name]
    if writes == "w":
        return tensors[0] * bpe
    return (sum(tensors) + (tensors[0] if writes == 0 else max(tensors))) * bpe


def _nccl_kind(kernel: str) -> str | None:
    low = kernel.lower()
    for key, kind in _NCCL_KINDS:
        if key in low:
            return kind
    return None


def _top_level(events: list[dict]) -> list[dict]:
    """Events not contained in another of the list on the same thread (sorted by start)."""
    out, by_tid = [], {}
    for e in sorted(events, key=lambda x: (x["ts"], -x["dur"])):
        end = by_tid.get(e["tid"])
        if end is None or e["ts"] >= end:
            out.append(e)
            by_tid[e["tid"]] = e["ts"] + e["dur"]
    return out


def _innermost(events: list[dict]) -> list[dict]:
    """Events that contain no other event of the list on the same thread."""
    keep = []
    evs = sorted(events, key=lambda x: (x["tid"], x["ts"], -x["dur"]))
    for i, e in enumerate(evs):
        nxt = evs[i + 1] if i + 1 < len(evs) else None
        inner = nxt is not None and nxt["tid"] == e["tid"] and nxt["ts"] < e["ts"] + e["dur"]
        if not inner:
            keep.append(e)
    return keep


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


_DT_NAMES = {"Float": "fp32", "BFloat16": "bf16", "Half": "fp16"}


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
