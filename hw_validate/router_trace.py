"""Record DeepSpeed's routing decisions as a ``moesim.router_trace`` file (format in :mod:`sim.inputs.router_trace`).

A forward hook on every MoE layer's ``TopKGate`` reads, per micro-batch and rank:

- ``assigned[e]``: DeepSpeed's ``exp_counts`` -- token-expert assignments the gate chose before the
  capacity limit (top-1: the argmax; top-2: the argmax plus the Gumbel-sampled second; top-k: the k
  largest), so ``sum(assigned) = tokens x top_k``;
- ``kept[e]``: the routes that survived the capacity limit. ``MOELayer`` calls the gate with
  ``sparse_routes=True``, which returns the expert index of every (route, token) with ``-1`` for a
  dropped route; ``kept`` counts the non-negative ones. (The dense path's ``dispatch_mask`` [S, E, C]
  is summed over tokens and capacity slots instead.)

Counts stay on the device during the step (no host sync inside the timed region) and are copied
after it. At the end every rank's counts are gathered to rank 0, which writes the trace with
:func:`sim.inputs.router_trace.save_trace` (atomic).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from sim.inputs.router_trace import RouterTrace


class RouterRecorder:
    """Per (step, micro-batch, MoE layer) counts of this rank, from gate forward hooks."""

    def __init__(self, num_experts: int, num_layers: int):
        self.num_experts = num_experts
        self.num_layers = num_layers
        self.enabled = False
        self.step = 0
        self.micro_batch = 0
        self._pending: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []
        self.records: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray]] = {}

    def install(self, gates: list[torch.nn.Module]) -> None:
        if len(gates) != self.num_layers:
            raise ValueError(f"{len(gates)} gates for {self.num_layers} MoE layers")
        for layer, gate in enumerate(gates):
            gate.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int) -> Any:
        def hook(_module: torch.nn.Module, _args: tuple, out: tuple) -> None:
            if not self.enabled:
                return
            assigned, kept = counts_from_gate_output(out, self.num_experts)
            self._pending.append((self.step, self.micro_batch, layer, assigned, kept))

        return hook

    def flush(self) -> None:
        """Copy this step's counts to the host (call after the timed region)."""
        for s, m, layer, a, k in self._pending:
            key = (s, m, layer)
            if key in self.records:
                raise RuntimeError(f"gate of MoE layer {layer} ran twice in step {s} micro-batch {m}")
            self.records[key] = (a.cpu().numpy().astype(np.int64), k.cpu().numpy().astype(np.int64))
        self._pending.clear()

    def as_array(self, steps: int, micro_batches: int) -> np.ndarray:
        """``(2, steps, micro_batches, layers, experts)`` int64: assigned, kept."""
        out = np.zeros((2, steps, micro_batches, self.num_layers, self.num_experts), dtype=np.int64)
        for (s, m, layer), (a, k) in self.records.items():
            out[0, s, m, layer], out[1, s, m, layer] = a, k
        return out


def counts_from_gate_output(out: tuple, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(assigned, kept) per expert from a ``TopKGate`` output (sparse 7-tuple or dense 4-tuple)."""
    exp_counts = out[-1].detach().to(torch.int64)
    if len(out) == 7:
        indices = out[3].detach().reshape(-1).to(torch.int64)
        valid = indices >= 0
        kept = torch.zeros(num_experts, dtype=torch.int64, device=indices.device)
        kept.index_add_(0, indices.clamp(min=0), valid.to(torch.int64))
    else:
        dispatch_mask = out[2]
        kept = dispatch_mask.detach().to(torch.int64).sum(dim=(0, 2))
    return exp_counts, kept


def build_trace(
    gathered: np.ndarray, *, scenario: str, top_k: int, ep: int, tokens_per_micro_batch: int
) -> RouterTrace:
    """A :class:`RouterTrace` from counts gathered over ranks: ``(ranks, 2, steps, micro, layers, experts)``."""
    ranks, _, steps, micro, layers, experts = gathered.shape
    per = np.moveaxis(gathered, 0, 4)  # (2, steps, micro, layers, ranks, experts)
    return RouterTrace(
        scenario=scenario,
        num_experts=experts,
        top_k=top_k,
        ep=ep,
        world_size=ranks,
        moe_layers=layers,
        tokens_per_micro_batch=tokens_per_micro_batch,
        assigned=np.ascontiguousarray(per[0]),
        kept=np.ascontiguousarray(per[1]),
    )
