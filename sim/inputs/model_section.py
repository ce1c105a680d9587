"""The ``model`` section of the scenario schema: a transformer's shape (attention, dense and MoE FFNs,
routers, MTP), inline or from a HuggingFace ``config.json`` plus overrides.

Strict like every section (:mod:`sim.inputs.sections`, which re-exports it); checks inside the section
raise :func:`~sim.inputs.yamlio.field_error` naming ``model.<field>``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from sim.inputs.yamlio import StrictModel, field_error

_STRICT = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)
_WIDTH = 1_000_000  # upper bound on head counts, head and low-rank widths: far past any model
_FFN = 100_000_000  # upper bound on FFN widths
#: Megatron-Core's hybrid layer symbols (megatron/core/models/hybrid/hybrid_layer_allocation.py Symbols)
HYBRID_KINDS = ("M", "*", "-", "E")


class ModelConfig(StrictModel):
    """Model shape. Either inline fields, or ``hf_config`` (a HuggingFace config.json) plus overrides."""

    model_config = _STRICT
    name: str = "custom"
    hf_config: str | None = Field(default=None, description="path to a HuggingFace config.json")
    num_layers: int = Field(ge=1, le=100_000)
    hidden_size: int = Field(ge=1, le=1_000_000)
    num_attention_heads: int = Field(default=1, ge=1, le=_WIDTH)
    num_kv_heads: int | None = Field(
        default=None, ge=1, le=_WIDTH, description="GQA key/value heads (default = heads)"
    )
    head_dim: int | None = Field(default=None, ge=1, le=_WIDTH, description="default hidden_size / heads")
    attention: Literal["mha", "mla", "none"] = Field(default="mha", description="mha covers GQA/MQA")
    q_lora_rank: int | None = Field(
        default=None, ge=1, le=_WIDTH, description="MLA query low-rank (None: full-rank q)"
    )
    kv_lora_rank: int | None = Field(default=None, ge=1, le=_WIDTH, description="MLA compressed KV rank")
    qk_nope_head_dim: int | None = Field(default=None, ge=0, le=_WIDTH)
    qk_rope_head_dim: int | None = Field(default=None, ge=0, le=_WIDTH)
    v_head_dim: int | None = Field(default=None, ge=1, le=_WIDTH)
    attention_bias: bool = Field(default=False, description="biases on q/k/v projections (Qwen2)")
    attention_out_bias: bool = Field(
        default=False, description="bias on the attention output projection (GPT-OSS: q/k/v/o all biased)"
    )
    attention_sinks: bool = Field(
        default=False,
        description="a learned sink logit per head and layer: one more softmax column that no value row "
        "follows (GPT-OSS)",
    )
    sliding_window: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="tokens a query of a windowed layer attends to, itself included (HF semantics); "
        "None = full causal attention in every layer",
    )
    sliding_window_pattern: int | None = Field(
        default=None,
        ge=2,
        le=100_000,
        description="with sliding_window, layer i (0-based) attends fully iff (i + 1) % n == 0 and the others "
        "use the window (HF Gemma's sliding_window_pattern, Megatron's window_attn_skip_freq; GPT-OSS: 2); "
        "None = every layer windowed",
    )
    qk_norm: Literal["none", "head", "full"] = Field(
        default="none",
        description="RMSNorm on queries and keys: head = per head, width head_dim (Qwen3-MoE); "
        "full = over the whole q (heads x head_dim) and k (kv_heads x head_dim) projections (OLMoE)",
    )
    vocab_size: int = Field(default=32000, ge=1, le=100_000_000)
    tie_word_embeddings: bool = False
    norm_type: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    ffn_type: Literal["gated", "plain", "linear"] = Field(
        default="gated", description="gated: SwiGLU, 3 matrices; plain: 2 matrices; linear: 1 d x d matrix"
    )
    linear_bias: bool = Field(default=False, description="biases on FFN/expert linear layers")
    swiglu_limit: float | None = Field(
        default=None,
        gt=0,
        le=1e6,
        description="GPT-OSS's clamped SwiGLU: gate clamped to <= limit, linear half to [-limit, limit], "
        "out = (up + 1) * gate * sigmoid(1.702 gate); None = plain SwiGLU",
    )
    ffn_hidden_size: int | None = Field(default=None, ge=1, le=_FFN, description="dense layers' FFN width")
    moe_ffn_hidden_size: int | None = Field(
        default=None, ge=1, le=_FFN, description="one routed expert's FFN width"
    )
    num_experts: int = Field(default=1, ge=1, le=1_000_000, description="routed experts per MoE layer")
    top_k: int = Field(default=1, ge=1, le=1_000_000, description="experts per token")
    num_shared_experts: int = Field(default=0, ge=0, le=10_000)
    shared_expert_ffn_hidden_size: int | None = Field(
        default=None, ge=1, description="one shared expert's width"
    )
    shared_expert_gate: bool = Field(default=False, description="Qwen2-MoE sigmoid gate on the shared expert")
    first_dense_layers: int = Field(
        default=0, ge=0, le=100_000, description="leading layers with a dense FFN"
    )
    moe_latent_size: int | None = Field(
        default=None,
        ge=1,
        le=_WIDTH,
        description="LatentMoE (Megatron's moe_latent_size, Nemotron 3 Super): tokens are projected from "
        "hidden_size down to this width after routing, dispatched and computed by the experts at it, and "
        "projected back after the combine; None = experts at hidden_size",
    )
    moe_layer_freq: int = Field(
        default=1, ge=1, le=100_000, description="every n-th layer (after the dense ones) is MoE"
    )
    mtp_layers: int = Field(
        default=0, ge=0, le=1000, description="multi-token-prediction modules (DeepSeek-V3)"
    )
    mtp_repeated_layer: bool = Field(
        default=False,
        description="Megatron's mtp_use_repeated_layer: one MTP module's weights run mtp_layers times "
        "(Nemotron 3 Super's recipe: mtp_num_layers 2 over the HF config's single module)",
    )
    hybrid_pattern: str | None = Field(
        default=None,
        min_length=1,
        max_length=100_000,
        description="Megatron-Core's hybrid_override_pattern, one character per layer, each a residual "
        "block with its own pre-norm: M = Mamba-2 mixer, * = attention, - = dense MLP, E = MoE "
        "(Nemotron-H, Nemotron-3); None = every layer attention + FFN",
    )
    mamba_num_heads: int | None = Field(default=None, ge=1, le=_WIDTH, description="Mamba-2 heads per layer")
    mamba_head_dim: int = Field(default=64, ge=1, le=_WIDTH, description="Mamba-2 head dim (P)")
    mamba_state_dim: int = Field(default=128, ge=1, le=_WIDTH, description="Mamba-2 state size (N)")
    mamba_groups: int = Field(default=8, ge=1, le=_WIDTH, description="Mamba-2 B/C groups (G)")
    mamba_conv_kernel: int = Field(default=4, ge=1, le=1024, description="Mamba-2 causal conv1d width")
    mamba_chunk_size: int = Field(default=128, ge=1, le=1_000_000, description="SSD chunk length (Q)")
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = Field(default=True, description="renormalise the top-k weights to sum to 1")
    router_bias: bool = Field(default=False, description="per-expert selection bias (DeepSeek-V3)")
    router_logit_bias: bool = Field(
        default=False,
        description="bias of the router's linear layer, added to the logits before top-k and softmax, so it "
        "moves the weights too (GPT-OSS)",
    )

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.top_k > self.num_experts:
            raise field_error("top_k", f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.num_kv_heads is not None and self.num_attention_heads % self.num_kv_heads:
            raise field_error(
                "num_kv_heads",
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})",
            )
        if self.attention == "mha" and self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise field_error(
                "head_dim",
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); set head_dim",
            )
        if self.qk_norm != "none" and self.attention != "mha":
            raise field_error(
                "qk_norm", f"qk_norm: {self.qk_norm} applies to attention: mha only, not {self.attention}"
            )
        if self.attention_out_bias and self.attention != "mha":
            raise field_error(
                "attention_out_bias",
                f"attention_out_bias applies to attention: mha only, not {self.attention}",
            )
        if self.attention == "none":
            for name in ("attention_sinks", "sliding_window"):
                if getattr(self, name):
                    raise field_error(name, f"{name} needs attention layers; attention is none")
        if self.sliding_window_pattern is not None and self.sliding_window is None:
            raise field_error(
                "sliding_window_pattern", "sliding_window_pattern needs sliding_window (the window in tokens)"
            )
        if self.swiglu_limit is not None and self.ffn_type != "gated":
            raise field_error(
                "swiglu_limit", f"swiglu_limit clamps a gated (SwiGLU) FFN; ffn_type is {self.ffn_type}"
            )
        if self.mtp_repeated_layer and not self.mtp_layers:
            raise field_error("mtp_repeated_layer", "mtp_repeated_layer needs MTP modules: mtp_layers >= 1")
        if self.moe_latent_size is not None and self.num_experts <= 1:
            raise field_error("moe_latent_size", "moe_latent_size needs routed experts: num_experts > 1")
        if self.router_logit_bias and self.num_experts <= 1:
            raise field_error("router_logit_bias", "router_logit_bias needs a router: num_experts > 1")
        if self.attention == "mla":
            missing = [
                f
                for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                if getattr(self, f) is None
            ]
            if missing:
                raise field_error("attention", f"attention: mla needs {', '.join(missing)}")
        if self.is_moe and self.moe_ffn_hidden_size is None and self.ffn_type != "linear":
            raise field_error("moe_ffn_hidden_size", "moe_ffn_hidden_size is required when num_experts > 1")
        has_dense = self.first_dense_layers > 0 or self.moe_layer_freq > 1 or not self.is_moe
        if self.hybrid_pattern is not None:
            has_dense = "-" in self.hybrid_pattern
        if has_dense and self.ffn_hidden_size is None and self.ffn_type != "linear":
            raise field_error(
                "ffn_hidden_size", "ffn_hidden_size is required: the model has dense FFN layers"
            )
        self._check_hybrid()
        if self.first_dense_layers > self.num_layers:
            raise field_error(
                "first_dense_layers",
                f"first_dense_layers ({self.first_dense_layers}) exceeds num_layers ({self.num_layers})",
            )
        return self

    def _check_hybrid(self) -> None:
        pattern = self.hybrid_pattern
        if pattern is None:
            if self.mamba_num_heads is not None:
                raise field_error("mamba_num_heads", "Mamba-2 layers need hybrid_pattern (M marks them)")
            return
        bad = sorted(set(pattern) - set(HYBRID_KINDS))
        if bad:
            raise field_error(
                "hybrid_pattern", f"unknown layer symbol(s) {bad}; use M (Mamba-2), * (attention), - (MLP), E (MoE)"
            )
        if len(pattern) != self.num_layers:
            raise field_error(
                "hybrid_pattern", f"has {len(pattern)} layers, num_layers is {self.num_layers}"
            )
        if "M" in pattern:
            if self.mamba_num_heads is None:
                raise field_error("mamba_num_heads", "hybrid_pattern has Mamba-2 layers (M): set mamba_num_heads")
            if self.mamba_num_heads % self.mamba_groups:
                raise field_error(
                    "mamba_groups",
                    f"mamba_num_heads ({self.mamba_num_heads}) must be a multiple of mamba_groups ({self.mamba_groups})",
                )
        if ("E" in pattern) != (self.num_experts > 1):
            raise field_error(
                "hybrid_pattern",
                "E (MoE) layers need num_experts > 1, and num_experts > 1 needs E layers "
                f"(num_experts {self.num_experts}, pattern {'with' if 'E' in pattern else 'without'} E)",
            )
        if self.first_dense_layers or self.moe_layer_freq != 1:
            raise field_error(
                "hybrid_pattern", "with hybrid_pattern the pattern places MoE layers: leave first_dense_layers "
                "and moe_layer_freq at 0 and 1",
            )

    def layer_mixer(self, layer: int) -> str | None:
        """The token mixer of layer ``layer`` (0-based): ``attention``, ``mamba`` or None (an MLP or MoE
        layer of a hybrid pattern). A hybrid model's MTP layer (``layer >= num_layers``) is attention + MoE
        (Nemotron 3's ``mtp_hybrid_override_pattern`` ``*E``)."""
        if self.hybrid_pattern is None or layer >= self.num_layers:
            return "attention"
        return {"M": "mamba", "*": "attention"}.get(self.hybrid_pattern[layer])

    def layer_ffn(self, layer: int) -> str | None:
        """The FFN of layer ``layer``: ``moe``, ``dense`` or None (a mixer-only layer of a hybrid pattern)."""
        if self.hybrid_pattern is None:
            return "moe" if self.is_moe_layer(layer) else "dense"
        if layer >= self.num_layers:
            return "moe"
        return {"E": "moe", "-": "dense"}.get(self.hybrid_pattern[layer])

    @property
    def moe_token_width(self) -> int:
        """Width of a routed token as the dispatcher moves it and the experts see it: ``moe_latent_size``
        under LatentMoE, else ``hidden_size``."""
        return self.moe_latent_size or self.hidden_size

    @property
    def norms_per_layer(self) -> int:
        """Pre-norms per layer: two in a transformer layer, one in each block of a hybrid pattern."""
        return 2 if self.hybrid_pattern is None else 1

    @property
    def mamba_d_inner(self) -> int:
        """Mamba-2 inner width: heads x head dim."""
        return (self.mamba_num_heads or 0) * self.mamba_head_dim

    @property
    def mamba_conv_channels(self) -> int:
        """Channels of the causal conv1d: x, B and C (``d_inner + 2 G N``)."""
        return self.mamba_d_inner + 2 * self.mamba_groups * self.mamba_state_dim

    @property
    def mamba_in_proj_width(self) -> int:
        """Outputs of Megatron's ``in_proj``: z, x, B, C and dt (``2 d_inner + 2 G N + heads``)."""
        return self.mamba_d_inner + self.mamba_conv_channels + (self.mamba_num_heads or 0)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1 or self.num_shared_experts > 0

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def attention_window(self, layer: int) -> int | None:
        """Keys per query of layer ``layer`` (0-based): ``sliding_window`` in a windowed layer, None in
        a full-attention one (HF ``layer_types``; see ``sliding_window_pattern``)."""
        if self.sliding_window is None:
            return None
        pattern = self.sliding_window_pattern
        return None if pattern is not None and (layer + 1) % pattern == 0 else self.sliding_window

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has an MoE FFN (HF's first_k_dense_replace + moe_layer_freq, or
        an E of ``hybrid_pattern``)."""
        if self.num_experts <= 1:
            return False
        if self.hybrid_pattern is not None:
            return layer >= self.num_layers or self.hybrid_pattern[layer] == "E"
        return (
            layer >= self.first_dense_layers and (layer - self.first_dense_layers) % self.moe_layer_freq == 0
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))


__all__ = ["HYBRID_KINDS", "ModelConfig"]
