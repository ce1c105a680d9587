"""Pipeline schedules as data: per pipeline rank, the ordered list of forward and backward passes of
its model chunks, as DeepSpeed's ``TrainSchedule.steps()`` and Megatron-Core's
``pipeline_parallel/schedules.py`` order them. The engine only executes the list; :func:`check`
verifies any schedule.

An :class:`Instr` is ``F`` or ``B`` of ``(chunk, micro)`` on one pipeline rank. Virtual stage ``v``
of the model is chunk ``v // pp`` of rank ``v % pp`` (interleaved) or the DualPipe pairing of
:mod:`sim.inputs.stages`; ``F(v, m)`` needs ``F(v - 1, m)`` done and its activations received, ``B(v,
m)`` needs ``B(v + 1, m)`` (or, on the last virtual stage, its own ``F``).

- ``1f1b`` (PipeDream-Flush, Narayanan et al. 2021; Megatron ``forward_backward_pipelining_without_
  interleaving``): rank r runs ``min(pp - r - 1, m)`` warm-up forwards, then alternates one forward
  and one backward, then the remaining backwards. Bubble ``(pp - 1) / (m + pp - 1)`` of the step
  with uniform stages and free communication.
- ``interleaved`` (Megatron ``forward_backward_pipelining_with_interleaving``): ``vpp`` chunks per
  rank, micro-batches in groups of ``pp``; warm-up ``(pp - r - 1) 2 + (vpp - 1) pp`` forwards; bubble
  divided by ``vpp``.
- ``dualpipe`` (DeepSeek-V3, arXiv 2412.19437 section 3.2.1; deepseek-ai/DualPipe): micro-batches
  enter from both ends; rank r holds virtual stages r and 2 pp - 1 - r; half the micro-batches run
  the "forward" direction, half the "reverse". Modelled as the bidirectional 1F1B of its reference
  implementation's eight phases, without the F/B overlap of one chunk pair (the engine's
  ``collectives.a2a_overlap`` models the all-to-all hiding that overlap buys).
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.errors import InputError


@dataclass(frozen=True)
class Instr:
    """One pass on a pipeline rank: ``F`` forward, ``B`` backward (``zb``: input gradients only, the
    weight gradients left to a later ``W``, zero-bubble style), ``W`` the deferred weight gradients of
    the oldest ``zb`` backward. ``paired``: this F and the following B run as one overlapped pair
    (DualPipe's ``_forward_backward_chunk``), so their all-to-alls can hide behind each other."""

    kind: str
    chunk: int
    micro: int
    zb: bool = False
    paired: bool = False

    def __repr__(self) -> str:
        return f"{self.kind}{'z' if self.zb else ''}{self.chunk}.{self.micro}{'~' if self.paired else ''}"


def one_f_one_b(pp: int, m: int, overlap: bool = False) -> list[list[Instr]]:
    """``overlap`` with pp 1: Megatron's ``combined_1f1b_schedule_for_no_pipelining`` (EP all-to-all
    overlap), micro-batch 0's forward alone, then the forward of i + 1 with the backward of i, then
    the last backward alone: one warm-up forward, so that each forward is followed by another
    micro-batch's backward."""
    out = []
    for r in range(pp):
        warm = min(pp - r - 1 + (1 if overlap and pp == 1 else 0), m)
        seq = [Instr("F", 0, i) for i in range(warm)]
        f, b = warm, 0
        while f < m:
            seq.append(Instr("F", 0, f))
            f += 1
            seq.append(Instr("B", 0, b))
            b += 1
        seq.extend(Instr("B", 0, i) for i in range(b, m))
        out.append(seq)
    return out


def _interleaved_ids(k: int, pp: int, vpp: int, forward: bool) -> tuple[int, int]:
    """(chunk, micro) of the k-th forward (or backward) pass of a rank under Megatron's interleaving
    (micro-batch groups of ``pp`` per chunk: ``get_model_chunk_id`` / ``get_microbatch_id``)."""
    group = pp * vpp
    chunk = (k % group) // pp
    if not forward:
        chunk = vpp - 1 - chunk
    micro = (k // group) * pp + k % pp
    return chunk, micro


def interleaved(pp: int, vpp: int, m: int) -> list[list[Instr]]:
    if m % pp:
        raise InputError(f"interleaving needs micro-batches ({m}) divisible by pp ({pp})", field="training.grad_accum_steps")
    total = m * vpp
    out = []
    for r in range(pp):
        warm = min((pp - r - 1) * 2 + (vpp - 1) * pp, total)
        seq = [Instr("F", *_interleaved_ids(k, pp, vpp, True)) for k in range(warm)]
        f, b = warm, 0
        while f < total:
            seq.append(Instr("F", *_interleaved_ids(f, pp, vpp, True)))
            f += 1
            seq.append(Instr("B", *_interleaved_ids(b, pp, vpp, False)))
            b += 1
        seq.extend(Instr("B", *_interleaved_ids(k, pp, vpp, False)) for k in range(b, total))
        out.append(seq)
    return out


def dualpipe(pp: int, m: int) -> list[list[Instr]]:
    """DualPipe's eight steps (deepseek-ai/DualPipe ``dualpipe.py``, ``DualPipe.step``), per rank.
    Micro-batches ``0 .. m/2 - 1`` enter at rank 0 and run module 0 (chunk 0: model stage r on rank
    r); ``m/2 .. m - 1`` enter at rank pp - 1 and run module 1 (chunk 1: model stage pp - 1 - r). A
    rank in the second half swaps its phases, as the reference does (``phase ^= is_in_second_half``)."""
    return [_dualpipe_rank(r, pp, m) for r in range(pp)]


def _dualpipe_rank(r: int, pp: int, m: int) -> list[Instr]:
    half_ranks, half_m = pp // 2, m // 2
    hr, second = min(r, pp - 1 - r), r >= pp // 2
    middle = r in (half_ranks - 1, half_ranks)
    seq: list[Instr] = []
    nf, nb = [0, 0], [0, 0]
    pending_w: list[Instr] = []

    def chunk(phase: int) -> int:
        return phase ^ int(second)

    def F(phase: int, paired: bool = False) -> None:
        c = chunk(phase)
        seq.append(Instr("F", c, nf[c] + c * half_m, paired=paired))
        nf[c] += 1

    def B(phase: int, zb: bool = False) -> None:
        c = chunk(phase)
        ins = Instr("B", c, nb[c] + c * half_m, zb=zb)
        seq.append(ins)
        nb[c] += 1
        if zb:
            pending_w.append(ins)

    def W() -> None:
        ins = pending_w.pop(0)
        seq.append(Instr("W", ins.chunk, ins.micro))

    def FB(p0: int, p1: int) -> None:
        F(p0, paired=True)
        B(p1)

    for _ in range((half_ranks - hr - 1) * 2):  # step 1: nF0
        F(0)
    for _ in range(hr + 1):  # step 2: nF0F1
        F(0)
        F(1)
    for _ in range(half_ranks - hr - 1):  # step 3: nB1W1F1
        B(1, zb=True)
        W()
        F(1)
    for i in range(half_m - pp + hr + 1):  # step 4: nF0B1F1B0
        if i == 0 and middle:
            F(0)
            B(1)
        else:
            FB(0, 1)
        FB(1, 0)
    for _ in range(half_ranks - hr - 1):  # step 5: nB1F1B0
        B(1)
        FB(1, 0)
    zb = False
    for i in range(hr + 1):  # step 6: nB1B0, zero bubble from the middle on
        if i == (hr + 1) // 2 and hr % 2 == 1:
            zb = True
        B(1, zb=zb)
        if i == (hr + 1) // 2 and hr % 2 == 0:
            zb = True
        B(0, zb=zb)
    for _ in range(half_ranks - hr - 1):  # step 7: nWB0
        W()
        B(0, zb=True)
    for _ in range(hr + 1):  # step 8: nW
        W()
    assert not pending_w
    return seq


def path(schedule: str, pp: int, vpp: int, m: int, micro: int) -> list[tuple[int, int]]:
    """(pipeline rank, chunk) of every model stage, in model order, that micro-batch ``micro``
    passes through: its forward walks the list, its backward walks it back."""
    if schedule == "dualpipe":
        if micro < m // 2:
            return [(r, 0) for r in range(pp)]
        return [(pp - 1 - v, 1) for v in range(pp)]
    return [(v % pp, v // pp) for v in range(pp * vpp)]


def build(schedule: str, pp: int, vpp: int, m: int, overlap: bool = False) -> list[list[Instr]]:
    """The instruction list of every pipeline rank (``overlap``: ``collectives.a2a_overlap``)."""
    if schedule == "dualpipe":
        return dualpipe(pp, m)
    if schedule == "interleaved" and vpp > 1:
        return interleaved(pp, vpp, m)
    return one_f_one_b(pp, m, overlap)


def chunks(schedule: str, vpp: int) -> int:
    """Model chunks each rank holds."""
    return 2 if schedule == "dualpipe" else vpp


def check(schedule: str, pp: int, vpp: int, m: int, seqs: list[list[Instr]]) -> None:
    """Raise AssertionError unless ``seqs`` is a valid schedule: every rank runs the F and the B of
    each (chunk, micro) it owns exactly once, F before B, a ``W`` after each ``zb`` B; and running each
    rank's list in order, with F waiting for the previous stage's F of the same micro-batch and B for
    the next stage's B (the last stage's B for its own F), finishes (no deadlock)."""
    owned: list[set[tuple[int, int]]] = [set() for _ in range(pp)]
    for i in range(m):
        for r, c in path(schedule, pp, vpp, m, i):
            owned[r].add((c, i))
    for r, seq in enumerate(seqs):
        fb = [(x.kind, x.chunk, x.micro) for x in seq if x.kind in "FB"]
        want = {(k, c, i) for k in "FB" for c, i in owned[r]}
        assert len(fb) == len(set(fb)) and set(fb) == want, f"rank {r}: wrong passes"
        pos = {g: j for j, g in enumerate((x.kind, x.chunk, x.micro) for x in seq)}
        for c, i in owned[r]:
            assert pos[("F", c, i)] < pos[("B", c, i)], f"rank {r}: B before F of chunk {c} micro {i}"
        zb = [(x.chunk, x.micro) for x in seq if x.kind == "B" and x.zb]
        ws = [(x.chunk, x.micro) for x in seq if x.kind == "W"]
        assert sorted(zb) == sorted(ws), f"rank {r}: every zero-bubble B needs one W"
    done: set[tuple[str, int, int, int]] = set()

    def ready(r: int, ins: Instr) -> bool:
        if ins.kind == "W":
            return True
        p = path(schedule, pp, vpp, m, ins.micro)
        v = p.index((r, ins.chunk))
        if ins.kind == "F":
            return v == 0 or ("F", *p[v - 1], ins.micro) in done
        if v == len(p) - 1:
            return ("F", r, ins.chunk, ins.micro) in done
        return ("B", *p[v + 1], ins.micro) in done

    heads = [0] * pp
    progressed = True
    while progressed:
        progressed = False
        for r, seq in enumerate(seqs):
            while heads[r] < len(seq) and ready(r, seq[heads[r]]):
                ins = seq[heads[r]]
                done.add((ins.kind, r, ins.chunk, ins.micro))
                heads[r] += 1
                progressed = True
    stuck = [r for r in range(pp) if heads[r] < len(seqs[r])]
    assert not stuck, f"deadlock: ranks {stuck} wait at {[seqs[r][heads[r]] for r in stuck]}"


__all__ = ["Instr", "build", "check", "chunks", "dualpipe", "interleaved", "one_f_one_b", "path"]
