"""What CPU ranks add to a step beyond their compute (:mod:`sim.host.cpu_ranks`): the rank-to-rank
spread of identical compute segments before a rendezvous, and the late wake-ups after a blocking
collective; what :mod:`hw_validate.fits.cpu_ranks` reads. Both loops are GEMMs of one unit,
timed per call on every rank."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from hw_validate.microbenchmarks.harness import Bench


def _gemm_unit(b: Bench):
    """A 256x256 GEMM and how many of them make 1 ms (the same count on every rank): the unit of
    the compute segments of :func:`bench_noise` and :func:`bench_wake`."""
    a = torch.randn(256, 256, device=b.device)
    w = torch.randn(256, 256, device=b.device)

    def gemm():
        torch.mm(a, w)

    return gemm, b.iters_for(gemm, agree=True, target_s=1e-3)


def bench_noise(b: Bench, world: int, progress) -> list[dict]:
    """Rank-to-rank spread of identical compute (``noise: {"segments_s": [...], "calls": N}``).

    Every rank runs the same GEMM loop, lasting about each of ``segments_s``, right after a barrier,
    then joins a tiny all-reduce (as a layer's compute ends at an all-to-all); each rank's segment
    time is recorded per call. The row keeps, per call, every rank's time: the fit
    (:func:`hw_validate.fits.cpu_ranks.fit_noise`) turns the spread across ranks into the relative
    standard deviation of a rank's segment time, which the simulator draws per compute segment
    and rank, so the ranks reach each all-to-all at different times and wait for the last, as in
    the job. Measured on this VM (2 ranks, 1 thread each, segments of 1-65 ms): the ranks differ by
    ~10% of the segment, partly persistently (one vCPU faster for a while); in the e8-top1-t512 job
    the later rank reaches each all-to-all 1-2 ms after the first (segments of 3-7 ms)."""
    cfg = b.spec.get("noise") or {}
    rows: list[dict] = []
    if world < 2 or not cfg.get("segments_s"):
        return rows
    tiny = torch.zeros(1, device=b.device)
    gemm, per = _gemm_unit(b)
    calls = int(cfg.get("calls", 20))
    for seg in cfg["segments_s"]:
        n = max(1, round(per * float(seg) / 1e-3))
        gemm()
        mine = []
        for _ in range(calls):
            dist.barrier()
            b.sync()
            t0 = time.perf_counter()
            for _ in range(n):
                gemm()
            b.sync()
            mine.append(time.perf_counter() - t0)
            dist.all_reduce(tiny)
        t = torch.tensor(mine, dtype=torch.float64, device=b.device)
        every = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(every, t)
        rows.append({"segment_s": float(seg), "gemms": n, "calls": calls,
                     "per_rank_s": [e.cpu().tolist() for e in every]})  # fmt: skip
        progress.update()
    return rows


def bench_wake(b: Bench, world: int, progress) -> list[dict]:
    """Late wake-ups after a blocking collective (``wake: {"segments_s": [...], "calls": N, "bytes": B}``).

    Every call: a barrier, 1 ms of GEMMs on every rank, an ``all_to_all_single`` of ``bytes`` per
    rank, then a compute segment of each of ``segments_s`` -- as a layer's all-to-all is followed by
    the next op's compute. Each rank records when it left the collective; the row keeps, per call,
    the spread of the exits (last rank's exit - first rank's). Measured on this VM (2 ranks, 1
    thread each, 2 vCPUs, 2026-12-04): with nothing after the call the ranks leave within
    0.1-0.3 ms; with a 2 ms segment after it, one call in 3-5 has one rank leaving 1-2.5 ms late
    (gloo's completion wakes it on the core the peer is computing on, so it waits for the peer's
    segment to end); in the e8-top1-t512 job the exit spreads are 0 or 0.5-4.3 ms. The fit
    (:func:`hw_validate.fits.cpu_ranks.fit_wake`) gives ``wake_delay_p`` and ``wake_delay_cap_s``."""
    cfg = b.spec.get("wake") or {}
    rows: list[dict] = []
    if world < 2 or not cfg.get("segments_s"):
        return rows
    n = int(cfg.get("bytes", 65536)) // 4 // world * world
    x = torch.ones(max(world, n), device=b.device)
    y = torch.empty_like(x)
    gemm, per = _gemm_unit(b)
    calls = int(cfg.get("calls", 40))
    dist.all_to_all_single(y, x)
    for seg in [0.0, *cfg["segments_s"]]:
        after = max(0, round(per * float(seg) / 1e-3))
        exits = []
        for _ in range(calls):
            dist.barrier()
            for _ in range(per):
                gemm()
            dist.all_to_all_single(y, x)
            exits.append(time.perf_counter())
            for _ in range(after):
                gemm()
        t = torch.tensor(exits, dtype=torch.float64, device=b.device)
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)  # perf_counter is one clock for the ranks of one host
        every = torch.stack(parts)
        spread = (every.max(0).values - every.min(0).values).cpu().tolist()
        rows.append({"segment_s": float(seg), "gemms_after": after, "calls": calls, "bytes": n * 4,
                     "exit_spread_s": spread})  # fmt: skip
        progress.update()
    return rows
