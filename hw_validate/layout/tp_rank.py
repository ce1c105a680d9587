"""One rank of the tensor-parallel job: ``torch.distributed.tensor.parallel`` on gloo, timed per layer.

::

    torchrun --nproc_per_node=2 hw_validate/layout/tp_rank.py --scenario S --out DIR [--steps N]

The scenario's transformer (:func:`hw_validate.model.build_model`, dense) split over the TP group as
Megatron-Core splits it with sequence parallelism (``parallelism.sequence_parallel``, on by default
with tp > 1): in every layer Q, K, V and the MLP's up (and gate) projections column-parallel, the
attention output and the MLP's down projection row-parallel, the norms sequence-parallel; so each
layer's forward all-gathers the sequence before attention and before the MLP and reduce-scatters
after each (the backward the reverse), the collectives the simulator's ``tp_all_gather`` /
``tp_reduce_scatter`` spans stand for. Without sequence parallelism the row-parallel outputs are
all-reduced instead (``tp_all_reduce``). The embedding is vocab-parallel (row-parallel, its output
reduce-scattered over the sequence), the LM head column-parallel with the loss computed on the
vocab shards (``loss_parallel``), as Megatron's vocab-parallel embedding and cross entropy do.

Timed (:mod:`hw_validate.layout.record` names): every TP collective at DTensor's own calls
(``_functional_collectives.all_gather_single``, ``reduce_scatter_single``, ``all_reduce``, wrapped
and waited for at once, so a span is the collective's whole time on this rank), with its kind,
forward or backward, region (``attention``, ``mlp``, ``embedding``, ``head``, ``loss``), layer and bytes; the
windows of every layer's attention and MLP modules forward (pre-hooks run before the input's
all-gather) and backward (full backward hooks: from the output gradient to the input gradient; the
input's reduce-scatter runs right after and is attributed to the same region); the forward (with
the loss), the backward, the optimizer and the step.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from hw_validate.data import NextTokenTask, split
from hw_validate.layout.timeline import Recorder, clock, collective_sweep, end, finish, log, parse_args, start
from hw_validate.model import GatedMLP, PlainMLP, build_model

_COLLECTIVES = {"all_gather_single": "tp_all_gather", "reduce_scatter_single": "tp_reduce_scatter",
                "all_reduce": "tp_all_reduce"}  # fmt: skip


class _Timed:
    """The TP collectives and the layers' windows of one rank, with the region they belong to."""

    def __init__(self, rec: Recorder):
        self.rec = rec
        self.region: tuple[str, int] = ("embedding", -1)
        self.trailing: tuple[str, int] | None = None  # a backward window just ended: its input's collective
        self.bwd_started = False
        self.phase = "fwd"  # fwd | bwd | optimizer: what the rank is running (set by the training loop)
        self.inside: list[float] = []  # collective seconds inside the open window
        self.inside_window = False

    def install(self) -> None:
        self.originals = {name: getattr(funcol, name) for name in _COLLECTIVES}
        for name, span in _COLLECTIVES.items():
            setattr(funcol, name, self._wrap(self.originals[name], span))

    def uninstall(self) -> None:
        for name, fn in self.originals.items():
            setattr(funcol, name, fn)

    def _wrap(self, fn, span: str):
        def timed(tensor, *a, **k):
            t0 = clock()
            out = fn(tensor, *a, **k)
            if isinstance(out, funcol.AsyncCollectiveTensor):
                out = out.wait()
            t1 = clock()
            phase = self.phase
            region, layer = self.region if phase != "optimizer" else ("optimizer", -3)
            if phase == "bwd" and not self.inside_window:
                if self.trailing is not None:
                    region, layer = self.trailing
                    self.trailing = None
                else:
                    region, layer = ("embedding", -1) if self.bwd_started else ("head", -2)
            self.rec.span(span, t0, t1, phase=phase, region=region, layer=layer,
                          bytes=tensor.numel() * tensor.element_size())  # fmt: skip
            self.inside.append(t1 - t0)
            return out

        return timed

    def module(self, mod: torch.nn.Module, region: str, layer: int, backward: bool) -> None:
        state: dict[str, float] = {}

        def pre(_m, _a):
            self.region, self.inside_window = (region, layer), True
            self.inside = []
            state["f"] = clock()

        def post(_m, _a, _o):
            self.rec.span(region, state["f"], clock(), phase="fwd", layer=layer, comm_s=sum(self.inside))
            self.inside_window = False

        mod.register_forward_pre_hook(pre, prepend=True)
        mod.register_forward_hook(post)
        if not backward:
            return

        def bpre(_m, _g):
            self.region, self.inside_window, self.trailing, self.bwd_started = (region, layer), True, None, True
            self.inside = []
            state["b"] = clock()

        def bpost(_m, _gi, _go):
            self.rec.span(region, state["b"], clock(), phase="bwd", layer=layer, comm_s=sum(self.inside))
            self.inside_window, self.trailing = False, (region, layer)

        mod.register_full_backward_pre_hook(bpre)
        mod.register_full_backward_hook(bpost)


def parallelize(model: torch.nn.Module, mesh, tp: int, sp: bool) -> None:
    """Megatron's TP (+ SP) split of :class:`hw_validate.model.MoETransformer`'s dense layers."""
    seq = Shard(1) if sp else Replicate()
    outer = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        outer["norm"] = SequenceParallel()
    parallelize_module(model, mesh, outer)
    for block in model.blocks:
        if not isinstance(block.ffn, GatedMLP | PlainMLP) or block.attn is None:
            raise SystemExit("the tensor-parallel job runs dense blocks with attention and a gated or plain MLP")
        plan = {
            "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(output_layouts=seq),
            "ffn.up": ColwiseParallel(), "ffn.down": RowwiseParallel(output_layouts=seq),
        }  # fmt: skip
        if isinstance(block.ffn, GatedMLP):
            plan["ffn.gate"] = ColwiseParallel()
        # the module's input as one replicated DTensor: the input gradients of Q, K and V (of the MLP's
        # projections) sum to one partial gradient, reduced once (reduce-scattered with SP)
        plan["attn"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        plan["ffn"] = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),))
        if sp:
            plan.update({"norm1": SequenceParallel(), "norm2": SequenceParallel()})
        parallelize_module(block, mesh, plan)
        block.attn.h //= tp  # heads of this rank (Megatron's num_attention_heads_per_partition)
        block.attn.kv //= tp


def allreduce_norm_grads(model: torch.nn.Module, rec: Recorder) -> None:
    """Sum the partial gradients of the sequence-parallel norms over the TP group in one all-reduce,
    as Megatron-Core's ``_allreduce_layernorm_grads`` does after the backward (left to DTensor, every
    optimizer op on such a gradient would all-reduce it again)."""
    parts = [q for q in model.parameters()
             if isinstance(q.grad, DTensor) and any(pl.is_partial() for pl in q.grad.placements)]  # fmt: skip
    if not parts:
        return
    local = [q.grad.to_local() for q in parts]
    flat = torch.cat([g.reshape(-1) for g in local])
    t0 = clock()
    dist.all_reduce(flat)
    rec.span("tp_all_reduce", t0, clock(), phase="bwd", region="norm_grads", layer=-3, bytes=flat.numel() * 4)
    offset = 0
    for q, g in zip(parts, local, strict=True):
        n = g.numel()
        q.grad = DTensor.from_local(flat[offset:offset + n].view_as(g), q.grad.device_mesh, [Replicate()])
        offset += n


def tp_sweep(mesh, nbytes: int, tp: int) -> list[dict]:
    """The layers' TP collectives alone (every rank idle, after a barrier), through the same
    functional collectives DTensor calls, at the job's activation size and around it."""
    group = mesh.get_group()
    out = []
    for name, fn in (("tp_all_gather", lambda n: funcol.all_gather_single(torch.zeros(n // 4 // tp), 0, group)),
                     ("tp_reduce_scatter", lambda n: funcol.reduce_scatter_single(torch.zeros(n // 4), "sum", 0, group)),
                     ("tp_all_reduce", lambda n: funcol.all_reduce(torch.zeros(n // 4), "sum", group))):  # fmt: skip
        out += collective_sweep(name, lambda n, fn=fn: _waited(fn(n)), sorted({nbytes // 4, nbytes, 4 * nbytes}))
    return out


def _waited(t) -> None:
    if isinstance(t, funcol.AsyncCollectiveTensor):
        t.wait()


def main(argv: list[str] | None = None) -> int:
    args = parse_args("tp_rank", argv)
    s, steps, warmup = start(args)
    p, t, m = s.parallelism, s.training, s.model
    if p.pp * p.cp * s.dp != 1 or p.tp != dist.get_world_size():
        raise SystemExit("the tensor-parallel job runs tp = world size (pp = cp = dp = 1)")
    if m.tie_word_embeddings or m.kv_heads % p.tp:
        raise SystemExit("the tensor-parallel job needs untied embeddings and kv heads divisible by tp")
    sp = s.sequence_parallel
    mesh = init_device_mesh("cpu", (p.tp,))
    model = build_model(s, None, dense=True, seed=args.seed)
    parallelize(model, mesh, p.tp, sp)
    rec = Recorder()
    timed = _Timed(rec)
    timed.install()
    timed.module(model.embed, "embedding", -1, backward=False)
    timed.module(model.head, "head", m.num_layers, backward=False)
    for i, block in enumerate(model.blocks):
        timed.module(block.attn, "attention", i, backward=True)
        timed.module(block.ffn, "mlp", i, backward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    task = NextTokenTask(m.vocab_size, t.seq_len, t.micro_batch_size, seed=args.seed)
    micro = t.grad_accum_steps
    losses = []
    for step in range(steps):
        t0 = rec.begin_step()
        total = 0.0
        for mb in range(micro):
            x, y = split(task.batch(step, mb, 0))  # the same batch on every rank of the TP group
            a = clock()
            timed.phase = "fwd"
            logits, _ = model(x)
            timed.region = ("loss", m.num_layers)
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1)) / micro
                b = clock()
                rec.span("forward", a, b, micro=mb)
                timed.bwd_started, timed.phase = False, "bwd"
                loss.backward()
            rec.span("backward", b, clock(), micro=mb)
            total += float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)
        timed.phase = "bwd"
        allreduce_norm_grads(model, rec)
        t1 = clock()
        timed.phase = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = clock()
        rec.span("optimizer", t1, t2)
        rec.span("step", t0, t2)
        losses.append(total)
        log(f"step {step + 1:4d}/{steps}  loss {total:.4f}  rank0 {t2 - t0:.4f} s")
    act = t.micro_batch_size * t.seq_len * m.hidden_size * 4
    config = {
        "pp": 1, "vpp": 1, "tp": p.tp, "sequence_parallel": sp, "library": "torch.distributed.tensor.parallel",
        "micro_batches": micro, "micro_batch_size": t.micro_batch_size, "seq_len": t.seq_len,
        "hidden_size": m.hidden_size, "num_layers": m.num_layers, "dtype": "fp32", "tp_bytes": act,
        "optimizer": "torch.optim.AdamW",
    }  # fmt: skip
    timed.uninstall()
    finish(args, "tensor_parallel", s, rec, config, losses, warmup, tp_sweep(mesh, act, p.tp))
    return end(rec)


if __name__ == "__main__":
    sys.exit(main())
