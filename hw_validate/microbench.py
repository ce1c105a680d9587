"""Microbenchmarks of one machine, run as a real multi-rank job (one process per rank).

Launched by :mod:`hw_validate.calibrate` (``moesim calibrate``, through
:mod:`hw_validate.microbenchmarks.runner`) with ``torchrun`` or the ``deepspeed`` launcher; every
rank runs::

    python hw_validate/microbench.py --spec SPEC.json --out RESULT.json

This script is the job: it reads the spec, runs each item in turn and merges the ranks' results;
how each item is measured is in :mod:`hw_validate.microbenchmarks`, one module per kind.

``SPEC.json`` (written by the driver) says what to measure::

    {"backend": "gloo" | "nccl", "dtypes": ["fp32"],
     "comm": {"kinds": ["all_to_all", "all_reduce"], "sizes": [4096, ...], "reps": 5, "target_s": 0.02},
     "gemm": [[m, n, k], ...],                      # (m x k) @ (k x n)
     "attention": [[batch, heads, seq, head_dim], ...],
     "memory_elements": [65536, ...], "memory_ops": ["add", "gelu", "layer_norm", "softmax"],
     "launch_ops": 2000,
     "optimizer_params": [100000, 1000000], "optimizer": {"impl": "deepspeed", "zero_stage": 2},
     "dispatcher": [[tokens, d, experts, k, capacity_factor, min_capacity, drop_tokens], ...],  # DeepSpeed's gate/permute
     "reps": 5, "target_s": 0.02,
     "flush_bytes": 33554432, "cold_iters": 4,      # optional: cold-cache compute timing
     "noise": {"segments_s": [0.001, 0.004], "calls": 20},  # optional: rank-to-rank compute spread
     "wake": {"segments_s": [0.001, 0.002, 0.004, 0.008], "calls": 40, "bytes": 65536}}  # optional (CPU)

Cold caches (``flush_bytes`` > 0, what ``moesim calibrate`` asks for on CPU ranks): every timed GEMM
and optimizer step is preceded by a read of a buffer larger than the last-level cache, because in
the training job the rest of the step evicts an op's weights (and the optimizer's states) before it
runs again; the GEMM's activation operand is then touched again (the previous op just wrote it).
Memory-bound ops and attention's core read only activations just written, so they stay warm. Measured inside a 2-rank e4-top2-d128 job (2026-12-03): the
``Experts`` forward took 2.57 ms a call in the job, 1.63 ms when re-run in a tight loop on the same
input in the same process, and 2.49 ms in that loop with a 32 MiB read before each call.

Rank 0 writes ``RESULT.json`` (atomically): seconds per call for every item, the median over
``reps`` timed repetitions (each a loop long enough to last ``target_s``), and for compute items
the median over ranks. Every rank computes at the same time (a barrier before each item), as the
ranks of the training job do, so shared memory bandwidth and cores are shared the same way.
Collectives: each repetition's time is the slowest rank's (all-reduce MAX), nccl-tests style.

Threads: on CPU ranks each rank uses ``cpu_count // local ranks`` threads unless
``OMP_NUM_THREADS`` is set -- the rule of ``hw_validate/train_moe.py`` -- so that calibration and
the training job see the same compute. Progress goes to rank 0's stderr (tqdm).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun / deepspeed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hw_validate.microbenchmarks.collectives import bench_comm  # noqa: E402
from hw_validate.microbenchmarks.compute import (  # noqa: E402
    MEMORY_OPS,
    bench_attention,
    bench_gemm,
    bench_launch,
    bench_memory,
)
from hw_validate.microbenchmarks.cpu_ranks import bench_noise, bench_wake  # noqa: E402
from hw_validate.microbenchmarks.dispatcher import bench_dispatcher  # noqa: E402
from hw_validate.microbenchmarks.harness import Bench, set_threads  # noqa: E402
from hw_validate.microbenchmarks.optimizer import bench_optimizer  # noqa: E402

COMPUTE_KEYS = ("gemm", "attention", "memory", "optimizer", "dispatcher")


def _count(spec: dict, world: int) -> int:
    c = spec.get("comm") or {}
    n_comm = len(c.get("kinds", ())) * len(c.get("sizes", ())) if world > 1 else 0
    per_dtype = len(spec.get("gemm", ())) + len(spec.get("attention", ()))
    n_noise = len((spec.get("noise") or {}).get("segments_s", ())) if world > 1 else 0
    wake = (spec.get("wake") or {}).get("segments_s", ())
    n_noise += len(wake) + 1 if world > 1 and wake else 0
    n_comm += len(spec.get("dispatcher", ()))
    return n_comm + n_noise + per_dtype * len(spec.get("dtypes", ["fp32"])) + len(
        spec.get("memory_elements", ())) * len(spec.get("memory_ops", MEMORY_OPS)) + 1 + len(
        spec.get("optimizer_params", ())
    )


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="microbenchmarks", file=sys.stderr, disable=not enabled, dynamic_ncols=True)
    except ImportError:  # tqdm is a dependency of moesim; keep going without a bar if it is missing

        class _Null:
            def update(self, n=1):
                pass

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass

        return _Null()


def hardware(device: torch.device, backend: str, world: int, threads: int) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    return {
        "device": device.type,
        "device_name": name,
        "backend": backend,
        "world_size": world,
        "threads_per_rank": threads,
        "cpu_count": os.cpu_count(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES") or None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="microbench.py")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    backend = spec.get("backend", "gloo")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    threads = set_threads(device.type)
    dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    b = Bench(spec, device)
    bar = _progress(_count(spec, world), rank == 0)
    t0 = time.time()
    out: dict = {"hardware": hardware(device, backend, world, threads)}
    bar.set_postfix_str("collectives")
    out["comm"] = bench_comm(b, world, bar)
    bar.set_postfix_str("compute noise")
    out["noise"] = bench_noise(b, world, bar)
    bar.set_postfix_str("late wake-ups")
    out["wake"] = bench_wake(b, world, bar)
    out["gemm"], out["attention"] = [], []
    for dtype in spec.get("dtypes", ["fp32"]):
        bar.set_postfix_str(f"GEMM {dtype}")
        out["gemm"] += bench_gemm(b, dtype, bar)
        bar.set_postfix_str(f"attention {dtype}")
        out["attention"] += bench_attention(b, dtype, bar)
    bar.set_postfix_str("memory")
    out["memory"] = bench_memory(b, bar)
    out["launch"] = bench_launch(b, bar)
    bar.set_postfix_str("token dispatcher")
    out["dispatcher"] = bench_dispatcher(b, bar)
    bar.set_postfix_str("optimizer")
    out["optimizer"] = bench_optimizer(b, bar)
    bar.close()
    # compute items: median over ranks of each rank's statistics (collectives are already the MAX)
    local = {k: [{f: r[f] for f in r if f.endswith("_s")} for r in out[k]] for k in COMPUTE_KEYS}
    local["launch"] = [{f: v for f, v in out["launch"].items() if f.endswith("_s")}]
    every = [None] * world
    dist.all_gather_object(every, local)
    if rank == 0:
        for key in (*COMPUTE_KEYS, "launch"):
            rows = out[key] if key != "launch" else [out["launch"]]
            for i, r in enumerate(rows):
                for f in list(local[key][i]):
                    per_rank = [e[key][i][f] for e in every]
                    r[f] = statistics.median(per_rank)
                    if f == "time_s":
                        r["per_rank_s"] = per_rank
        out["wall_s"] = time.time() - t0
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(out, indent=1, sort_keys=True))
        os.replace(tmp, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
