"""The scenario schema (pydantic v2) shared by the simulator and the DeepSpeed harness.

A scenario is one YAML file with the sections ``cluster``, ``model``, ``parallelism``, ``training``,
``routing``, ``collectives``, ``calibration`` and ``faults``. Unknown keys, wrong types and
impossible layouts are :class:`~sim.errors.InputError` (exit 2) naming the file and field.
Layout follows DeepSpeed: world = dp (data parallel); expert parallel groups of ``ep`` contiguous
ranks are carved out of it, and expert gradients are reduced over ``edp = dp / ep`` strided ranks.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from sim.errors import InputError, did_you_mean
from sim.topology import Topology, load_topology
from sim.yamlio import _sub_model, field_error, load_yaml_mapping, validate_model

_STRICT = ConfigDict(extra="forbid", validate_assignment=False)

POLICIES = ("topk", "node_limited", "device_limited")
_POLICY_RE = re.compile(r"^(topk|node_limited|device_limited)(?::M=(\d+))?$")


def parse_policy(text: str) -> tuple[str, int | None]:
    """``'node_limited:M=4'`` -> ``('node_limited', 4)``; ``'topk'`` -> ``('topk', None)``."""
    m = _POLICY_RE.match(text.strip())
    if not m:
        raise ValueError(
            f"policy '{text}' not understood; use topk, node_limited:M=<groups> or device_limited:M=<groups>"
        )
    return m.group(1), (int(m.group(2)) if m.group(2) else None)


class ClusterConfig(BaseModel):
    """Which hardware and how much of it."""

    model_config = _STRICT
    topology: str = Field(description="shipped topology name (dgx-h100, ...) or path to a topology YAML")
    nodes: int = Field(ge=1, le=1_000_000, description="number of nodes")
    gpus_per_node: int | None = Field(default=None, ge=1, description="override the topology's GPUs per node")


class ModelConfig(BaseModel):
    """Model shape. Either inline fields, or ``hf_config`` (a HuggingFace config.json) plus overrides."""

    model_config = _STRICT
    name: str = "custom"
    hf_config: str | None = Field(default=None, description="path to a HuggingFace config.json")
    num_layers: int = Field(ge=1, le=100_000)
    hidden_size: int = Field(ge=1, le=1_000_000)
    num_attention_heads: int = Field(default=1, ge=1)
    num_kv_heads: int | None = Field(default=None, ge=1, description="GQA key/value heads (default = heads)")
    head_dim: int | None = Field(default=None, ge=1, description="default hidden_size / heads")
    attention: Literal["mha", "mla", "none"] = Field(default="mha", description="mha covers GQA/MQA")
    q_lora_rank: int | None = Field(default=None, ge=1, description="MLA query low-rank (None: full-rank q)")
    kv_lora_rank: int | None = Field(default=None, ge=1, description="MLA compressed KV rank")
    qk_nope_head_dim: int | None = Field(default=None, ge=0)
    qk_rope_head_dim: int | None = Field(default=None, ge=0)
    v_head_dim: int | None = Field(default=None, ge=1)
    attention_bias: bool = Field(default=False, description="biases on q/k/v projections (Qwen2)")
    vocab_size: int = Field(default=32000, ge=1)
    tie_word_embeddings: bool = False
    norm_type: Literal["rmsnorm", "layernorm"] = "rmsnorm"
    ffn_type: Literal["gated", "plain", "linear"] = Field(
        default="gated", description="gated: SwiGLU, 3 matrices; plain: 2 matrices; linear: 1 d x d matrix"
    )
    linear_bias: bool = Field(default=False, description="biases on FFN/expert linear layers")
    ffn_hidden_size: int | None = Field(default=None, ge=1, description="dense layers' FFN width")
    moe_ffn_hidden_size: int | None = Field(default=None, ge=1, description="one routed expert's FFN width")
    num_experts: int = Field(default=1, ge=1, le=1_000_000, description="routed experts per MoE layer")
    top_k: int = Field(default=1, ge=1, description="experts per token")
    num_shared_experts: int = Field(default=0, ge=0)
    shared_expert_ffn_hidden_size: int | None = Field(
        default=None, ge=1, description="one shared expert's width"
    )
    shared_expert_gate: bool = Field(default=False, description="Qwen2-MoE sigmoid gate on the shared expert")
    first_dense_layers: int = Field(default=0, ge=0, description="leading layers with a dense FFN")
    moe_layer_freq: int = Field(default=1, ge=1, description="every n-th layer (after the dense ones) is MoE")
    mtp_layers: int = Field(default=0, ge=0, description="multi-token-prediction modules (DeepSeek-V3)")
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = Field(default=True, description="renormalise the top-k weights to sum to 1")
    router_bias: bool = Field(default=False, description="per-expert selection bias (DeepSeek-V3)")

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
        if has_dense and self.ffn_hidden_size is None and self.ffn_type != "linear":
            raise field_error(
                "ffn_hidden_size", "ffn_hidden_size is required: the model has dense FFN layers"
            )
        if self.first_dense_layers > self.num_layers:
            raise field_error(
                "first_dense_layers",
                f"first_dense_layers ({self.first_dense_layers}) exceeds num_layers ({self.num_layers})",
            )
        return self

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1 or self.num_shared_experts > 0

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) has an MoE FFN (HF's first_k_dense_replace + moe_layer_freq)."""
        if self.num_experts <= 1:
            return False
        return (
            layer >= self.first_dense_layers and (layer - self.first_dense_layers) % self.moe_layer_freq == 0
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))


class ParallelismConfig(BaseModel):
    """DeepSpeed-style data + expert parallelism with ZeRO."""

    model_config = _STRICT
    dp: int | None = Field(
        default=None, ge=1, description="data-parallel size; derived (= world size) when omitted"
    )
    ep: int = Field(default=1, ge=1, description="expert-parallel group size (contiguous ranks)")
    zero_stage: Literal[0, 1, 2, 3] = 2


class AuxFreeBalancing(BaseModel):
    """DeepSeek-V3 aux-loss-free balancing: per-expert selection bias moved by +-gamma per step."""

    model_config = _STRICT
    enabled: bool = False
    gamma: float = Field(default=0.001, gt=0, description="bias update speed per step")
    steps: int = Field(
        default=0, ge=0, description="simulated warm-up steps of bias updates before the measured step"
    )


class TrainingConfig(BaseModel):
    """Batch, precision and optimizer."""

    model_config = _STRICT
    micro_batch_size: int = Field(ge=1, le=1_000_000, description="sequences per rank per micro-step")
    seq_len: int = Field(ge=1, le=10_000_000, description="tokens per sequence")
    grad_accum_steps: int = Field(default=1, ge=1, description="micro-steps per optimizer step")
    global_batch_size: int | None = Field(
        default=None, ge=1, description="sequences per step; checked = micro x accum x dp when given"
    )
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    optimizer: Literal["adam", "sgd"] = "adam"
    offload_optimizer: Literal["none", "cpu"] = "none"
    activation_checkpointing: bool = False
    steps: int = Field(default=10, ge=1, description="steps a real run takes (hw_validate)")
    warmup_steps: int = Field(default=2, ge=0, description="steps excluded from measurement (hw_validate)")
    lr: float = Field(default=1e-3, gt=0)


class RoutingConfig(BaseModel):
    """Router decisions: gate-score generator, policy, capacity and dispatch."""

    model_config = _STRICT
    policy: str = Field(
        default="topk", description="topk | node_limited | device_limited (or 'node_limited:M=4')"
    )
    max_groups: int | None = Field(
        default=None, ge=1, description="M: groups (nodes/devices) a token may use"
    )
    generator: Literal["uniform", "skewed", "trace"] = "uniform"
    skew: float = Field(default=0.0, ge=0, le=100, description="expert-popularity skew; 0 = uniform")
    drift: float = Field(default=0.0, ge=0, le=1, description="popularity change from layer to layer (0..1)")
    sequence_correlation: float = Field(
        default=0.0, ge=0, le=1, description="tokens of a sequence share a preference"
    )
    trace: str | None = Field(default=None, description="router trace file for generator: trace")
    capacity_factor: float | None = Field(
        default=1.0, gt=0, description="null = no capacity limit (no drops)"
    )
    min_capacity: int = Field(default=4, ge=0)
    drop_policy: Literal["probs", "position"] = "probs"
    dispatch: Literal["capacity_padded", "dropless"] = "capacity_padded"
    route_scale: float = Field(default=1.0, gt=0, description="scale on routing weights (DeepSeek-V3: 2.5)")
    seed: int = Field(default=0, ge=0)
    aux_free_balancing: AuxFreeBalancing = AuxFreeBalancing()

    @model_validator(mode="after")
    def _policy(self) -> RoutingConfig:
        try:
            name, m = parse_policy(self.policy)
        except ValueError as exc:
            raise field_error("policy", str(exc)) from None
        if m is not None:
            if self.max_groups is not None and self.max_groups != m:
                raise field_error("max_groups", f"policy says M={m} but max_groups is {self.max_groups}")
            self.max_groups = m
        self.policy = name
        if name != "topk" and self.max_groups is None:
            raise field_error("max_groups", f"policy {name} needs max_groups (M), e.g. policy: {name}:M=2")
        if self.generator == "trace" and not self.trace:
            raise field_error("trace", "generator: trace needs routing.trace (path to a router trace file)")
        return self

    @property
    def policy_string(self) -> str:
        return self.policy if self.policy == "topk" else f"{self.policy}:M={self.max_groups}"


class CollectivesConfig(BaseModel):
    """Collective algorithms and gradient bucketing."""

    model_config = _STRICT
    all_to_all: Literal["direct", "hierarchical"] = "direct"
    all_reduce: Literal["ring", "tree"] = "ring"
    reduce_bucket_elements: int = Field(default=500_000_000, ge=1, description="DeepSpeed reduce_bucket_size")
    overlap_comm: bool = Field(default=True, description="overlap gradient reduction with backward")


class FaultsConfig(BaseModel):
    """Reserved for simulated faults (degraded/failed links, stragglers)."""

    model_config = _STRICT


class Scenario(BaseModel):
    """One scenario file, validated and bound to its topology."""

    model_config = _STRICT
    name: str = "scenario"
    description: str = ""
    cluster: ClusterConfig
    model: ModelConfig
    parallelism: ParallelismConfig = ParallelismConfig()
    training: TrainingConfig
    routing: RoutingConfig = RoutingConfig()
    collectives: CollectivesConfig = CollectivesConfig()
    calibration: str | None = Field(
        default=None, description="calibration JSON written by `moesim calibrate`"
    )
    faults: FaultsConfig = FaultsConfig()

    _topology: Topology | None = PrivateAttr(default=None)
    _source: str | None = PrivateAttr(default=None)
    _base_dir: Path = PrivateAttr(default_factory=Path.cwd)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("name must not be empty")
        return v

    # ---- derived layout -------------------------------------------------------------------
    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise RuntimeError("scenario is not bound to a topology; use load_scenario()")
        return self._topology

    @property
    def source(self) -> str | None:
        return self._source

    @property
    def gpus_per_node(self) -> int:
        return self.cluster.gpus_per_node or self.topology.node.gpus_per_node

    @property
    def world_size(self) -> int:
        return self.cluster.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.parallelism.dp or self.world_size

    @property
    def ep(self) -> int:
        return self.parallelism.ep

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert (DeepSpeed's expert_data_parallel group)."""
        return self.dp // self.ep

    @property
    def experts_per_rank(self) -> int:
        return self.model.num_experts // self.ep

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens one rank routes per micro-step (DeepSpeed gating sees S = micro x seq)."""
        return self.training.micro_batch_size * self.training.seq_len

    @property
    def global_batch_size(self) -> int:
        return self.training.micro_batch_size * self.training.grad_accum_steps * self.dp

    def node_of_rank(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def ep_group_of(self, rank: int) -> list[int]:
        """DeepSpeed's EP group containing ``rank``: ``ep`` contiguous ranks."""
        start = (rank // self.ep) * self.ep
        return list(range(start, start + self.ep))

    def ep_groups(self) -> list[list[int]]:
        return [list(range(s, s + self.ep)) for s in range(0, self.world_size, self.ep)]

    def edp_groups(self) -> list[list[int]]:
        """DeepSpeed's expert-data-parallel groups: ranks with the same index in every EP group (strided)."""
        return [list(range(i, self.world_size, self.ep)) for i in range(self.ep)]

    def resolve_path(self, p: str) -> Path:
        """A path from the scenario, relative to the scenario file's folder."""
        path = Path(p)
        return path if path.is_absolute() else self._base_dir / path

    def check_layout(self) -> None:
        """Cross-field checks that need the topology; raises :class:`InputError` naming the field."""
        world = self.world_size
        if self.parallelism.dp is not None and self.parallelism.dp != world:
            raise InputError(
                f"dp ({self.parallelism.dp}) x tp (1) x pp (1) must equal the world size "
                f"{world} = {self.cluster.nodes} nodes x {self.gpus_per_node} GPUs; omit dp to derive it",
                field="parallelism.dp",
            )
        ep, experts = self.ep, self.model.num_experts
        if experts % ep:
            raise InputError(
                f"ep ({ep}) must divide model.num_experts ({experts}); "
                f"choose ep in {_divisors(experts, world)}",
                field="parallelism.ep",
            )
        if world % ep:
            raise InputError(
                f"ep ({ep}) must divide the world size ({world}); choose ep in {_divisors(experts, world)}",
                field="parallelism.ep",
            )
        r = self.routing
        if r.policy != "topk":
            per_group = self._experts_per_group()
            groups = experts // per_group
            m = r.max_groups or 0
            if m > groups:
                raise InputError(
                    f"M={m} exceeds the {groups} {self._group_word()} the experts of one EP group span",
                    field="routing.max_groups",
                )
            if m * per_group < self.model.top_k:
                raise InputError(
                    f"M={m} {self._group_word()} hold {m * per_group} experts, fewer than top_k "
                    f"({self.model.top_k}); raise M to at least {math.ceil(self.model.top_k / per_group)}",
                    field="routing.max_groups",
                )
        if (
            self.training.global_batch_size is not None
            and self.training.global_batch_size != self.global_batch_size
        ):
            t = self.training
            raise InputError(
                f"global_batch_size ({t.global_batch_size}) must equal micro_batch_size ({t.micro_batch_size}) x "
                f"grad_accum_steps ({t.grad_accum_steps}) x dp ({self.dp}) = {self.global_batch_size}",
                field="training.global_batch_size",
            )
        if self.model.first_dense_layers == self.model.num_layers and self.model.num_experts > 1:
            raise InputError(
                "every layer is dense: first_dense_layers == num_layers", field="model.first_dense_layers"
            )

    def _group_word(self) -> str:
        return "nodes" if self.routing.policy == "node_limited" else "devices"

    def _experts_per_group(self) -> int:
        """Experts in one routing group: one EP rank's experts (device-limited) or one node's (node-limited)."""
        if self.routing.policy == "device_limited":
            return self.experts_per_rank
        ranks_per_node_in_group = min(self.ep, self.gpus_per_node)
        return self.experts_per_rank * ranks_per_node_in_group


def _divisors(experts: int, world: int) -> list[int]:
    return [d for d in range(1, min(experts, world) + 1) if experts % d == 0 and world % d == 0]


# ---- overrides -----------------------------------------------------------------------------------
def parse_override(text: str) -> tuple[str, Any]:
    """``'model.num_experts=64'`` -> ``('model.num_experts', 64)``; the value is parsed as YAML."""
    if "=" not in text:
        raise InputError(f"override '{text}' must look like path=value, e.g. cluster.nodes=32", field="--set")
    path, raw = text.split("=", 1)
    path = path.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_override(data: dict[str, Any], path: str, value: Any) -> None:
    """Set ``data[a][b]... = value`` for ``path = 'a.b...'``; the path must exist in the schema."""
    parts = path.split(".")
    cls: type[BaseModel] | None = Scenario
    node = data
    for i, part in enumerate(parts):
        assert cls is not None
        if part not in cls.model_fields:
            prefix = ".".join(parts[:i])
            allowed = sorted(cls.model_fields)
            raise InputError(
                f"unknown override path '{path}'{did_you_mean(part, allowed)}; "
                f"keys under {prefix or 'the top level'}: {', '.join(allowed)}",
                field="--set",
            )
        if i == len(parts) - 1:
            node[part] = value
            return
        sub = _sub_model(cls.model_fields[part].annotation)
        if sub is None:
            raise InputError(
                f"'{'.'.join(parts[: i + 1])}' is a value, not a section, in '{path}'", field="--set"
            )
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node, cls = nxt, sub


# ---- loading -------------------------------------------------------------------------------------
def load_scenario(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read, override, resolve the HF config, validate and bind the topology of a scenario file."""
    path = Path(path)
    data = load_yaml_mapping(path, "scenario file")
    for text in overrides:
        key, value = parse_override(text)
        apply_override(data, key, value)
    return scenario_from_dict(data, source=str(path), base_dir=path.resolve().parent)


def scenario_from_dict(
    data: dict[str, Any], source: str | None = None, base_dir: Path | None = None
) -> Scenario:
    """Validate a scenario mapping (as read from YAML) and bind its topology."""
    base_dir = base_dir or Path.cwd()
    data = dict(data)
    model = data.get("model")
    if isinstance(model, dict) and model.get("hf_config"):
        from sim.hfconfig import model_fields_from_hf

        hf_path = Path(model["hf_config"])
        if not hf_path.is_absolute():
            hf_path = base_dir / hf_path
        fields = model_fields_from_hf(hf_path)
        data["model"] = {**fields, **model}
    scenario = validate_model(Scenario, data, source)
    scenario._source = source
    scenario._base_dir = base_dir
    try:
        scenario._topology = load_topology(scenario.cluster.topology, base_dir)
        scenario.check_layout()
    except InputError as exc:
        raise (exc.with_file(source) if source else exc) from None
    return scenario


__all__ = [
    "POLICIES",
    "ClusterConfig",
    "CollectivesConfig",
    "ModelConfig",
    "ParallelismConfig",
    "RoutingConfig",
    "Scenario",
    "TrainingConfig",
    "apply_override",
    "load_scenario",
    "parse_override",
    "parse_policy",
    "scenario_from_dict",
]
