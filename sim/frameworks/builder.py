"""Build the :class:`~sim.frameworks.program.Program` of a scenario: per pipeline rank its model
chunks' ops for one micro-batch and the pipeline schedule's instruction list.

Per transformer layer, forward (Megatron-Core's order and span names):
``[tp all-gather] attention [tp reduce-scatter]`` (all-reduce instead without sequence parallelism),
then MoE ``route permute [capacity sync] dispatch [etp all-gather] experts [etp reduce-scatter]
combine unpermute shared_experts`` or dense ``[tp all-gather] mlp [tp reduce-scatter]``. Backward
mirrors it (the gradient of an all-gather is a reduce-scatter and vice versa; the gradient of combine
runs in the dispatch direction). Full recompute runs the layer's forward again, collectives included,
before its backward; selective recompute (Megatron's ``recompute_modules``, by default layernorm +
moe_act) adds the recomputed modules' kernels, and for ``moe`` / ``mlp`` the block's forward ops again,
its all-to-alls or TP collectives included. The first model stage starts with the embedding, the last ends
with the LM head and loss (and DeepSeek-V3's MTP modules); gradients are handed to the comm stream
after each layer's backward (:mod:`sim.frameworks.policies` decides when they are reduced).
"""

from __future__ import annotations

from sim.frameworks import pipeline
from sim.frameworks.muon import muon_step_s
from sim.frameworks.policies import Policy, policy_of
from sim.frameworks.program import (
    CapacitySync,
    Chunk,
    EPAllToAll,
    Grads,
    GroupComm,
    Kernel,
    Kernels,
    ParamGather,
    Program,
    StageProgram,
    Tail,
    WaitParams,
)
from sim.hardware.costs import CostModel, cpu_adam_time
from sim.inputs.scenario import Scenario
from sim.inputs.sections import RECOMPUTE_MODULES
from sim.inputs.stages import VirtualStage, rank_chunks
from sim.model.dtypes import BYTES_PER_ELEMENT, ceil_div, grad_reduce_bytes, storage_dtype
from sim.model.params import count_params, layer_params, layer_tensors, outer_tensors, rank_layer_params

#: recompute_modules priced as one ``selective_recompute`` kernel (:meth:`Pricer.selective_recompute`);
#: ``moe`` and ``mlp`` run their block's forward ops again, collectives included.
KERNEL_RECOMPUTE = frozenset(RECOMPUTE_MODULES) - {"moe", "mlp"}


class _Layers:
    """Op templates of one layer's forward and backward (see the module docstring)."""

    def __init__(self, s: Scenario):
        self.s, self.m = s, s.model
        p, t = s.parallelism, s.training
        self.tp, self.etp, self.cp, self.sp = p.tp, p.etp, p.cp, s.sequence_parallel
        bpe = BYTES_PER_ELEMENT[storage_dtype(t.dtype)]
        tokens = t.micro_batch_size * t.seq_len // p.cp
        self.tokens = tokens
        self.act_bytes = tokens * self.m.hidden_size * bpe  # a full activation of the TP group
        m = self.m
        kv_width = (m.kv_lora_rank or 0) + (m.qk_rope_head_dim or 0) if m.attention == "mla" else 2 * m.kv_heads * m.head_size
        self.kv_bytes = tokens * kv_width // (self.tp if m.attention != "mla" else 1) * bpe  # one cp rank's K and V
        self.routed = s.routed_tokens_per_rank
        self.expert_bytes = self.routed * self.m.top_k * self.m.moe_token_width * bpe  # mean tokens a rank's experts get
        self.overlap = s.collectives.tp_comm_overlap
        r = s.routing
        self.capacity_sync = r.dispatch == "capacity_padded" and r.capacity_factor is None and s.ep > 1
        self.moe_index: dict[int, int] = {}
        k = 0
        for i in range(self.m.num_layers):
            if self.m.is_moe_layer(i):
                self.moe_index[i] = k
                k += 1
        for i in range(self.m.num_layers, self.m.num_layers + self.m.mtp_layers):  # an MTP module's MoE block
            if k and self.m.is_moe_layer(i):  # routes as the last MoE layer does (the plan holds the main layers')
                self.moe_index[i] = k - 1

    def _tp(self, i: int, name: str, first: bool) -> list:
        """The TP collective before (``first``) or after a TP region of layer ``i``."""
        if self.tp == 1:
            return []
        if self.sp:
            kind = "all_gather" if first else "reduce_scatter"
            return [GroupComm(f"tp_{kind}", kind, "tp", self.act_bytes, i, self.overlap)]
        return [] if first else [GroupComm("tp_all_reduce", "all_reduce", "tp", self.act_bytes, i, self.overlap)]

    def vocab_parallel_loss(self, n: int) -> list:
        """The vocab-parallel cross entropy's all-reduces over TP (max logit, sum of exponentials, target
        logit: 3 floats per token), priced as one collective."""
        if self.tp == 1:
            return []
        return [GroupComm("tp_all_reduce", "all_reduce", "tp", 3 * 4 * self.tokens, n)]

    def _etp(self, i: int, first: bool) -> list:
        if self.etp == 1:
            return []
        kind = "all_gather" if first else "reduce_scatter"
        return [GroupComm(f"etp_{kind}", kind, "etp", self.expert_bytes * self.etp, i)]

    def _cp(self, i: int, backward: bool) -> list:
        """Context parallelism's key/value exchange around the attention core: every cp rank needs
        every chunk's K and V (all-gather in forward; their gradients reduce-scattered in backward), as a
        blocking collective on the cp group (ring attention overlaps part of it with the core: not
        modelled)."""
        if self.cp == 1:
            return []
        kind = "reduce_scatter" if backward else "all_gather"
        return [GroupComm(f"cp_{kind}", kind, "cp", self.kv_bytes * self.cp, i)]

    def _mixer(self, i: int, backward: bool) -> list:
        """Layer ``i``'s token mixer with its TP (and, for attention, CP) collectives: attention, a hybrid
        pattern's Mamba-2 mixer (in_proj column-, out_proj row-parallel, like attention), or nothing."""
        mixer = self.m.layer_mixer(i)
        if mixer is None:
            return []
        core = [Kernels([Kernel(mixer, i)], i)]
        if mixer == "attention":  # CP: K/V all-gathered before the forward core, reduce-scattered after the backward's
            core = [*core, *self._cp(i, True)] if backward else [*self._cp(i, False), *core]
        return [*self._tp(i, mixer, True), *core, *self._tp(i, mixer, False)]

    def _ffn(self, i: int) -> list:
        """Layer ``i``'s FFN forward: MoE (route ... unpermute, shared experts), dense MLP, or nothing."""
        moe, kind = self.moe_index.get(i), self.m.layer_ffn(i)
        if kind is None:
            return []
        if moe is None:
            return [*self._tp(i, "mlp", True), Kernels([Kernel("mlp", i)], i), *self._tp(i, "mlp", False)]
        ops: list = [Kernels([Kernel("route", i), Kernel("permute", i, moe)], i)]
        if self.capacity_sync:
            ops.append(CapacitySync(moe, i))
        ops += [EPAllToAll("dispatch", "dispatch", moe, i), *self._etp(i, True),
                Kernels([Kernel("experts", i, moe)], i), *self._etp(i, False),
                EPAllToAll("combine", "combine", moe, i)]  # fmt: skip
        tail = [Kernel("unpermute", i, moe)] + ([Kernel("shared_experts", i)] if self.m.num_shared_experts else [])
        ops.append(Kernels(tail, i))
        return ops

    def forward(self, i: int) -> list:
        return [*self._mixer(i, False), *self._ffn(i)]

    def backward(self, i: int, recompute: str) -> list:
        moe, kind = self.moe_index.get(i), self.m.layer_ffn(i)
        ops: list = []
        if recompute == "full":
            ops += [Kernels(op.kernels, op.layer, "fwd") if isinstance(op, Kernels) else op for op in self.forward(i)]
        elif recompute == "selective":
            mods = self.s.training.recompute_set
            if mods & KERNEL_RECOMPUTE:
                ops.append(Kernels([Kernel("selective_recompute", i, moe)], i))
            if ("moe" in mods and moe is not None) or ("mlp" in mods and kind == "dense"):  # the whole block again
                ops += [Kernels(op.kernels, op.layer, "fwd") if isinstance(op, Kernels) else op for op in self._ffn(i)]
        if kind == "dense":
            ops += [*self._tp(i, "mlp", True), Kernels([Kernel("mlp", i)], i), *self._tp(i, "mlp", False)]
        elif kind == "moe":
            head = [Kernel("unpermute", i, moe)] + ([Kernel("shared_experts", i)] if self.m.num_shared_experts else [])
            ops += [Kernels(head, i), EPAllToAll("combine", "dispatch", moe, i), *self._etp(i, True),
                    Kernels([Kernel("experts", i, moe)], i), *self._etp(i, False),
                    EPAllToAll("dispatch", "combine", moe, i), Kernels([Kernel("permute", i, moe), Kernel("route", i)], i)]  # fmt: skip
        return [*ops, *self._mixer(i, True)]


def _merge(ops: list) -> list:
    """Adjacent kernel runs of the same layer as one :class:`Kernels` op (a compute segment)."""
    out: list = []
    for op in ops:
        prev = out[-1] if out else None
        if isinstance(op, Kernels) and isinstance(prev, Kernels) and (prev.layer, prev.phase) == (op.layer, op.phase):
            out[-1] = Kernels(prev.kernels + op.kernels, op.layer, op.phase)
        else:
            out.append(op)
    return out


def _params(s: Scenario) -> tuple[dict[int, tuple[int, int]], int, int]:
    """Per layer (non-expert, expert) parameters per rank; embedding and head parameters per rank."""
    m, p = s.model, s.parallelism
    out = {}
    for i in range(m.num_layers + m.mtp_layers):  # MTP modules: their layer, eh_proj and norms
        out[i] = rank_layer_params(m, i, p.tp, p.etp, s.experts_per_rank)
    counts = count_params(m)
    final_norm = counts.norms - sum(layer_params(m, i).norms for i in range(m.num_layers))
    output = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size  # counts.embedding holds both tables
    head = output // p.tp + final_norm
    emb = (counts.embedding - output) // p.tp
    return out, emb, head


def layer_recompute(s: Scenario, position: int, recompute: str) -> str:
    """What the backward of the chunk's ``position``-th layer recomputes: Megatron's block method checkpoints
    only the first ``recompute_num_layers`` layers of each chunk under full recompute."""
    n = s.training.recompute_num_layers
    return "none" if recompute == "full" and n is not None and position >= n else recompute


def _step_units(vs: VirtualStage, params, outer: int) -> list[tuple[str, int, int]]:
    """(key, nonexpert, expert) of the buckets Megatron's overlapped param gather brings in for chunk
    ``vs``: one per layer in forward order, the first with the chunk's embedding / head (``outer``)."""
    units = [(f"s{vs.index}.{i}", *params[i]) for i in vs.layers] or [(f"s{vs.index}", 0, 0)]
    key, ne, ex = units[0]
    return [(key, ne + outer, ex)] + units[1:]


def _next_gather(units, j: int) -> list:
    """Megatron's distributed optimizer with ``overlap_param_gather`` gathers a chunk's buckets one after
    another: the forward pre-hook that waits on one dispatches the next (``next_param_gather_bucket_group``)."""
    return [ParamGather(*units[j + 1], first_micro_only=True)] if j + 1 < len(units) else []


def _chunk(s: Scenario, vs: VirtualStage, layers: _Layers, pol: Policy, params, emb: int, head: int) -> Chunk:
    recompute = s.training.activation_checkpointing
    every = pol.grads_every_micro
    fwd: list = []
    bwd: list = []
    n, mtp = s.model.num_layers, range(s.model.num_layers, s.model.num_layers + s.model.mtp_layers)
    own = [*vs.layers, *(mtp if vs.head else [])]  # the chunk's layers and, on the last, the MTP modules'
    ne_total = sum(params[i][0] for i in own) + (emb if vs.embedding else 0) + (head if vs.head else 0)
    ex_total = sum(params[i][1] for i in own)
    outer_f = (emb if vs.embedding else 0) + (head if vs.head else 0)  # gathered with the first layer
    units = _step_units(vs, params, outer_f)
    if pol.step_gather:
        # every chunk's first bucket is dispatched when the step starts (align_param_gather, which
        # Megatron-Bridge sets with pipeline parallelism; without pipelining the step starts with it anyway)
        fwd.append(ParamGather(*units[0], first_micro_only=True, at_step_start=True))
        fwd += _next_gather(units, 0)
        fwd.append(WaitParams(units[0][0], first_micro_only=True))
    if pol.layer_gathers and vs.layers:
        fwd.append(ParamGather(f"f{vs.layers[0]}", params[vs.layers[0]][0] + outer_f, params[vs.layers[0]][1]))
    waited_first = False
    if vs.embedding:  # vocab-parallel lookup, then reduced over TP (reduce-scattered under SP)
        if pol.layer_gathers and vs.layers:  # the lookup needs the table, gathered with the first layer
            fwd.append(WaitParams(f"f{vs.layers[0]}"))
            waited_first = True
        fwd += [Kernels([Kernel("embedding", -1)], -1), *layers._tp(-1, "embedding", False)]
    for j, i in enumerate(vs.layers):
        if pol.step_gather and j > 0:
            fwd += _next_gather(units, j)
            fwd.append(WaitParams(units[j][0], first_micro_only=True))
        if pol.layer_gathers:
            if j + 1 < len(vs.layers):
                fwd.append(ParamGather(f"f{vs.layers[j + 1]}", *params[vs.layers[j + 1]]))
            if not (j == 0 and waited_first):
                fwd.append(WaitParams(f"f{i}"))
        fwd += layers.forward(i)
    if vs.head:
        # MTP modules (Megatron's MultiTokenPredictionBlock): per module eh_proj over the normed hidden state
        # and the shifted embedding, then one layer (the model's layer shape: MLA + MoE for DeepSeek-V3, *E
        # for Nemotron 3); the LM head and the loss run again on each module's output
        for i in mtp:
            fwd += [Kernels([Kernel("mtp_proj", n)], n), *layers.forward(i)]
        # column-parallel LM head: its input gathered over TP under SP (the input gradient reduced in backward),
        # the vocab-parallel cross entropy's three all-reduces of per-token floats (max, sum, target logit) as one
        heads = [Kernel("output", n)] * (1 + len(mtp))
        fwd += [*layers._tp(n, "output", True), Kernels(heads, n), *layers.vocab_parallel_loss(n)]
        bwd += [Kernels(heads, n), *layers._tp(n, "output", False)]
        if head:
            bwd.append(Grads(n, head, 0, every))
        for i in reversed(mtp):
            bwd += [*layers.backward(i, recompute), Kernels([Kernel("mtp_proj", n)], n), Grads(i, *params[i], every)]
    rev = list(reversed(vs.layers))
    regather = pol.layer_gathers and pol.regather_for_backward and bool(rev)
    if regather:  # ZeRO-3 gathers the head again with the last layer (the per-rank engine's model); FSDP2
        # keeps the root module's parameters gathered from forward (Policy.root_kept)
        head_again = head if vs.head and not pol.root_kept else 0
        bwd.append(ParamGather(f"b{rev[0]}", params[rev[0]][0] + head_again, params[rev[0]][1]))
    for j, i in enumerate(rev):
        if regather:
            if j + 1 < len(rev):
                bwd.append(ParamGather(f"b{rev[j + 1]}", *params[rev[j + 1]]))
            bwd.append(WaitParams(f"b{i}"))
        bwd += layers.backward(i, layer_recompute(s, vs.layers.index(i), recompute))
        if s.training.framework == "fsdp2":  # its post-backward hook's copy-in (see Pricer, fsdp_grad_copy_in)
            bwd.append(Kernels([Kernel("fsdp_grad_copy_in", i)], i))
        bwd.append(Grads(i, *params[i], every))
    if vs.embedding:
        bwd += [*layers._tp(-1, "embedding", True), Kernels([Kernel("embedding", -1)], -1)]
        bwd.append(Grads(-1, emb, 0, every))
    for k in range(len(bwd) - 1, -1, -1):  # the last hand-over of the backward flushes the buckets
        if isinstance(bwd[k], Grads):
            g = bwd[k]
            bwd[k] = Grads(g.layer, g.nonexpert, g.expert, g.every_micro, flush=True)
            break
    m = s.model  # zero-bubble W passes: the MTP modules' too
    weight = [Kernel(m.layer_mixer(i), i) for i in own if m.layer_mixer(i)]
    weight += [Kernel("experts", i, layers.moe_index[i]) if i in layers.moe_index else Kernel("mlp", i)
               for i in own if m.layer_ffn(i)]  # fmt: skip
    bpe = BYTES_PER_ELEMENT[storage_dtype(s.training.dtype)]
    t, p = s.training, s.parallelism
    send = t.micro_batch_size * t.seq_len // p.cp // (p.tp if s.sequence_parallel else 1) * s.model.hidden_size * bpe
    return Chunk(vs.index, vs.rank, vs.chunk, vs.layers, _merge(fwd), _merge(bwd), weight, float(send), ne_total, ex_total)


def _tail(s: Scenario, chunks: list[Chunk], pol: Policy, cost: CostModel) -> Tail:
    m = s.model
    ne = sum(c.params_nonexpert for c in chunks)
    ex = sum(c.params_expert for c in chunks)
    dp_shard = s.dp * s.parallelism.cp
    opt = ceil_div(ne, dp_shard) + ceil_div(ex, s.edp) if pol.optimizer_sharded else ne + ex
    offload = s.training.offload_optimizer == "cpu"
    norm_s, groups = [], []
    if pol.norm == "deepspeed":  # DeepSpeed: each group's partial norm, all-reduced over dp (then experts over edp)
        layers = [i for c in chunks for i in c.layers]
        tensors = [layer_tensors(m, i) for i in layers]
        ne_t = outer_tensors(m) + sum(t[0] for t in tensors)
        norm_s.append(cost.grad_norm_time(ceil_div(ne_t, s.dp), ceil_div(ne, s.dp)))
        groups.append(["dp"])
        if ex:
            ex_t = sum(t[1] * s.experts_per_rank for i, t in zip(layers, tensors, strict=True) if m.is_moe_layer(i))
            norm_s.append(cost.grad_norm_time(ceil_div(ex_t, s.edp), ceil_div(ex, s.edp)))
            groups.append(["dp", "edp"])
    elif pol.norm == "world":  # one fused norm over the shard, all-reduced over every rank (Megatron's get_grad_norm_fp32)
        norm_s.append(opt * 4 / cost.hbm_Bps + cost.launch_s)
        groups.append(["world"])
    rate = s.topology.node.cpu.adam_Gparams_per_s
    if s.training.optimizer == "muon":
        opt_s = muon_step_s(s, cost, [i for c in chunks for i in c.layers], opt)
    else:
        opt_s = 0.0 if offload else cost.optimizer_time(opt)
    return Tail(
        optimizer_params=opt,
        optimizer_s=opt_s,
        norm_s=norm_s,
        norm_groups=groups,
        gather_nonexpert=ne if pol.post_step_gather else 0,
        gather_expert=ex if pol.post_step_gather else 0,
        offload_bytes=float(opt * BYTES_PER_ELEMENT[storage_dtype(s.training.dtype)]) if offload else 0.0,
        cpu_adam_s=cpu_adam_time(opt, s.gpus_per_node, rate) if offload else 0.0,
    )


def build_program(s: Scenario, cost: CostModel, micro_batches: int | None = None) -> Program:
    """The program of one training step of ``s`` (see the module docstring); ``micro_batches``: a
    shorter step's (the steady-state window of :mod:`sim.engine.window`)."""
    pol = policy_of(s)
    p, t = s.parallelism, s.training
    layers = _Layers(s)
    params, emb, head = _params(s)
    micro = micro_batches or t.grad_accum_steps
    seqs = pipeline.build(p.schedule, p.pp, p.vpp, micro, s.collectives.a2a_overlap)
    stages = []
    for r, vss in enumerate(rank_chunks(s)):
        chunks = [_chunk(s, vs, layers, pol, params, emb, head) for vs in vss]
        for c in chunks:
            c.chunk = vss.index(next(v for v in vss if v.index == c.stage_index))
        if pol.grads_after_backward:  # ZeRO-0: everything after the last backward, in one flush
            last = chunks[0]
            last.bwd = [op for op in last.bwd if not isinstance(op, Grads)] + [
                Grads(-1, sum(c.params_nonexpert for c in chunks), sum(c.params_expert for c in chunks), False, True)
            ]
            for c in chunks[1:]:
                c.bwd = [op for op in c.bwd if not isinstance(op, Grads)]
        last_micro = {}
        for ins in seqs[r]:
            if ins.kind == "B":
                last_micro[ins.chunk] = max(last_micro.get(ins.chunk, -1), ins.micro)
        stages.append(StageProgram(r, chunks, seqs[r], _tail(s, chunks, pol, cost), last_micro))
    bpe = BYTES_PER_ELEMENT[storage_dtype(t.dtype)]
    grad_bpe = grad_reduce_bytes(t.dtype, t.grad_reduce_dtype)
    return Program(stages, p.schedule, micro, pol.grad_kind, grad_bpe, bpe, pol.name)


__all__ = ["build_program"]
