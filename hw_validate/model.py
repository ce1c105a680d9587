"""The torch Transformer a scenario describes, with ``deepspeed.moe.layer.MoE`` feed-forward layers.

``embedding -> N x [norm -> causal self-attention -> residual, norm -> FFN -> residual] -> norm -> head``.
The FFN of layer ``i`` is an MoE layer when ``model.is_moe_layer(i)`` (HF ``first_k_dense_replace``
and ``moe_layer_freq``), else a dense MLP of ``ffn_hidden_size``. An MoE FFN is DeepSpeed's ``MoE``
with ``num_experts`` experts (``ep_size`` of them split over the EP group), ``top_k``, capacity
factor, min capacity and ``drop_tokens`` from the routing section, plus ``num_shared_experts``
always-on experts (optionally behind a sigmoid gate, Qwen2-MoE).

Expert MLPs (``model.ffn_type``): ``gated`` = SwiGLU (three matrices), ``plain`` = Linear-GELU-Linear,
``linear`` = one ``Linear(d, d)`` + ReLU (the original example's expert). Attention ``mha`` covers
GQA/MQA (``num_kv_heads``); ``none`` skips attention; ``mla`` is simulated only (an error here).

Routing weights: DeepSpeed's top-2 and top-k gates renormalise the kept weights of a token to sum
to 1; its top-1 gate multiplies by the raw softmax probability. With ``norm_topk_prob: true`` and
k = 1 a gate hook renormalises too (weight p/p = 1, as HF's Qwen/Mixtral code computes it), so an
upcycled model equals its dense parent. ``routing.route_scale`` multiplies the weights.

Expert weights are seeded by (seed, MoE layer, *global* expert id), so the initial model does not
depend on how the experts are split over ranks; everything else is seeded by ``seed`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hw_validate.dsconfig import GateSettings
from sim.errors import InputError
from sim.inputs.scenario import ModelConfig, Scenario


def _norm(m: ModelConfig, d: int) -> nn.Module:
    return nn.RMSNorm(d, eps=1e-6) if m.norm_type == "rmsnorm" else nn.LayerNorm(d, eps=1e-5)


class Attention(nn.Module):
    """Causal multi-head self-attention with grouped KV heads (GQA/MQA when kv_heads < heads)."""

    def __init__(self, m: ModelConfig):
        super().__init__()
        d, self.h, self.kv, self.hd = m.hidden_size, m.num_attention_heads, m.kv_heads, m.head_size
        self.q = nn.Linear(d, self.h * self.hd, bias=m.attention_bias)
        self.k = nn.Linear(d, self.kv * self.hd, bias=m.attention_bias)
        self.v = nn.Linear(d, self.kv * self.hd, bias=m.attention_bias)
        self.o = nn.Linear(self.h * self.hd, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        if self.kv != self.h:
            rep = self.h // self.kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, self.h * self.hd))


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, d: int, f: int, bias: bool):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, f, bias=bias), nn.Linear(d, f, bias=bias), nn.Linear(f, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class PlainMLP(nn.Module):
    """up -> GELU -> down."""

    def __init__(self, d: int, f: int, bias: bool):
        super().__init__()
        self.up, self.down = nn.Linear(d, f, bias=bias), nn.Linear(f, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class LinearReLU(nn.Module):
    """One ``Linear(d, d)`` followed by ReLU: the expert of the original DeepSpeed example."""

    def __init__(self, d: int, bias: bool):
        super().__init__()
        self.proj = nn.Linear(d, d, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.proj(x))


def make_mlp(m: ModelConfig, width: int | None) -> nn.Module:
    """One expert or dense FFN of ``model.ffn_type`` with hidden ``width``."""
    d = m.hidden_size
    if m.ffn_type == "linear":
        return LinearReLU(d, m.linear_bias)
    assert width is not None
    return GatedMLP(d, width, m.linear_bias) if m.ffn_type == "gated" else PlainMLP(d, width, m.linear_bias)


def _shared_width(m: ModelConfig) -> int | None:
    return m.shared_expert_ffn_hidden_size or m.moe_ffn_hidden_size


class MoEFFN(nn.Module):
    """DeepSpeed's ``MoE`` plus optional shared experts; returns (output, aux loss)."""

    def __init__(self, m: ModelConfig, gate: GateSettings, ep_size: int, route_scale: float = 1.0):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.moe = MoE(
            hidden_size=m.hidden_size,
            expert=make_mlp(m, m.moe_ffn_hidden_size),
            num_experts=m.num_experts,
            ep_size=ep_size,
            k=gate.k,
            capacity_factor=gate.capacity_factor,
            eval_capacity_factor=gate.capacity_factor,
            min_capacity=gate.min_capacity,
            drop_tokens=gate.drop_tokens,
        )
        self.shared = nn.ModuleList(make_mlp(m, _shared_width(m)) for _ in range(m.num_shared_experts))
        self.shared_gate = nn.Linear(m.hidden_size, 1, bias=False) if m.shared_expert_gate and self.shared else None
        self.renorm_top1 = gate.k == 1 and m.norm_topk_prob
        self.route_scale = float(route_scale)
        if self.renorm_top1 or self.route_scale != 1.0:
            self.moe.deepspeed_moe.gate.register_forward_hook(self._reweight)

    def _reweight(self, module: nn.Module, args: tuple, out: tuple) -> tuple:
        """Renormalise top-1 weights (p / p) and apply ``route_scale`` to the gate's weights."""
        out = list(out)
        idx = 5 if len(out) == 7 else 1  # sparse routes: gates_ [k, S]; dense: combine_weights [S, E, C]
        w = out[idx]
        if self.renorm_top1:
            total = w.sum(dim=0, keepdim=True) if len(out) == 7 else w.sum(dim=(1, 2), keepdim=True)
            w = torch.where(total > 0, w / total.clamp(min=torch.finfo(w.dtype).tiny), w)
        out[idx] = w * self.route_scale
        return tuple(out)

    @property
    def gate(self) -> nn.Module:
        return self.moe.deepspeed_moe.gate

    @property
    def experts(self) -> nn.ModuleList:
        """This rank's local experts (``num_experts / ep`` of them)."""
        return self.moe.deepspeed_moe.experts.deepspeed_experts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y, l_aux, _ = self.moe(x)
        if len(self.shared):
            s = sum(e(x) for e in self.shared)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            y = y + s
        return y, l_aux


class Block(nn.Module):
    def __init__(self, m: ModelConfig, ffn: nn.Module):
        super().__init__()
        self.norm1 = _norm(m, m.hidden_size) if m.attention != "none" else None
        self.attn = Attention(m) if m.attention != "none" else None
        self.norm2 = _norm(m, m.hidden_size)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.attn is not None:
            x = x + self.attn(self.norm1(x))
        out = self.ffn(self.norm2(x))
        if isinstance(out, tuple):
            y, aux = out
            return x + y, aux
        return x + out, None


class MoETransformer(nn.Module):
    """Token embedding, blocks, final norm and LM head; ``forward(tokens) -> (logits, summed aux loss)``."""

    def __init__(self, m: ModelConfig, ffns: list[nn.Module]):
        super().__init__()
        self.embed = nn.Embedding(m.vocab_size, m.hidden_size)
        self.blocks = nn.ModuleList(Block(m, f) for f in ffns)
        self.norm = _norm(m, m.hidden_size)
        self.head = nn.Linear(m.hidden_size, m.vocab_size, bias=False)
        if m.tie_word_embeddings:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens)
        aux = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, a = block(x)
            if a is not None:
                aux = aux + a.float()
        return self.head(self.norm(x)), aux

    def moe_layers(self) -> list[MoEFFN]:
        return [b.ffn for b in self.blocks if isinstance(b.ffn, MoEFFN)]


def check_supported(scenario: Scenario) -> list[str]:
    """Raise for shapes the real job cannot build; return notices for features simulated only."""
    m = scenario.model
    if m.attention == "mla":
        raise InputError(
            "attention: mla is simulated only; the DeepSpeed job builds mha (incl. GQA/MQA) or none",
            file=scenario.source,
            field="model.attention",
        )
    notices = []
    if m.score_function != "softmax":
        notices.append("model.score_function sigmoid is simulated only: DeepSpeed's gate uses softmax")
    if m.router_bias or scenario.routing.aux_free_balancing.enabled:
        notices.append("router selection bias / aux-free balancing are simulated only")
    if m.mtp_layers:
        notices.append("model.mtp_layers are simulated only (no MTP modules in the real job)")
    if m.top_k >= 2 and not m.norm_topk_prob:
        notices.append("DeepSpeed renormalises top-k (k >= 2) weights; norm_topk_prob: false is not reproduced")
    return notices


def build_model(
    scenario: Scenario, gate: GateSettings | None, *, ep_size: int = 1, dense: bool = False, seed: int = 0
) -> MoETransformer:
    """The model of ``scenario``; ``dense=True`` puts a dense MLP (of the expert width) in every MoE slot."""
    m = scenario.model
    torch.manual_seed(seed)
    ffns: list[nn.Module] = []
    for i in range(m.num_layers):
        if m.is_moe_layer(i):
            if dense:
                ffns.append(make_mlp(m, m.moe_ffn_hidden_size))
            else:
                assert gate is not None
                ffns.append(MoEFFN(m, gate, ep_size, scenario.routing.route_scale))
        else:
            ffns.append(make_mlp(m, m.ffn_hidden_size))
    return MoETransformer(m, ffns)


def _seed_of(*parts: int) -> int:
    h = 0x9E3779B1
    for p in parts:
        h = (h * 1_000_003 + int(p) + 1) % (2**61 - 1)
    return h


def init_experts(model: MoETransformer, seed: int, ep_rank: int) -> None:
    """Re-initialise every local expert from (seed, MoE layer, global expert id): layout-independent."""
    with torch.no_grad():
        for layer, moe in enumerate(model.moe_layers()):
            local = len(moe.experts)
            for j, expert in enumerate(moe.experts):
                g = torch.Generator().manual_seed(_seed_of(seed, layer, ep_rank * local + j))
                for lin in _linears(expert):
                    bound = 1.0 / math.sqrt(lin.in_features)
                    lin.weight.copy_(torch.empty_like(lin.weight).uniform_(-bound, bound, generator=g))
                    if lin.bias is not None:
                        lin.bias.copy_(torch.empty_like(lin.bias).uniform_(-bound, bound, generator=g))


def _linears(module: nn.Module) -> Iterator[nn.Linear]:
    return (mod for mod in module.modules() if isinstance(mod, nn.Linear))


def count_params(model: nn.Module) -> dict[str, int]:
    """This rank's parameters: total, expert (local experts) and the rest."""
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for p in model.parameters() if getattr(p, "allreduce", True) is False)
    return {"total_local": total, "expert_local": expert, "non_expert": total - expert}
