"""Section models of the scenario schema: ``cluster``, ``model``, ``parallelism``, ``training``,
``routing`` and ``collectives`` (``faults`` lives in :mod:`sim.inputs.faults`).

Every model is strict (unknown keys are errors); cross-field checks inside one section raise
:func:`~sim.inputs.yamlio.field_error` so the message names ``section.field``. Checks that need the
topology or more than one section live on :class:`sim.inputs.scenario.Scenario`.
"""

from __future__ import annotations

import re
from typing import Any, Literal, get_args

from pydantic import ConfigDict, Field, field_validator, model_validator

from sim.inputs.model_section import ModelConfig  # noqa: F401  (re-exported: the model section lives there)
from sim.inputs.precision_section import GemmPrecision
from sim.inputs.stages import parse_layout
from sim.inputs.yamlio import StrictModel, field_error

_STRICT = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)

POLICIES = ("topk", "node_limited", "device_limited")
#: Megatron-Core's ``recompute_modules`` (transformer_config.py) this simulator prices; ``selective``
#: without a list recomputes the first two (this schema's meaning of selective since it existed).
RecomputeModule = Literal["layernorm", "moe_act", "core_attn", "mla_up_proj", "mlp", "moe", "shared_experts"]
RECOMPUTE_MODULES: tuple[str, ...] = get_args(RecomputeModule)
SELECTIVE_DEFAULT = ("layernorm", "moe_act")
#: Collective kinds (nccl-tests names); calibration files key their bytes factors by them.
Kind = Literal["all_to_all", "all_reduce", "reduce_scatter", "all_gather"]
KINDS: tuple[str, ...] = ("all_to_all", "all_reduce", "reduce_scatter", "all_gather")
_POLICY_RE = re.compile(r"^(topk|node_limited|device_limited)(?::M=(\d+))?$")


def parse_policy(text: str) -> tuple[str, int | None]:
    """``'node_limited:M=4'`` -> ``('node_limited', 4)``; ``'topk'`` -> ``('topk', None)``."""
    m = _POLICY_RE.match(text.strip())
    if not m:
        raise ValueError(
            f"policy '{text}' not understood; use topk, node_limited:M=<groups> or device_limited:M=<groups>"
        )
    return m.group(1), (int(m.group(2)) if m.group(2) else None)


class ClusterConfig(StrictModel):
    """Which hardware and how much of it."""

    model_config = _STRICT
    topology: str = Field(description="shipped topology name (dgx-h100, ...) or path to a topology YAML")
    nodes: int = Field(ge=1, le=1_000_000, description="number of nodes")
    gpus_per_node: int | None = Field(
        default=None, ge=1, le=1024, description="override the topology's GPUs per node"
    )
    nvlink_domain_nodes: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="nodes the job places in each NVLink domain, at most the topology's (GB200 NVL72: 18 "
        "trays of 4; jobs placed 16 trays a rack, Slurm --segment 16, have 64-GPU domains)",
    )


class ParallelismConfig(StrictModel):
    """Megatron-Core's 5-D layout (world = tp x cp x pp x dp; the expert layers fold etp x ep x edp
    over the tp x cp x dp ranks of a stage) and the data-parallel sharding (ZeRO stage)."""

    model_config = _STRICT
    tp: int = Field(default=1, ge=1, le=1_000_000, description="tensor-parallel size (attention and dense GEMMs)")
    cp: int = Field(default=1, ge=1, le=1_000_000, description="context-parallel size (sequence split, ring attention)")
    pp: int = Field(default=1, ge=1, le=1_000_000, description="pipeline-parallel stages")
    vpp: int = Field(default=1, ge=1, le=1_000, description="virtual pipeline chunks per stage (interleaved 1F1B)")
    dp: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000_000,
        description="data-parallel size; derived (= world / (tp cp pp)) when omitted",
    )
    ep: int = Field(
        default=1, ge=1, le=1_000_000_000, description="expert-parallel group size (contiguous ranks of a stage)"
    )
    etp: int = Field(default=1, ge=1, le=1_000_000, description="expert tensor-parallel size (expert GEMMs split)")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        default=2, description="DeepSpeed ZeRO stage; megatron shards the optimizer (1), fsdp2 everything (3)"
    )
    pp_schedule: Literal["1f1b", "interleaved", "dualpipe"] | None = Field(
        default=None, description="pipeline schedule; default interleaved when vpp > 1, else 1f1b"
    )
    sequence_parallel: bool | None = Field(
        default=None, description="Megatron sequence parallelism with tp > 1 (default: on when tp > 1)"
    )
    first_stage_layers: int | None = Field(
        default=None, ge=0, le=100_000, description="layers on the first pipeline stage (num_layers_in_first_pipeline_stage)"
    )
    last_stage_layers: int | None = Field(
        default=None, ge=0, le=100_000, description="layers on the last pipeline stage (num_layers_in_last_pipeline_stage)"
    )
    embedding_as_layer: bool = Field(
        default=False, description="count the embedding as a layer when splitting stages (account_for_embedding_in_pipeline_split)"
    )
    loss_as_layer: bool = Field(
        default=False, description="count the LM head and loss as a layer when splitting stages (account_for_loss_in_pipeline_split)"
    )
    pipeline_layout: str | None = Field(
        default=None,
        min_length=1,
        max_length=10_000,
        description="Megatron-Core's custom layout (--pipeline-model-parallel-layout), e.g. 'Et*4|(t*4|)*14tmL': the "
        "pp x vpp virtual stages, '|'-separated, of E (embedding), t (decoder layer), m (MTP layer), L (loss)",
    )

    @property
    def schedule(self) -> str:
        """The pipeline schedule in effect."""
        return self.pp_schedule or ("interleaved" if self.vpp > 1 else "1f1b")

    @model_validator(mode="after")
    def _check(self) -> ParallelismConfig:
        if self.vpp > 1 and self.pp == 1:
            raise field_error("vpp", f"vpp ({self.vpp}) needs pipeline stages: pp > 1")
        if self.pp_schedule == "interleaved" and self.vpp == 1:
            raise field_error("pp_schedule", "interleaved needs vpp > 1 virtual chunks per stage")
        if self.pp_schedule == "dualpipe" and (self.pp < 2 or self.pp % 2):
            raise field_error("pp_schedule", f"dualpipe needs an even pp >= 2 (two stages per rank), got pp {self.pp}")
        if self.pp_schedule == "dualpipe" and self.vpp > 1:
            raise field_error("pp_schedule", f"dualpipe runs its own two chunks per rank: vpp must be 1, got {self.vpp}")
        if self.sequence_parallel and self.tp == 1:
            raise field_error("sequence_parallel", "sequence_parallel needs tp > 1")
        return self

    @model_validator(mode="after")
    def _check_pipeline_layout(self) -> ParallelismConfig:
        """The layout's syntax and stage count here; its layers against the model in :mod:`sim.inputs.stages`."""
        if self.pipeline_layout is None:
            return self
        for name in ("first_stage_layers", "last_stage_layers", "embedding_as_layer", "loss_as_layer"):
            if getattr(self, name) is not None and getattr(self, name) is not False:  # 0 layers is set
                raise field_error(name, f"pipeline_layout places every layer itself: it cannot be set with {name} "
                                  "(Megatron-Core refuses the two together); leave one out")  # fmt: skip
        if self.pp_schedule == "dualpipe":
            raise field_error("pipeline_layout", "dualpipe splits the model into its own pp stages: a pipeline_layout "
                              "needs pp_schedule 1f1b or interleaved")  # fmt: skip
        try:
            n = len(parse_layout(self.pipeline_layout))
        except ValueError as exc:
            raise field_error("pipeline_layout", str(exc)) from None
        if n % self.pp or n // self.pp != self.vpp:
            fix = f"set vpp: {n // self.pp}" if n % self.pp == 0 else "the stages must be a multiple of pp"
            raise field_error("pipeline_layout", f"{n} virtual stages ('|'-separated) where pp x vpp = {self.pp} x "
                              f"{self.vpp} = {self.pp * self.vpp}: {fix} (Megatron-Core derives vpp from the layout; "
                              "a scenario states it, as the schedule depends on it)")  # fmt: skip
        return self


class AuxFreeBalancing(StrictModel):
    """DeepSeek-V3 aux-loss-free balancing: per-expert selection bias moved by +-gamma per step."""

    model_config = _STRICT
    enabled: bool = False
    gamma: float = Field(default=0.001, gt=0, le=1000, description="bias update speed per step")
    steps: int = Field(
        default=0,
        ge=0,
        le=1_000_000,
        description="simulated warm-up steps of bias updates before the measured step",
    )


class TrainingConfig(StrictModel):
    """Batch, precision and optimizer."""

    model_config = _STRICT
    micro_batch_size: int = Field(ge=1, le=1_000_000, description="sequences per rank per micro-step")
    seq_len: int = Field(ge=1, le=10_000_000, description="tokens per sequence")
    grad_accum_steps: int = Field(default=1, ge=1, le=1_000_000, description="micro-steps per optimizer step")
    global_batch_size: int | None = Field(default=None, ge=1, le=10**15,
                                          description="sequences per step; checked = micro x accum x dp when given")  # fmt: skip
    dtype: Literal["bf16", "fp16", "fp32", "fp8", "mxfp8", "nvfp4"] = Field(
        default="bf16",
        description="GEMM precision; fp8 (per-tensor/blockwise), mxfp8 and nvfp4 (TE's NVFP4BlockScaling, megatron "
        "only) keep bf16 weights, activations and gradients and fp32 master weights and optimizer states",
    )
    fp8_recipe: Literal["delayed", "current", "blockwise"] = Field(
        default="delayed",
        description="with dtype fp8, TransformerEngine's scaling recipe: delayed (amax history, TE's default), "
        "current (per-tensor current scaling: an extra amax pass over each input), blockwise (1x128 / 128x128 "
        "blocks as DeepSeek-V3; on Blackwell it runs as MXFP8)",
    )
    gemm_precision: GemmPrecision = Field(default_factory=GemmPrecision, description="GEMMs in another precision "
                                          "(Megatron first_last_layers_bf16, --quant-recipe matchers): precision_section.py")
    framework: Literal["deepspeed", "megatron", "fsdp2"] = Field(
        default="deepspeed",
        description="what runs the step: DeepSpeed ZeRO, Megatron-Core (distributed optimizer) or FSDP2",
    )
    cross_entropy_fusion: bool = Field(
        default=True,
        description="the loss as one fused kernel over the logits (Megatron-Core --cross-entropy-loss-fusion, "
        "which Megatron-Bridge recipes set) or, false, Megatron-LM's default unfused vocab-parallel cross "
        "entropy: fp32 copy, max, subtract, exp, sum, divide, multiply (megatron only)",
    )
    cutedsl_fused_grouped_mlp: bool = Field(default=False, description="TE's CuTe DSL fused grouped MLP (Megatron-Bridge "
        "cutedsl_fused_grouped_mlp): the experts' GLU and its MXFP8 casts in the grouped GEMMs' epilogues (mxfp8)")  # fmt: skip
    fp8_attention: bool = Field(default=False, description="the attention core in FP8 / MXFP8 (Megatron's "
        "fp8_dot_product_attention, cuDNN): at the GPU's measured attention_shapes rates (dtype fp8 or mxfp8)")  # fmt: skip
    fp8_output_proj: bool = Field(default=False, description="the LM head in MXFP8 (Megatron's fp8_output_proj, a TE "
        "linear); without it the head is Megatron's own ColumnParallelLinear in BF16 under every precision")  # fmt: skip
    optimizer: Literal["adam", "sgd", "muon"] = Field(default="adam", description="adam, sgd, or muon (megatron: "
        "Megatron-Core's dist_muon, layer-wise over dp; Newton-Schulz on the weight matrices)")  # fmt: skip
    offload_optimizer: Literal["none", "cpu"] = "none"
    activation_checkpointing: Literal["full", "selective", "none"] = Field(
        default="none",
        description="recompute in backward: full (each layer's forward), selective (recompute_modules; by "
        "default norms and expert activations, Megatron's layernorm + moe_act) or none; true/false = full/none",
    )
    recompute_modules: list[RecomputeModule] | None = Field(
        default=None,
        description="Megatron-Core's selective recompute_modules: " + ", ".join(RECOMPUTE_MODULES) + "; "
        "setting it means activation_checkpointing: selective (default there: layernorm, moe_act)",
    )
    recompute_num_layers: int | None = Field(
        default=None, ge=1, le=1_000_000,
        description="with full checkpointing, recompute only the first N layers of each pipeline chunk "
        "(Megatron recompute_method=block, recompute_num_layers); unset: every layer",
    )
    reshard_after_forward: bool = Field(
        default=True, description="fsdp2: free gathered parameters after forward, gather again for backward"
    )
    grad_reduce_dtype: Literal["bf16", "fp32"] | None = Field(
        default=None, description="dtype of gradient reductions (default: the parameters' dtype)"
    )
    steps: int = Field(default=10, ge=1, le=10_000_000, description="steps a real run takes (hw_validate)")
    warmup_steps: int = Field(
        default=2, ge=0, le=10_000_000, description="steps excluded from measurement (hw_validate)"
    )
    lr: float = Field(default=1e-3, gt=0, le=1000)

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _recompute_bool(cls, v: Any) -> Any:
        return {True: "full", False: "none"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="before")
    @classmethod
    def _modules_mean_selective(cls, data: Any) -> Any:
        """``recompute_modules`` alone selects selective recompute; with full or none it is an error."""
        if isinstance(data, dict) and data.get("recompute_modules") is not None:
            ac = cls._recompute_bool(data.get("activation_checkpointing", "selective"))
            if ac != "selective":
                raise field_error(
                    "recompute_modules",
                    f"recompute_modules lists what selective recompute recomputes; activation_checkpointing is "
                    f"{ac!r} (leave it out or set it to selective)",
                )
            data = {**data, "activation_checkpointing": "selective"}
        return data

    @field_validator("recompute_modules")
    @classmethod
    def _modules_once(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(set(v)) != len(v):
            raise ValueError(f"recompute_modules lists a module twice: {v}")
        if v is not None and not v:
            raise ValueError("recompute_modules is empty: leave it out, or use activation_checkpointing: none")
        return v

    @model_validator(mode="after")
    def _recompute_layers_need_full(self) -> TrainingConfig:
        if self.recompute_num_layers is not None and self.activation_checkpointing != "full":
            raise field_error(
                "recompute_num_layers",
                "recompute_num_layers needs activation_checkpointing: full "
                f"(it is {self.activation_checkpointing!r})",
            )
        return self

    @model_validator(mode="after")
    def _unfused_loss_is_megatron(self) -> TrainingConfig:
        if not self.cross_entropy_fusion and self.framework != "megatron":
            raise field_error(
                "cross_entropy_fusion",
                f"cross_entropy_fusion: false prices Megatron-LM's unfused vocab-parallel loss; framework is "
                f"{self.framework!r} (use framework: megatron)",
            )
        return self

    @property
    def recompute(self) -> bool:
        """Whether backward recomputes anything (full or selective checkpointing)."""
        return self.activation_checkpointing != "none"

    @property
    def recompute_set(self) -> frozenset[str]:
        """The modules selective recompute recomputes (empty unless selective)."""
        if self.activation_checkpointing != "selective":
            return frozenset()
        return frozenset(self.recompute_modules or SELECTIVE_DEFAULT)


class RoutingConfig(StrictModel):
    """Router decisions: gate-score generator, policy, capacity and dispatch."""

    model_config = _STRICT
    policy: str = Field(
        default="topk", description="topk | node_limited | device_limited (or 'node_limited:M=4')"
    )
    max_groups: int | None = Field(
        default=None, ge=1, le=1_000_000_000, description="M: groups (nodes/devices) a token may use"
    )
    generator: Literal["uniform", "skewed", "trace", "balanced"] = Field(
        default="uniform",
        description="gate scores: uniform, skewed popularity, a recorded trace, or balanced (every expert "
        "gets exactly its share, as forced-balance benchmarks run)",
    )
    balanced_pattern: Literal["spread", "contiguous"] = Field(
        default="spread",
        description="generator balanced: spread (each token's k experts spread evenly over the experts, "
        "Megatron's force_load_balancing) or contiguous (token i -> experts k i .. k i + k - 1 modulo E, "
        "AutoModel's fake balanced gate)",
    )
    skew: float = Field(default=0.0, ge=0, le=100, description="expert-popularity skew; 0 = uniform")
    drift: float = Field(default=0.0, ge=0, le=1, description="popularity change from layer to layer (0..1)")
    sequence_correlation: float = Field(
        default=0.0, ge=0, le=1, description="tokens of a sequence share a preference"
    )
    trace: str | None = Field(default=None, description="router trace file for generator: trace")
    capacity_factor: float | None = Field(
        default=1.0, gt=0, le=1e6, description="null = no capacity limit (no drops)"
    )
    min_capacity: int = Field(default=4, ge=0, le=1_000_000_000)
    drop_policy: Literal["probs", "position"] = "probs"
    dispatch: Literal["capacity_padded", "dropless"] = "capacity_padded"
    route_scale: float = Field(
        default=1.0, gt=0, le=1e6, description="scale on routing weights (DeepSeek-V3: 2.5)"
    )
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
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


class CollectivesConfig(StrictModel):
    """Collective algorithms and gradient bucketing."""

    model_config = _STRICT
    all_to_all: Literal["direct", "hierarchical", "deepep", "hybridep"] = Field(
        default="direct",
        description="dispatcher: direct (NCCL all-to-all), hierarchical (NVLink forwarding), deepep or "
        "hybridep (RDMA to the same-index GPU of each node, NVLink forwarding, SMs taken from compute)",
    )
    a2a_overlap: bool = Field(
        default=False,
        description="hide one micro-batch's all-to-all behind another's compute (Megatron's "
        "overlap_moe_expert_parallel_comm, DeepSeek's DualPipe)",
    )
    dispatcher_sms: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="SMs the deepep/hybridep kernels occupy (default: the library's); they slow overlapped "
        "compute and cap DeepEP's bandwidth inside one NVLink domain",
    )
    tp_comm_overlap: bool = Field(default=False, description="overlap TP all-gather/reduce-scatter with GEMMs")
    all_reduce: Literal["ring", "tree"] = "ring"
    reduce_bucket_elements: int = Field(
        default=500_000_000, ge=1, le=10**13, description="DeepSpeed reduce_bucket_size"
    )
    overlap_comm: bool = Field(default=True, description="overlap gradient reduction with backward")


__all__ = [
    "POLICIES",
    "AuxFreeBalancing",
    "ClusterConfig",
    "CollectivesConfig",
    "ModelConfig",
    "ParallelismConfig",
    "RoutingConfig",
    "TrainingConfig",
    "parse_policy",
]
