"""Run the microbenchmark job (``hw_validate/microbench.py``) on local ranks under ``torchrun`` or
the ``deepspeed`` launcher and supervise it: its output copied to a log (and to stderr), a run past
the timeout stopped, and a failed or hung job a :class:`hw_validate.launch.JobError` naming the
cause and the rank that printed it, with the log's last lines. No torch here."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections import deque
from pathlib import Path
from typing import Any

from hw_validate.diagnose import cause_of
from hw_validate.jit_ops import accelerator_of, cpu_rank_env, needed_ops
from hw_validate.launch import JobError, free_port, launcher_head, prepare_ops, remove_shm_buffers, stop_group
from sim.errors import InputError
from sim.reports import progress

ROOT = Path(__file__).resolve().parents[2]
#: the script every rank runs (as a script: torchrun and the deepspeed launcher take a path)
MICROBENCH = ROOT / "hw_validate" / "microbench.py"


class _ByteTail(deque):
    """The last ``limit`` bytes of the job's output, in the chunks they came in: tqdm redraws its bar
    in tiny chunks, so a count of chunks would lose the traceback that says why a rank failed."""

    def __init__(self, limit: int = 256 * 1024):
        super().__init__()
        self.limit, self.size = limit, 0

    def append(self, chunk: bytes) -> None:
        super().append(chunk)
        self.size += len(chunk)
        while self.size > self.limit and len(self) > 1:
            self.size -= len(self.popleft())


#: the job's own tqdm bar (hw_validate/microbench.py): "microbenchmarks:  45%|...| 20/44 [...]"
_BAR = re.compile(r"microbenchmarks:.*?(\d+)/(\d+)")


def _pump(stream, log_path: Path, echo: bool, tail: deque) -> None:
    """Copy the job's output to its log (and to our stderr), in raw chunks so tqdm's bar redraws.
    While moesim's own progress bar shows (:mod:`sim.reports.progress`), the job's bar moves it
    instead and the job's other lines are printed above it."""
    pending = ""
    with stream, open(log_path, "wb") as log:
        while True:
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                return
            log.write(chunk)
            log.flush()
            tail.append(chunk)
            if progress.active():
                pieces = re.split(r"[\r\n]", pending + chunk.decode("utf-8", "replace"))
                pending = pieces.pop()
                for piece in pieces:
                    m = _BAR.search(piece)
                    if m:
                        progress.report(int(m[1]) / max(1, int(m[2])), f"{m[1]}/{m[2]} items")
                    elif echo and piece.strip():
                        progress.write(piece, sys.stderr)
            elif echo:
                with contextlib.suppress(BrokenPipeError, OSError):
                    sys.stderr.buffer.write(chunk)
                    sys.stderr.flush()


def run_microbench(
    spec: dict[str, Any],
    nproc: int,
    launcher: str = "torchrun",
    timeout_s: float = 900.0,
    echo: bool = True,
    work_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Launch ``hw_validate/microbench.py`` on ``nproc`` local ranks and return rank 0's result."""
    if nproc < 1:
        raise InputError(f"must be >= 1, got {nproc}", field="--nproc")
    work = Path(tempfile.mkdtemp(prefix="moesim-calibrate-", dir=work_dir))
    spec_path, out_path, log_path = work / "spec.json", work / "result.json", work / "job.log"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    cmd = [*launcher_head(launcher, nproc, port), str(MICROBENCH), "--spec", str(spec_path), "--out", str(out_path)]
    env = dict(os.environ)
    root = str(ROOT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if spec.get("backend") == "gloo":
        env.setdefault("DS_ACCELERATOR", "cpu")
    env = cpu_rank_env(env)
    uses_ds = launcher == "deepspeed" or (spec.get("optimizer") or {}).get("impl") == "deepspeed"
    if uses_ds and accelerator_of(env) == "cpu":
        try:
            prepare_ops(needed_ops("cpu", None), env, timeout_s, echo)
        except JobError:
            shutil.rmtree(work, ignore_errors=True)
            raise
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    tail = _ByteTail()
    pump = threading.Thread(target=_pump, args=(proc.stdout, log_path, echo, tail), daemon=True)
    pump.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        pump.join(timeout=5)
        raise JobError(
            f"calibration job timed out after {timeout_s:g} s ({nproc} ranks, {launcher}; "
            f"{_stage(tail)}), stopped; log: {log_path}\n" + _last_lines(tail),
            run_dir=work,
        ) from None
    except BaseException:
        stop_group(proc)
        raise
    finally:
        remove_shm_buffers(port)
    pump.join(timeout=10)
    if rc != 0 or not out_path.is_file():
        why = "exited 0 without writing its result" if rc == 0 else (_cause(tail) or f"exit status {rc}")
        raise JobError(
            f"calibration job failed ({nproc} ranks, {launcher}, exit status {rc}): {why}; log: {log_path}\n"
            + _last_lines(tail),
            run_dir=work,
            returncode=rc,
        )
    result = json.loads(out_path.read_text())
    result["command"] = cmd
    shutil.rmtree(work, ignore_errors=True)
    return result


def _lines(tail: deque) -> list[str]:
    text = b"".join(tail).decode("utf-8", "replace").replace("\r", "\n")
    return [ln for ln in text.splitlines() if ln.strip() and "microbenchmarks:" not in ln]


_RANK_PREFIX = re.compile(r"^\[(?:rank|default)(\d+)\]:\s?")


def _cause(tail: deque) -> str | None:
    """The last line stating a cause (an exception's ``SomeError: message``), with the rank that
    printed it when the launcher prefixed its lines (``[rank1]: ...``)."""
    for line in reversed(_lines(tail)):
        m = _RANK_PREFIX.match(line)
        text = line[m.end():] if m else line
        why = cause_of([text])
        if why and "ChildFailedError" not in why:
            return f"rank {m.group(1)}: {why}" if m else why
    return None


def _stage(tail: deque) -> str:
    """Where the job was: the last state of its progress bar, or that it never started measuring."""
    text = b"".join(tail).decode("utf-8", "replace").replace("\r", "\n")
    bars = [ln.strip() for ln in text.splitlines() if "microbenchmarks:" in ln]
    return f"last progress: {bars[-1]}" if bars else "no rank started measuring (hung in start-up or rendezvous)"


def _last_lines(tail: deque, n: int = 15) -> str:
    lines = _lines(tail)[-n:]
    return "  last lines of the job:\n" + "\n".join(f"    {ln}" for ln in lines)
