"""One training step as ops per rank, the way DeepSpeed runs expert parallelism with data parallelism
and ZeRO (pure: no SimPy here; :mod:`sim.engine.des` runs the ops).

Every rank runs the same op sequence (:mod:`sim.frameworks.ops`); only durations differ from rank
to rank (its experts' token counts, stragglers). Kernel times come from :mod:`sim.frameworks.kernels`.
Per micro-batch and layer:

forward   ``attention`` | MoE: ``route``, ``permute`` (DeepSpeed's sparse routes: a gather of S
          tokens into E x C slots, memory bound; or the dropless gather), all-to-all ``dispatch``,
          ``experts``, all-to-all ``combine``, ``unpermute`` (gather of the k S routes back and their
          gate-weighted sum, or the weighted scatter), ``shared_experts`` | dense: ``mlp``.
backward  mirrored in reverse, the all-to-alls again (gradient of combine runs in the dispatch direction, gradient of
          dispatch in the combine direction). Activation checkpointing recomputes each layer's
          forward, all-to-alls included, before its backward.
gradients ``GradReady`` hands a layer's gradients to the comm stream (bucketed by the engine):
          non-expert over the data-parallel group, expert over the expert-data-parallel group;
          ZeRO-0 all-reduces after the last backward, ZeRO-1 during the last micro-batch's
          backward, ZeRO-2 during every backward: DeepSpeed 0.19's ZeRO-1/2 all-reduce each
          gradient bucket and keep the rank's partition (``average_tensor`` ->
          ``allreduce_and_scatter``, ``use_multi_rank_bucket_allreduce`` true by default), twice a
          reduce-scatter's bytes; ZeRO-3 reduce-scatters, and all-gathers each layer's parameters
          before its forward and backward (one layer of prefetch).
tail      wait for the comm stream, the optimizer (fused Adam on the GPU, or offloaded: gradients
          over PCIe, DeepSpeedCPUAdam, parameters back), then ZeRO-1/2's parameter all-gather.

Span names are Megatron-Core's (``attention``, ``route``, ``dispatch``, ``experts``, ``combine``,
``grad_sync``, ``optimizer``) so that simulated spans and hw_validate's timed regions match.
"""

from __future__ import annotations

import numpy as np

from sim.frameworks.kernels import KernelBlocks
from sim.frameworks.ops import (
    AllToAll,
    CapacitySync,
    Compute,
    Gather,
    GradReady,
    Schedule,
    Tail,
    WaitGather,
    apply_jitter,
)
from sim.hardware.costs import CostModel, cpu_adam_time
from sim.inputs.scenario import Scenario
from sim.model.dtypes import ceil_div
from sim.model.flops import model_flops_per_token
from sim.model.params import count_params, layer_params, layer_tensors, outer_tensors
from sim.routing.plan import RoutingPlan


class _Builder(KernelBlocks):
    """Emits DeepSpeed's ops of one step, block by block."""

    def __init__(self, s: Scenario, plan: RoutingPlan | None, cost: CostModel, factor: np.ndarray):
        super().__init__(s, plan, cost, factor)
        self.ops: list = []

    def grad_hooks(self, params: int, layer: int, micro: int, epilogue: bool = False) -> None:
        """ZeRO-1/2's backward beyond autograd, when the calibration measured it
        (``zero_grad_hook_*``): DeepSpeed's gradient hooks copying each of the rank's ``params``
        gradients into the reduce bucket; ``epilogue``: instead its fixed cost, the backward's
        epilogue after the last bucket's reduction (``independent_gradient_partition_epilogue``:
        gradients copied into the rank's partition, buckets released), ``zero_epilogue``."""
        cal = self.cost.calibration
        if cal is None or cal.zero_grad_hook_ns_per_param is None or self.s.parallelism.zero_stage not in (1, 2):
            return
        if epilogue:
            dur, name = (cal.zero_grad_hook_overhead_us or 0.0) * 1e-6, "zero_epilogue"
        else:
            dur, name = params * cal.zero_grad_hook_ns_per_param * 1e-9, "grad_hooks"
        if dur > 0:
            d = np.full((1, self.world), dur) * self.factor
            self.ops.append(Compute([name], d, np.zeros((1, self.world)), "bwd", layer, micro))

    def compute(self, parts: list[tuple[str, int | None]], phase: str, layer: int, micro: int) -> None:
        names, durs, flops = [], [], []
        for name, moe in parts:
            f, b, fl = self.block(name, moe, micro)
            if not np.any(f if phase != "bwd" else b) and name not in ("embedding",):
                continue
            names.append(name)
            durs.append((b if phase == "bwd" else f) * self.kernel_factor)
            flops.append(fl * (2.0 if phase == "bwd" else 1.0))
        if names:
            self.ops.append(Compute(names, np.stack(durs), np.stack(flops), phase, layer, micro))

    def layer_forward(self, i: int, moe: int | None, micro: int, phase: str) -> None:
        m = self.m
        if moe is None:
            self.compute([("attention", None), ("mlp", None)], phase, i, micro)
            return
        r = self.s.routing
        if r.dispatch == "capacity_padded" and r.capacity_factor is None and self.s.ep > 1:
            # DeepSpeed's drop_tokens=False gate: all-reduce (MAX) of the capacity over the EP group
            self.compute([("attention", None), ("route", None)], phase, i, micro)
            self.ops.append(CapacitySync(moe, i, micro, phase))
            self.compute([("permute", moe)], phase, i, micro)
        else:
            self.compute([("attention", None), ("route", None), ("permute", moe)], phase, i, micro)
        self.ops.append(AllToAll("dispatch", "dispatch", moe, i, micro, phase))
        self.compute([("experts", moe)], phase, i, micro)
        self.ops.append(AllToAll("combine", "combine", moe, i, micro, phase))
        tail = [("unpermute", moe)] + ([("shared_experts", None)] if m.num_shared_experts else [])
        self.compute(tail, phase, i, micro)

    def layer_backward(self, i: int, moe: int | None, micro: int) -> None:
        m = self.m
        if moe is None:
            self.compute([("mlp", None), ("attention", None)], "bwd", i, micro)
            return
        head = [("unpermute", moe)] + ([("shared_experts", None)] if m.num_shared_experts else [])
        self.compute(head, "bwd", i, micro)
        self.ops.append(AllToAll("combine", "dispatch", moe, i, micro, "bwd"))
        self.compute([("experts", moe)], "bwd", i, micro)
        self.ops.append(AllToAll("dispatch", "combine", moe, i, micro, "bwd"))
        self.compute([("permute", moe), ("route", None), ("attention", None)], "bwd", i, micro)


def build_schedule(
    s: Scenario, plan: RoutingPlan | None, cost: CostModel, compute_factor: np.ndarray, jitter=None
) -> Schedule:
    """The ops of one step of scenario ``s`` (see the module docstring); ``compute_factor`` (world,)
    slows every kernel of a rank (stragglers), ``jitter(rank, n)`` draws per-kernel noise factors."""
    b = _Builder(s, plan, cost, compute_factor)
    m, t = s.model, s.training
    stage, micros = s.parallelism.zero_stage, t.grad_accum_steps
    moe_index, k = [], 0
    for i in range(m.num_layers):
        moe_index.append(k if m.is_moe_layer(i) else None)
        k += int(m.is_moe_layer(i))
    lp = [layer_params(m, i) for i in range(m.num_layers)]
    epr = s.experts_per_rank
    ne = [p.non_expert for p in lp]
    ex = [p.expert_each * epr for p in lp]
    counts = count_params(m)
    head = (0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size) + counts.norms - sum(p.norms for p in lp)
    emb = counts.embedding + counts.norms - sum(p.norms for p in lp) - head  # input table (+ tied head)
    overlap = s.collectives.overlap_comm and s.topology.gpu.async_comm  # CPU ranks: no comm stream
    for micro in range(micros):
        reduce_now = (stage >= 2) or (stage == 1 and micro == micros - 1)
        layer_keys = [("layer", micro, "fwd", i) for i in range(m.num_layers)]
        if stage == 3:  # embeddings and head too; the lookup waits for its table
            b.ops.append(Gather(layer_keys[0], ne[0] + emb + head, ex[0]))
            b.ops.append(WaitGather(layer_keys[0]))
        b.compute([("embedding", None)], "fwd", -1, micro)
        for i in range(m.num_layers):
            if stage == 3:
                if i + 1 < m.num_layers:
                    b.ops.append(Gather(layer_keys[i + 1], ne[i + 1], ex[i + 1]))
                if i > 0:
                    b.ops.append(WaitGather(layer_keys[i]))
            b.layer_forward(i, moe_index[i], micro, "fwd")
        b.compute([("output", None)], "fwd", m.num_layers, micro)
        b.compute([("output", None)], "bwd", m.num_layers, micro)
        if reduce_now and head:
            b.grad_hooks(head, m.num_layers, micro)
            b.ops.append(GradReady(m.num_layers, head, 0, blocking=not overlap))
        bkeys = [("layer", micro, "bwd", i) for i in range(m.num_layers)]
        if stage == 3:
            b.ops.append(Gather(bkeys[-1], ne[-1] + head, ex[-1]))
        for i in reversed(range(m.num_layers)):
            if stage == 3:
                if i > 0:
                    b.ops.append(Gather(bkeys[i - 1], ne[i - 1], ex[i - 1]))
                b.ops.append(WaitGather(bkeys[i]))
            if t.recompute:
                b.layer_forward(i, moe_index[i], micro, "recompute")
            b.layer_backward(i, moe_index[i], micro)
            if reduce_now:
                b.grad_hooks(ne[i] + ex[i], i, micro)
                b.ops.append(GradReady(i, ne[i], ex[i], blocking=not overlap))
        b.compute([("embedding", None)], "bwd", -1, micro)
        if reduce_now:
            b.grad_hooks(emb, -1, micro)
            b.ops.append(GradReady(-1, emb, 0, flush=True, blocking=not overlap))
            b.grad_hooks(0, -1, micro, epilogue=True)
    if stage == 0:
        b.ops.append(GradReady(-1, sum(ne) + emb + head, sum(ex), flush=True))
    if jitter is not None:
        apply_jitter(b.ops, jitter)
    dp, edp = s.dp, s.edp
    ne_total, ex_total = sum(ne) + emb + head + counts.mtp, sum(ex)
    opt_params = (-(-ne_total // dp) + -(-ex_total // edp)) if stage >= 1 else ne_total + ex_total
    offload = t.offload_optimizer == "cpu"
    cal = cost.calibration
    rate = (
        cal.cpu_adam_Gparams_per_s
        if cal is not None and cal.cpu_adam_Gparams_per_s is not None
        else s.topology.node.cpu.adam_Gparams_per_s
    )
    optimizer_s = np.zeros(s.world_size) if offload else np.full(s.world_size, cost.optimizer_time(opt_params))
    norm_s = []
    if stage >= 1:  # the gradient norm of each parameter group's partition, non-expert then expert
        tensors = [layer_tensors(m, i) for i in range(m.num_layers)]
        ne_tensors = outer_tensors(m) + sum(t[0] for t in tensors)
        norm_s.append(cost.grad_norm_time(ceil_div(ne_tensors, dp), ceil_div(ne_total, dp)))
        if ex_total:
            ex_tensors = sum(t[1] * epr for i, t in enumerate(tensors) if moe_index[i] is not None)
            norm_s.append(cost.grad_norm_time(ceil_div(ex_tensors, edp), ceil_div(ex_total, edp)))
    tail_s = np.vstack([optimizer_s, *(np.full(s.world_size, x) for x in norm_s)])
    tail = Tail(
        optimizer_s=tail_s[0],
        offload_bytes=float(opt_params * b.bpe) if offload else 0.0,
        cpu_adam_s=cpu_adam_time(opt_params, s.gpus_per_node, rate) if offload else 0.0,
        gather_nonexpert=ne_total if stage in (1, 2) else 0,
        gather_expert=ex_total if stage in (1, 2) else 0,
        norm_reduce=stage >= 1,
        norm_s=list(tail_s[1:]),
    )

    tokens = s.global_batch_size * t.seq_len
    return Schedule(
        ops=b.ops,
        tail=tail,
        world=s.world_size,
        grad_kind="reduce_scatter" if stage == 3 else "all_reduce",
        grad_bytes_per_param=b.bpe,
        param_bytes_per_param=b.bpe,
        model_flops=model_flops_per_token(m, t.seq_len) * tokens,
        stats={"optimizer_params_per_rank": int(opt_params)},
    )


__all__ = ["build_schedule"]
