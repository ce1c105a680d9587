"""Two parts of the lane engine's record (:mod:`sim.engine.lanes`): the per-kernel jitter factors of
the simulated ranks, and for each rank the member of its lane it most often waited for at all-to-alls."""

from __future__ import annotations

import numpy as np

from sim.frameworks.program import Kernels


class Jitter:
    """Per-kernel noise factors of the simulated ranks (``faults.jitter``), drawn per rank in the
    order the rank runs its kernels, as :func:`sim.frameworks.ops.apply_jitter` draws them."""

    def __init__(self, eng, sampler):
        self.factors, self.pos = [], []
        for r, st in enumerate(eng.program.stages):
            n = 0
            for ins in st.instructions:
                ch = st.chunks[ins.chunk]
                if ins.kind == "W":
                    n += len(ch.weight_kernels)
                    continue
                n += sum(
                    len(op.kernels)
                    for op in (ch.fwd if ins.kind == "F" else ch.bwd)
                    if isinstance(op, Kernels)
                )
            ranks = eng.q + r * eng.S
            self.factors.append(np.stack([np.asarray(sampler(int(g), n), dtype=np.float64) for g in ranks], axis=1)
                                if n else np.ones((0, len(ranks))))  # fmt: skip
            self.pos.append(0)

    def next(self, r: int) -> np.ndarray:
        i = self.pos[r]
        self.pos[r] += 1
        return self.factors[r][i]


def waited_on(eng) -> dict[int, int]:
    """Global rank -> the member of its lane that most often arrived last at its all-to-alls."""
    out: dict[int, int] = {}
    if eng.wait_on is None:
        return out
    lane_start = (np.arange(eng.n) // eng.L) * eng.L
    for r in range(eng.pp):
        counts = eng.wait_on[r].copy()
        counts[np.arange(eng.n), np.arange(eng.n) % eng.L] = 0
        best = counts.argmax(axis=1)
        for i in np.flatnonzero(counts.max(axis=1) > 0):
            out[int(eng.q[i] + r * eng.S)] = int(eng.q[lane_start[i] + best[i]] + r * eng.S)
    return out


__all__ = ["Jitter", "waited_on"]
