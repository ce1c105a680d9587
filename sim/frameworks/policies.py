"""What a training framework does with gradients and parameters in one step.

- ``deepspeed`` (ZeRO as DeepSpeed 0.19 runs it): stage 0 all-reduces every gradient after the last
  backward; 1 all-reduces buckets during the last micro-batch's backward; 2 during every backward
  (``reduce_bucket_size`` buckets; ``allreduce_and_scatter`` keeps the partition); 3 reduce-scatters
  per layer and gathers each layer's parameters before its forward and its backward. The optimizer
  updates the rank's partition (stage >= 1) and ZeRO-1/2 all-gather the parameters after it.
- ``megatron`` (Megatron-Core ``DistributedDataParallel`` with the distributed optimizer,
  ``overlap_grad_reduce`` and ``overlap_param_gather``): gradients accumulate in the grad buffer and
  are reduce-scattered bucket by bucket (``bucket_size = max(40M, 1M x dp)`` elements) during the last
  micro-batch's backward; the optimizer updates the shard; the updated parameters are all-gathered at
  the start of the next step's forward, each bucket waited for by the layer that needs it.
- ``megatron`` with ``optimizer: muon`` (``dist_muon``, :mod:`sim.frameworks.muon`): the same
  buckets all-reduced (every rank keeps the full gradient), each rank updates the layers it owns, and
  the updated parameters are all-gathered after the step.
- ``fsdp2`` (PyTorch ``fully_shard`` per transformer block): each block's parameters are all-gathered
  before its forward (one block of prefetch) and, with ``reshard_after_forward``, freed after it and
  gathered again before its backward; gradients are reduce-scattered per block in every backward, after
  the post-backward hook copies them into the reduce-scatter input in ``reduce_dtype`` on the compute
  stream (torch ``foreach_reduce``; the builder's ``fsdp_grad_copy_in`` kernel).

Dense (non-expert) parameters are sharded over the data-parallel group (with context parallelism,
dp x cp, as Megatron's ``dp-cp`` group), experts over the expert-data-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.inputs.scenario import Scenario


@dataclass(frozen=True)
class Policy:
    name: str
    grad_kind: str  # all_reduce | reduce_scatter
    grads_every_micro: bool
    grads_after_backward: bool  # ZeRO-0: one reduction after the last backward, not overlapped
    layer_gathers: bool  # parameters gathered per layer before use (ZeRO-3, FSDP2)
    regather_for_backward: bool  # gathered again before each layer's backward
    step_gather: bool  # gathered once per step before the first forward (Megatron)
    post_step_gather: bool  # all-gathered after the optimizer (ZeRO-1/2)
    optimizer_sharded: bool
    bucket_elements: int  # gradient bucket size (elements); 0: one bucket per hand-over (per block)
    norm: str  # gradient norm: deepspeed (per group over dp, experts also over edp), world (one all-reduce), none
    #: the root module's parameters (embedding, final norm, LM head) stay gathered from forward through
    #: backward: FSDP2 does not reshard the root after forward (torch ``_fsdp_state.py`` ``_lazy_init``:
    #: "For the root, do not reshard after forward ... all-gathered immediately")
    root_kept: bool = False


def policy_of(s: Scenario) -> Policy:
    t, p = s.training, s.parallelism
    if t.framework == "megatron" and t.optimizer == "muon":  # LayerWiseDistributedOptimizer (sim/frameworks/muon.py)
        return Policy("megatron-muon", "all_reduce", False, False, False, False, False, True, True,
                      max(40_000_000, 1_000_000 * s.dp), "world")  # fmt: skip
    if t.framework == "megatron":
        return Policy("megatron", "reduce_scatter", False, False, False, False, True, False, True,
                      max(40_000_000, 1_000_000 * s.dp), "world")  # fmt: skip
    if t.framework == "fsdp2":
        return Policy("fsdp2", "reduce_scatter", True, False, True, t.reshard_after_forward, False, False, True,
                      0, "world", root_kept=True)  # fmt: skip
    z = p.zero_stage
    bucket = s.collectives.reduce_bucket_elements
    return Policy(
        f"deepspeed-zero{z}",
        "reduce_scatter" if z == 3 else "all_reduce",
        grads_every_micro=z >= 2,
        grads_after_backward=z == 0,
        layer_gathers=z == 3,
        regather_for_backward=z == 3,
        step_gather=False,
        post_step_gather=z in (1, 2),
        optimizer_sharded=z >= 1,
        bucket_elements=bucket,
        norm="deepspeed" if z >= 1 else "none",  # ZeRO-0's clipping norm is not modelled
    )


__all__ = ["Policy", "policy_of"]
