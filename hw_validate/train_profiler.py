"""The ``--profile DIR`` profiler of :mod:`hw_validate.train_moe`: ``torch.profiler`` around a few
measured steps, written as Chrome/Kineto JSON per rank (what ``moesim calibrate --from-profile``
reads), with what the profiler cost a step written into the trace.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from sim.ioutil import atomic_write_text

#: the largest share of a profiled step taken as the profiler's cost: on cpu-2rank (2 gloo ranks,
#: ~4,700 recorded ops a step) it cost ~20% on quiet steps (2026-12-07); larger differences between
#: the profiled steps and the others came with the machine's load changing (up to 2x a minute here)
PROFILER_COST_MAX = 0.3


class _Profiler:
    """``torch.profiler`` around ``active`` steps after the job's warm-up (``--profile DIR``): CPU ops
    with their input shapes (``record_shapes``), and the device's kernels on GPUs, written as
    Chrome/Kineto JSON to ``DIR/rank-<r>.json`` -- what ``moesim calibrate --from-profile`` reads.
    ``step()`` ends a training step (one ``ProfilerStep#N`` range per recorded step)."""

    def __init__(self, out: Path, rank: int, accelerator: str, wait: int, active: int):
        import torch.profiler as tp

        self.path = out / f"rank-{rank}.json"
        self.wait, self.active = wait, active
        acts = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if accelerator == "cuda" else [])
        self.prof = tp.profile(activities=acts, record_shapes=True,
                               schedule=tp.schedule(wait=wait, warmup=1, active=active, repeat=1),
                               on_trace_ready=self._write)  # fmt: skip
        self.prof.start()

    def _write(self, prof) -> None:
        prof.export_chrome_trace(str(self.path))

    def step(self) -> None:
        self.prof.step()

    def stop(self) -> None:
        self.prof.stop()

    def annotate(self, step_s: list[float], warmup: int) -> float:
        """Write into the trace (top-level ``moesim``) what the profiler cost this rank a step: the
        median of the profiled steps' timer less that of the other measured steps, from 0 to
        :data:`PROFILER_COST_MAX` of the profiled steps (beyond, the machine's load moved between the
        steps), which ``--from-profile`` takes off the trace's windows; returns it (seconds)."""
        profiled = range(self.wait + 1, self.wait + 1 + self.active)
        on = [t for i, t in enumerate(step_s) if i in profiled]
        off = [t for i, t in enumerate(step_s) if i >= warmup and i not in profiled]
        cost = 0.0
        if on and off:
            cost = min(max(0.0, statistics.median(on) - statistics.median(off)), PROFILER_COST_MAX * statistics.median(on))
        doc = json.loads(self.path.read_text())
        doc["moesim"] = {"profiler_cost_per_step_s": cost, "profiled_steps": list(profiled),
                         "profiled_step_s": on, "unprofiled_step_s": off}  # fmt: skip
        atomic_write_text(self.path, json.dumps(doc))
        return cost


def start_profiler(out: str, rank: int, accelerator: str, steps: int, warmup: int, active: int) -> _Profiler:
    """The profiler of ``--profile``: the last warm-up step warms it up, then it records up to
    ``active`` measured steps (all of them when fewer)."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    wait = max(0, warmup - 1)
    return _Profiler(d, rank, accelerator, wait, max(1, min(active, steps - wait - 1)))

