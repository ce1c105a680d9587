"""A training step as a program per pipeline rank: what each model chunk runs for one micro-batch,
and in which order the pipeline schedule runs the passes. Pure data; the engine executes it.

A :class:`Program` holds, per pipeline rank, its :class:`Chunk` s (one per model chunk it holds) and its
instruction list (:mod:`sim.frameworks.pipeline`). A chunk's ``fwd`` and ``bwd`` are op templates of one
micro-batch; durations are priced when the engine runs them (:class:`sim.frameworks.pricing.Pricer`),
on the ranks it runs them for, so nothing world-sized is stored per op.

Ops (names as Megatron-Core's spans): :class:`Kernels` (back to back on the compute stream),
:class:`EPAllToAll` (dispatch / combine in an EP group), :class:`GroupComm` (a blocking collective on a
tensor, expert-tensor or context parallel group), :class:`Grads` (gradients handed to the comm
stream), :class:`ParamGather` / :class:`WaitParams` (sharded parameters gathered ahead of use) and
:class:`CapacitySync` (DeepSpeed's drop-free gate). The step's :class:`Tail` lists what follows the
last backward: gradient-norm all-reduces, the optimizer, a parameter all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.frameworks.pipeline import Instr


@dataclass(frozen=True)
class Kernel:
    name: str  # span name: embedding, attention, route, permute, experts, unpermute, shared_experts, mlp, output ...
    layer: int  # model layer (-1: embedding, num_layers: LM head / loss)
    moe: int | None = None  # MoE layer index of routing-dependent blocks


@dataclass
class Kernels:
    """Kernels back to back on the compute stream; ``phase="fwd"``: priced as a forward inside a
    backward pass (full recompute), else as the pass they run in."""

    kernels: list[Kernel]
    layer: int
    phase: str = ""


@dataclass(frozen=True)
class EPAllToAll:
    name: str  # dispatch | combine (the span)
    direction: str  # dispatch | combine (the data's direction)
    moe: int
    layer: int


@dataclass(frozen=True)
class GroupComm:
    """A collective on the lane's ``group`` (``tp``, ``etp`` or ``cp``) that the compute stream waits for;
    ``nbytes`` in nccl-tests' convention (per-rank buffer for all-reduce, whole array for all-gather and
    reduce-scatter). ``overlap``: the part hidden behind GEMMs when TP communication overlap is on."""

    name: str
    kind: str  # all_gather | reduce_scatter | all_reduce
    group: str
    nbytes: float
    layer: int
    overlap: bool = False


@dataclass(frozen=True)
class Grads:
    """Gradients of ``layer`` ready on each rank: ``nonexpert`` / ``expert`` parameters per rank.
    ``every_micro``: reduced in every micro-batch's backward, else only in the last one's;
    ``flush``: the last hand-over of a backward (buckets are reduced whatever their fill)."""

    layer: int
    nonexpert: int
    expert: int
    every_micro: bool
    flush: bool = False


@dataclass(frozen=True)
class ParamGather:
    """Start gathering the sharded parameters ``key`` (per rank: ``nonexpert`` / ``expert`` params)."""

    key: str
    nonexpert: int
    expert: int
    first_micro_only: bool = False  # gathered once per step (Megatron's overlapped param gather)
    at_step_start: bool = False  # issued when the step starts (optimizer.zero_grad), not when reached


@dataclass(frozen=True)
class WaitParams:
    key: str
    first_micro_only: bool = False


@dataclass(frozen=True)
class CapacitySync:
    moe: int
    layer: int
    nbytes: float = 8.0


@dataclass
class Chunk:
    """One model chunk on one pipeline rank: its ops for one micro-batch's forward and backward, the
    activation bytes it sends to the next model stage per rank, and its parameters per rank."""

    stage_index: int  # model order
    rank: int
    chunk: int
    layers: tuple[int, ...]
    fwd: list
    bwd: list
    weight_kernels: list[Kernel]  # blocks whose weight gradients a zero-bubble W pass computes
    send_bytes: float
    params_nonexpert: int
    params_expert: int


@dataclass
class Tail:
    """After the last backward of a pipeline rank: gradient norm all-reduce(s), optimizer, parameter
    all-gather. Parameters per rank; per part of the gradient norm its seconds (``norm_s``) and the
    groups its all-reduces run over in order (``norm_groups``: ``dp``, ``edp`` or ``world``)."""

    optimizer_params: int
    optimizer_s: float
    norm_s: list[float]
    norm_groups: list[list[str]]
    gather_nonexpert: int
    gather_expert: int
    offload_bytes: float = 0.0
    cpu_adam_s: float = 0.0


@dataclass
class StageProgram:
    rank: int
    chunks: list[Chunk]
    instructions: list[Instr]
    tail: Tail
    last_micro: dict[int, int] = field(default_factory=dict)  # chunk -> its last backward's micro-batch


@dataclass
class Program:
    stages: list[StageProgram]
    schedule: str
    micro_batches: int
    grad_kind: str  # all_reduce | reduce_scatter
    grad_bytes_per_param: int
    param_bytes_per_param: int
    framework: str
    notes: list[str] = field(default_factory=list)

    @property
    def pp(self) -> int:
        return len(self.stages)


__all__ = ["CapacitySync", "Chunk", "EPAllToAll", "GroupComm", "Grads", "Kernel", "Kernels", "ParamGather",
           "Program", "StageProgram", "Tail", "WaitParams"]
