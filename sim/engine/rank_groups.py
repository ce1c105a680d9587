"""Which group of each kind a rank of a pipeline stage belongs to, as Megatron-Core's rank order
lays them out (:class:`sim.inputs.layout.Layout`): tensor, expert-tensor, context and EP groups
inside a lane, data-parallel (dense) and expert-data-parallel groups across the lanes of a stage."""

from __future__ import annotations

import numpy as np

from sim.inputs.scenario import Scenario


def group_ids(s: Scenario, q: np.ndarray, kind: str) -> np.ndarray:
    """Index of the ``kind`` group (within one stage) of each stage position in ``q``."""
    p = s.parallelism
    tp, cp, ep, etp = p.tp, p.cp, p.ep, p.etp
    if kind == "tp":
        return q // tp
    if kind == "etp":
        return q // etp
    if kind == "cp":
        return (q % tp) + tp * (q // (tp * cp))
    if kind == "ep":
        return (q % etp) + etp * (q // (etp * ep))
    if kind == "dp":
        return q % (tp * cp)
    if kind == "edp":
        return q % (etp * ep)
    raise ValueError(kind)


def group_members(s: Scenario, kind: str, gid: int, stage: int) -> list[int]:
    """Global ranks of group ``gid`` of ``kind`` in pipeline stage ``stage``."""
    lay = s.layout
    q = np.arange(lay.stage_size)
    return [int(x) + stage * lay.stage_size for x in q[group_ids(s, q, kind) == gid]]


def gmax(values: np.ndarray, ids: np.ndarray, n: int) -> np.ndarray:
    out = np.full(n, -np.inf)
    np.maximum.at(out, ids, values)
    return out


__all__ = ["gmax", "group_ids", "group_members"]
