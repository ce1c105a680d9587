"""The timing harness of the microbenchmark job (every rank of ``hw_validate/microbench.py``):
repetitions of a loop long enough to last ``target_s``, every rank at once after a barrier, with cold
caches where the job would have them (``flush_bytes``), and collectives timed nccl-tests style or as
isolated blocking calls after some compute (gloo); :func:`set_threads` gives a CPU rank the
training job's thread count."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}


def set_threads(device: str) -> int:
    """train_moe.py's rule: ``cpu_count // LOCAL_WORLD_SIZE`` threads per CPU rank unless OMP_NUM_THREADS."""
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    return torch.get_num_threads()


def stats(times: list[float]) -> tuple[float, float]:
    """(median, lower quartile) of repetition times. The fits read the median by default (what a
    call in a job typically pays); the quartile (``--stat p25``) is the least disturbed by other
    processes on a shared host while not the lucky extreme."""
    p25 = statistics.quantiles(times, n=4, method="inclusive")[0] if len(times) > 1 else times[0]
    return statistics.median(times), float(p25)


class Bench:
    """Times one rank's share of the job's items: ``spec`` is the job's SPEC.json (``reps``,
    ``target_s``, ``max_iters``, ``flush_bytes``, ``cold_iters``, ``comm``)."""

    def __init__(self, spec: dict, device: torch.device):
        self.spec, self.device = spec, device
        self.cuda = device.type == "cuda"
        self.reps = int(spec.get("reps", 5))
        self.target_s = float(spec.get("target_s", 0.02))
        self.max_iters = int(spec.get("max_iters", 1000))
        # cold-cache compute timing (CPU ranks): see _loop_cold; 0 = warm tight loops
        flush = int(spec.get("flush_bytes", 0))
        self._flush = torch.ones(flush // 4, dtype=torch.float32, device=device) if flush > 0 else None
        self.cold_iters = int(spec.get("cold_iters", 4))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _loop(self, fn, iters: int) -> float:
        self.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / iters

    def _loop_cold(self, fn, iters: int, warm=None) -> float:
        """Seconds per call of ``fn`` with cold caches: before each timed call, read the flush buffer
        (larger than the last-level cache), as the rest of a training step evicts an op's weights
        between two calls of it; then ``warm()`` (untimed) touches what the previous op of the job
        has just written (the activation input). The flush itself is not timed."""
        total = 0.0
        for _ in range(iters):
            self._flush.sum()
            if warm is not None:
                warm()
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            total += time.perf_counter() - t0
        return total / iters

    def _time_isolated(self, fn, reps: int, gap_s: float) -> list[float]:
        calls = max(1, int(self.spec.get("comm", {}).get("isolated_calls", 8)))
        fn()
        out = []
        for _ in range(reps):
            mine = []
            for _ in range(calls):
                dist.barrier()
                _spin(gap_s)
                self.sync()
                t0 = time.perf_counter()
                fn()
                self.sync()
                mine.append(time.perf_counter() - t0)
            t = torch.tensor(mine, dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            out.append(float(t.mean().item()))
        return out

    def iters_for(self, fn, agree: bool = False, target_s: float | None = None) -> int:
        """Iterations per repetition so that one lasts ``target_s``; ``agree``: the same on every rank."""
        fn()
        once = max(self._loop(fn, 1), 1e-7)
        if agree:
            t = torch.tensor([once], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            once = float(t.item())
        return int(min(self.max_iters, max(1, round((target_s or self.target_s) / once))))

    def time_local(self, fn, cold: bool = True, warm=None) -> tuple[float, float]:
        """(median, lower quartile) over repetitions of seconds per call of ``fn`` on this rank (all
        ranks run it at the same time). ``cold`` (and a ``flush_bytes`` spec): every call starts
        with cold caches (``cold_iters`` calls a repetition; ``warm``: see _loop_cold), as in the job."""
        dist.barrier()
        if cold and self._flush is not None:
            fn()
            times = [self._loop_cold(fn, self.cold_iters, warm) for _ in range(self.reps)]
            dist.barrier()
            return stats(times)
        iters = self.iters_for(fn)
        times = [self._loop(fn, iters) for _ in range(self.reps)]
        dist.barrier()
        return stats(times)

    def time_collective(self, fn, reps: int | None = None, target_s: float | None = None,
                        gap_s: float = 0.0) -> list[float]:  # fmt: skip
        """The slowest rank's seconds per call in each of ``reps`` repetitions (nccl-tests style:
        every repetition starts at a barrier, and its time is the MAX over ranks).

        ``gap_s`` > 0 (blocking backends, gloo): isolated calls instead of a back-to-back loop. Each
        call starts at a barrier followed by ``gap_s`` of busy compute on every rank, as a call in
        the training job follows the layer's compute; its time is the MIN over ranks of the time
        inside the call -- the last rank to arrive waits for nobody, so that is the collective's
        own cost, while the earlier ranks' extra time is waiting (the simulator's rendezvous).
        Measured on this VM (2 ranks): a 256 KiB all_to_all takes 0.23 ms a call in a loop, where
        gloo's calls pipeline, and ~0.5 ms isolated after 1 ms of compute (0.54-0.84 ms inside
        the e8-top1-t512 job from the last arrival to the first exit)."""
        if gap_s > 0:
            return self._time_isolated(fn, reps or self.reps, gap_s)
        iters = self.iters_for(fn, agree=True, target_s=target_s)
        out = []
        for _ in range(reps or self.reps):
            dist.barrier()
            dt = self._loop(fn, iters)
            t = torch.tensor([dt], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.append(float(t.item()))
        return out


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
