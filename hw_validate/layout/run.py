"""Launch a layout job's rank script on local ranks under ``torchrun`` and supervise it. No torch here.

Each rank runs under :mod:`hw_validate.rankwrap` (its output in ``logs/rank<r>.log``, its exit in
``status/``), in a staging folder inside the output folder; only when every rank exited 0 and the
measurement exists does it move to ``OUT/measurement.json`` (logs to ``OUT/logs``). A failed or
timed-out job is a :class:`hw_validate.launch.JobError` naming the rank, its exit status and last
lines (:mod:`hw_validate.diagnose`), with the logs kept in ``OUT/failed-*``.

The machine's load is recorded: the share of its CPU time that was busy during the job, the job's
own share and the rest (other processes), from ``/proc/stat`` and the job's CPU time. On a shared
host, other processes competing for the cores delay gloo's communication threads and the ranks'
wake-ups, which the record should say; ``quiet`` waits (up to ``quiet_wait_s``) until the machine's
busy share over 5 s is below it before starting.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hw_validate.diagnose import explain_exit, read_states
from hw_validate.launch import (
    WRAPPER,
    JobError,
    free_port,
    keep_failed,
    keep_logs,
    launcher_head,
    rank_env,
    stage_run,
    stop_group,
)
from sim.api import load_scenario
from sim.errors import InputError

HERE = Path(__file__).resolve().parent
SCRIPTS = {"pipeline": HERE / "pipeline_rank.py", "tensor_parallel": HERE / "tp_rank.py"}
MEASUREMENT_FILE = "measurement.json"


@dataclass
class LayoutJob:
    measurement: Path
    logs: Path
    wall_s: float
    command: list[str]
    load: dict[str, float]


def _cpu() -> tuple[float, float, float, float]:
    """(total jiffies, idle jiffies, our children's CPU seconds, monotonic time)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    t = os.times()
    return float(sum(v)), float(v[3] + v[4]), t.children_user + t.children_system, time.monotonic()


def _share(a, b) -> dict[str, float]:
    """The machine's busy share of its CPU capacity between two :func:`_cpu` samples, ours, the others'."""
    total, idle = b[0] - a[0], b[1] - a[1]
    busy = (total - idle) / total if total else 0.0
    ours = (b[2] - a[2]) / max(1e-9, (b[3] - a[3]) * (os.cpu_count() or 1))
    return {"machine_busy": round(busy, 3), "job": round(min(ours, busy), 3), "others": round(max(0.0, busy - ours), 3)}


def wait_quiet(max_busy: float, limit_s: float) -> float:
    """Wait until the machine was busy less than ``max_busy`` of its CPU over 5 s; seconds waited."""
    t0 = time.monotonic()
    while max_busy > 0 and time.monotonic() - t0 < limit_s:
        a = _cpu()
        time.sleep(5.0)
        if _share(a, _cpu())["machine_busy"] < max_busy:
            break
    return time.monotonic() - t0


def run_layout_job(job: str, scenario: str | Path, out_dir: str | Path, steps: int | None = None,
                   warmup: int | None = None, overrides: list[str] | tuple[str, ...] = (),
                   timeout_s: float = 600.0, echo: bool = False, quiet: float = 0.0,
                   quiet_wait_s: float = 300.0) -> LayoutJob:  # fmt: skip
    """Run the ``job`` (``pipeline`` | ``tensor_parallel``) of ``scenario`` on its world size of
    local CPU ranks (gloo); raise :class:`JobError` if it fails or runs past ``timeout_s``."""
    s = load_scenario(scenario, list(overrides))
    if s.cluster.nodes != 1:
        raise InputError("the layout jobs run on one host", file=str(scenario), field="cluster.nodes")
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise JobError("torch is not installed for this Python: install the hw extra, `pip install -e '.[hw]'`")
    out = Path(out_dir)
    staging, args = stage_run(out, scenario, overrides, steps)
    if warmup is not None:
        args += ["--warmup", str(warmup)]
    cmd = [*launcher_head("torchrun", s.world_size, free_port()), str(WRAPPER), str(SCRIPTS[job]), *args]
    env = rank_env({**os.environ, "DS_ACCELERATOR": "cpu"}, staging)
    waited = wait_quiet(quiet, quiet_wait_s)
    before = _cpu()
    t0 = time.monotonic()
    with open(staging / "job.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=None if echo else log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            failed = keep_failed(staging, out)
            raise JobError(f"{job} job timed out after {timeout_s:g} s; logs in {failed}", run_dir=failed) from None
        except BaseException:
            stop_group(proc)
            raise
    wall = time.monotonic() - t0
    load = {**_share(before, _cpu()), "waited_quiet_s": round(waited, 1), "loadavg_1m": os.getloadavg()[0]}
    meas = staging / MEASUREMENT_FILE
    if rc != 0 or not meas.is_file():
        states = read_states(staging, s.world_size)
        rank, msg = explain_exit(states, rc, staging) if rc != 0 else (None, f"every rank exited 0 but no {MEASUREMENT_FILE}")
        failed = keep_failed(staging, out)
        raise JobError(f"{job} job failed: " + msg.replace(str(staging), str(failed)), rank=rank, run_dir=failed,
                       returncode=rc)  # fmt: skip
    os.replace(meas, out / MEASUREMENT_FILE)
    logs = keep_logs(staging, out)
    return LayoutJob(out / MEASUREMENT_FILE, logs, wall, cmd, load)


__all__ = ["SCRIPTS", "LayoutJob", "run_layout_job", "wait_quiet"]
