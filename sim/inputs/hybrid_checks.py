"""What a hybrid model (``model.hybrid_pattern``: Mamba-2, attention, MLP and MoE blocks) and LatentMoE
(``model.moe_latent_size``) need from the rest of a scenario; each miss is an
:class:`~sim.errors.InputError` naming the field (exit 2)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.errors import InputError

if TYPE_CHECKING:
    from sim.inputs.scenario import Scenario


def check_hybrid(s: Scenario) -> None:
    """Mamba-2 layers are priced for Megatron-Core's and FSDP2's programs, on a GPU with an ``ssd`` figure,
    with their heads and groups split by tp and without context parallelism or Muon."""
    m, p, t = s.model, s.parallelism, s.training
    if (m.hybrid_pattern is not None or m.moe_latent_size is not None) and t.framework == "deepspeed":
        raise InputError("a hybrid (model.hybrid_pattern) or LatentMoE (model.moe_latent_size) model is built for "
                         "framework megatron or fsdp2, not deepspeed", field="training.framework")  # fmt: skip
    if m.hybrid_pattern is None:
        return
    if t.optimizer == "muon":
        raise InputError("optimizer muon is not modelled for a hybrid model's Mamba-2 matrices", field="training.optimizer")
    if "M" not in m.hybrid_pattern:
        return
    gpu = s.topology.gpu
    if gpu.ssd is None:
        raise InputError(
            f"Mamba-2 layers run at the GPU's measured SSD rate: {gpu.kind} (topology '{s.topology.name}') has no "
            "ssd figure", field="model.hybrid_pattern",
        )  # fmt: skip
    heads = m.mamba_num_heads or 0
    if heads % p.tp or m.mamba_groups % p.tp:
        raise InputError(
            f"tp ({p.tp}) must divide model.mamba_num_heads ({heads}) and model.mamba_groups ({m.mamba_groups}), "
            "as Megatron-Core's MambaMixer requires",
            field="parallelism.tp",
        )
    if p.cp > 1:
        raise InputError(
            "context parallelism of Mamba-2 layers (Megatron's all-to-all over cp) is not modelled: set cp 1",
            field="parallelism.cp",
        )


__all__ = ["check_hybrid"]
