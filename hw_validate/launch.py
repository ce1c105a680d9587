"""Launch a scenario's real DeepSpeed job (``deepspeed`` or ``torchrun``) and supervise it.

::

    python -m hw_validate.launch --scenario scenarios/cpu-2rank.yaml [--nproc 2] [--launcher deepspeed|torchrun]
        [--steps N] [--out DIR] [--timeout S] [--set k=v]... [-- EXTRA train_moe ARGS]

or from Python (``moesim validate`` does)::

    res = run_job("scenarios/cpu-2rank.yaml", nproc=2, out_dir="runs/cpu-2rank", steps=10)
    res.measurement, res.trace        # paths of measurement.json and router_trace.json

The job runs in a fresh staging folder ``OUT/.staging-*``; each rank runs under
:mod:`hw_validate.rankwrap` (per-rank log, exit status). Only when every rank exited 0 and both
result files exist are they moved into ``OUT`` (trace first, then measurement; logs to
``OUT/logs``). Otherwise nothing in ``OUT`` is touched except a new ``OUT/failed-<time>/`` with the
logs, and :class:`JobError` names the rank that died (its exit status, step and last log lines) or,
after ``--timeout`` (or ``--stall-timeout`` seconds in which no rank started a new step, counted once
every rank has started stepping), the rank that looks hung (heartbeats and ``faulthandler`` stacks, taken by
sending SIGUSR1 before the job's process group is stopped).

Exit status of the CLI: 0 ok; 2 bad input (scenario, rank count); 1 the job failed or timed out.
No torch import here: the launcher runs on any Python with the scenario schema.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hw_validate.diagnose import cause_of, explain_exit, explain_timeout, read_states
from hw_validate.jit_ops import BuildError, accelerator_of, cpu_rank_env, needed_ops, prepare
from sim.api import load_scenario
from sim.errors import InputError
from sim.reports import progress

HERE = Path(__file__).resolve().parent
TRAIN_SCRIPT = HERE / "train_moe.py"
WRAPPER = HERE / "rankwrap.py"
MEASUREMENT_FILE = "measurement.json"
TRACE_FILE = "router_trace.json"
LAUNCHERS = ("deepspeed", "torchrun")


class JobError(RuntimeError):
    """A launched job failed or hung; ``rank`` is the rank to blame (None when unknown)."""

    def __init__(self, message: str, rank: int | None = None, run_dir: Path | None = None, returncode: int | None = None):
        super().__init__(message)
        self.rank, self.run_dir, self.returncode = rank, run_dir, returncode


@dataclass
class JobResult:
    out_dir: Path
    measurement: Path
    trace: Path
    logs: Path
    wall_s: float
    command: list[str]


def missing_packages(launcher: str) -> None:
    """Raise :class:`JobError` (one line) when this Python lacks what the job imports: torch, and
    DeepSpeed (the job's engine, and the ``deepspeed`` launcher). Cheap: looks, does not import."""
    import importlib.util

    for name, why in (("torch", "the job's model"), ("deepspeed", "the job's engine" + (" and launcher" if launcher == "deepspeed" else ""))):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):  # blocked (sys.modules[name] = None) or broken
            spec = None
        if spec is None:
            raise JobError(
                f"{name} is not installed for {sys.executable} ({why}): install the hw extra, "
                f"`pip install torch==2.13.0 && pip install -e '.[hw]'` (a CUDA build of torch on GPU machines)"
            )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: DeepSpeed's CPU shared-memory all-reduce (``deepspeed_shm_comm``, ops/csrc/cpu/comm/shm.cpp)
#: creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>`` (66 MB a rank in 0.19.8)
#: and never unlinks it. On this VM a day of jobs left 334 of them, 21 GiB of its 24 GiB of memory,
#: until a four-rank test job was OOM-killed. The harness removes a job's buffers when it ends.
SHM_DIR = Path("/dev/shm")


def remove_shm_buffers(port: int, shm_dir: Path = SHM_DIR) -> int:
    """Unlink the DeepSpeed shared-memory buffers of the job whose master port was ``port`` (this
    user's, any address and rank); how many were removed. Call it once the job's ranks are gone."""
    n = 0
    for f in shm_dir.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{int(port)}_*"):
        with contextlib.suppress(OSError):
            f.unlink()
            n += 1
    return n


def launcher_head(launcher: str, nproc: int, master_port: int) -> list[str]:
    """The launcher's part of the command line, for ``nproc`` ranks on this host."""
    if launcher == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nproc), "--master_port", str(master_port)]
    if launcher == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(master_port),
        ]  # fmt: skip
    raise InputError(f"unknown launcher '{launcher}'; use one of {', '.join(LAUNCHERS)}", field="--launcher")


def build_command(launcher: str, nproc: int, script_args: list[str], master_port: int) -> list[str]:
    """The launcher command line: every rank runs ``rankwrap.py train_moe.py SCRIPT_ARGS``."""
    head = launcher_head(launcher, nproc, master_port)
    return [*head, str(WRAPPER), str(TRAIN_SCRIPT), *script_args]


#: the job's line per step (hw_validate/train_moe.py), read for the progress bar
_STEP_LINE = re.compile(r"^step\s+(\d+)/(\d+)\s")


def _pump(stream, log_path: Path, echo: bool, keep: collections.deque) -> None:
    """Copy the job's output to its log and, with ``echo``, to stdout (above the progress bar when
    one shows); its step lines move the bar (:mod:`sim.reports.progress`)."""
    with stream, open(log_path, "wb") as log:
        for line in iter(stream.readline, b""):
            log.write(line)
            log.flush()
            text = line.decode("utf-8", "replace").rstrip("\n")
            keep.append(text)
            m = _STEP_LINE.match(text)
            if m:
                progress.report(int(m[1]) / int(m[2]), f"step {m[1]}/{m[2]}")
            if echo:
                try:
                    if progress.active():
                        progress.write(text)
                    else:
                        sys.stdout.buffer.write(line)
                        sys.stdout.flush()
                except (BrokenPipeError, OSError):
                    pass


def stop_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the job's process group (the one this function's caller started), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _dump_stacks(states) -> None:
    for s in states:
        if s.pid and s.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(s.pid, signal.SIGUSR1)


def _supervise(
    proc: subprocess.Popen, run_dir: Path, nproc: int, t0: float, timeout_s: float, stall_timeout_s: float | None
) -> tuple[int | None, str]:
    """Wait for the job; (returncode, "") when it ended, (None, reason) when it ran too long or stalled."""
    while True:
        try:
            return proc.wait(timeout=0.5), ""
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() - t0 > timeout_s:
            return None, f"job timed out after {timeout_s:g} s"
        if stall_timeout_s is not None:
            beats = [(s.step, s.beat_at) for s in read_states(run_dir, nproc, logs=False)]
            if all(step is not None and at is not None for step, at in beats):
                newest = max(at for _, at in beats)
                if time.time() - newest > stall_timeout_s:
                    return None, f"job stalled: no rank started a step for {stall_timeout_s:g} s"


def run_job(
    scenario_path: str | Path,
    nproc: int | None = None,
    out_dir: str | Path | None = None,
    steps: int | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    timeout_s: float = 900.0,
    launcher: str = "deepspeed",
    extra_args: list[str] | tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    echo: bool = True,
    stall_timeout_s: float | None = None,
) -> JobResult:
    """Run the scenario's DeepSpeed job on ``nproc`` local ranks; raise :class:`JobError` if it fails."""
    scen = load_scenario(scenario_path, list(overrides))
    if scen.cluster.nodes != 1:
        raise InputError(
            f"the launcher runs one node; for {scen.cluster.nodes} nodes run `deepspeed --hostfile H "
            f"--num_nodes {scen.cluster.nodes} hw_validate/train_moe.py --scenario {scenario_path}` on the cluster",
            file=str(scenario_path),
            field="cluster.nodes",
        )
    nproc = scen.world_size if nproc is None else nproc
    if nproc != scen.world_size:
        raise InputError(
            f"--nproc {nproc} but the scenario describes {scen.world_size} ranks; "
            f"add --set cluster.gpus_per_node={nproc} to run it on {nproc}",
            file=str(scenario_path),
            field="--nproc",
        )
    if launcher not in LAUNCHERS:
        raise InputError(f"unknown launcher '{launcher}'; use one of {', '.join(LAUNCHERS)}", field="--launcher")
    if steps is not None and steps < 1:
        raise InputError("must be >= 1", field="--steps")
    missing_packages(launcher)
    out = Path(out_dir) if out_dir is not None else Path("runs") / scen.name
    staging, script_args = stage_run(out, scenario_path, overrides, steps)
    script_args += list(extra_args)
    port = free_port()
    cmd = build_command(launcher, nproc, script_args, port)
    run_env = rank_env(os.environ if env is None else env, staging)
    run_env["MOESIM_LAUNCHER"] = launcher
    try:
        prepare_ops(needed_ops(accelerator_of(run_env), scen.training.offload_optimizer), run_env, timeout_s, echo)
    except JobError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=run_env, start_new_session=True)
    keep: collections.deque = collections.deque(maxlen=40)
    pump = threading.Thread(target=_pump, args=(proc.stdout, staging / "job.log", echo, keep), daemon=True)
    pump.start()
    try:
        rc, why = _supervise(proc, staging, nproc, t0, timeout_s, stall_timeout_s)
        if rc is None:
            _dump_stacks(read_states(staging, nproc))
            time.sleep(2.0)
            states = read_states(staging, nproc, n_lines=25)
            stop_group(proc)
            pump.join(timeout=5)
            failed = keep_failed(staging, out)
            rank, msg = explain_timeout(states, why, failed)
            raise JobError(msg, rank=rank, run_dir=failed, returncode=None)
    except BaseException:
        stop_group(proc)
        raise
    finally:
        remove_shm_buffers(port)
    pump.join(timeout=10)
    wall = time.monotonic() - t0
    meas, trace = staging / MEASUREMENT_FILE, staging / TRACE_FILE
    if rc != 0 or not meas.is_file() or not trace.is_file():
        states = read_states(staging, nproc)
        if rc == 0:
            rank, msg = None, f"every rank exited 0 but {MEASUREMENT_FILE} / {TRACE_FILE} are missing"
        else:
            rank, msg = explain_exit(states, rc, staging)
        if rank is None and keep:
            cause = cause_of(list(keep))
            if cause:
                msg = msg.replace("\n", f": {cause}\n", 1) if "\n" in msg else f"{msg}: {cause}"
            msg += "\n  last lines of the launcher:\n" + "\n".join(f"    {line}" for line in list(keep)[-15:])
        failed = keep_failed(staging, out)
        raise JobError(msg.replace(str(staging), str(failed)), rank=rank, run_dir=failed, returncode=rc)
    os.replace(trace, out / TRACE_FILE)
    os.replace(meas, out / MEASUREMENT_FILE)
    logs = keep_logs(staging, out)
    return JobResult(out, out / MEASUREMENT_FILE, out / TRACE_FILE, logs, wall, cmd)


def prepare_ops(ops: list[str], env: dict[str, str], timeout_s: float, echo: bool) -> None:
    """Compile the DeepSpeed ops the job loads (once) and clear locks left by killed builds, before
    the ranks start (see :mod:`hw_validate.jit_ops`); a failed compile is a :class:`JobError`."""
    def log(msg: str) -> None:
        if echo:
            print(msg, file=sys.stderr, flush=True)

    try:
        prepare(ops, env=env, timeout_s=timeout_s, log=log)
    except BuildError as e:
        raise JobError(str(e)) from None


def stage_run(out: Path, scenario: str | Path, overrides, steps: int | None) -> tuple[Path, list[str]]:
    """A fresh staging folder inside ``out`` (the job writes there; moved into ``out`` only when it
    succeeded) and the training script's common arguments: scenario, output, overrides, steps."""
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=out))
    args = ["--scenario", str(Path(scenario).resolve()), "--out", str(staging)]
    for o in overrides:
        args += ["--set", o]
    if steps is not None:
        args += ["--steps", str(steps)]
    return staging, args


def rank_env(base, staging: Path) -> dict[str, str]:
    """The ranks' environment: :func:`~hw_validate.jit_ops.cpu_rank_env` of ``base``, the run folder
    the rank wrapper writes into, unbuffered output and this repository first on ``PYTHONPATH``."""
    env = cpu_rank_env(base)
    env.update(MOESIM_RUN_DIR=str(staging), PYTHONUNBUFFERED="1")
    root = str(HERE.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def keep_logs(staging: Path, out: Path) -> Path:
    """A finished job's logs into ``out/logs`` (replacing older ones), its staging folder removed."""
    logs = out / "logs"
    if logs.exists():
        shutil.rmtree(logs)
    os.replace(staging / "logs", logs)
    os.replace(staging / "job.log", logs / "job.log")
    shutil.rmtree(staging, ignore_errors=True)
    return logs


def keep_failed(staging: Path, out: Path) -> Path:
    """A failed job's staging folder kept as ``out/failed-<time>`` (its path; the staging one if the
    move fails)."""
    target = out / time.strftime("failed-%Y%m%d-%H%M%S")
    n = 1
    while target.exists():
        target = out / (time.strftime("failed-%Y%m%d-%H%M%S") + f"-{n}")
        n += 1
    try:
        os.replace(staging, target)
    except OSError:
        return staging
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hw_validate.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: the scenario's world size)")
    ap.add_argument("--launcher", choices=LAUNCHERS, default="deepspeed")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--out", default=None, help="result folder (default runs/<scenario>)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds before the job counts as hung")
    ap.add_argument("--stall-timeout", type=float, default=None, help="seconds without a new step (once all ranks stepped)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--quiet", action="store_true", help="do not echo the job's output")
    ap.add_argument("extra", nargs="*", help="after --: more train_moe.py arguments (e.g. --init upcycle ...)")
    args = ap.parse_args(argv)
    try:
        res = run_job(
            args.scenario, args.nproc, args.out, args.steps, args.overrides, args.timeout,
            args.launcher, args.extra, echo=not args.quiet, stall_timeout_s=args.stall_timeout,
        )  # fmt: skip
    except InputError as exc:
        print(f"launch: error: {exc}", file=sys.stderr)
        return 2
    except JobError as exc:
        print(f"launch: error: {exc}", file=sys.stderr)
        return 1
    print(f"launch: ok in {res.wall_s:.1f} s: {res.measurement} and {res.trace} (logs in {res.logs})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
