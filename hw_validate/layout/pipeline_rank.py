"""One rank of the pipeline-parallel job: ``torch.distributed.pipelining`` on gloo, timed per pass.

::

    torchrun --nproc_per_node=2 hw_validate/layout/pipeline_rank.py --scenario S --out DIR [--steps N]

The scenario's transformer (:func:`hw_validate.model.build_model`, dense: MoE slots hold a dense MLP
of the expert width) is cut into the simulator's virtual stages (:func:`sim.inputs.stages.stage_layers`:
the same layers per stage, the embedding on the first, the final norm, LM head and loss on the
last); each rank builds the ``PipelineStage`` of its chunks and runs one schedule step per training
step: ``Schedule1F1B`` with one chunk a rank, ``ScheduleInterleaved1F1B`` with ``vpp`` chunks, over
``training.grad_accum_steps`` micro-batches of ``micro_batch_size`` sequences, then AdamW.

Timed (:mod:`hw_validate.layout.record` names), by wrapping the library's own calls, not by
changing them: each stage's ``forward_one_chunk`` / ``backward_one_chunk`` (``forward``, ``backward``),
the schedule's p2p posts and waits (the module functions ``_batch_p2p`` and ``_wait_batch_p2p``
of ``torch.distributed.pipelining.schedules``, called as the schedule calls them): a receive's wait
is ``recv_wait``, a send's ``send_wait``, each post (the ``isend``/``irecv`` calls) a ``p2p_post``
span with a ``send_issue``/``recv_issue`` mark per op; the loss, the optimizer and the whole step. Each P2P op is tagged with its direction and
micro-batch from the stage's ``get_{fwd,bwd}_{send,recv}_ops`` so that the driver can pair a send
with its receive on the other rank.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.pipelining import schedules as pp_schedules

from hw_validate.data import NextTokenTask, split
from hw_validate.layout.timeline import Recorder, clock, collective_sweep, end, finish, log, parse_args, start
from hw_validate.model import build_model
from sim.inputs.stages import VirtualStage, stage_layers


class StageModule(nn.Module):
    """The layers of one virtual stage, with the embedding on the first and the head on the last."""

    def __init__(self, model: nn.Module, vs: VirtualStage):
        super().__init__()
        self.embed = model.embed if vs.embedding else None
        self.blocks = nn.ModuleList(model.blocks[i] for i in vs.layers)
        self.norm = model.norm if vs.head else None
        self.head = model.head if vs.head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x, _ = block(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


class _Timed:
    """Wraps a stage's passes and the schedule's p2p calls; records into ``rec``."""

    def __init__(self, rec: Recorder):
        self.rec = rec
        self.tags: dict[int, tuple] = {}  # id(P2POp) -> (op, dir, micro, chunk, kind, bytes)
        self.works: dict[int, tuple] = {}  # id(Work) -> (work, dir, micro, chunk, kind, stage)
        self.last_forward = -1  # micro-batch of the latest forward (the loss that follows is its)

    def stage(self, st: PipelineStage, chunk: int) -> None:
        fwd, bwd = st.forward_one_chunk, st.backward_one_chunk

        def forward_one_chunk(mb, *a, **k):
            t0 = clock()
            out = fwd(mb, *a, **k)
            self.rec.span("forward", t0, clock(), micro=mb, chunk=chunk, stage=st.stage_index)
            self.last_forward = mb
            return out

        def backward_one_chunk(mb, *a, **k):
            t0 = clock()
            out = bwd(mb, *a, **k)
            self.rec.span("backward", t0, clock(), micro=mb, chunk=chunk, stage=st.stage_index)
            return out

        st.forward_one_chunk, st.backward_one_chunk = forward_one_chunk, backward_one_chunk
        for name, direction, kind in (("get_fwd_recv_ops", "F", "recv"), ("get_fwd_send_ops", "F", "send"),
                                      ("get_bwd_recv_ops", "B", "recv"), ("get_bwd_send_ops", "B", "send")):  # fmt: skip
            setattr(st, name, self._tagger(getattr(st, name), direction, kind, chunk, st.stage_index))

    def _tagger(self, get, direction: str, kind: str, chunk: int, stage_index: int):
        def ops(mb: int):
            out = get(mb)
            for op in out:
                self.tags[id(op)] = (op, direction, mb, chunk, kind, op.tensor.numel() * op.tensor.element_size(),
                                     stage_index)  # fmt: skip
            return out

        return ops

    def install(self) -> None:
        batch = pp_schedules._batch_p2p

        def _batch_p2p(p2p_ops, desc=None):
            t0 = clock()
            works = batch(p2p_ops, desc)
            t1 = clock()
            tags = [self.tags.pop(id(op), None) for op in p2p_ops]
            if p2p_ops:
                self.rec.span("p2p_post", t0, t1, ops=len(p2p_ops))
            if len(works) == len(p2p_ops):  # gloo: one Work per op, in order (no coalescing)
                for w, tag in zip(works, tags, strict=True):
                    if tag is None:
                        continue
                    _, d, mb, chunk, kind, nbytes, st = tag
                    self.works[id(w)] = (w, d, mb, chunk, kind, st)
                    self.rec.mark(f"{kind}_issue", t0, dir=d, micro=mb, chunk=chunk, stage=st, bytes=nbytes)
            return works

        def _wait_batch_p2p(works):
            for w in works:
                info = self.works.pop(id(w), None)
                arrived = w.is_completed()
                t0 = clock()
                w.wait()
                t1 = clock()
                if info is None:
                    continue
                _, d, mb, chunk, kind, st = info
                name = "recv_wait" if kind == "recv" else "send_wait"
                self.rec.span(name, t0, t1, dir=d, micro=mb, chunk=chunk, stage=st, blocked=not arrived)

        pp_schedules._batch_p2p, pp_schedules._wait_batch_p2p = _batch_p2p, _wait_batch_p2p


def p2p_sweep(nbytes: int) -> list[dict]:
    """Rank 0 sends to rank 1 with the receive already posted, the others idle: the transport's own
    cost at the job's message size and around it (:func:`hw_validate.layout.timeline.collective_sweep`)."""
    rank = dist.get_rank()
    bufs: dict[int, torch.Tensor] = {}

    def send(n: int) -> float | None:
        buf = bufs.setdefault(n, torch.zeros(max(1, n // 4)))
        if rank == 1:
            dist.irecv(buf, 0).wait()
        elif rank == 0:
            time.sleep(0.002)  # the receive is posted
            t0 = clock()
            dist.isend(buf, 1).wait()
            return t0
        return None

    return collective_sweep("p2p", send, sorted({max(4, nbytes // 16), max(4, nbytes // 4), nbytes, 4 * nbytes}))


def main(argv: list[str] | None = None) -> int:
    args = parse_args("pipeline_rank", argv)
    s, steps, warmup = start(args)
    p, t, m = s.parallelism, s.training, s.model
    if p.tp * p.cp * s.dp != 1 or p.schedule == "dualpipe":
        raise SystemExit("the pipeline job runs tp = cp = dp = 1 and the 1f1b or interleaved schedule")
    if m.tie_word_embeddings:
        raise SystemExit("the pipeline job needs model.tie_word_embeddings: false (embedding and head on different stages)")
    rank = dist.get_rank()
    model = build_model(s, None, dense=True, seed=args.seed)  # the same weights on every rank; keep our chunks
    mine = [vs for vs in stage_layers(s) if vs.rank == rank]
    n_virtual = p.pp * p.vpp
    rec = Recorder()
    timed = _Timed(rec)
    timed.install()
    stages = []
    for chunk, vs in enumerate(mine):
        st = PipelineStage(StageModule(model, vs), vs.index, n_virtual, torch.device("cpu"))
        timed.stage(st, chunk)
        stages.append(st)
    del model
    params = [q for st in stages for q in st.submod.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    micro = t.grad_accum_steps
    loss_parts: list[torch.Tensor] = []

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        t0 = clock()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        rec.span("loss", t0, clock(), micro=timed.last_forward)
        loss_parts.append(loss.detach())
        return loss

    if p.vpp > 1:
        sched = ScheduleInterleaved1F1B(stages, micro, loss_fn=loss_fn)
    else:
        sched = Schedule1F1B(stages[0], micro, loss_fn=loss_fn)
    task = NextTokenTask(m.vocab_size, t.seq_len, t.micro_batch_size * micro, seed=args.seed)
    first = any(vs.embedding for vs in mine)
    last = any(vs.head for vs in mine)
    losses = []
    for step in range(steps):
        x, y = split(task.batch(step, 0, 0))
        loss_parts.clear()
        t0 = rec.begin_step()
        kwargs = {"target": y} if last else {}
        if first:
            sched.step(x, **kwargs)
        else:
            sched.step(**kwargs)
        t1 = clock()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = clock()
        rec.span("optimizer", t1, t2)
        rec.span("step", t0, t2)
        # the last ``micro`` losses: the first step's stage set-up also calls the loss once (shape inference)
        part = torch.stack(loss_parts[-micro:]).mean() if loss_parts else torch.zeros(())
        dist.all_reduce(part)  # only the last stage has a loss: the sum over ranks is it
        losses.append(float(part))
        log(f"step {step + 1:4d}/{steps}  loss {losses[-1]:.4f}  rank0 {t2 - t0:.4f} s")
    send = t.micro_batch_size * t.seq_len * m.hidden_size * 4
    config = {
        "pp": p.pp, "vpp": p.vpp, "tp": 1, "schedule": "interleaved" if p.vpp > 1 else "1f1b",
        "library": f"torch.distributed.pipelining.{type(sched).__name__}", "micro_batches": micro,
        "micro_batch_size": t.micro_batch_size, "seq_len": t.seq_len, "hidden_size": m.hidden_size,
        "num_layers": m.num_layers, "dtype": "fp32", "p2p_bytes": send, "optimizer": "torch.optim.AdamW",
        "stages": [{"index": vs.index, "rank": vs.rank, "chunk": vs.chunk, "layers": list(vs.layers),
                    "embedding": vs.embedding, "head": vs.head} for vs in stage_layers(s)],
    }  # fmt: skip
    finish(args, "pipeline", s, rec, config, losses, warmup, p2p_sweep(send))
    return end(rec)


if __name__ == "__main__":
    sys.exit(main())
