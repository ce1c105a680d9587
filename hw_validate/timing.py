"""Per-phase timing of the real job, named as the simulator names its spans (Megatron's names).

Clocks: on CUDA every boundary is a ``torch.cuda.Event`` recorded on the current stream and the
step is resolved after one ``torch.cuda.synchronize()`` at its end (no sync inside the step); on
CPU ranks a boundary is ``time.perf_counter()`` (CPU ops are synchronous, so the wall clock brackets
the work). Steps start after a ``dist.barrier()`` so that every rank's step clock starts together.

Phases per step (seconds, summed over micro-batches and layers of one rank). The forward names are
:mod:`sim.frameworks.deepspeed`'s span names one to one:

``embedding``      the token embedding (module hooks, pre -> post).
``attention``      every block's self-attention.
``route``          the MoE gate: router GEMM, softmax, top-k, capacity (``TopKGate.forward``).
``permute``        gate end -> experts start, less ``dispatch``: DeepSpeed's dispatch encode.
``dispatch``       time inside the dispatch ``all_to_all_single`` (0 when ep = 1).
``experts``        the local experts' forward (``Experts.forward``).
``combine``        time inside the combine ``all_to_all_single``.
``unpermute``      experts end -> MoE layer end, less ``combine``: the weighted decode.
``shared_experts`` shared experts' forward; ``mlp`` dense FFN layers; ``output`` the LM head.
``forward``        the whole ``engine(tokens)`` call plus the loss.
``forward_comm``   other collectives in forward (the dropless gate's capacity all-reduce MAX).
``attention_bwd``, ``experts_bwd``  backward of those modules (full backward hooks).
``combine_bwd``, ``dispatch_bwd``   time inside the backward all-to-alls (gradient of combine runs
                   first, in the dispatch direction; gradient of dispatch after ``experts_bwd``).
``grad_sync``      time inside gradient collectives (all-reduce / reduce-scatter / reduce) during
                   ``engine.backward``: ZeRO-1/2 reduce gradient buckets from backward hooks, so
                   this is the exposed reduction time; on CPU ranks gloo calls block, so it is the
                   whole reduction. Calls made with ``async_op=True`` count their launch only
                   (``async_calls`` counts them).
``backward``       the whole ``engine.backward(loss)`` call (incl. ``grad_sync`` and the all-to-alls).
``optimizer_comm`` collectives inside ``engine.step()`` (ZeRO's all-gather of updated partitions).
``optimizer``      the ``engine.step()`` calls (update, CPU-offload copies, ``optimizer_comm``).
``step``           barrier end -> last ``engine.step()`` end: the measured step time.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

PHASES = (
    "embedding",
    "attention",
    "route",
    "permute",
    "dispatch",
    "experts",
    "combine",
    "unpermute",
    "shared_experts",
    "mlp",
    "output",
    "forward",
    "forward_comm",
    "attention_bwd",
    "experts_bwd",
    "combine_bwd",
    "dispatch_bwd",
    "grad_sync",
    "backward",
    "optimizer_comm",
    "optimizer",
    "step",
)
#: collectives counted (calls and bytes of the largest buffer) per step
COMM_PHASES = ("dispatch", "combine", "forward_comm", "combine_bwd", "dispatch_bwd", "grad_sync", "optimizer_comm")
_COMM_OPS = (
    "all_to_all_single",
    "all_reduce",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "all_reduce_coalesced",
)


class StepTimer:
    """Collects (phase, start, end) boundaries during one step and resolves them to seconds."""

    def __init__(self, device_type: str = "cpu"):
        self.cuda = device_type == "cuda"
        self.enabled = False
        self.region: str | None = None
        self.moe_stage = "dispatch"  # which all-to-all comes next: dispatch/combine (fwd), *_bwd (bwd)
        self._spans: list[tuple[str, Any, Any]] = []
        self._open: dict[int, Any] = {}
        self.comm_bytes: dict[str, int] = defaultdict(int)
        self.comm_calls: dict[str, int] = defaultdict(int)
        self.async_calls = 0
        # MOESIM_TIMING_SPANS=DIR: every step's raw spans (perf_counter seconds, one clock for all ranks of
        # a host) go to DIR/rank-<r>.jsonl, to see per call who waited for whom (diagnosis, not a result)
        self.span_dir = os.environ.get("MOESIM_TIMING_SPANS") or None
        self._step_no = 0

    @property
    def clock(self) -> str:
        return "cuda_event" if self.cuda else "perf_counter"

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def add(self, phase: str, start: Any, end: Any) -> None:
        self._spans.append((phase, start, end))

    def begin_step(self) -> None:
        self._spans.clear()
        self._open.clear()
        self.comm_bytes = defaultdict(int)
        self.comm_calls = defaultdict(int)
        self.async_calls = 0
        self.enabled = True

    def end_step(self) -> dict[str, float]:
        """Seconds per phase for the step just finished (every phase in :data:`PHASES`, 0 if unused)."""
        self.enabled = False
        self.region = None
        if self.cuda:
            torch.cuda.synchronize()
        out = dict.fromkeys(PHASES, 0.0)
        out.update(_pre_experts=0.0, _post_experts=0.0)
        for phase, a, b in self._spans:
            dt = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            out[phase] = out.get(phase, 0.0) + float(dt)
        if self.span_dir and not self.cuda:
            self._dump_spans()
        self._spans.clear()
        out["permute"] = max(0.0, out.pop("_pre_experts") - out["dispatch"])
        out["unpermute"] = max(0.0, out.pop("_post_experts") - out["combine"])
        return out

    def _dump_spans(self) -> None:
        rank = int(os.environ.get("RANK", "0"))
        os.makedirs(self.span_dir, exist_ok=True)
        with open(os.path.join(self.span_dir, f"rank-{rank}.jsonl"), "a") as f:
            f.write(json.dumps({"step": self._step_no, "spans": [[p, a, b] for p, a, b in self._spans]}) + "\n")
        self._step_no += 1

    @contextmanager
    def phase(self, name: str, region: str | None = None) -> Iterator[None]:
        """Time a block as ``name``; ``region`` (forward/backward/optimizer) classifies collectives inside."""
        prev = self.region
        self.region = region if region is not None else prev
        if region in ("forward", "backward"):
            self.moe_stage = "dispatch" if region == "forward" else "combine_bwd"
        start = self.mark()
        try:
            yield
        finally:
            self.add(name, start, self.mark())
            self.region = prev

    # ---- module hooks ------------------------------------------------------------------------
    def _pre(self, key: int) -> Callable:
        def hook(*_a: Any) -> None:
            if self.enabled:
                self._open[key] = self.mark()

        return hook

    def _post(self, key: int, phase: str) -> Callable:
        def hook(*_a: Any) -> None:
            if self.enabled and key in self._open:
                self.add(phase, self._open.pop(key), self.mark())

        return hook

    def time_module(self, module: torch.nn.Module, phase: str, backward_phase: str | None = None) -> None:
        """Forward (and optionally backward) of ``module`` counted as ``phase``."""
        key = id(module)
        module.register_forward_pre_hook(self._pre(key))
        module.register_forward_hook(self._post(key, phase))
        if backward_phase is not None:
            module.register_full_backward_pre_hook(self._pre(-key))
            module.register_full_backward_hook(self._post(-key, backward_phase))

    def time_between(self, first: torch.nn.Module, second: torch.nn.Module, phase: str, *, pre: bool) -> None:
        """From the end of ``first``'s forward to the start (``pre``) or end of ``second``'s forward."""
        key = id(first) ^ id(second)
        first.register_forward_hook(self._pre(key))
        if pre:
            second.register_forward_pre_hook(self._post(key, phase))
        else:
            second.register_forward_hook(self._post(key, phase))

    def stage_after(self, module: torch.nn.Module, forward_stage: str | None, backward_stage: str | None) -> None:
        """After ``module``'s forward (backward) the next all-to-all is ``forward_stage`` (``backward_stage``)."""

        def fwd(*_a: Any) -> None:
            self.moe_stage = forward_stage or self.moe_stage

        def bwd(*_a: Any) -> None:
            self.moe_stage = backward_stage or self.moe_stage

        if forward_stage:
            module.register_forward_hook(fwd)
        if backward_stage:
            module.register_full_backward_hook(bwd)

    # ---- collectives -------------------------------------------------------------------------
    def wrap_comm(self, backend: Any) -> None:
        """Time every collective of DeepSpeed's comm backend (``deepspeed.comm.comm.cdb``) by region."""
        for name in _COMM_OPS:
            fn = getattr(backend, name, None)
            if fn is None or getattr(fn, "_moesim_timed", False):
                continue
            setattr(backend, name, self._timed(name, fn))

    def _timed(self, name: str, fn: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            region = self.region if self.enabled else None
            if region is None:
                return fn(*args, **kwargs)
            if name == "all_to_all_single":
                phase = self._a2a_phase(region)
            else:
                phase = {"backward": "grad_sync", "optimizer": "optimizer_comm"}.get(region, "forward_comm")
            start = self.mark()
            result = fn(*args, **kwargs)
            self.add(phase, start, self.mark())
            self.comm_calls[phase] += 1
            self.comm_bytes[phase] += _largest_buffer(args, kwargs)
            if kwargs.get("async_op"):
                self.async_calls += 1
            return result

        wrapper._moesim_timed = True  # type: ignore[attr-defined]
        return wrapper

    def _a2a_phase(self, region: str) -> str:
        """dispatch/combine in forward; in backward combine's gradient first, dispatch's after the experts."""
        if region == "backward":
            if self.moe_stage == "dispatch_bwd":
                self.moe_stage = "combine_bwd"  # the next MoE layer down starts with its combine gradient
                return "dispatch_bwd"
            return "combine_bwd"
        return "combine" if self.moe_stage == "combine" else "dispatch"


def _largest_buffer(args: tuple, kwargs: dict) -> int:
    best = 0
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            best = max(best, a.numel() * a.element_size())
        elif isinstance(a, list | tuple):
            best = max(best, sum(t.numel() * t.element_size() for t in a if isinstance(t, torch.Tensor)))
    return best


def install_model_hooks(model: torch.nn.Module, timer: StepTimer) -> None:
    """Hooks for every forward phase and the attention/expert backward on a :class:`MoETransformer`."""
    from hw_validate.model import MoEFFN

    timer.time_module(model.embed, "embedding")
    timer.time_module(model.head, "output")
    for block in model.blocks:
        if block.attn is not None:
            timer.time_module(block.attn, "attention", "attention_bwd")
        ffn = block.ffn
        if isinstance(ffn, MoEFFN):
            layer = ffn.moe.deepspeed_moe
            timer.time_module(layer.gate, "route")
            timer.stage_after(layer.gate, "dispatch", None)
            timer.time_between(layer.gate, layer.experts, "_pre_experts", pre=True)
            timer.time_module(layer.experts, "experts", "experts_bwd")
            timer.stage_after(layer.experts, "combine", "dispatch_bwd")
            timer.time_between(layer.experts, layer, "_post_experts", pre=False)
            for shared in ffn.shared:
                timer.time_module(shared, "shared_experts")
        else:
            timer.time_module(ffn, "mlp")
