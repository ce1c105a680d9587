"""What a rank of :mod:`hw_validate.train_moe` does around its training: whether it can run here at
all (torch, DeepSpeed, a GPU per local rank: :func:`preflight`), its CPU threads, the heartbeat the
launcher watches (``$MOESIM_RUN_DIR/status/rank<r>.json``), and the fault injection of the
launcher's tests (``MOESIM_KILL_RANK``, ``MOESIM_KILL_AT_STEP``, ``MOESIM_FAULT``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from sim.ioutil import atomic_write_text


class Heartbeat:
    """``$MOESIM_RUN_DIR/status/rank<r>.json``: pid, step and time, rewritten every step."""

    def __init__(self, rank: int):
        run_dir = os.environ.get("MOESIM_RUN_DIR")
        self.path = Path(run_dir) / "status" / f"rank{rank}.json" if run_dir else None
        self.rank = rank

    def beat(self, step: int | None, state: str) -> None:
        if self.path is not None:
            rec = {"rank": self.rank, "pid": os.getpid(), "step": step, "state": state, "time": time.time()}
            atomic_write_text(self.path, json.dumps(rec) + "\n")


def inject_fault(rank: int, step: int) -> None:
    """``MOESIM_KILL_RANK`` / ``MOESIM_KILL_AT_STEP`` / ``MOESIM_FAULT`` (exit | hang)."""
    if os.environ.get("MOESIM_KILL_RANK") != str(rank) or os.environ.get("MOESIM_KILL_AT_STEP", "0") != str(step):
        return
    if os.environ.get("MOESIM_FAULT", "exit") == "hang":
        print(f"[rank {rank}] fault injection: hanging at step {step}", flush=True)
        while True:
            time.sleep(3600)
    print(f"[rank {rank}] fault injection: exiting with status 1 at step {step}", flush=True)
    os._exit(1)


def _threads(accelerator: str) -> None:
    import torch

    if accelerator == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))


def preflight() -> str | None:
    """Why this rank cannot run here (None if it can): DeepSpeed or torch missing, or the CUDA
    accelerator asked for (``DS_ACCELERATOR=cuda``, or picked by DeepSpeed) without a GPU for every
    local rank. Said in one line before DeepSpeed fails deeper down with a longer story."""
    for name in ("torch", "deepspeed"):
        try:
            __import__(name)
        except ImportError as exc:
            return (f"{name} cannot be imported by {sys.executable} ({exc}); install the hw extra: "
                    f"pip install torch==2.13.0 && pip install -e '.[hw]'")  # fmt: skip
    import torch
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cuda":
        return None
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= local:
        return None
    built = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    return (f"the CUDA accelerator is selected (DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR', 'auto')}) but torch "
            f"{torch.__version__} ({built}) sees {have} GPU(s) for {local} local ranks: run on a node with {local} "
            f"GPUs, launch fewer ranks, or set DS_ACCELERATOR=cpu for CPU ranks on gloo")  # fmt: skip
