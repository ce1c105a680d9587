"""The parallel layout of a scenario: Megatron-Core's rank order and every process group.

One small frozen object turns the degrees into rank groups, as ``RankGenerator`` in Megatron-Core's
``parallel_state.py`` does; code asks it instead of doing index arithmetic of its own.

Dense layers: ``rank = tp_i + tp (cp_i + cp (dp_i + dp pp_i))`` (order ``tp-cp-dp-pp``: tp fastest).
Expert layers fold ``etp x ep x edp`` over the same ``tp x cp x dp`` ranks of a stage (MoE parallel
folding, order ``tp-ep-dp-pp`` with tp = etp, dp = edp):
``rank = etp_i + etp (ep_i + ep (edp_i + edp pp_i))``. With tp = cp = pp = 1 this is DeepSpeed's
layout: EP groups of ``ep`` contiguous ranks, expert-data-parallel groups strided by ``ep``.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm

#: Group kinds; ``tp-cp`` is the group a dense layer's tensor and context shards span.
GROUP_KINDS = ("tp", "cp", "dp", "pp", "tp-cp", "dp-cp", "ep", "etp", "edp")


@dataclass(frozen=True)
class Layout:
    """Degrees of a valid layout (``world = tp cp pp dp``; ``etp ep edp = tp cp dp``)."""

    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    ep: int = 1
    etp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: tp x cp x dp (= etp x ep x edp)."""
        return self.tp * self.cp * self.dp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: replicas of each expert within a stage."""
        return self.stage_size // (self.ep * self.etp)

    @property
    def lane_size(self) -> int:
        """Ranks of a stage that meet in tensor, context or expert collectives: the smallest block of
        consecutive ranks holding whole tp x cp groups and whole etp x ep groups. Lanes of a stage only
        meet each other in data-parallel collectives (gradients, parameter gathers)."""
        return lcm(self.tp * self.cp, self.ep * self.etp)

    @property
    def lanes(self) -> int:
        """Lanes per stage."""
        return self.stage_size // self.lane_size

    # ---- coordinates --------------------------------------------------------------------------
    def rank(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int) -> dict[str, int]:
        """Dense coordinates (tp, cp, dp, pp) and expert coordinates (etp, ep, edp) of ``rank``."""
        q, pp = rank % self.stage_size, rank // self.stage_size
        tp, r = q % self.tp, q // self.tp
        cp, dp = r % self.cp, r // self.cp
        etp, r = q % self.etp, q // self.etp
        ep, edp = r % self.ep, r // self.ep
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "etp": etp, "ep": ep, "edp": edp}

    def stage_of(self, rank: int) -> int:
        return rank // self.stage_size

    # ---- groups -------------------------------------------------------------------------------
    def groups(self, kind: str) -> list[list[int]]:
        """Every group of ``kind`` (one of :data:`GROUP_KINDS`), each a sorted list of global ranks;
        together they partition the world."""
        if kind not in GROUP_KINDS:
            raise ValueError(f"group kind must be one of {GROUP_KINDS}, got {kind!r}")
        if kind in ("etp", "ep", "edp"):
            sizes = {"etp": self.etp, "ep": self.ep, "edp": self.edp}
            order = ["etp", "ep", "edp"]
        else:
            sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp}
            order = ["tp", "cp", "dp"]
        varying = {"tp-cp": ["tp", "cp"], "dp-cp": ["cp", "dp"]}.get(kind, [kind])
        if kind == "pp":
            return [[q + s * self.stage_size for s in range(self.pp)] for q in range(self.stage_size)]
        out = []
        for stage in range(self.pp):
            base = stage * self.stage_size
            seen: dict[tuple, list[int]] = {}
            for q in range(self.stage_size):
                coords, rest = [], q
                for name in order:
                    coords.append(rest % sizes[name])
                    rest //= sizes[name]
                key = tuple(c for name, c in zip(order, coords, strict=True) if name not in varying)
                seen.setdefault(key, []).append(base + q)
            out.extend(seen.values())
        return out

    def group_of(self, kind: str, rank: int) -> list[int]:
        return next(g for g in self.groups(kind) if rank in g)

    def describe(self) -> dict[str, int]:
        """The JSON ``layout`` record."""
        return {"tp": self.tp, "cp": self.cp, "pp": self.pp, "vpp": self.vpp, "ep": self.ep, "etp": self.etp,
                "dp": self.dp, "edp": self.edp}  # fmt: skip


__all__ = ["GROUP_KINDS", "Layout"]
