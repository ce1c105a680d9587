"""Rank side of the layout jobs: the flags every rank script takes, process-group start-up, the span
recorder and the end of a job (every rank's spans gathered to rank 0, which writes the file of
:mod:`hw_validate.layout.record`).

One clock for every rank: ``time.perf_counter`` is ``CLOCK_MONOTONIC`` on Linux, the same clock in
every process of a host, so a send posted by one rank and the receive it completes on another are
comparable instants (the transfer time of a pipeline send is measured that way). A step starts with a
``dist.barrier()``; its origin is the earliest rank's exit from it.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from hw_validate.calibration_cache import cpu_model
from hw_validate.layout.record import FORMAT, VERSION
from hw_validate.train_rank import Heartbeat
from sim.api import load_scenario
from sim.inputs.scenario import Scenario
from sim.ioutil import atomic_write_text, dumps_json

clock = time.perf_counter
MEASUREMENT_FILE = "measurement.json"


def parse_args(prog: str, argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--steps", type=int, default=None, help="default training.steps")
    ap.add_argument("--warmup", type=int, default=None, help="default training.warmup_steps")
    ap.add_argument("--out", required=True, help="folder of measurement.json")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def start(args: argparse.Namespace) -> tuple[Scenario, int, int]:
    """Load the scenario, join the gloo process group, one thread per local rank unless
    ``OMP_NUM_THREADS`` says otherwise (the rule of ``hw_validate/train_moe.py``); (scenario, steps, warm-up)."""
    s = load_scenario(args.scenario, args.overrides)
    dist.init_process_group("gloo")
    if "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    if dist.get_world_size() != s.world_size:
        raise SystemExit(f"the scenario describes {s.world_size} ranks, the job has {dist.get_world_size()}")
    steps = args.steps if args.steps is not None else s.training.steps
    warmup = args.warmup if args.warmup is not None else s.training.warmup_steps
    if not 0 <= warmup < steps:
        raise SystemExit(f"warm-up steps ({warmup}) must be fewer than the steps ({steps})")
    return s, steps, warmup


class Recorder:
    """The spans of one rank, per step, on the shared clock (absolute until :func:`finish`)."""

    def __init__(self) -> None:
        self.steps: list[list[list]] = []
        # $MOESIM_RUN_DIR/status/rank<r>.json: a failed job's diagnosis names the step a rank died in
        self.heartbeat = Heartbeat(dist.get_rank())
        self.heartbeat.beat(None, "init")

    def begin_step(self) -> float:
        self.heartbeat.beat(len(self.steps), "step")
        dist.barrier()
        t = clock()
        self.steps.append([])
        self.mark("step_start", t)
        return t

    def span(self, name: str, start: float, end: float, **args: Any) -> None:
        self.steps[-1].append([name, start, end, args])

    def mark(self, name: str, t: float, **args: Any) -> None:
        self.span(name, t, t, **args)


def collective_sweep(name: str, call, sizes: list[int], reps: int = 15) -> list[dict[str, Any]]:
    """Isolated timings of ``call(nbytes)`` (returns None or its real entry time) on every rank (all idle, started together after a barrier):
    per size the median over ``reps`` of the first rank's exit and the last rank's exit, from the last
    rank's entry (the shared clock); what the same transport costs without the job's compute around it."""
    out = []
    for n in sizes:
        firsts, lasts = [], []
        for _ in range(reps):
            dist.barrier()
            t0 = clock()
            entry = call(n)  # a call may say when it really entered (after a deliberate delay)
            t1 = clock()
            t0 = t0 if entry is None else entry
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, (t0, t1))
            start = max(a for a, _ in every)
            firsts.append(min(b for _, b in every) - start)
            lasts.append(max(b for _, b in every) - start)
        out.append({"name": name, "bytes": n, "first_exit_s": float(sorted(firsts)[reps // 2]),
                    "last_exit_s": float(sorted(lasts)[reps // 2]), "reps": reps})  # fmt: skip
    return out


def _environment(world: int) -> dict[str, Any]:
    cpu = cpu_model()
    return {
        "hostname": socket.gethostname(), "python": platform.python_version(), "torch": torch.__version__,
        "backend": str(dist.get_backend()), "world_size": world, "threads_per_rank": torch.get_num_threads(),
        "launcher": "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "unknown", "cpu": cpu,
        "cpu_count": os.cpu_count(),
    }  # fmt: skip


def finish(args: argparse.Namespace, job: str, s: Scenario, rec: Recorder, config: dict[str, Any],
           losses: list[float], warmup: int, sweep: list[dict[str, Any]] | None = None) -> None:  # fmt: skip
    """Gather every rank's spans to rank 0; rank 0 writes ``OUT/measurement.json`` with each step's
    spans relative to its origin (the earliest rank's ``step_start``)."""
    rec.heartbeat.beat(len(rec.steps), "writing")
    world = dist.get_world_size()
    every: list[Any] = [None] * world
    dist.all_gather_object(every, rec.steps)
    if dist.get_rank() != 0:
        return
    steps = len(rec.steps)
    spans = []
    for i in range(steps):
        origin = min(next(sp[1] for sp in every[r][i] if sp[0] == "step_start") for r in range(world))
        spans.append([[[n, a - origin, b - origin, x] for n, a, b, x in every[r][i] if n != "step_start"]
                      for r in range(world)])  # fmt: skip
    data = {
        "format": FORMAT, "version": VERSION, "job": job, "scenario": s.name,
        "scenario_file": str(args.scenario), "overrides": list(args.overrides), "created_unix_s": time.time(),
        "environment": _environment(world), "config": config, "steps": steps, "warmup_steps": warmup,
        "measured_steps": list(range(warmup, steps)),
        "clock": "time.perf_counter (CLOCK_MONOTONIC, one clock for every rank of the host)",
        "spans": spans, "loss": losses, "sweep": sweep or [],
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / MEASUREMENT_FILE, dumps_json(data))


def end(rec: Recorder) -> NoReturn:
    """Leave the process group and end the rank's process at once: everything is written, and
    skipping the interpreter's teardown keeps C++ worker threads of gloo and the functional
    collectives from aborting the exit ("terminate called without an active exception", seen
    once on a loaded machine) after a successful job."""
    dist.destroy_process_group()
    rec.heartbeat.beat(len(rec.steps), "done")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)
        sys.stdout.flush()


__all__ = ["MEASUREMENT_FILE", "Recorder", "clock", "collective_sweep", "end", "finish", "log", "parse_args", "start"]
