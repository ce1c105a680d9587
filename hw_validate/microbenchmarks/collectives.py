"""Collective sweeps: all-to-all, all-reduce, all-gather and reduce-scatter over the spec's sizes, the slowest
rank's time per call (nccl-tests style), or isolated blocking calls after compute on gloo; what the
link fit (:mod:`hw_validate.fits.links`) reads."""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from hw_validate.microbenchmarks.harness import Bench, stats


def bench_comm(b: Bench, world: int, progress) -> list[dict]:
    """One row per collective kind and size (``comm: {"kinds", "sizes", "reps", "target_s", "gap_s"}``)."""
    c = b.spec.get("comm") or {}
    rows = []
    if world < 2:
        return rows
    for kind in c.get("kinds", ("all_to_all", "all_reduce")):
        for size in c.get("sizes", ()):
            n = max(world, int(size) // 4 // world * world)  # fp32 elements, a multiple of world
            x = torch.ones(n, dtype=torch.float32, device=b.device)
            if kind == "all_to_all":
                y = torch.empty_like(x)

                def fn(x=x, y=y):
                    dist.all_to_all_single(y, x)
            elif kind == "all_reduce":

                def fn(x=x):
                    dist.all_reduce(x)
            elif kind == "all_gather":  # nccl-tests' size: the gathered output (ZeRO's post-step gather)
                part = torch.ones(n // world, dtype=torch.float32, device=b.device)

                def fn(x=x, part=part):
                    dist.all_gather_into_tensor(x, part)
            elif kind == "reduce_scatter":  # nccl-tests' size: the input (sequence parallelism's exit)
                part = torch.empty(n // world, dtype=torch.float32, device=b.device)

                def fn(x=x, part=part):
                    dist.reduce_scatter_tensor(part, x)
            else:
                raise ValueError(f"unknown collective {kind}")
            gap = float(c.get("gap_s", 0.0))
            reps = b.time_collective(fn, int(c.get("reps", b.reps)), c.get("target_s"), gap)
            # isolated blocking calls (gloo) have a heavy tail: on this VM (2 ranks, 2026-12-04) a
            # 4 KiB all_reduce after 1 ms of compute takes 0.35-0.5 ms at the median and 0.8-1.9 ms
            # on average, a 64 KiB all_to_all 0.31 / 0.46 ms. A job pays every call, so the mean is
            # its cost; NCCL's back-to-back loops (gap 0) keep nccl-tests' median
            mid = statistics.fmean(reps) if gap > 0 else statistics.median(reps)
            rows.append({"kind": kind, "bytes": n * 4, "ranks": world, "time_s": mid,
                         "median_rep_s": statistics.median(reps), "p25_s": stats(reps)[1],
                         "min_s": min(reps), "reps_s": reps, "stat": "mean" if gap > 0 else "median"})  # fmt: skip
            progress.update()
    return rows
