"""What a routing plan keeps: per (MoE layer, micro-batch, rank) counts sized world x ep, and the sums
its statistics need, written one layer at a time as the builders draw them.

Every builder (exact, pooled, trace, balanced) hands :class:`CountsWriter` one layer's counts per
(micro-batch, rank): expert copies assigned and kept (E wide), distinct tokens per destination rank
(ep) and node slot. The writer keeps what the engines read, never world x E nor world x world:

- ``pair_copies`` (layers, micro, world, ep): kept copies each rank sends to each member of its EP group;
- ``expert_rows`` (layers, micro, world, experts_per_rank): kept copies each local expert receives;
- ``rank_tokens`` / ``node_tokens``: distinct tokens per destination rank / node slot;
- ``group_max`` (layers, micro, groups): the largest assigned count of each EP group (the padded
  buffer's capacity without drops, :func:`sim.routing.capacity.padded_capacity`);
- :class:`LayerSums`: per layer, the integer sums and per micro-batch load ratios of the statistics.

While layers x micro x world x E <= :data:`WIDE_LIMIT` (small scenarios: tests, the per-rank reference
engine, trace files) it keeps the E-wide ``assigned``/``kept`` arrays instead, and the compact ones
are derived from them when first asked (:func:`compact`), so that a plan whose E-wide counts are
replaced stays consistent. Above it one layer's E-wide arrays are the peak.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from sim.routing.policy import ExpertLayout
from sim.routing.tokens import FeatureColumns
from sim.routing.traffic import locality_masks, max_over_mean, rank_copies, received

#: E-wide counts ((layers, micro, world, E) int32) are kept up to this many elements (256 MiB): up to
#: 1,024 GPUs of 128gpu (50M), where the per-rank reference and analytic engines still run.
WIDE_LIMIT = 1 << 26


@dataclass
class LayerSums:
    """Per MoE layer: kept copies in all, to the source rank itself and to another rank of its node,
    assigned copies, distinct (token, rank) and (token, node) pairs (int64, (layers,)); max/mean of the
    received rows per rank and per expert replica of every micro-batch (float64, (layers, micro))."""

    copies: np.ndarray
    local: np.ndarray
    intra: np.ndarray
    assigned: np.ndarray
    rank_tokens: np.ndarray
    node_tokens: np.ndarray
    load_ratio: np.ndarray
    expert_ratio: np.ndarray

    def statistics(self, world: int, tokens_per_rank: int) -> dict[str, np.ndarray]:
        """Per-layer statistics (see :mod:`sim.routing.traffic`), arrays of length layers."""
        total = self.copies.astype(np.float64)
        safe = np.where(total > 0, total, 1.0)
        n_tokens = self.load_ratio.shape[1] * world * tokens_per_rank
        return {
            "local_fraction": self.local / safe,
            "intra_node_fraction": self.intra / safe,
            "inter_node_fraction": (total - self.local - self.intra) / safe,
            "max_over_mean_load": self.load_ratio.mean(axis=1),
            "max_over_mean_expert_load": self.expert_ratio.mean(axis=1),
            "dropped_fraction": 1.0 - self.copies / np.maximum(self.assigned, 1),
            "mean_ranks_per_token": self.rank_tokens / n_tokens,
            "mean_nodes_per_token": self.node_tokens / n_tokens,
            "kept_copies": self.copies,
            "assigned_copies": self.assigned,
            "copies": total,
        }


@dataclass
class PlanArrays:
    """Counts (layers, micro_batches, world, ...) int32 and the per-token statistics of the routing.

    The compact part (``pair_copies``, ``expert_rows``, ``group_max``, ``sums``) is None where the
    E-wide ``assigned``/``kept`` are kept (and the other way round; ``group_max`` also where no padded
    buffer needs it); ``kept is assigned`` without drops."""

    rank_tokens: np.ndarray
    node_tokens: np.ndarray
    pair_copies: np.ndarray | None
    expert_rows: np.ndarray | None
    group_max: np.ndarray | None
    sums: LayerSums | None
    assigned: np.ndarray | None
    kept: np.ndarray | None
    retained_gate_mass: np.ndarray | None = None
    mean_weight_sum: np.ndarray | None = None
    sample_chosen: np.ndarray | None = None
    balancing: list[float] | None = None


@dataclass
class LayerCounts:
    """One MoE layer's counts per cell ((micro-batch, rank) pair, micro-batch major), as a builder
    hands them to :class:`CountsWriter`: kept distinct tokens per EP-local rank (cells, ep) and node
    slot (cells, slots), kept copies per EP-local rank (cells, ep) and per local expert (cells,
    experts_per_rank), the largest assigned count of each EP group (cells / ep; None where no padded
    buffer needs it), assigned copies in all; E-wide ``assigned``/``kept`` (cells, E) only where the
    writer keeps them."""

    rank_tokens: np.ndarray
    node_tokens: np.ndarray
    copies: np.ndarray
    rows: np.ndarray
    group_max: np.ndarray | None
    assigned_copies: int
    assigned: np.ndarray | None = None
    kept: np.ndarray | None = None

    @classmethod
    def of(
        cls, assigned: np.ndarray, kept: np.ndarray, rank_tokens: np.ndarray, node_tokens: np.ndarray,
        layout: ExpertLayout,
    ) -> LayerCounts:  # fmt: skip
        """From E-wide counts (..., world, E) and distinct tokens (..., world, ep | slots)."""
        e, ep, g = layout.num_experts, layout.ep, layout.num_ep_groups
        assigned, kept = assigned.reshape(-1, layout.world, e), kept.reshape(-1, layout.world, e)
        return cls(
            rank_tokens.reshape(-1, ep),
            node_tokens.reshape(-1, node_tokens.shape[-1]),
            rank_copies(kept, layout).reshape(-1, ep),
            received(kept, layout).reshape(-1, layout.experts_per_rank),
            assigned.reshape(-1, g, ep * e).max(axis=-1).reshape(-1),
            int(assigned.sum(dtype=np.int64)),
            assigned.reshape(-1, e),
            kept.reshape(-1, e),
        )


class CountsWriter:
    """Takes one MoE layer's counts at a time and keeps the plan's arrays (see module docstring).
    ``capped``: kept copies differ from assigned ones (capacity drops, recorded traces)."""

    def __init__(
        self, layout: ExpertLayout, cols: FeatureColumns, layers: int, micro: int, capped: bool,
        wide: bool | None = None,
    ):  # fmt: skip
        self.layout, self.micro = layout, micro
        w, ep, e = layout.world, layout.ep, layout.num_experts
        #: whether the E-wide counts are kept (then the compact part is derived when asked)
        self.wide = layers * micro * w * e <= WIDE_LIMIT if wide is None else wide
        shape = (layers, micro, w)
        # np.empty, not zeros: every layer is written, and first writes to calloc'd pages cost ~10x more
        self.rank_tokens = np.empty((*shape, ep), dtype=np.int32)
        self.node_tokens = np.empty((*shape, cols.max_slots), dtype=np.int32)
        self.assigned = self.kept = self.pair_copies = self.expert_rows = self.group_max = None
        self.sums: LayerSums | None = None
        self._group_max_missing = False
        if self.wide:
            self.assigned = np.empty((*shape, e), dtype=np.int32)
            self.kept = np.empty((*shape, e), dtype=np.int32) if capped else self.assigned
            return
        self.pair_copies = np.empty((*shape, ep), dtype=np.int32)
        self.expert_rows = np.empty((*shape, layout.experts_per_rank), dtype=np.int32)
        self.group_max = np.empty((layers, micro, layout.num_ep_groups), dtype=np.int64)
        ints = [np.zeros(layers, dtype=np.int64) for _ in range(6)]
        self.sums = LayerSums(*ints, np.zeros((layers, micro)), np.zeros((layers, micro)))
        local, same_node = locality_masks(layout, cols)
        self._local, self._intra = local, same_node & ~local

    def add(self, layer: int, counts: LayerCounts) -> None:
        """Layer ``layer``'s counts."""
        m, w = self.micro, self.layout.world
        self.rank_tokens[layer] = counts.rank_tokens.reshape(m, w, -1)
        self.node_tokens[layer] = counts.node_tokens.reshape(m, w, -1)
        if self.wide:
            assert counts.assigned is not None and counts.kept is not None
            self.assigned[layer] = counts.assigned.reshape(m, w, -1)
            if self.kept is not self.assigned:
                self.kept[layer] = counts.kept.reshape(m, w, -1)
            return
        copies = self.pair_copies[layer]
        copies[...] = counts.copies.reshape(m, w, -1)
        rows = self.expert_rows[layer]
        rows[...] = counts.rows.reshape(m, w, -1)
        if counts.group_max is None:
            self._group_max_missing = True
        else:
            self.group_max[layer] = counts.group_max.reshape(m, -1)
        s = self.sums
        s.copies[layer] = copies.sum(dtype=np.int64)
        s.local[layer] = copies[:, self._local].sum(dtype=np.int64)
        s.intra[layer] = copies[:, self._intra].sum(dtype=np.int64)
        s.assigned[layer] = counts.assigned_copies
        s.rank_tokens[layer] = self.rank_tokens[layer].sum(dtype=np.int64)
        s.node_tokens[layer] = self.node_tokens[layer].sum(dtype=np.int64)
        s.load_ratio[layer] = max_over_mean(rows.sum(axis=-1))
        s.expert_ratio[layer] = max_over_mean(rows.reshape(m, -1))

    def arrays(self, **extra) -> PlanArrays:
        """The plan's arrays; ``extra``: retained_gate_mass, mean_weight_sum, sample_chosen, balancing."""
        group_max = None if self._group_max_missing else self.group_max
        return PlanArrays(
            self.rank_tokens, self.node_tokens, self.pair_copies, self.expert_rows, group_max,
            self.sums, self.assigned, self.kept, **extra,
        )  # fmt: skip


def compact(arrays: PlanArrays, layout: ExpertLayout, cols: FeatureColumns) -> PlanArrays:
    """``arrays`` with the compact part derived from its E-wide counts (as given when it has one)."""
    if arrays.pair_copies is not None:
        return arrays
    assert arrays.assigned is not None and arrays.kept is not None
    a = arrays
    layers, micro = a.assigned.shape[:2]
    writer = CountsWriter(layout, cols, layers, micro, a.kept is not a.assigned, wide=False)
    for layer in range(layers):
        counts = LayerCounts.of(
            a.assigned[layer], a.kept[layer], a.rank_tokens[layer], a.node_tokens[layer], layout
        )
        writer.add(layer, counts)
    return dataclasses.replace(
        a, pair_copies=writer.pair_copies, expert_rows=writer.expert_rows, group_max=writer.group_max,
        sums=writer.sums,
    )  # fmt: skip


__all__ = ["WIDE_LIMIT", "CountsWriter", "LayerCounts", "LayerSums", "PlanArrays", "compact"]
