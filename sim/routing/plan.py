"""Router decisions of a scenario: :func:`route_scenario` -> :class:`RoutingPlan`, what the step
engine consumes (per MoE layer and micro-batch: tokens per expert and per rank, dispatch/combine
token and byte matrices, padded capacities) and what ``moesim route`` summarises.

Dispatch modes: ``capacity_padded`` (DeepSpeed/GShard: each rank's all-to-all buffer is E x C x d
elements whatever the counts, and every local expert computes ep x C rows) and ``dropless`` (actual
kept counts, Megatron/DeepEP). Shared experts compute every local token and are never sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sim.inputs.scenario import Scenario
from sim.model.dtypes import BYTES_PER_ELEMENT, storage_dtype
from sim.routing.build import (
    POOL_TOKENS,
    build_balanced,
    build_exact,
    build_from_trace,
    build_pooled,
)
from sim.routing.capacity import deepspeed_capacity, group_padding
from sim.routing.counts import WIDE_LIMIT, PlanArrays, compact
from sim.routing.policy import ExpertLayout, RoutingPolicy
from sim.routing.threads import single_blas_thread
from sim.routing.tokens import FeatureColumns
from sim.routing.traffic import (
    group_matrix,
    locality_masks,
    measured_touched,
    node_matrix,
    uniform_touched,
)

#: ``method="auto"`` samples every token exactly while layers x micro x world x tokens x E stays under this.
EXACT_LIMIT = 1 << 23


def expert_param_count(scenario: Scenario) -> int:
    """Parameters of one routed expert: gated (SwiGLU) 3 d f, plain 2 d f, linear d^2, plus biases."""
    m = scenario.model
    d, f = m.moe_token_width, m.moe_ffn_hidden_size or m.hidden_size
    weights = {"gated": 3 * d * f, "plain": 2 * d * f, "linear": d * d}[m.ffn_type]
    biases = {"gated": 2 * f + d, "plain": f + d, "linear": d}[m.ffn_type] if m.linear_bias else 0
    return weights + biases


@dataclass
class RoutingPlan:
    """Counts of every MoE layer l and micro-batch m; arrays are (layers, micro_batches, world, ...)."""

    scenario: str
    policy: str
    method: str
    dispatch: str
    layout: ExpertLayout
    cols: FeatureColumns
    top_k: int
    tokens_per_rank: int
    hidden_size: int
    bytes_per_elem: int
    num_shared_experts: int
    expert_bytes: int
    seed: int
    capacity_per_rank: int | None
    arrays: PlanArrays
    padded: np.ndarray | None  # (layers, micro, groups) capacity C of the padded buffers
    _compact: PlanArrays | None = field(default=None, init=False, repr=False, compare=False)

    # ---- counts ------------------------------------------------------------------------------
    @property
    def counts(self) -> PlanArrays:
        """:attr:`arrays` with the compact part (:mod:`sim.routing.counts`), derived once from the
        E-wide counts where the plan keeps those."""
        if self.arrays.pair_copies is not None:
            return self.arrays
        if self._compact is None:
            self._compact = compact(self.arrays, self.layout, self.cols)
        return self._compact

    @property
    def kept(self) -> np.ndarray:
        """(layers, micro, world, E) tokens of source rank r kept for expert e of r's EP group."""
        return self._wide(self.arrays.kept)

    @property
    def assigned(self) -> np.ndarray:
        """Like :attr:`kept`, before capacity drops."""
        return self._wide(self.arrays.assigned)

    def _wide(self, counts: np.ndarray | None) -> np.ndarray:
        if counts is None:
            lay = self.layout
            raise ValueError(
                "per-expert counts are kept while MoE layers x micro-batches x world x experts <= "
                f"{WIDE_LIMIT} ({self.num_moe_layers} x {self.micro_batches} x {lay.world} x "
                f"{lay.num_experts} here); use pair_copies() and expert_load()"
            )
        return counts

    @property
    def num_moe_layers(self) -> int:
        return int(self.arrays.rank_tokens.shape[0])

    @property
    def micro_batches(self) -> int:
        return int(self.arrays.rank_tokens.shape[1])

    def pair_copies(self, layer: int, micro: int, rows: np.ndarray | None = None) -> np.ndarray:
        """(world, ep) int32 token copies each source rank sends to each EP-local rank of its group
        (kept copies, one per token and expert); only the source ranks ``rows`` when given."""
        copies = self.counts.pair_copies[layer, micro]
        return copies if rows is None else copies[rows]

    def dispatch_tokens(self, layer: int, micro: int) -> np.ndarray:
        """(world, world) token copies src -> dst rank (one per token and expert)."""
        return group_matrix(self.pair_copies(layer, micro).astype(np.int64), self.layout)

    def dispatch_rank_tokens(self, layer: int, micro: int) -> np.ndarray:
        """(world, world) distinct tokens src -> dst rank (a token sent once per rank, DeepEP style)."""
        return group_matrix(self.arrays.rank_tokens[layer, micro].astype(np.int64), self.layout)

    def dispatch_node_tokens(self, layer: int, micro: int) -> np.ndarray:
        """(world, nodes) distinct tokens src rank -> dst node, for hierarchical all-to-all."""
        return node_matrix(self.arrays.node_tokens[layer, micro].astype(np.int64), self.layout)

    def expert_load(self, layer: int, micro: int) -> np.ndarray:
        """(world, experts_per_rank) rows each local expert computes (ep x C when padded)."""
        if self.padded is not None:
            c = np.repeat(self.padded[layer, micro], self.layout.ep) * self.layout.ep
            return np.repeat(c[:, None], self.layout.experts_per_rank, axis=1).astype(np.int64)
        return self.counts.expert_rows[layer, micro].astype(np.int64)

    def shared_expert_load(self) -> np.ndarray:
        """(world, num_shared_experts) rows each shared expert computes: every local token."""
        return np.full((self.layout.world, self.num_shared_experts), self.tokens_per_rank, dtype=np.int64)

    def dispatch_bytes(self, layer: int, micro: int, hidden: int, bytes_per_elem: int) -> np.ndarray:
        """(world, world) dispatch bytes src -> dst (diagonal: the rank's own chunk, never on a wire).
        Combine moves the transpose. For the per-rank reference engine (world x world)."""
        if self.padded is not None:
            chunk = self.padded[layer, micro].astype(np.int64) * self.layout.experts_per_rank
            per_dst = np.repeat(np.repeat(chunk, self.layout.ep)[:, None], self.layout.ep, axis=1)
            return group_matrix(per_dst, self.layout) * (hidden * bytes_per_elem)
        return self.dispatch_tokens(layer, micro) * (hidden * bytes_per_elem)

    def dispatch_bytes_per_rank(self, layer: int, micro: int, hidden: int, bytes_per_elem: int) -> np.ndarray:
        """(world,) all-to-all send buffer per rank, own chunk included (padded: E x C x d elements)."""
        return self.dispatch_bytes(layer, micro, hidden, bytes_per_elem).sum(axis=1)

    # ---- statistics --------------------------------------------------------------------------
    def layer_stats(self) -> dict[str, np.ndarray]:
        a = self.arrays
        stats = self.counts.sums.statistics(self.layout.world, self.tokens_per_rank)
        missing = np.full(self.num_moe_layers, np.nan)
        stats["retained_gate_mass"] = a.retained_gate_mass if a.retained_gate_mass is not None else missing
        stats["mean_routing_weight_sum"] = a.mean_weight_sum if a.mean_weight_sum is not None else missing
        return stats

    def a2a_bytes(self) -> tuple[float, float, float | None]:
        """Dispatch bytes per MoE layer and micro-batch summed over ranks (off the source rank), the
        part crossing nodes, and the inter-node part when each token crosses once per destination node
        (hierarchical all-to-all, dropless only); means over layers and micro-batches."""
        elem = self.hidden_size * self.bytes_per_elem
        local, same_node = locality_masks(self.layout, self.cols)
        cells = self.num_moe_layers * self.micro_batches
        dedup = None
        if self.padded is None:
            s = self.counts.sums
            total = float((s.copies - s.local).sum()) * elem
            inter = float((s.copies - s.local - s.intra).sum()) * elem
            nodes = self.arrays.node_tokens.sum(axis=(0, 1), dtype=np.int64)  # (world, slots)
            ranks = np.arange(self.layout.world)
            own = self.cols.patterns[
                self.cols.pattern_of_group[ranks // self.layout.ep], ranks % self.layout.ep
            ]
            dedup = float(nodes.sum() - nodes[ranks, own].sum()) * elem / cells
        else:
            g = self.layout.num_ep_groups
            remote = (~local).reshape(g, -1).sum(axis=1)
            cross = (~same_node).reshape(g, -1).sum(axis=1)
            chunk = self.padded.astype(np.float64) * self.layout.experts_per_rank * elem
            total, inter = float((chunk * remote).sum()), float((chunk * cross).sum())
        return total / cells, inter / cells, dedup

    def summary(self) -> dict[str, Any]:
        """JSON-friendly statistics: whole-run values and the same per layer."""
        st = self.layer_stats()
        copies = st["copies"]
        whole = copies.sum() or 1.0
        kept, assigned = st["kept_copies"].sum(), st["assigned_copies"].sum()
        a2a, inter_bytes, dedup_bytes = self.a2a_bytes()
        rgm = st["retained_gate_mass"]
        summary = {
            "local_fraction": float((st["local_fraction"] * copies).sum() / whole),
            "intra_node_fraction": float((st["intra_node_fraction"] * copies).sum() / whole),
            "inter_node_fraction": float((st["inter_node_fraction"] * copies).sum() / whole),
            "max_over_mean_load": float(st["max_over_mean_load"].mean()),
            "max_over_mean_expert_load": float(st["max_over_mean_expert_load"].mean()),
            "dropped_fraction": float(1.0 - kept / max(assigned, 1)),
            "retained_gate_mass": None if np.isnan(rgm).any() else float(rgm.mean()),
            "mean_nodes_per_token": float(st["mean_nodes_per_token"].mean()),
            "mean_ranks_per_token": float(st["mean_ranks_per_token"].mean()),
            "capacity_per_rank": self.capacity_per_rank,
            "padded_capacity_mean": None if self.padded is None else float(self.padded.mean()),
            "dispatch_bytes_per_layer": a2a,
            "inter_node_dispatch_bytes_per_layer": inter_bytes,
            "inter_node_dedup_bytes_per_layer": dedup_bytes,
            "mean_routing_weight_sum": None
            if np.isnan(st["mean_routing_weight_sum"]).any()
            else float(st["mean_routing_weight_sum"].mean()),
        }
        keys = [k for k in st if k not in ("copies", "kept_copies", "assigned_copies")]
        per_layer = [
            {"layer": i, **{k: (None if np.isnan(st[k][i]) else float(st[k][i])) for k in keys}}
            for i in range(self.num_moe_layers)
        ]
        return {"summary": summary, "per_layer": per_layer}

    def touched(self, batch_tokens: list[int]) -> list[dict[str, Any]]:
        """Distinct experts hit by batches of n tokens, measured on routed tokens and uniform formula,
        and the expert weight bytes read per token (touched x bytes per expert / n)."""
        e = self.layout.num_experts
        rng = np.random.default_rng([self.seed, 16])
        rows = []
        for n in batch_tokens:
            sample = self.arrays.sample_chosen
            measured = measured_touched(sample, n, rng) if sample is not None else None
            uniform = uniform_touched(e, self.top_k, n)
            rows.append(
                {
                    "tokens": n,
                    "measured": measured,
                    "uniform": uniform,
                    "expert_bytes_per_token": None if measured is None else measured * self.expert_bytes / n,
                    "uniform_expert_bytes_per_token": uniform * self.expert_bytes / n,
                }
            )
        return rows


def route_scenario(
    scenario: Scenario, policy: str | None = None, method: str = "auto", pool_tokens: int = POOL_TOKENS
) -> RoutingPlan:
    """Route every MoE layer and micro-batch of ``scenario``; ``policy`` ('topk', 'node_limited:M=2')
    overrides ``routing.policy``. ``method``: exact | pooled | auto (exact while small). The same
    ``routing.seed`` gives the same gate scores for every policy."""
    pol = RoutingPolicy.resolve(
        scenario, policy, field="--policy" if policy is not None else "routing.policy"
    )
    r, m = scenario.routing, scenario.model
    layout = ExpertLayout.of(scenario)
    s_tok = scenario.routed_tokens_per_rank
    if r.generator == "trace":
        arrays, used = build_from_trace(scenario, pol), "trace"
    elif r.generator == "balanced":
        arrays, used = build_balanced(scenario, pol), "balanced"
    else:
        work = m.num_moe_layers * scenario.training.grad_accum_steps * layout.world * s_tok * m.num_experts
        used = ("exact" if work <= EXACT_LIMIT else "pooled") if method == "auto" else method
        if used not in ("exact", "pooled"):
            raise ValueError(f"method must be exact, pooled or auto, not {method!r}")
        build = build_exact if used == "exact" else build_pooled
        with single_blas_thread():
            arrays = build(scenario, pol, pool_tokens)
    cap = (
        None
        if r.capacity_factor is None
        else deepspeed_capacity(s_tok, m.num_experts, m.top_k, r.capacity_factor, r.min_capacity)
    )
    plan = RoutingPlan(
        scenario=scenario.name,
        policy=pol.label,
        method=used,
        dispatch=r.dispatch,
        layout=layout,
        cols=FeatureColumns.of(layout),
        top_k=m.top_k,
        tokens_per_rank=s_tok,
        hidden_size=m.moe_token_width,  # the width the dispatcher moves (latent under LatentMoE)
        bytes_per_elem=BYTES_PER_ELEMENT[storage_dtype(scenario.training.dtype)],
        num_shared_experts=m.num_shared_experts,
        expert_bytes=expert_param_count(scenario) * BYTES_PER_ELEMENT[storage_dtype(scenario.training.dtype)],
        seed=r.seed,
        capacity_per_rank=cap,
        arrays=arrays,
        padded=None,
    )
    if r.dispatch == "capacity_padded":  # drop_tokens=False: the largest count of each EP group
        shape = (m.num_moe_layers, scenario.training.grad_accum_steps, layout.num_ep_groups)
        plan.padded = (
            np.full(shape, cap, dtype=np.int64)
            if cap is not None
            else group_padding(plan.counts.group_max, s_tok, m.top_k)
        )
    return plan


__all__ = ["EXACT_LIMIT", "RoutingPlan", "expert_param_count", "route_scenario"]
