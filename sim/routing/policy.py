"""Expert placement and routing policies: unconstrained top-k, node-limited and device-limited.

Placement is DeepSpeed's: an EP group is ``ep`` contiguous ranks and expert ``e`` (0..E-1, the
experts of one group) lives on EP-local rank ``e // (E / ep)``. EP-local ranks map to nodes through
the rank numbering (``rank // gpus_per_node``); a group's *node slots* number the nodes it spans.

Group-limited policies restrict each token to ``M`` groups of contiguous experts, then take the top
k among them (Megatron-Core ``group_limited_topk``):
- ``node_limited:M`` (DeepSeek-V3, arXiv 2412.19437, ``inference/model.py`` ``Gate``): a group is
  the experts on one node of the EP group; group score = sum of its top ``k // M`` affinities
  (V3 sums the top 2 = 8 // 4 biased scores; its bias-free branch uses the max instead).
- ``device_limited:M`` (DeepSeek-V2, arXiv 2405.04434): a group is one EP rank's experts; group
  score = max affinity in it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from sim.errors import InputError
from sim.inputs.scenario import Scenario, parse_policy


@dataclass(frozen=True)
class ExpertLayout:
    """Where experts and ranks live: world size, EP size, experts, GPUs per node."""

    world: int
    ep: int
    num_experts: int
    gpus_per_node: int

    @classmethod
    def of(cls, scenario: Scenario) -> ExpertLayout:
        """The ranks of one pipeline stage (all ranks without pipelining): every stage routes alike."""
        return cls(scenario.layout.stage_size, scenario.ep, scenario.model.num_experts, scenario.gpus_per_node)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.ep

    @property
    def num_ep_groups(self) -> int:
        return self.world // self.ep

    @property
    def num_nodes(self) -> int:
        return -(-self.world // self.gpus_per_node)

    def node_slots(self) -> np.ndarray:
        """(groups, ep): node slot of each EP-local rank, counted from the group's first node."""
        ranks = np.arange(self.world).reshape(self.num_ep_groups, self.ep)
        nodes = ranks // self.gpus_per_node
        return nodes - nodes[:, :1]

    def patterns(self) -> tuple[np.ndarray, np.ndarray]:
        """Distinct node-slot rows ``(patterns, ep)`` and the pattern index of every EP group."""
        rows, inverse = np.unique(self.node_slots(), axis=0, return_inverse=True)
        return rows, inverse.reshape(-1)

    def first_node_of_group(self) -> np.ndarray:
        return (np.arange(self.num_ep_groups) * self.ep) // self.gpus_per_node


@dataclass(frozen=True)
class RoutingPolicy:
    """A parsed policy: ``topk`` or a group-limited one with its group size (experts) and M."""

    name: str
    max_groups: int | None
    group_size: int | None

    @property
    def label(self) -> str:
        return self.name if self.name == "topk" else f"{self.name}:M={self.max_groups}"

    @classmethod
    def resolve(
        cls, scenario: Scenario, text: str | None = None, field: str = "routing.policy"
    ) -> RoutingPolicy:
        """The scenario's policy, or ``text`` ('node_limited:M=2') instead; checked against the layout."""
        if text is None:
            name, m = scenario.routing.policy, scenario.routing.max_groups
        else:
            try:
                name, m = parse_policy(text)
            except ValueError as exc:
                raise InputError(str(exc), field=field) from None
            if name != "topk" and m is None:
                raise InputError(f"policy {name} needs M, e.g. {name}:M=2", field=field)
        if name == "topk":
            return cls("topk", None, None)
        size, groups = group_shape(scenario, name, field)
        k = scenario.model.top_k
        assert m is not None
        if m > groups:
            raise InputError(
                f"M={m} exceeds the {groups} groups ({'nodes' if name == 'node_limited' else 'devices'}) "
                "the experts of one EP group span",
                field=field,
            )
        if m * size < k:
            raise InputError(
                f"M={m} groups hold {m * size} experts, fewer than top_k ({k}); use M >= {math.ceil(k / size)}",
                field=field,
            )
        return cls(name, m, size)


def group_shape(scenario: Scenario, name: str, field: str = "routing.policy") -> tuple[int, int]:
    """(experts per group, groups one EP group spans) of the group-limited policy ``name``."""
    layout = ExpertLayout.of(scenario)
    size = _group_size(name, layout, field)
    return size, layout.num_experts // size


def _group_size(name: str, layout: ExpertLayout, field: str) -> int:
    """Experts per group: one EP rank's (device-limited) or one node's share of the EP group."""
    if name == "device_limited":
        return layout.experts_per_rank
    ep, gpn = layout.ep, layout.gpus_per_node
    if ep % gpn and gpn % ep:
        raise InputError(
            f"node_limited needs EP groups aligned with nodes: ep ({ep}) and gpus_per_node ({gpn}) "
            "must divide one another",
            field="parallelism.ep" if field == "routing.policy" else field,
        )
    return layout.experts_per_rank * min(ep, gpn)


def select_experts(
    scores: np.ndarray, k: int, policy: RoutingPolicy, bias: np.ndarray | None = None
) -> np.ndarray:
    """(tokens, k) chosen experts, best first by (biased) score; bias steers selection only (DeepSeek-V3)."""
    sel = scores + bias.astype(scores.dtype) if bias is not None else scores
    if policy.name != "topk":
        assert policy.group_size is not None and policy.max_groups is not None
        n, e = sel.shape
        grouped = sel.reshape(n, e // policy.group_size, policy.group_size)
        if policy.name == "device_limited":
            group_score = grouped[..., 0].copy()
            for j in range(1, policy.group_size):  # faster than max over a short last axis
                np.maximum(group_score, grouped[..., j], out=group_score)
        else:
            top = min(max(1, k // policy.max_groups), policy.group_size)
            group_score = -np.partition(-grouped, top - 1, axis=-1)[..., :top].sum(axis=-1)
        keep = _topk_indices(group_score, policy.max_groups)
        dropped = np.ones(group_score.shape, dtype=bool)
        np.put_along_axis(dropped, keep, False, axis=-1)
        sel = np.where(dropped[:, :, None], -np.inf, grouped).reshape(n, e)
    return _topk_indices(sel, k, ordered=True)


def topk_mass(scores: np.ndarray, k: int) -> np.ndarray:
    """Per token, the sum of its k largest scores: the unconstrained top-k mass."""
    return -np.partition(-scores, k - 1, axis=-1)[:, :k].sum(axis=-1, dtype=np.float64)


def _topk_indices(values: np.ndarray, k: int, ordered: bool = False) -> np.ndarray:
    if k == values.shape[-1]:
        idx = np.broadcast_to(np.arange(k), values.shape).copy()
    else:
        idx = np.argpartition(-values, k - 1, axis=-1)[..., :k]
    if ordered:
        order = np.argsort(-np.take_along_axis(values, idx, axis=-1), axis=-1, kind="stable")
        idx = np.take_along_axis(idx, order, axis=-1)
    return idx


__all__ = ["ExpertLayout", "RoutingPolicy", "group_shape", "select_experts", "topk_mass"]
