"""Seconds of every kernel block on any set of ranks, with the layout's splits and the precision.

The generalisation of :class:`sim.frameworks.kernels.KernelBlocks` for layouts and for lazy pricing:
a block is priced for one micro-batch on the ranks asked for (positions of a pipeline stage), so the
engine never holds a world-sized array per op. Splits (Megatron-Core):

- tensor parallelism: column-parallel GEMMs (``linear_qkv``, ``linear_fc1``, MLA's up projections,
  the LM head) split N by ``tp``, row-parallel ones (``linear_proj``, ``linear_fc2``) split K; the
  attention core splits its heads; with sequence parallelism norms and residuals see ``T / tp`` rows;
- context parallelism: every rank holds ``seq / cp`` tokens; the attention core computes its queries
  against all keys (``1 / cp`` of the FLOPs, load-balanced causal chunks);
- expert tensor parallelism: expert GEMMs split like the dense FFN by ``etp``;
- FP8 / MXFP8: GEMMs at the FP8 peak (the cost model's ``fp8``/``mxfp8`` curves; block-scaled FP8 at
  the GPU's ``fp8_block_gemm_fraction`` of it, or as MXFP8 on Blackwell), plus TransformerEngine's
  quantization of their inputs (:data:`~sim.model.dtypes.QUANT_BYTES_PER_ELEMENT` per element of the
  activation in forward and of the output gradient in backward, the weight once per step); everything
  else stays bf16.

Backward GEMMs cost the input gradient (``dgrad``) plus the weight gradient (``wgrad``); a
zero-bubble backward prices ``dgrad`` only and the deferred ``W`` pass the ``wgrad`` part.
"""

from __future__ import annotations

import numpy as np

from sim.frameworks.dispatcher import dispatcher_work
from sim.frameworks.kernels import ATTENTION_BWD_FACTOR, FUSED_CE_BYTES
from sim.frameworks.precision import gemm_precision
from sim.hardware.costs import GROUPED, CostModel
from sim.inputs.scenario import Scenario
from sim.model.dtypes import (
    BYTES_PER_ELEMENT,
    QUANT_BYTES_PER_ELEMENT,
    QUANT_KERNELS,
    fp8_recipe,
    fsdp_copy_in_bytes,
    gemm_dtype,
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
    latent_gemms,
    lm_head_gemm,
    mamba_gemms,
    mla_rope_bytes,
    mla_up_gemms,
    mtp_gemms,
    router_gemm,
    shared_expert_gemms,
    ssd_flops_per_token,
)
from sim.model.params import rank_layer_params
from sim.routing.plan import RoutingPlan

#: Megatron-LM's unfused vocab-parallel cross entropy (megatron/core/tensor_parallel/cross_entropy.py,
#: identical at 1e057005 and 00611e6e), per logit: forward ``.float()`` (read 2, write 4), ``max``
#: (read 4), ``-= logits_max`` (8), ``torch.exp(out=)`` (8), ``sum`` (4), ``div_`` (8) = 38 bytes in 6
#: kernels (+ the target gather and 3 small all-reduces); backward ``mul_(grad_output)`` (8) and the
#: ``.float()``'s gradient cast back to bf16 (read 4, write 2) = 14 bytes in 3 kernels (+ index update).
UNFUSED_CE_FWD_BYTES, UNFUSED_CE_FWD_KERNELS = 38.0, 8
UNFUSED_CE_BWD_BYTES, UNFUSED_CE_BWD_KERNELS = 14.0, 3
#: GEMMs split along N (column-parallel) under tensor parallelism; the rest of the TP-split ones along K.
_COLUMN = ("linear_qkv", "linear_q", "linear_q_up", "linear_kv_up", "linear_fc1", "output_layer", "in_proj")
_ROW = ("linear_proj", "linear_fc2", "out_proj")
#: Mamba-2 SSD backward over forward (mamba_ssm ``_mamba_chunk_scan_combined_bwd``): it re-runs the forward's
#: chunk states and state passing (2 of its 5 kernels, ~0.65 of the bytes they move: the per-chunk states),
#: then each product's gradients with respect to both operands (2x the forward). An estimate from the
#: kernels' structure: no published backward timing was found.
SSD_BWD_OVER_FWD = 2.65
#: HBM passes over the conv1d channels (x, B, C) and over the gated RMSNorm's d_inner (y, z, output) of
#: mamba_ssm's ``mamba_split_conv1d_scan_combined`` (checkpoint_lvl 1): forward conv read + write, norm
#: read y and z, write; backward re-runs both forwards, then conv reads x and dout and writes dx, norm
#: reads y, z, dout and writes dy, dz.
CONV_PASSES, GATED_NORM_PASSES = (2, 5), (3, 8)
#: Routing-dependent blocks kept priced (oldest dropped first): a micro-batch's forward's for its backward.
RECENT_BLOCKS = 512
RECENT_BYTES = 1 << 28  # and no more than 256 MiB of them (4 float64 arrays per block)
#: Passes a block is priced for.
PASSES = ("fwd", "bwd", "bwd_input", "bwd_weight")


def tp_split(g: Gemm, tp: int) -> Gemm:
    """The shard of ``g`` one of ``tp`` ranks multiplies (replicated when neither column nor row parallel)."""
    base = g.name.rsplit(".", 1)[-1]
    if tp == 1:
        return g
    if base in _COLUMN:
        return Gemm(g.name, max(1, g.n // tp), g.k)
    if base in _ROW:
        return Gemm(g.name, g.n, max(1, g.k // tp))
    return g


def attention_ratio(s: Scenario, cost: CostModel, layer: int, gemm_dt: str) -> tuple[float, float]:
    """(forward, backward) factor on the attention figure's rate for ``layer``: the GPU's measured rate of
    the layer's shape (MLA, a window) in its precision (``training.fp8_attention``: MXFP8 where the GEMMs
    run ``gemm_dt`` mxfp8, else FP8) over the reference shape's BF16 rate; 1 without ``attention_shapes``
    or when a calibration measured the attention efficiency."""
    shapes, m = cost.gpu.attention_shapes, s.model
    if shapes is None or not cost.attention_from_figure:
        return 1.0, 1.0
    dt = ("mxfp8" if gemm_dt == "mxfp8" else "fp8") if s.training.fp8_attention else "bf16"
    return shapes.ratio(m.attention == "mla", m.attention_window(layer), dt)


class Pricer:
    """Kernel seconds of a scenario's blocks: ``price(name, layer, moe, micro, part, ranks)``."""

    def __init__(self, s: Scenario, plan: RoutingPlan | None, cost: CostModel, factor: np.ndarray):
        self.s, self.plan, self.cost = s, plan, cost
        self.factor = np.asarray(factor, dtype=np.float64) * cost.compute_scale  # per global rank
        p, m, t = s.parallelism, s.model, s.training
        self.m, self.tp, self.cp, self.etp = m, p.tp, p.cp, p.etp
        self.sp = s.sequence_parallel
        self.dt = gemm_dtype(t.dtype)
        self.bpe = BYTES_PER_ELEMENT[storage_dtype(t.dtype)]
        self.quantized = is_quantized(t.dtype)  # FP8, MXFP8 or NVFP4: GEMMs under TE's autocast
        self.recipe = fp8_recipe(t.dtype, t.fp8_recipe)
        self.dtype = t.dtype  # the training precision; gemm_precision moves single GEMMs off it
        self.moved = t.gemm_precision.active
        self.grouped = t.framework != "deepspeed"  # DeepSpeed's experts are a loop of nn.Linear (dense GEMMs)
        self.fused_mlp = t.cutedsl_fused_grouped_mlp
        #: block-scaled FP8 GEMMs: slower kernels on Hopper, MXFP8 ones where the GPU has MX tensor cores
        gpu = cost.gpu
        self.rate_scale = 1.0
        if self.recipe == "blockwise":
            if gpu.fp8_block_gemm_fraction is not None:
                self.rate_scale = gpu.fp8_block_gemm_fraction
            elif "mxfp8" in gpu.peak_TFLOPs:
                self.dt = "mxfp8"
        #: quantizing a weight happens once per step (TE caches it from the first micro-batch on)
        self.weight_share = 1.0 / max(t.grad_accum_steps, 1)
        #: tokens of a micro-batch a rank's GEMMs see (full sequence shard after SP all-gathers)
        self.T = t.micro_batch_size * t.seq_len // p.cp
        #: tokens a rank holds between TP regions (norms, residual, the router): T / tp with SP
        self.T_sp = self.T // p.tp if self.sp else self.T
        self._scalar: dict[tuple, tuple[float, float, float, float]] = {}
        self._recent: dict[tuple, tuple] = {}  # routed blocks priced lately (a forward's, for its backward)

    # ---- helpers ------------------------------------------------------------------------------
    def _mem(self, nbytes: float, kernels: int = 1) -> float:
        return nbytes / self.cost.hbm_Bps + kernels * self.cost.launch_s if nbytes > 0 else 0.0

    def _gemm(self, g: Gemm, rows: np.ndarray | float, quant_input: bool = True, quant_grad: bool = True, bf16: bool = False,
              layer: int | None = None, grouped: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        """(fwd, dgrad, wgrad, FLOPs) of ``g`` on ``rows`` (array or scalar), cast costs included: the
        quantization of its input activation (``quant_input``) and of its output gradient (``quant_grad``)
        unless the kernel before it writes them quantized (the fused grouped MLP's epilogues). ``bf16``: a
        layer outside TE's FP8 autocast (Megatron's own ColumnParallelLinear LM head), BF16 and no casts.
        ``layer``: the GEMM's layer, whose ``training.gemm_precision`` may move it to another precision.
        ``grouped``: routed experts' GEMMs as one grouped GEMM (Megatron's GroupedLinear, FSDP2's grouped_mm),
        at the GPU's grouped-GEMM curve of the precision where it measured one."""
        r = np.atleast_1d(np.asarray(rows, dtype=np.float64))
        dt, scale, recipe = ("bf16", 1.0, None) if bf16 else (self.dt, self.rate_scale, self.recipe)
        if not bf16 and layer is not None and self.moved:
            own = gemm_precision(self.m, self.s.training.gemm_precision, self.dtype, g.name, layer)
            if own != self.dtype:  # the recipe of that precision (fp8: the scenario's fp8_recipe), at its own rate
                dt, scale, recipe = own, 1.0, fp8_recipe(own, self.s.training.fp8_recipe)
        key = dt + GROUPED if grouped and self.grouped else dt
        fwd, bwd = self.cost.gemm_train_times(r, g.n, g.k, key, scale)
        dgrad = self.cost.gemm_times(r, g.k, g.n, key, scale)
        wgrad = bwd - dgrad
        if recipe is not None:  # TE quantizes the activation (forward) and the output gradient (backward);
            per = QUANT_BYTES_PER_ELEMENT[recipe] / self.cost.hbm_Bps  # wgrad reuses their column copies
            launches = QUANT_KERNELS[recipe] * self.cost.launch_s
            used = r > 0
            weight = (g.n * g.k * per + launches) * self.weight_share
            fwd = fwd + np.where(used, (r * g.k * per + launches) * quant_input + weight, 0.0)
            dgrad = dgrad + np.where(used, (r * g.n * per + launches) * quant_grad, 0.0)
        return fwd, dgrad, wgrad, 2.0 * r * g.n * g.k

    def _gemms(self, gemms: list[Gemm], rows, split: int, bf16: bool = False, layer: int | None = None,
               grouped: bool = False) -> tuple[float | np.ndarray, ...]:  # fmt: skip
        f = d = w = fl = 0.0
        for g in gemms:
            a, b, c, x = self._gemm(tp_split(g, split), rows, bf16=bf16, layer=layer, grouped=grouped)
            f, d, w, fl = f + a, d + b, w + c, fl + x
        return f, d, w, fl

    # ---- blocks -------------------------------------------------------------------------------
    def _static(self, name: str, layer: int) -> tuple[float, float, float, float]:
        """(fwd, dgrad-like backward, wgrad, FLOPs) of a block that does not depend on routing."""
        key = (name, layer if name in ("attention", "fsdp_grad_copy_in") or self.moved else None)
        hit = self._scalar.get(key)
        if hit is not None:
            return hit
        m, T, Tsp, bpe, d, tp = self.m, self.T, self.T_sp, self.bpe, self.m.hidden_size, self.tp
        norm = self._mem(2 * Tsp * d * bpe)
        if name == "embedding":
            e = self._mem(2 * Tsp * d * bpe)
            out = (e, e, 0.0, 0.0)
        elif name == "attention":
            f, dg, wg, fl = self._gemms(attention_gemms(m), T, tp, layer=layer)
            cf, cb, core = self._attention_core(layer)
            extra = norm + self._mem(3 * Tsp * d * bpe, kernels=2)  # rope, residual
            out = (float(f[0]) + cf + extra, float(dg[0]) + cb + 2 * extra, float(wg[0]), float(fl[0]) + core)
        elif name == "mamba":
            out = self._mamba(norm, layer)
        elif name == "mlp":
            f, dg, wg, fl = self._gemms(dense_ffn_gemms(m), T, tp, layer=layer)
            out = (float(f[0]) + norm, float(dg[0]) + 2 * norm, float(wg[0]), float(fl[0]))
        elif name == "shared_experts":
            f, dg, wg, fl = self._gemms(shared_expert_gemms(m), Tsp, 1, layer=layer)
            out = (float(f[0]), float(dg[0]), float(wg[0]), float(fl[0])) if shared_expert_gemms(m) else (0.0,) * 4
        elif name == "route":  # the router, and LatentMoE's projections down and back up (duplicated over TP)
            # Megatron's router_gating_linear (moe_utils.py) is a plain GEMM on BF16 operands, never FP8
            f, dg, wg, fl = self._gemms([router_gemm(m)], Tsp, 1, bf16=self.quantized)
            lf, ldg, lwg, lfl = self._gemms(latent_gemms(m), Tsp, 1, layer=layer)  # TE linears: under the autocast
            f, dg, wg, fl = f + lf, dg + ldg, wg + lwg, fl + lfl
            r = self.s.routing
            drop = not (r.dispatch == "dropless" or r.capacity_factor is None)
            of, bf, ob, bb = dispatcher_work("gate", Tsp, d, m.num_experts, m.top_k, 0.0, drop, bpe)
            tf = float(self.cost.dispatcher_time(np.asarray(bf), of))
            tb = float(self.cost.dispatcher_time(np.asarray(bb), ob))
            out = (float(f[0]) + norm + tf, float(dg[0]) + 2 * norm + tb, float(wg[0]), float(fl[0]))
        elif name == "output":
            rows = T if tp > 1 else Tsp  # the head gathers the sequence: every token, vocab / tp logits each
            # Megatron's head is its own ColumnParallelLinear, outside TE's FP8 autocast, unless fp8_output_proj
            f, dg, wg, fl = self._gemms([lm_head_gemm(m)], rows, tp, bf16=self.quantized and not self.s.training.fp8_output_proj)
            logits = rows * m.vocab_size / tp
            if self.s.training.cross_entropy_fusion:
                ce_f = ce_b = self._mem(logits * FUSED_CE_BYTES, kernels=2)
            else:
                ce_f = self._mem(logits * UNFUSED_CE_FWD_BYTES, kernels=UNFUSED_CE_FWD_KERNELS)
                ce_b = self._mem(logits * UNFUSED_CE_BWD_BYTES, kernels=UNFUSED_CE_BWD_KERNELS)
            out = (float(f[0]) + norm + ce_f, float(dg[0]) + norm + ce_b, float(wg[0]), float(fl[0]))
        elif name == "fsdp_grad_copy_in":  # torch FSDP2 foreach_reduce, on the compute stream after a block's
            # backward: the unsharded gradients read and copied into the reduce-scatter input in reduce_dtype
            ne, ex = rank_layer_params(m, layer, tp, self.etp, self.s.experts_per_rank)
            t = self.s.training
            out = (0.0, 0.0, self._mem(fsdp_copy_in_bytes(ne + ex, t.dtype, t.grad_reduce_dtype)), 0.0)  # wgrad part
        elif name == "mtp_proj":
            f, dg, wg, fl = self._gemms(mtp_gemms(m), Tsp, 1, layer=layer)
            out = (float(f[0]) + 2 * norm, float(dg[0]) + 2 * norm, float(wg[0]), float(fl[0])) if m.mtp_layers else (0.0,) * 4
        else:
            raise ValueError(f"unknown block {name!r}")
        self._scalar[key] = out
        return out

    def _mamba(self, norm: float, layer: int) -> tuple[float, float, float, float]:
        """(fwd, backward, wgrad, FLOPs) of one Mamba-2 mixer on a TP rank (Megatron ``MambaMixer``, heads and
        groups split by tp): in_proj and out_proj GEMMs, the causal conv1d, the chunked SSD (the GPU's
        ``ssd`` figure; backward :data:`SSD_BWD_OVER_FWD` of it), the gated RMSNorm, the pre-norm and the
        residual add; with micro-batches of several sequences Megatron's ``_ssm_training`` also copies
        in_proj's output to batch-major and the SSD output back (``.contiguous()``)."""
        m, T, bpe, tp = self.m, self.T, self.bpe, self.tp
        f, dg, wg, fl = self._gemms(mamba_gemms(m), T, tp, layer=layer)
        heads = (m.mamba_num_heads or 0) // tp
        ssd = self.cost.ssd_time(T * heads, m.mamba_head_dim, m.mamba_state_dim)
        conv, gated = T * m.mamba_conv_channels // tp * bpe, T * m.mamba_d_inner // tp * bpe
        fwd = ssd + self._mem(CONV_PASSES[0] * conv) + self._mem(GATED_NORM_PASSES[0] * gated)
        bwd = SSD_BWD_OVER_FWD * ssd + self._mem(CONV_PASSES[1] * conv, 2) + self._mem(GATED_NORM_PASSES[1] * gated, 2)
        if self.s.training.micro_batch_size > 1:  # _ssm_training's rearrange(...).contiguous(): in_proj's output
            # to batch-major and the SSD output back, each a copy (read + write) forward and its gradient's backward
            moved = self._mem(2 * T * (m.mamba_in_proj_width + m.mamba_d_inner) // tp * bpe, 2)
            fwd, bwd = fwd + moved, bwd + moved
        extra = norm + self._mem(3 * self.T_sp * m.hidden_size * bpe)  # the residual add
        core = T * ssd_flops_per_token(m, heads)
        return float(f[0]) + fwd + extra, float(dg[0]) + bwd + 2 * extra, float(wg[0]), float(fl[0]) + core

    def _expert_rows(self, moe: int, micro: int, q: np.ndarray) -> np.ndarray:
        """(n, experts_per_rank) rows each local expert of positions ``q`` computes. Under expert tensor
        parallelism the etp ranks of an expert shard (consecutive positions) all-gather their tokens
        first, so each computes the rows its whole etp group routed there, on its 1 / etp of the width."""
        load = self.plan.expert_load(moe, micro)
        if self.etp == 1:
            return load[q].astype(np.float64)
        first = (q // self.etp) * self.etp
        return sum(load[first + j] for j in range(self.etp)).astype(np.float64)

    def _routed(self, name: str, moe: int, micro: int, q: np.ndarray, layer: int | None = None):
        """(fwd, dgrad, wgrad, FLOPs) arrays over stage positions ``q`` of a routing-dependent block."""
        plan, m, d, bpe = self.plan, self.m, self.m.moe_token_width, self.bpe
        assert plan is not None
        if name == "experts":  # the grouped GEMMs of the rank's experts, all experts in one vector
            rows = self._expert_rows(moe, micro, q)  # (n, experts_per_rank)
            width = (m.moe_ffn_hidden_size or d) // self.etp
            passes = (3 if m.ffn_type == "gated" else 2) + expert_activation_passes(m)
            flat = rows.reshape(-1)
            if self.fused_mlp:  # TE's CuTe DSL grouped MLP: fc1's epilogue applies the GLU and writes fc2's
                # MXFP8 input; in backward fc2's dgrad epilogue applies the GLU's gradient and quantizes it
                fc1, fc2 = (tp_split(g, self.etp) for g in expert_gemms(m))
                one = self._gemm(fc1, flat, quant_grad=False, layer=layer, grouped=True)
                two = self._gemm(fc2, flat, quant_input=False, layer=layer, grouped=True)
                (a, b, c, x), act = (u + v for u, v in zip(one, two, strict=True)), 0.0
            else:
                a, b, c, x = self._gemms(expert_gemms(m), flat, self.etp, layer=layer, grouped=True)
                act = np.where(flat > 0, flat * width * bpe * passes / self.cost.hbm_Bps + self.cost.launch_s, 0.0)
            shape = rows.shape
            return ((a + act).reshape(shape).sum(axis=1), (b + 2 * act).reshape(shape).sum(axis=1),
                    np.asarray(c).reshape(shape).sum(axis=1), np.asarray(x).reshape(shape).sum(axis=1))  # fmt: skip
        if plan.padded is not None:  # DeepSpeed's sparse routes into / out of E x C slots
            c = np.repeat(plan.padded[moe, micro].astype(np.float64), self.s.ep)[q]
            of, bf, ob, bb = dispatcher_work("encode" if name == "permute" else "decode", self.T_sp, d,
                                             m.num_experts, m.top_k, m.num_experts * c, True, bpe)  # fmt: skip
            z = np.zeros(len(q))
            return self.cost.dispatcher_time(bf, of), self.cost.dispatcher_time(bb, ob), z, z
        copies = plan.pair_copies(moe, micro, q).sum(axis=1).astype(np.float64)
        g = self.cost.dispatcher_time(2 * copies * d * bpe, 1)  # permute: gather; unpermute: weighted scatter
        z = np.zeros(len(q))
        return g, g, z, z

    def selective_recompute(self, layer: int, moe: int | None, micro: int, q: np.ndarray, stage: int) -> np.ndarray:
        """Seconds of Megatron's selective recompute of one layer before its backward, by
        ``recompute_modules`` (:attr:`TrainingConfig.recompute_set`): ``layernorm`` the two norms,
        ``moe_act`` the experts' activation (MoE layers), ``core_attn`` the attention core's forward,
        ``mla_up_proj`` MLA's query / key-value up projections and RoPE, ``shared_experts`` the shared
        experts' forward. ``moe`` and ``mlp`` (a block's whole forward, its collectives included) are not
        one kernel: the program runs those ops again (:mod:`sim.frameworks.builder`)."""
        m, d, bpe, mods = self.m, self.m.hidden_size, self.bpe, self.s.training.recompute_set
        secs = np.zeros(len(q))
        if "layernorm" in mods and m.layer_mixer(layer) != "mamba":  # MambaLayer recomputes nothing (mamba_layer.py)
            secs += m.norms_per_layer * self._mem(2 * self.T_sp * d * bpe)
        # fused grouped MLP: its GLU-backward kernel recomputes the activation (experts.py activation_recompute_in_mlp)
        if "moe_act" in mods and moe is not None and self.plan is not None and not self.fused_mlp:
            rows = self._expert_rows(moe, micro, q).sum(axis=1)
            width = (m.moe_ffn_hidden_size or d) // self.etp
            passes = (3 if m.ffn_type == "gated" else 2) + expert_activation_passes(m)
            secs += rows * width * bpe * passes / self.cost.hbm_Bps + self.s.experts_per_rank * self.cost.launch_s
        attention = m.layer_mixer(layer) == "attention"
        if "core_attn" in mods and attention:
            secs += self._attention_core(layer)[0]
        if "mla_up_proj" in mods and m.attention == "mla" and attention:
            rope = self._mem(mla_rope_bytes(m, self.T, m.num_attention_heads // self.tp, bpe), kernels=2)
            secs += float(self._gemms(mla_up_gemms(m), self.T, self.tp, layer=layer)[0][0]) + rope
        if "shared_experts" in mods and moe is not None and m.num_shared_experts:
            secs += self._static("shared_experts", layer)[0]
        return secs * self.factor[q + stage * self.s.layout.stage_size]

    def _attention_core(self, layer: int) -> tuple[float, float, float]:
        """(forward s, backward s, FLOPs) of layer ``layer``'s attention core on one rank."""
        m, bpe, tp = self.m, self.bpe, self.tp
        seq = self.s.training.seq_len
        core = attention_core_flops_layer(m, seq, layer) * self.s.training.micro_batch_size / (self.cp * tp)
        io = 4 * self.T * (m.num_attention_heads // tp) * m.head_size * bpe
        core_dt = "bf16" if self.quantized else self.dt  # the attention core runs bf16 under TE's recipes
        rf, rb = attention_ratio(self.s, self.cost, layer, self.dt)
        cf = self.cost.attention_time(core / rf, io, core_dt)
        return cf, self.cost.attention_time(ATTENTION_BWD_FACTOR * core / rb, 2 * io, core_dt), core

    def price(self, name: str, layer: int, moe: int | None, micro: int, part: str, q: np.ndarray,
              stage: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        """(seconds, FLOPs) of block ``name`` of ``layer`` for pass ``part`` on stage positions ``q`` of
        pipeline stage ``stage`` (stragglers and the calibrated compute scale applied)."""
        if name in ("experts", "permute", "unpermute"):
            key = (name, moe, micro, len(q), hash(q.tobytes()))
            hit = self._recent.get(key)
            if hit is None:
                if len(self._recent) >= min(RECENT_BLOCKS, max(8, RECENT_BYTES // (32 * max(len(q), 1)))):
                    self._recent.pop(next(iter(self._recent)))
                hit = self._recent[key] = self._routed(name, moe, micro, q, layer)
            f, dg, wg, fl = hit
        else:
            f, dg, wg, fl = (np.full(len(q), x) for x in self._static(name, layer))
        secs = {"fwd": f, "bwd": dg + wg, "bwd_input": dg, "bwd_weight": wg}[part]
        flops = fl if part == "fwd" else fl * (2.0 if part == "bwd" else 1.0)
        return secs * self.factor[q + stage * self.s.layout.stage_size], flops


__all__ = ["PASSES", "Pricer", "attention_ratio", "tp_split"]
