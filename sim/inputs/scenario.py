"""The scenario schema (pydantic v2) shared by the simulator and the DeepSpeed harness.

A scenario is one YAML file with the sections ``cluster``, ``model``, ``parallelism``, ``training``,
``routing``, ``collectives``, ``calibration`` and ``faults``. Unknown keys, wrong types and
impossible layouts are :class:`~sim.errors.InputError` (exit 2) naming the file and field.
Layout follows Megatron-Core (:class:`~sim.inputs.layout.Layout`): world = tp x cp x pp x dp, tp
fastest; the expert layers fold etp x ep x edp over a stage's tp x cp x dp ranks. With tp = cp = pp
= 1 it is DeepSpeed's: expert parallel groups of ``ep`` contiguous ranks, expert gradients reduced
over ``edp = dp / ep`` strided ranks.

The section models live in :mod:`sim.inputs.sections` and :mod:`sim.inputs.faults`; this
module re-exports them, so ``from sim.inputs.scenario import ModelConfig`` keeps working.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import Field, PrivateAttr, field_validator

from sim.errors import InputError
from sim.inputs.faults import FaultsConfig
from sim.inputs.hybrid_checks import check_hybrid
from sim.inputs.layout import Layout
from sim.inputs.precision_checks import check_precision
from sim.inputs.sections import (
    _STRICT,
    POLICIES,
    AuxFreeBalancing,
    ClusterConfig,
    CollectivesConfig,
    ModelConfig,
    ParallelismConfig,
    RoutingConfig,
    TrainingConfig,
    parse_policy,
)
from sim.inputs.topology import Topology
from sim.inputs.yamlio import StrictModel


class Scenario(StrictModel):
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
        p = self.parallelism
        return p.dp or self.world_size // (p.tp * p.cp * p.pp)

    @property
    def ep(self) -> int:
        return self.parallelism.ep

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert within a stage (etp x ep x edp = tp x cp x dp)."""
        p = self.parallelism
        return p.tp * p.cp * self.dp // (self.ep * p.etp)

    @property
    def layout(self) -> Layout:
        p = self.parallelism
        return Layout(tp=p.tp, cp=p.cp, pp=p.pp, vpp=p.vpp, dp=self.dp, ep=p.ep, etp=p.etp)

    @property
    def sequence_parallel(self) -> bool:
        p = self.parallelism
        return p.tp > 1 if p.sequence_parallel is None else p.sequence_parallel

    @property
    def experts_per_rank(self) -> int:
        return self.model.num_experts // self.ep

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens one rank routes per micro-step (DeepSpeed gating sees S = micro x seq)."""
        return self.training.micro_batch_size * self.training.seq_len

    @property
    def routed_tokens_per_rank(self) -> int:
        """Tokens each rank routes per micro-batch: its sequence shard (``/ cp``), split again over the
        tensor-parallel group under sequence parallelism (Megatron's MoE layers see ``T / tp`` tokens)."""
        p = self.parallelism
        return self.tokens_per_micro_batch // (p.cp * (p.tp if self.sequence_parallel else 1))

    @property
    def global_batch_size(self) -> int:
        return self.training.micro_batch_size * self.training.grad_accum_steps * self.dp

    def node_of_rank(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def ep_group_of(self, rank: int) -> list[int]:
        """The EP group containing ``rank`` (``ep`` contiguous ranks when etp = 1)."""
        return self.layout.group_of("ep", rank)

    def ep_groups(self) -> list[list[int]]:
        """Every EP group of every stage."""
        if self.parallelism.etp == 1:
            return [list(range(s, s + self.ep)) for s in range(0, self.world_size, self.ep)]
        return self.layout.groups("ep")

    def edp_groups(self) -> list[list[int]]:
        """Expert-data-parallel groups: ranks holding the same experts (strided by ep x etp in a stage)."""
        if self.layout.world == self.layout.stage_size and self.parallelism.etp == 1:
            return [list(range(i, self.world_size, self.ep)) for i in range(self.ep)]
        return self.layout.groups("edp")

    def resolve_path(self, p: str) -> Path:
        """A path from the scenario, relative to the scenario file's folder."""
        path = Path(p)
        return path if path.is_absolute() else self._base_dir / path

    def check_layout(self) -> None:
        """Cross-field checks that need the topology; raises :class:`InputError` naming the field."""
        so = self.topology.scaleout
        if so.kind == "none" and self.cluster.nodes > 1:
            raise InputError(
                f"topology '{self.topology.name}' has no scale-out fabric (scaleout.kind: none): it holds "
                f"one node, got {self.cluster.nodes}",
                field="cluster.nodes",
            )
        self._check_files()
        check_precision(self)
        self._check_recompute_modules()
        check_hybrid(self)
        world = self.world_size
        p = self.parallelism
        model_par = p.tp * p.cp * p.pp
        where = f"the world size {world} = {self.cluster.nodes} nodes x {self.gpus_per_node} GPUs"
        if world % model_par:
            raise InputError(
                f"tp x cp x pp = {p.tp} x {p.cp} x {p.pp} = {model_par} must divide {where}",
                field="parallelism.pp" if p.pp > 1 else "parallelism.tp" if p.tp > 1 else "parallelism.cp",
            )
        if p.dp is not None and p.dp * model_par != world:
            raise InputError(
                f"tp x cp x pp x dp = {p.tp} x {p.cp} x {p.pp} x {p.dp} = {model_par * p.dp} must equal {where}; "
                "omit dp to derive it",
                field="parallelism.dp",
            )
        self._check_model_split()
        ep, experts = self.ep, self.model.num_experts
        stage = p.tp * p.cp * self.dp
        if experts % ep:
            raise InputError(
                f"ep ({ep}) must divide model.num_experts ({experts}); "
                f"choose ep in {_divisors(experts, stage // p.etp)}",
                field="parallelism.ep",
            )
        if stage % (ep * p.etp):
            ranks = (f"the world size ({world})" if stage == world
                     else f"the {stage} ranks of a pipeline stage (tp x cp x dp)")  # fmt: skip
            raise InputError(
                f"ep x etp = {ep} x {p.etp} must divide {ranks}; choose ep in {_divisors(experts, stage // p.etp)}",
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

    def _check_recompute_modules(self) -> None:
        """Megatron-Core's own checks on recompute_modules: mla_up_proj needs MLA attention."""
        mods, m = self.training.recompute_modules or [], self.model
        if "mla_up_proj" in mods and m.attention != "mla":
            raise InputError(
                f"recompute_modules: mla_up_proj recomputes MLA's up projections; model.attention is {m.attention!r}",
                field="training.recompute_modules",
            )
        if self.training.framework == "deepspeed" and self.training.recompute_modules is not None:
            raise InputError(
                "recompute_modules are Megatron-Core's selective recompute; framework is 'deepspeed' (its "
                "activation checkpointing recomputes whole layers: activation_checkpointing: full)",
                field="training.recompute_modules",
            )

    def _check_model_split(self) -> None:
        """Heads split over tp, the sequence over cp (and tp with sequence parallelism), layers over
        the pipeline's stages and chunks."""
        p, m, t = self.parallelism, self.model, self.training
        if m.num_attention_heads % p.tp:
            raise InputError(
                f"tp ({p.tp}) must divide model.num_attention_heads ({m.num_attention_heads})",
                field="parallelism.tp",
            )
        if m.attention == "mha" and m.kv_heads % p.tp:
            raise InputError(
                f"tp ({p.tp}) must divide the key/value heads ({m.kv_heads}), as Megatron-Core requires "
                "(num_query_groups % tp == 0)",
                field="parallelism.tp",
            )
        split = p.cp * (2 if p.cp > 1 else 1) * (p.tp if self.sequence_parallel else 1)
        if t.seq_len % split:
            raise InputError(
                f"training.seq_len ({t.seq_len}) must be a multiple of {split} "
                f"({'2 x cp' if p.cp > 1 else ''}{' x ' if p.cp > 1 and self.sequence_parallel else ''}"
                f"{'tp with sequence parallelism' if self.sequence_parallel else ''})",
                field="training.seq_len",
            )
        if p.pp == 1:
            if p.first_stage_layers is not None or p.last_stage_layers is not None:
                raise InputError("first/last_stage_layers need pp > 1", field="parallelism.pp")
            if p.pipeline_layout is None:
                return
        from sim.inputs.stages import stage_layers

        stage_layers(self)  # raises with the field when the layers (or the layout) do not fit the stages
        m_count = t.grad_accum_steps
        if p.schedule == "interleaved" and m_count % p.pp:
            raise InputError(
                f"the interleaved schedule needs grad_accum_steps (micro-batches per step, {m_count}) to be a "
                f"multiple of pp ({p.pp})",
                field="training.grad_accum_steps",
            )
        if self.collectives.a2a_overlap and p.pp > 1 and p.schedule == "1f1b":
            raise InputError(  # Megatron-Core's TransformerConfig asserts the same
                f"a2a_overlap with pp {p.pp} needs the interleaved schedule (vpp > 1, as Megatron-Core requires for "
                "overlap_moe_expert_parallel_comm) or dualpipe: under plain 1F1B the last stage's forward is "
                "followed by its own micro-batch's backward, which cannot overlap it",
                field="collectives.a2a_overlap",
            )
        if p.schedule == "dualpipe":
            if p.pp % 2:
                raise InputError(f"dualpipe needs an even pp, got {p.pp}", field="parallelism.pp")
            if m_count < 2 * p.pp:
                raise InputError(
                    f"dualpipe needs at least 2 pp = {2 * p.pp} micro-batches per step, got {m_count}",
                    field="training.grad_accum_steps",
                )

    def _check_files(self) -> None:
        """Files the scenario names (calibration, router trace) exist; their content is read by
        the commands that use them (and by ``moesim check``)."""
        named = (
            ("calibration", self.calibration, "calibration file"),
            ("routing.trace", self.routing.trace, "router trace"),
        )
        for field, value, what in named:
            if value is None:
                continue
            path = self.resolve_path(value)
            if not path.exists():
                raise InputError(
                    f"{what} '{value}' not found (a relative path is read from the scenario's folder, {self._base_dir})",
                    field=field,
                )
            if not path.is_file():
                raise InputError(f"{what} '{value}' is a directory, expected a file", field=field)

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


__all__ = [
    "POLICIES",
    "AuxFreeBalancing",
    "ClusterConfig",
    "CollectivesConfig",
    "FaultsConfig",
    "ModelConfig",
    "ParallelismConfig",
    "RoutingConfig",
    "Scenario",
    "TrainingConfig",
    "parse_policy",
]
