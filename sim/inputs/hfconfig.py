"""HuggingFace ``config.json`` -> the fields of :class:`sim.inputs.scenario.ModelConfig`.

One mapper per ``model_type``, each reading the keys the matching ``transformers`` modeling file
reads (``configuration_<type>.py`` defaults where a key is optional). Bad files and missing keys
are :class:`~sim.errors.InputError` naming the file and the key (exit 2), never a traceback.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sim.errors import InputError
from sim.inputs.yamlio import parse_json, read_text

Fields = dict[str, Any]


class _Config:
    """Typed access to one parsed config.json; every error names the file and key."""

    def __init__(self, data: dict[str, Any], file: str):
        self.data = data
        self.file = file

    def error(self, key: str, message: str) -> InputError:
        return InputError(message, file=self.file, field=key)

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        value = self.data.get(key)
        if value is None:  # absent or null: transformers falls back to the config class default
            if default is None:
                raise self.error(key, f"required key '{key}' is missing (or null)")
            value = default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"must be an integer, got {value!r}")
        if value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}")
        return value

    def opt_int(self, key: str) -> int | None:
        """An integer key that may be absent or null (e.g. DeepSeek's ``q_lora_rank``)."""
        return None if self.data.get(key) is None else self.int(key)

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        """A positive finite number (int or float); absent or null gives ``default``."""
        value = self.data.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise self.error(key, f"must be a positive number, got {value!r}")
        return float(value)

    def choice(self, key: str, default: str, allowed: tuple[str, ...]) -> str:
        value = self.data.get(key, default)
        if value is None:
            return default
        if value not in allowed:
            raise self.error(key, f"must be one of {', '.join(allowed)}, got {value!r}")
        return value


def _common(c: _Config) -> Fields:
    """Fields every decoder-only config shares (Llama naming)."""
    heads = c.int("num_attention_heads")
    fields: Fields = {
        "num_layers": c.int("num_hidden_layers"),
        "hidden_size": c.int("hidden_size"),
        "num_attention_heads": heads,
        "num_kv_heads": c.int("num_key_value_heads", default=heads),
        "vocab_size": c.int("vocab_size"),
        "tie_word_embeddings": c.bool("tie_word_embeddings", False),
        "norm_type": "rmsnorm",
        "ffn_type": "gated",
    }
    if c.data.get("head_dim") is not None:
        fields["head_dim"] = c.int("head_dim")
    return fields


def _dense(c: _Config, attention_bias: bool | None = None) -> Fields:
    """Llama / Mistral / Qwen2: a dense SwiGLU model (``num_experts = 1``), the source of upcycling."""
    return {
        **_common(c),
        "ffn_hidden_size": c.int("intermediate_size"),
        "attention_bias": c.bool("attention_bias", False) if attention_bias is None else attention_bias,
        "linear_bias": c.bool("mlp_bias", False),
        "num_experts": 1,
        "top_k": 1,
    }


def _llama(c: _Config) -> Fields:
    return _dense(c)


def _mistral(c: _Config) -> Fields:
    # MistralModel: a sliding-window causal mask in every layer when sliding_window is set.
    return {**_dense(c), "sliding_window": c.opt_int("sliding_window")}


def _qwen2(c: _Config) -> Fields:
    return _dense(c, attention_bias=True)  # Qwen2Attention: q/k/v always carry a bias


def _routed(c: _Config, experts_key: str, width_key: str, norm_topk_default: bool) -> Fields:
    """Top-k softmax routing over ``experts_key`` experts of width ``width_key``."""
    experts = c.int(experts_key)
    top_k = c.int("num_experts_per_tok")
    if top_k > experts:
        raise c.error(
            "num_experts_per_tok", f"num_experts_per_tok ({top_k}) exceeds {experts_key} ({experts})"
        )
    return {
        "num_experts": experts,
        "top_k": top_k,
        "moe_ffn_hidden_size": c.int(width_key),
        "score_function": "softmax",
        "norm_topk_prob": c.bool("norm_topk_prob", norm_topk_default),
    }


def _mixtral(c: _Config) -> Fields:
    # MixtralSparseMoeBlock: softmax over all experts, top-2, renormalised (always).
    fields = {**_common(c), **_routed(c, "num_local_experts", "intermediate_size", True)}
    fields["norm_topk_prob"] = True
    fields["sliding_window"] = c.opt_int("sliding_window")  # as Mistral: every layer, when set
    return fields


def _granitemoe(c: _Config) -> Fields:
    # GraniteMoeMoE: router Linear(h, E), top-k softmax over the k selected logits (renormalised).
    fields = {**_common(c), **_routed(c, "num_local_experts", "intermediate_size", True)}
    fields["attention_bias"] = c.bool("attention_bias", False)
    fields["norm_topk_prob"] = True
    return fields


def _olmoe(c: _Config) -> Fields:
    fields = {**_common(c), **_routed(c, "num_experts", "intermediate_size", False)}
    fields["attention_bias"] = c.bool("attention_bias", False)
    # OlmoeAttention: q_norm = RMSNorm(heads x head_dim), k_norm = RMSNorm(kv_heads x head_dim)
    fields["qk_norm"] = "full"
    return fields


def _sparse_step(c: _Config, fields: Fields) -> Fields:
    """Qwen MoE layer placement: layer i is MoE iff ``(i + 1) % decoder_sparse_step == 0`` and i is not
    in ``mlp_only_layers`` -> ``first_dense_layers = step - 1``, ``moe_layer_freq = step``."""
    step = c.int("decoder_sparse_step", default=1)
    dense_only = c.data.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(isinstance(i, int) for i in dense_only):
        raise c.error("mlp_only_layers", f"must be a list of layer indices, got {dense_only!r}")
    first_dense = step - 1
    if dense_only:
        if step != 1 or sorted(dense_only) != list(range(len(dense_only))):
            raise c.error(
                "mlp_only_layers",
                "only a leading run of dense layers [0, 1, ..., k-1] with decoder_sparse_step 1 is "
                f"supported, got {dense_only} with decoder_sparse_step {step}",
            )
        first_dense = len(dense_only)
    fields["first_dense_layers"] = first_dense
    fields["moe_layer_freq"] = step
    fields["ffn_hidden_size"] = c.int("intermediate_size")
    return fields


def _qwen2_moe(c: _Config) -> Fields:
    fields = {**_common(c), **_routed(c, "num_experts", "moe_intermediate_size", False)}
    fields["attention_bias"] = True  # Qwen2MoeAttention: q/k/v biases
    shared = c.int("shared_expert_intermediate_size", default=0, minimum=0)
    if shared:
        fields.update(num_shared_experts=1, shared_expert_ffn_hidden_size=shared, shared_expert_gate=True)
    return _sparse_step(c, fields)


def _qwen3_moe(c: _Config) -> Fields:
    fields = {**_common(c), **_routed(c, "num_experts", "moe_intermediate_size", False)}
    fields["attention_bias"] = c.bool("attention_bias", False)
    fields["qk_norm"] = "head"  # Qwen3MoeAttention: q_norm / k_norm = RMSNorm(head_dim), per head
    return _sparse_step(c, fields)


def _deepseek(c: _Config, mtp: bool) -> Fields:
    """DeepSeek-V2/V3: MLA attention, shared experts, leading dense layers, optional MTP modules."""
    fields = {**_common(c), **_routed(c, "n_routed_experts", "moe_intermediate_size", False)}
    fields.pop("head_dim", None)
    first = c.int("first_k_dense_replace", default=0, minimum=0)
    freq = c.int("moe_layer_freq", default=1)
    if first % freq:
        # HF: MoE iff i >= first_k_dense_replace and i % moe_layer_freq == 0; ModelConfig counts from `first`.
        raise c.error(
            "moe_layer_freq",
            f"moe_layer_freq {freq} with first_k_dense_replace {first} places MoE layers at i % {freq} == 0, "
            "which moesim can represent only when first_k_dense_replace is a multiple of moe_layer_freq",
        )
    shared = c.int("n_shared_experts", default=0, minimum=0)
    fields.update(
        attention="mla",
        q_lora_rank=c.opt_int("q_lora_rank"),
        kv_lora_rank=c.int("kv_lora_rank"),
        qk_nope_head_dim=c.int("qk_nope_head_dim", minimum=0),
        qk_rope_head_dim=c.int("qk_rope_head_dim", minimum=0),
        v_head_dim=c.int("v_head_dim"),
        attention_bias=c.bool("attention_bias", False),
        ffn_hidden_size=c.int("intermediate_size"),
        first_dense_layers=first,
        moe_layer_freq=freq,
        num_shared_experts=shared,
        score_function=c.choice("scoring_func", "softmax", ("softmax", "sigmoid")),
        router_bias=c.choice("topk_method", "greedy", ("greedy", "group_limited_greedy", "noaux_tc"))
        == "noaux_tc",
        mtp_layers=c.int("num_nextn_predict_layers", default=0, minimum=0) if mtp else 0,
    )
    if shared:
        fields["shared_expert_ffn_hidden_size"] = fields["moe_ffn_hidden_size"]
    return fields


def _window_pattern(c: _Config, layers: int) -> tuple[bool, int | None]:
    """HF ``layer_types`` -> (any windowed layer, ``sliding_window_pattern``). Absent or null: GPT-OSS's
    default, ``sliding_attention`` where ``(i + 1) % 2`` else ``full_attention``."""
    types = c.data.get("layer_types")
    if types is None:
        return True, 2
    allowed = ("sliding_attention", "full_attention")
    if not isinstance(types, list) or not all(t in allowed for t in types):
        raise c.error("layer_types", f"must be a list of {' / '.join(allowed)}, got {types!r}")
    if len(types) != layers:
        raise c.error("layer_types", f"has {len(types)} entries for num_hidden_layers {layers}")
    if "sliding_attention" not in types:
        return False, None
    if "full_attention" not in types:
        return True, None
    pattern = types.index("full_attention") + 1
    expected = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if pattern < 2 or types != expected:
        raise c.error(
            "layer_types",
            "only a repeating run of n-1 sliding_attention layers then one full_attention layer is "
            f"supported (sliding_window_pattern n), got {types}",
        )
    return True, pattern


def _gpt_oss(c: _Config) -> Fields:
    """GPT-OSS: GQA with q/k/v/o biases and per-head sinks, windowed and full layers alternating, every
    layer MoE with biased experts and router (softmax over the top-k logits), clamped SwiGLU."""
    fields = {**_common(c), **_routed(c, "num_local_experts", "intermediate_size", True)}
    fields["norm_topk_prob"] = True  # GptOssTopKRouter: softmax over the k selected logits
    windowed, pattern = _window_pattern(c, fields["num_layers"])
    if "sliding_window" in c.data and c.data["sliding_window"] is None:
        windowed = False  # GptOssAttention: sliding_window None leaves every layer full
    bias = c.bool("attention_bias", True)
    fields.update(
        attention_bias=bias,
        attention_out_bias=bias,
        attention_sinks=True,
        sliding_window=c.int("sliding_window", default=128) if windowed else None,
        sliding_window_pattern=pattern if windowed else None,
        linear_bias=True,  # GptOssExperts: gate_up_proj_bias, down_proj_bias
        router_logit_bias=True,  # GptOssTopKRouter.bias
        swiglu_limit=c.number("swiglu_limit", 7.0),
    )
    return fields


#: HF NemotronH ``layers_block_type`` names -> Megatron-Core hybrid symbols
_BLOCK_SYMBOL = {"mamba": "M", "attention": "*", "mlp": "-", "moe": "E"}


def _nemotron_h(c: _Config) -> Fields:
    """Nemotron-H / Nemotron-3 (``NemotronHForCausalLM``): a hybrid pattern of Mamba-2, GQA attention,
    squared-ReLU MLP and MoE blocks (``hybrid_override_pattern``, or ``layers_block_type`` in later
    configs); MoE with sigmoid routing, a selection bias and one shared expert (HF ``NemotronHMOE``), in
    Nemotron 3 Super / Ultra through a latent width (``moe_latent_size``) and with attention + MoE MTP modules."""
    fields = _common(c)
    fields["ffn_type"] = "plain"  # relu2: up_proj and down_proj, no gate
    if c.data.get("mlp_hidden_act", "relu2") != "relu2":
        raise c.error("mlp_hidden_act", f"only relu2 is modelled, got {c.data.get('mlp_hidden_act')!r}")
    blocks = c.data.get("layers_block_type")
    if blocks is not None:
        if not isinstance(blocks, list) or not all(b in _BLOCK_SYMBOL for b in blocks):
            raise c.error("layers_block_type", f"must be a list of {' / '.join(_BLOCK_SYMBOL)}, got {blocks!r}")
        pattern = "".join(_BLOCK_SYMBOL[b] for b in blocks)
    else:
        pattern = c.data.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern:
            raise c.error("hybrid_override_pattern", "required (or layers_block_type): the hybrid layer pattern")
    fields["num_layers"] = len(pattern)
    mtp = c.int("num_nextn_predict_layers", default=0, minimum=0)
    if mtp:  # Nemotron 3 Super / Ultra / 3.5: each MTP module one attention and one MoE block
        blocks = c.data.get("mtp_layers_block_type")
        mtp_pattern = "".join(_BLOCK_SYMBOL.get(b, "?") for b in blocks) if isinstance(blocks, list) else \
            c.data.get("mtp_hybrid_override_pattern")
        if mtp_pattern != "*E":
            raise c.error("mtp_hybrid_override_pattern", f"only an attention + MoE MTP module (*E) is modelled, got {mtp_pattern!r}")
        fields["mtp_layers"] = mtp
    if c.data.get("moe_latent_size") is not None:
        fields["moe_latent_size"] = c.int("moe_latent_size")
    fields.update(
        hybrid_pattern=pattern,
        attention_bias=c.bool("attention_bias", False),
        linear_bias=c.bool("mlp_bias", False),
        mamba_num_heads=c.int("mamba_num_heads"),
        mamba_head_dim=c.int("mamba_head_dim"),
        mamba_state_dim=c.int("ssm_state_size"),
        mamba_groups=c.int("n_groups"),
        mamba_conv_kernel=c.int("conv_kernel", default=4),
        mamba_chunk_size=c.int("chunk_size", default=128),
    )
    if "-" in pattern:
        fields["ffn_hidden_size"] = c.int("intermediate_size")
    if "E" in pattern:
        fields.update(_routed(c, "n_routed_experts", "moe_intermediate_size", True))
        shared = c.int("n_shared_experts", default=0, minimum=0)
        fields.update(score_function="sigmoid", router_bias=True, num_shared_experts=shared)
        if shared:
            fields["shared_expert_ffn_hidden_size"] = c.int("moe_shared_expert_intermediate_size")
    return fields


#: model_type -> mapper. Dense llama/mistral/qwen2 give ``num_experts = 1`` (upcycling sources).
MAPPERS: dict[str, Callable[[_Config], Fields]] = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen3_moe": _qwen3_moe,
    "deepseek_v2": lambda c: _deepseek(c, mtp=False),
    "deepseek_v3": lambda c: _deepseek(c, mtp=True),
    "kimi_k2": lambda c: _deepseek(c, mtp=True),  # Moonshot's Kimi K2: DeepseekV3ForCausalLM (its README)
    "olmoe": _olmoe,
    "granitemoe": _granitemoe,
    "gpt_oss": _gpt_oss,
    "nemotron_h": _nemotron_h,
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(MAPPERS))


def load_hf_json(path: str | Path) -> dict[str, Any]:
    """Parse a config.json: a missing, empty, binary or malformed file is an :class:`InputError`."""
    text = read_text(path, "HF config")
    if not text.strip():
        raise InputError("HF config is empty", file=str(path))
    data = parse_json(text, path)
    if not isinstance(data, dict):
        raise InputError(
            f"expected a JSON object at the top level, got {type(data).__name__}", file=str(path)
        )
    return data


def model_fields_from_hf(path: Path) -> dict[str, Any]:
    """The ``ModelConfig`` fields described by the HuggingFace ``config.json`` at ``path``."""
    data = load_hf_json(path)
    c = _Config(data, str(path))
    model_type = data.get("model_type")
    if model_type is None:
        raise c.error(
            "model_type",
            f"required key 'model_type' is missing; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
        )
    if model_type not in MAPPERS:
        raise c.error(
            "model_type",
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}",
        )
    fields = MAPPERS[model_type](c)
    name = data.get("_name_or_path")
    fields["name"] = name if isinstance(name, str) and name else Path(path).resolve().parent.name
    return fields


__all__ = ["MAPPERS", "SUPPORTED_MODEL_TYPES", "load_hf_json", "model_fields_from_hf"]
