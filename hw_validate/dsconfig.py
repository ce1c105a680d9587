"""The DeepSpeed config (``ds_config``) a scenario implies, and the MoE gate settings.

The original example this project grew from had a ds_config that could not run: train batch 64
with no way to reach it from micro x accumulation x ranks, fp16 on a machine without CUDA and a
made-up ``"moe"`` section (DeepSpeed has none: MoE is configured on the ``MoE`` layer itself). Here
every number comes from the scenario:

- ``train_batch_size = micro_batch_size x grad_accum_steps x dp``, checked against the launched world;
- ``zero_optimization.stage`` from ``parallelism.zero_stage``; ``offload_optimizer: {device: cpu}``
  when ``training.offload_optimizer: cpu`` (DeepSpeed then builds ``DeepSpeedCPUAdam``);
- precision: fp16 on CUDA; on CPU ranks fp16 becomes bf16 (DeepSpeed's CPU accelerator has no fp16
  loss scaler) and a notice says so; fp32 is fp32 everywhere;
- the gradient bucket and overlap from ``collectives``.

No torch import: the accelerator kind (``"cpu"`` or ``"cuda"``) is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sim.errors import InputError
from sim.inputs.scenario import Scenario


@dataclass(frozen=True)
class GateSettings:
    """Arguments of ``deepspeed.moe.layer.MoE`` that come from ``routing``."""

    k: int
    capacity_factor: float
    min_capacity: int
    drop_tokens: bool
    notices: tuple[str, ...] = ()


@dataclass
class TrainSettings:
    """The ds_config plus what the harness decided on the way (effective dtype, notices)."""

    ds_config: dict[str, Any]
    dtype: str  # effective: fp32 | bf16 | fp16
    dtype_requested: str
    notices: list[str] = field(default_factory=list)

    @property
    def train_batch_size(self) -> int:
        return int(self.ds_config["train_batch_size"])


def gate_settings(scenario: Scenario) -> GateSettings:
    """DeepSpeed gate arguments: capacity factor, min capacity and drop_tokens from ``routing``."""
    r = scenario.routing
    notices: list[str] = []
    dropless = r.dispatch == "dropless" or r.capacity_factor is None
    if r.policy != "topk":
        notices.append(
            f"routing.policy {r.policy_string} is simulated only: DeepSpeed's TopKGate routes plain top-k"
        )
    k = scenario.model.top_k
    explicit = "drop_policy" in r.model_fields_set
    if explicit and k <= 2 and r.drop_policy == "probs" and not dropless:
        notices.append(
            "DeepSpeed's top-1/top-2 gates drop by position (top-2) or random token selection (top-1); "
            "routing.drop_policy: probs applies to k > 2 only"
        )
    if explicit and k > 2 and r.drop_policy == "position":
        notices.append("DeepSpeed's MoE layer always uses drop_policy probs for k > 2")
    return GateSettings(
        k=k,
        capacity_factor=float(r.capacity_factor if r.capacity_factor is not None else 1.0),
        min_capacity=int(r.min_capacity),
        drop_tokens=not dropless,
        notices=tuple(notices),
    )


def effective_dtype(requested: str, accelerator: str) -> tuple[str, list[str]]:
    """The dtype the job trains in, and a notice when it differs from the scenario's."""
    if requested == "fp16" and accelerator != "cuda":
        return "bf16", [
            "training.dtype fp16 needs CUDA (DeepSpeed's fp16 loss scaler); on CPU ranks this job trains in bf16"
        ]
    return requested, []


def build_ds_config(
    scenario: Scenario, world_size: int, accelerator: str, *, steps_per_print: int = 1_000_000
) -> TrainSettings:
    """The ds_config for ``scenario`` launched on ``world_size`` ranks of kind ``accelerator``."""
    if world_size != scenario.world_size:
        raise InputError(
            f"the job was launched on {world_size} ranks but the scenario describes "
            f"{scenario.world_size} = {scenario.cluster.nodes} nodes x {scenario.gpus_per_node} GPUs; "
            f"launch {scenario.world_size} ranks or override cluster.gpus_per_node / cluster.nodes",
            file=scenario.source,
            field="cluster.gpus_per_node",
        )
    t = scenario.training
    dtype, notices = effective_dtype(t.dtype, accelerator)
    micro, accum, dp = t.micro_batch_size, t.grad_accum_steps, scenario.dp
    train_batch = micro * accum * dp
    if t.global_batch_size is not None and t.global_batch_size != train_batch:
        raise InputError(
            f"global_batch_size ({t.global_batch_size}) != micro ({micro}) x accum ({accum}) x dp ({dp})",
            file=scenario.source,
            field="training.global_batch_size",
        )
    offload = t.offload_optimizer == "cpu"
    zero: dict[str, Any] = {
        "stage": scenario.parallelism.zero_stage,
        "overlap_comm": bool(scenario.collectives.overlap_comm),
        "contiguous_gradients": True,
        "reduce_bucket_size": int(scenario.collectives.reduce_bucket_elements),
        "allgather_bucket_size": int(scenario.collectives.reduce_bucket_elements),
    }
    if offload:
        if scenario.parallelism.zero_stage == 0:
            raise InputError(
                "offload_optimizer: cpu needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads ZeRO partitions)",
                file=scenario.source,
                field="training.offload_optimizer",
            )
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": accelerator == "cuda"}
    if t.optimizer == "adam":
        params: dict[str, Any] = {"lr": t.lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}
        if not offload:
            # FusedAdam needs a CUDA build of DeepSpeed's ops; torch's Adam runs everywhere.
            params["torch_adam"] = True
        optimizer = {"type": "Adam", "params": params}
    else:
        if offload:
            raise InputError(
                "offload_optimizer: cpu needs optimizer adam (DeepSpeedCPUAdam)",
                file=scenario.source,
                field="training.optimizer",
            )
        optimizer = {"type": "SGD", "params": {"lr": t.lr}}
    cfg: dict[str, Any] = {
        "train_batch_size": train_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "optimizer": optimizer,
        "zero_optimization": zero,
        "steps_per_print": steps_per_print,
        "wall_clock_breakdown": False,
    }
    if offload:
        cfg["zero_force_ds_cpu_optimizer"] = True
    if dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 100}
    elif dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if scenario.training.recompute:
        notices.append("training.activation_checkpointing is simulated only; the real job keeps activations")
    return TrainSettings(ds_config=cfg, dtype=dtype, dtype_requested=t.dtype, notices=notices)


def check_batch(cfg: dict[str, Any], world_size: int) -> None:
    """DeepSpeed's own rule, checked before it is: train batch = micro x accumulation x world."""
    tb = cfg["train_batch_size"]
    micro = cfg["train_micro_batch_size_per_gpu"]
    accum = cfg["gradient_accumulation_steps"]
    if tb != micro * accum * world_size:
        raise InputError(
            f"train_batch_size {tb} != micro {micro} x accumulation {accum} x world {world_size}",
            field="training.global_batch_size",
        )
