"""Parameter accounting of a :class:`~sim.inputs.scenario.ModelConfig`, module by module.

Counts follow the HuggingFace modeling files' ``nn.Linear`` / norm shapes: GQA attention
(q, k, v, o; q/k/v biases when ``attention_bias``, the o bias when ``attention_out_bias``, one sink
logit per head when ``attention_sinks``), DeepSeek MLA (q_a/q_b or q, kv_a with the rope key, kv_b,
o, and the two low-rank RMSNorms), gated FFN = 3 matrices (gate, up, down), plain = 2, linear = one
d x d matrix (each with its bias when ``linear_bias``), router ``E x d`` (+ ``E`` selection bias,
+ ``E`` logit bias), the Qwen2-MoE shared-expert gate ``d x 1``, two norms per layer plus a final
one, the query/key norms of ``qk_norm`` (counted in ``norms``: ``head`` = 2 x head_dim weights per
layer as Qwen3-MoE's q_norm/k_norm, ``full`` = (heads + kv_heads) x head_dim as OLMoE's), input
embedding and (untied) LM head.

``active`` = every parameter a token passes through: all non-routed parameters (embedding table
and LM head included, as in Mixtral's 12.9B) plus ``top_k`` routed experts per MoE layer. Cards that
leave the input embedding out (DeepSeek-V3, GPT-OSS: "unembedding parameters are counted towards
active, but not embeddings") compare with ``active - vocab x d``.
DeepSeek-V3 multi-token-prediction modules (eh_proj, two norms, one full transformer layer; the
embedding and head are shared with the main model) are reported in ``mtp`` and are not in
``total``, as the DeepSeek-V3 card reports 671B + MTP.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from sim.inputs.scenario import ModelConfig


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer, by module."""

    attention: int
    dense_ffn: int
    expert_each: int
    num_experts: int
    shared_expert: int
    router: int
    norms: int
    mamba: int = 0
    latent_proj: int = 0

    @property
    def tp_sharded(self) -> int:
        """Parameters Megatron splits over tensor parallelism: attention, dense FFN, the Mamba mixer."""
        return self.attention + self.dense_ffn + self.mamba

    @property
    def expert(self) -> int:
        """All routed experts of the layer."""
        return self.expert_each * self.num_experts

    @property
    def non_expert(self) -> int:
        return (self.attention + self.dense_ffn + self.mamba + self.shared_expert + self.router + self.norms
                + self.latent_proj)  # fmt: skip

    @property
    def total(self) -> int:
        return self.non_expert + self.expert

    def active(self, top_k: int) -> int:
        """Parameters one token passes through: everything but the routed experts it skips."""
        return self.non_expert + self.expert_each * min(top_k, self.num_experts)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model (integers). ``mtp`` and ``mtp_expert`` are outside ``total``."""

    total: int
    active: int
    expert: int
    shared_expert: int
    non_expert: int
    embedding: int
    attention: int
    dense_ffn: int
    router: int
    norms: int
    mamba: int
    mtp: int
    mtp_expert: int
    moe_layers: int
    expert_each: int

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def ffn_params(d: int, width: int | None, ffn_type: str, bias: bool) -> int:
    """One FFN (dense or expert): gated 3dw (+2w+d bias), plain 2dw (+w+d), linear d*d (+d)."""
    if ffn_type == "linear":
        return d * d + (d if bias else 0)
    assert width is not None, "ffn width is validated by ModelConfig"
    if ffn_type == "gated":
        return 3 * d * width + ((2 * width + d) if bias else 0)
    return 2 * d * width + ((width + d) if bias else 0)


def attention_params(m: ModelConfig) -> int:
    """One attention block (see the module docstring for the matrices counted)."""
    d, h = m.hidden_size, m.num_attention_heads
    if m.attention == "none":
        return 0
    if m.attention == "mla":
        qk = (m.qk_nope_head_dim or 0) + (m.qk_rope_head_dim or 0)
        kv_rank, v = m.kv_lora_rank or 0, m.v_head_dim or 0
        q = d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * h * qk if m.q_lora_rank else d * h * qk
        kv = (
            d * (kv_rank + (m.qk_rope_head_dim or 0))
            + kv_rank
            + kv_rank * h * ((m.qk_nope_head_dim or 0) + v)
        )
        return q + kv + h * v * d
    hd, kv_heads = m.head_size, m.kv_heads
    q_out, kv_out = h * hd, kv_heads * hd
    bias = ((q_out + 2 * kv_out) if m.attention_bias else 0) + (d if m.attention_out_bias else 0)
    return d * q_out + 2 * d * kv_out + q_out * d + bias + sink_params(m)


def sink_params(m: ModelConfig) -> int:
    """The learned sink logits of one attention block: one per query head (GPT-OSS's ``sinks``)."""
    return m.num_attention_heads if m.attention_sinks else 0


def _norm(m: ModelConfig, width: int | None = None) -> int:
    """Weights of one norm of ``width`` (default hidden_size): RMSNorm a scale, LayerNorm scale + bias."""
    width = m.hidden_size if width is None else width
    return 2 * width if m.norm_type == "layernorm" else width


def qk_norm_params(m: ModelConfig) -> int:
    """The query and key norms of one attention block (``ModelConfig.qk_norm``)."""
    if m.qk_norm == "head":
        return 2 * _norm(m, m.head_size)
    if m.qk_norm == "full":
        return _norm(m, m.num_attention_heads * m.head_size) + _norm(m, m.kv_heads * m.head_size)
    return 0


def mamba_params(m: ModelConfig) -> int:
    """One Mamba-2 mixer as Megatron's ``MambaMixer`` holds it: ``in_proj`` (d -> z, x, B, C, dt), the
    depthwise causal conv1d over x, B, C with its bias, ``dt_bias``, ``A_log`` and ``D`` per head, the
    gated RMSNorm over ``d_inner`` and ``out_proj`` (d_inner -> d); no projection biases (Nemotron-H)."""
    d, heads, conv = m.hidden_size, m.mamba_num_heads or 0, m.mamba_conv_channels
    return d * m.mamba_in_proj_width + conv * (m.mamba_conv_kernel + 1) + 3 * heads + m.mamba_d_inner * (1 + d)


def layer_params(m: ModelConfig, layer: int) -> LayerParams:
    """Parameters of layer ``layer`` (0-based): its mixer (attention, a hybrid pattern's Mamba-2 or none)
    and its FFN (dense, MoE per ``ModelConfig.is_moe_layer``, or none), one pre-norm per block."""
    d = m.hidden_size
    mixer, ffn = m.layer_mixer(layer), m.layer_ffn(layer)
    attention = attention_params(m) if mixer == "attention" else 0
    mamba = mamba_params(m) if mixer == "mamba" else 0
    blocks = 2 if m.hybrid_pattern is not None and layer >= m.num_layers else m.norms_per_layer  # hybrid MTP: *E
    norms = blocks * _norm(m) + (qk_norm_params(m) if mixer == "attention" else 0)
    if ffn is None:
        return LayerParams(attention, 0, 0, 0, 0, 0, norms, mamba)
    moe = ffn == "moe"
    if not moe and m.num_shared_experts and m.num_experts <= 1:
        moe = True  # shared experts only, no routing
    if not moe:
        dense = ffn_params(d, m.ffn_hidden_size, m.ffn_type, m.linear_bias)
        return LayerParams(attention, dense, 0, 0, 0, 0, norms, mamba)
    routed = m.num_experts if m.num_experts > 1 else 0
    each = ffn_params(m.moe_token_width, m.moe_ffn_hidden_size, m.ffn_type, m.linear_bias) if routed else 0
    latent = 2 * d * m.moe_latent_size if m.moe_latent_size else 0  # fc1_latent_proj, fc2_latent_proj
    shared_width = m.shared_expert_ffn_hidden_size or m.moe_ffn_hidden_size
    shared = m.num_shared_experts * ffn_params(d, shared_width, m.ffn_type, m.linear_bias)
    if m.shared_expert_gate and m.num_shared_experts:
        shared += d
    router = routed * (d + int(m.router_bias) + int(m.router_logit_bias))
    return LayerParams(attention, 0, each, routed, shared, router, norms, mamba, latent)


def mtp_head_params(m: ModelConfig) -> int:
    """An MTP module's parameters besides its layer: ``enorm``, ``hnorm`` and ``eh_proj`` (2d -> d)."""
    return 2 * _norm(m) + 2 * m.hidden_size * m.hidden_size


def mtp_params(m: ModelConfig) -> tuple[int, int]:
    """(parameters, of which routed experts) of the MTP modules: per module ``enorm``, ``hnorm``,
    ``eh_proj`` (2d -> d) and one transformer layer like the main model's last (MoE) layer."""
    if not m.mtp_layers:
        return 0, 0
    block = layer_params(m, m.num_layers - (0 if m.hybrid_pattern is not None else 1))  # hybrid: its *E module
    per_module = mtp_head_params(m) + block.total
    modules = 1 if m.mtp_repeated_layer else m.mtp_layers  # repeated: one module's weights, run mtp_layers times
    return modules * per_module, modules * block.expert


def count_params(model: ModelConfig) -> ParamCounts:
    """Total, per-token active and per-module parameter counts of ``model``."""
    layers = [layer_params(model, i) for i in range(model.num_layers)]
    d, vocab = model.hidden_size, model.vocab_size
    embedding = vocab * d * (1 if model.tie_word_embeddings else 2)
    final_norm = _norm(model)
    body_total = sum(layer.total for layer in layers)
    body_active = sum(layer.active(model.top_k) for layer in layers)
    expert = sum(layer.expert for layer in layers)
    total = body_total + embedding + final_norm
    mtp, mtp_expert = mtp_params(model)
    return ParamCounts(
        total=total,
        active=body_active + embedding + final_norm,
        expert=expert,
        shared_expert=sum(layer.shared_expert for layer in layers),
        non_expert=total - expert,
        embedding=embedding,
        attention=sum(layer.attention for layer in layers),
        dense_ffn=sum(layer.dense_ffn for layer in layers),
        router=sum(layer.router for layer in layers),
        norms=sum(layer.norms for layer in layers) + final_norm,
        mamba=sum(layer.mamba for layer in layers),
        mtp=mtp,
        mtp_expert=mtp_expert,
        moe_layers=sum(1 for layer in layers if layer.num_experts),
        expert_each=max((layer.expert_each for layer in layers), default=0),
    )


def _ffn_tensors(ffn_type: str, bias: bool) -> int:
    """Weight (and bias) tensors of one FFN, as :func:`ffn_params` counts its matrices."""
    mats = {"linear": 1, "gated": 3}.get(ffn_type, 2)
    return mats * (2 if bias else 1)


def layer_tensors(m: ModelConfig, layer: int) -> tuple[int, int]:
    """``(non_expert, per_expert)``: parameter tensors of layer ``layer`` as HF-style modules hold
    them (unfused q/k/v/o, each norm's scale and LayerNorm's bias, every routed expert's own
    matrices and biases). Frameworks loop over tensors in the optimizer's gradient norm (one
    ``vector_norm`` each in DeepSpeed's ``get_grad_norm_direct``), so per-tensor work scales with
    this count, not with the parameters."""
    norm = 2 if m.norm_type == "layernorm" else 1
    mixer = m.layer_mixer(layer)
    if mixer == "mamba":  # in_proj, conv1d weight and bias, dt_bias, A_log, D, the gated norm, out_proj
        attn = 8
    elif m.attention == "none" or mixer is None:
        attn = 0
    elif m.attention == "mla":  # q (or q_a, q_a norm, q_b), kv_a, kv_a norm, kv_b, o
        attn = (3 if m.q_lora_rank else 1) + 4
    else:
        attn = 4 + (3 if m.attention_bias else 0) + (2 * norm if m.qk_norm in ("head", "full") else 0)
        attn += int(m.attention_out_bias)
    attn += int(m.attention_sinks) if mixer == "attention" else 0
    lp = layer_params(m, layer)
    non_expert = attn + m.norms_per_layer * norm
    if lp.dense_ffn:
        non_expert += _ffn_tensors(m.ffn_type, m.linear_bias)
    if lp.shared_expert:
        non_expert += m.num_shared_experts * _ffn_tensors(m.ffn_type, m.linear_bias) + int(bool(m.shared_expert_gate))
    if lp.router:
        non_expert += 1 + int(bool(m.router_bias)) + int(m.router_logit_bias)
    non_expert += 2 if lp.latent_proj else 0
    return non_expert, (_ffn_tensors(m.ffn_type, m.linear_bias) if lp.num_experts else 0)


def outer_tensors(m: ModelConfig) -> int:
    """Tensors outside the layers: the embedding, the untied LM head, the final norm's."""
    return 1 + (0 if m.tie_word_embeddings else 1) + (2 if m.norm_type == "layernorm" else 1)


def rank_layer_params(m: ModelConfig, layer: int, tp: int, etp: int, experts_per_rank: int) -> tuple[int, int]:
    """(non-expert, expert) parameters of ``layer`` on one rank: attention and dense FFN split by ``tp``
    (Megatron's column / row parallel linears), shared experts, router and norms whole, the rank's
    ``experts_per_rank`` experts split by ``etp``. An MTP module (``layer >= num_layers``) adds its eh_proj
    and norms, whole; with ``mtp_repeated_layer`` only the first module holds weights."""
    if layer > m.num_layers and m.mtp_repeated_layer:
        return 0, 0
    lp = layer_params(m, layer)
    head = mtp_head_params(m) if layer >= m.num_layers else 0
    return lp.tp_sharded // tp + lp.shared_expert + lp.router + lp.norms + head, lp.expert_each * experts_per_rank // etp


__all__ = [
    "rank_layer_params",
    "LayerParams",
    "ParamCounts",
    "attention_params",
    "count_params",
    "ffn_params",
    "layer_params",
    "layer_tensors",
    "mamba_params",
    "mtp_head_params",
    "mtp_params",
    "outer_tensors",
    "qk_norm_params",
    "sink_params",
]
