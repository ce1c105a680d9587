"""A closed-form step time for ``moesim plan`` to order thousands of candidates before the lane
engine sees any: which ones are worth its estimate pass.

Per micro-batch and pipeline rank, every layer's kernels are priced with the same cost model and GEMM
shapes the engine prices them with (:class:`~sim.hardware.costs.CostModel`, :mod:`sim.model.flops`,
Megatron's TP/ETP/CP splits of :func:`sim.frameworks.pricing.tp_split`), under exactly balanced
routing (every expert ``ep etp T k / E`` rows). Communication is bytes over the bottleneck link class
plus latency: TP/SP and ETP rings over NVLink, CP's key/value all-gather, all-to-alls by the bytes a
rank sends inside and outside its NVLink domain (DeepEP/hierarchical/HybridEP: a token crosses the
fabric once per destination node and NVLink once per destination rank), pipeline sends. The
pipeline composes them as ``m t_max + (sum_r t_r - t_max) / vpp`` (1F1B's fill and drain, divided by
the chunks under interleaving) plus the sends along it; the tail is the optimizer on the shard and
the gradient reduction of the last chunk. No contention, no barriers, no imbalance, and the routing
policy plays no part (the estimate tells policies apart): a ranking aid, never reported as a result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.engine.a2a_timing import overlap_saved_s, sm_slowdown
from sim.frameworks.kernels import ATTENTION_BWD_FACTOR
from sim.frameworks.policies import policy_of
from sim.frameworks.pricing import attention_ratio, tp_split
from sim.hardware.costs import GROUPED, CostModel
from sim.inputs.scenario import Scenario
from sim.inputs.stages import rank_chunks
from sim.model.dtypes import (
    BYTES_PER_ELEMENT,
    fsdp_copy_in_bytes,
    gemm_dtype,
    grad_reduce_bytes,
    is_quantized,
    storage_dtype,
)
from sim.model.flops import (
    Gemm,
    attention_core_flops_layer,
    attention_gemms,
    dense_ffn_gemms,
    expert_activation_passes,
    expert_gemms,
    lm_head_gemm,
    mla_rope_bytes,
    mla_up_gemms,
    router_gemm,
    shared_expert_gemms,
)
from sim.model.params import rank_layer_params


@dataclass
class ScreenResult:
    """The closed form's step time and its parts (seconds)."""

    step_time_s: float
    parts_s: dict[str, float] = field(default_factory=dict)


class Screen:
    """Closed-form step times of candidate scenarios of one model on one topology; layer prices are
    cached by the knobs they depend on."""

    def __init__(self, s: Scenario):
        from sim.engine.simulate import cost_model

        self.cost: CostModel = cost_model(s)
        topo = s.topology
        self.gpn = s.gpus_per_node
        self.domain = topo.nvlink_domain_gpus or self.gpn
        self.nv_Bps = topo.node.intra.bw_GBps * 1e9
        self.nv_a2a_Bps = topo.node.intra.alltoall_bw_GBps * 1e9  # EP all-to-alls (sim.hardware.alltoall_links)
        self.nv_lat = 2 * topo.node.intra.latency_us * 1e-6
        so = topo.scaleout
        self.nic_Bps = so.nic_bw_GBps * 1e9 if so.kind != "none" else self.nv_Bps
        self.nic_lat = 4 * so.latency_us * 1e-6 + self.nv_lat
        self._layer: dict[tuple, tuple[float, float, float, float, float]] = {}

    # ---- links ----------------------------------------------------------------------------------
    def _ring(self, n: int, nbytes: float, span: int) -> float:
        """A ring all-gather / reduce-scatter of ``nbytes`` (whole array) over ``n`` ranks ``span``
        consecutive ranks wide (inside an NVLink domain or across the fabric)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        local = span <= self.domain
        bw, lat = (self.nv_Bps, self.nv_lat) if local else (self.nic_Bps, self.nic_lat)
        return (n - 1) / n * nbytes / bw + (n - 1) * lat

    def _a2a(self, s: Scenario, tokens: float, bpe: int) -> float:
        """One dispatch (or combine) of ``tokens`` routed tokens per rank over the EP group."""
        ep, etp, k = s.ep, s.parallelism.etp, s.model.top_k
        if ep == 1:
            return 0.0
        d = s.model.hidden_size
        local = max(1, min(ep, self.domain // etp))  # EP members in the rank's NVLink domain
        nodes = ep / local
        kind = s.collectives.all_to_all
        if kind == "direct":
            rows = tokens * k * d * bpe
            intra, inter = rows * (local - 1) / ep, rows * (ep - local) / ep
        else:  # once per destination node over the fabric, once per destination rank over NVLink
            reach_nodes = nodes * (1 - (1 - 1 / nodes) ** k)
            reach_ranks = ep * (1 - (1 - 1 / ep) ** k)
            inter = tokens * d * bpe * reach_nodes * (nodes - 1) / nodes
            intra = tokens * d * bpe * reach_ranks * (local - 1) / ep
        t = max(intra / self.nv_a2a_Bps, inter / self.nic_Bps)
        return t + (self.nic_lat if inter > 0 else self.nv_lat)

    # ---- one layer --------------------------------------------------------------------------------
    def _gemms(self, gemms: list[Gemm], rows: float, split: int, dt: str) -> tuple[float, float]:
        f = b = 0.0
        for g in gemms:
            g = tp_split(g, split)
            fw, bw = self.cost.gemm_train_times([rows], g.n, g.k, dt)
            f, b = f + float(fw[0]), b + float(bw[0])
        return f, b

    def layer(self, s: Scenario, i: int) -> tuple[float, float, float, float, float]:
        """(forward kernels, backward kernels, recompute kernels, comm, all-to-all) of layer ``i`` for
        one micro-batch on one rank, forward and backward (and what recompute runs again); comm excludes
        the all-to-alls (reported apart)."""
        p, t, m = s.parallelism, s.training, s.model
        moe = m.is_moe_layer(i)
        window = m.attention_window(i)
        key = (p.tp, p.cp, p.etp, s.ep, t.micro_batch_size, t.dtype, t.activation_checkpointing, t.recompute_set,
               moe, window, t.fp8_attention, t.cutedsl_fused_grouped_mlp, t.framework,
               s.collectives.all_to_all, s.sequence_parallel, s.collectives.tp_comm_overlap)  # fmt: skip
        hit = self._layer.get(key)
        if hit is not None:
            return hit
        dt, bpe = gemm_dtype(t.dtype), BYTES_PER_ELEMENT[storage_dtype(t.dtype)]
        d, tp = m.hidden_size, p.tp
        T = t.micro_batch_size * t.seq_len / p.cp
        Tsp = T / tp if s.sequence_parallel else T
        mem = self.cost.memory_time
        norm = mem(2 * Tsp * d * bpe)
        f, b = self._gemms(attention_gemms(m), T, tp, dt)
        core = attention_core_flops_layer(m, t.seq_len, i) * t.micro_batch_size / (p.cp * tp)
        io = 4 * T * (m.num_attention_heads // tp) * m.head_size * bpe
        cdt = "bf16" if is_quantized(t.dtype) else dt
        extra = norm + mem(3 * Tsp * d * bpe, 2)
        rf, rb = attention_ratio(s, self.cost, i, dt)  # the layer's shape and precision (pricing.Pricer's)
        core_f = self.cost.attention_time(core / rf, io, cdt)
        f += core_f + extra
        b += self.cost.attention_time(ATTENTION_BWD_FACTOR * core / rb, 2 * io, cdt) + 2 * extra
        act = T * d * bpe
        tp_comm = 0.0 if s.collectives.tp_comm_overlap or not s.sequence_parallel else 2 * self._ring(tp, act, tp)
        comm = tp_comm + self._ring(p.cp, T * 2 * m.kv_heads * m.head_size / tp * bpe * p.cp, tp * p.cp)
        a2a = 0.0
        if moe:
            rf, rb = self._gemms([router_gemm(m)], Tsp, 1, "bf16" if is_quantized(t.dtype) else dt)  # never FP8
            copies = Tsp * m.top_k
            perm = float(self.cost.dispatcher_time(2 * copies * d * bpe, 1))
            rows = s.ep * p.etp * Tsp * m.top_k / m.num_experts
            edt = dt + GROUPED if t.framework != "deepspeed" else dt  # grouped experts: pricing.Pricer's curve
            ef, eb = self._gemms(expert_gemms(m), rows, p.etp, edt)
            width = (m.moe_ffn_hidden_size or d) / p.etp
            passes = (3 if m.ffn_type == "gated" else 2) + expert_activation_passes(m)
            eact = 0.0 if t.cutedsl_fused_grouped_mlp else mem(rows * width * bpe * passes)  # fused: in the epilogues
            per = s.experts_per_rank
            sf, sb = self._gemms(shared_expert_gemms(m), Tsp, 1, dt)
            f += rf + norm + 2 * perm + per * (ef + eact) + sf
            b += rb + 2 * norm + 2 * perm + per * (eb + 2 * eact) + sb
            block_f = rf + norm + 2 * perm + per * (ef + eact) + sf
            etp_comm = 2 * self._ring(p.etp, copies * d * bpe * p.etp, p.etp)
            comm += etp_comm
            a2a = self._a2a(s, Tsp, bpe)
            parts = {"moe_act": per * eact, "shared_experts": sf, "moe": block_f}
            again, again_comm, again_a2a = ("moe", etp_comm, 2 * a2a)
        else:
            mf, mb = self._gemms(dense_ffn_gemms(m), T, tp, dt)
            f, b = f + mf + norm, b + mb + 2 * norm
            comm += tp_comm
            parts = {"mlp": mf + norm}
            again, again_comm, again_a2a = ("mlp", tp_comm, 0.0)
        if m.attention == "mla":
            rope = mem(mla_rope_bytes(m, T, m.num_attention_heads / tp, bpe), 2)
            parts["mla_up_proj"] = self._gemms(mla_up_gemms(m), T, tp, dt)[0] + rope
        parts |= {"layernorm": 2 * norm, "core_attn": core_f}
        mods = t.recompute_set
        full = t.activation_checkpointing == "full"
        recompute = f if full else sum(parts.get(k, 0.0) for k in mods)
        comm_all = comm * (3 if full else 2) + (again_comm if again in mods else 0.0)
        a2a_all = 2 * a2a * (3 if full else 2) + (again_a2a if again in mods else 0.0)
        out = (f, b, recompute, comm_all, a2a_all)
        self._layer[key] = out
        return out

    # ---- the step -------------------------------------------------------------------------------
    def step(self, s: Scenario) -> ScreenResult:
        p, t, m = s.parallelism, s.training, s.model
        dt, bpe = gemm_dtype(t.dtype), BYTES_PER_ELEMENT[storage_dtype(t.dtype)]
        pol = policy_of(s)
        T = t.micro_batch_size * t.seq_len / p.cp
        Tsp = T / p.tp if s.sequence_parallel else T
        slow = sm_slowdown(s)
        per_rank, parts = [], {"compute": 0.0, "a2a": 0.0, "comm": 0.0}
        params_rank = []
        for chunks in rank_chunks(s):
            kern = comm = a2a = 0.0
            ne = ex = 0.0
            for vs in chunks:
                for i in vs.layers:
                    f, b, rc, c, a = self.layer(s, i)
                    kern += f + b + rc
                    comm += c
                    a2a += a
                    lne, lex = rank_layer_params(m, i, p.tp, p.etp, s.experts_per_rank)
                    ne, ex = ne + lne, ex + lex
                    if t.framework == "fsdp2":  # the post-backward copy-in of the block's gradients (builder)
                        kern += self.cost.memory_time(fsdp_copy_in_bytes(lne + lex, t.dtype, t.grad_reduce_dtype))
                if vs.embedding:
                    kern += 2 * self.cost.memory_time(2 * Tsp * m.hidden_size * bpe)
                if vs.head:  # the LM head and loss, once more per MTP module after its layer (builder)
                    fp8_head = t.fp8_output_proj or not is_quantized(t.dtype)  # Megatron's head is BF16 under FP8
                    head_dt = dt if fp8_head else "bf16"
                    hf, hb = self._gemms([lm_head_gemm(m)], T if p.tp > 1 else Tsp, p.tp, head_dt)
                    head = hf + hb + 2 * self.cost.memory_time(2 * Tsp * m.vocab_size / p.tp * 4, 2)
                    kern += head * (1 + m.mtp_layers)
                    ne += m.vocab_size * m.hidden_size / p.tp
                    for i in range(m.num_layers, m.num_layers + m.mtp_layers):
                        f, b, rc, c, a = self.layer(s, i)
                        kern, comm, a2a = kern + f + b + rc, comm + c, a2a + a
                        lne, lex = rank_layer_params(m, i, p.tp, p.etp, s.experts_per_rank)
                        ne, ex = ne + lne, ex + lex
            if pol.layer_gathers:  # FSDP2 / ZeRO-3: every block gathered (and its gradient reduced) per micro-batch
                gathers = 3 if pol.regather_for_backward else 2
                comm += max(0.0, gathers * self._ring(s.dp * p.cp, ne * bpe, s.layout.stage_size)
                            + self._ring(s.edp, ex * bpe, s.layout.stage_size) - 0.5 * kern)  # fmt: skip
            if s.collectives.a2a_overlap and a2a > 0:
                saved = float(overlap_saved_s(kern, a2a, slow))
                busy = kern + a2a - saved + comm
                parts["a2a"] += a2a - saved
            else:
                busy = kern + comm + a2a
                parts["a2a"] += a2a
            parts["compute"] += kern
            parts["comm"] += comm
            per_rank.append(busy)
            params_rank.append((ne, ex))
        mb = t.grad_accum_steps
        worst = max(per_rank)
        chunks = 2 if p.schedule == "dualpipe" else p.vpp
        send = Tsp * m.hidden_size * bpe
        span = s.layout.stage_size
        p2p = (send / (self.nv_Bps if span < self.gpn else self.nic_Bps) + self.nic_lat) if p.pp > 1 else 0.0
        pipe = mb * worst + (sum(per_rank) - worst) / chunks + 2 * (p.pp * chunks - 1) * p2p
        bubble = pipe - mb * sum(per_rank) / len(per_rank)
        ne, ex = params_rank[per_rank.index(worst)]
        opt = ne / (s.dp * p.cp) + ex / s.edp if pol.optimizer_sharded else ne + ex
        grad_bytes = grad_reduce_bytes(t.dtype, t.grad_reduce_dtype)
        last = 1.0 / chunks  # the last chunk's gradients reduce after the last backward
        sync = self._ring(s.dp * p.cp, ne * last * grad_bytes, span) + self._ring(s.edp, ex * last * grad_bytes, span)
        tail = self.cost.optimizer_time(opt) + sync
        n = len(per_rank)
        return ScreenResult(pipe + tail, {"compute": mb * parts["compute"] / n, "a2a": mb * parts["a2a"] / n,
                                          "comm": mb * parts["comm"] / n, "pipeline_bubble": max(bubble, 0.0),
                                          "tail": tail})  # fmt: skip


__all__ = ["Screen", "ScreenResult"]
