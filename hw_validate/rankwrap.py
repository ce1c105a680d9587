"""One rank of a launched job, supervised: tee its output to a per-rank log and record how it ended.

:mod:`hw_validate.launch` starts ``deepspeed`` / ``torchrun`` with this file as the "training
script"; each copy runs the real script as a child process::

    python rankwrap.py [--local_rank=R] SCRIPT ARGS...   ->   python -u SCRIPT [--local_rank=R] ARGS...

and, under ``$MOESIM_RUN_DIR``:

- ``logs/rank<r>.log``: everything the rank wrote to stdout and stderr (file-descriptor level, so
  C++ errors, ``faulthandler`` stack dumps and the last lines before an ``os._exit`` are kept);
- ``status/rank<r>.exit.json``: ``{"rank", "pid", "returncode", "time"}`` once the rank has ended
  (negative return code: killed by that signal).

Rank 0's lines are echoed unchanged, other ranks' lines prefixed ``[rank r]``. SIGTERM/SIGINT are
forwarded to the child so that a launcher stopping the job still gets every exit recorded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def child_command(argv: list[str]) -> list[str]:
    """The real rank's command line from the wrapper's arguments."""
    local = [a for a in argv if a.startswith("--local_rank") or a.startswith("--local-rank")]
    rest = [a for a in argv if a not in local]
    if not rest:
        raise SystemExit("rankwrap: usage: rankwrap.py [--local_rank=R] SCRIPT ARGS...")
    return [sys.executable, "-u", rest[0], *local, *rest[1:]]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    run_dir = Path(os.environ.get("MOESIM_RUN_DIR", "."))
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    (run_dir / "status").mkdir(parents=True, exist_ok=True)
    cmd = child_command(argv)
    prefix = b"" if rank == 0 else f"[rank {rank}] ".encode()
    with open(run_dir / "logs" / f"rank{rank}.log", "wb", buffering=0) as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0)

        def forward(signum: int, _frame: object) -> None:
            if proc.poll() is None:
                proc.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        assert proc.stdout is not None
        out = sys.stdout.buffer
        for line in iter(proc.stdout.readline, b""):
            log.write(line)
            try:
                out.write(prefix + line)
                out.flush()
            except (BrokenPipeError, OSError):
                pass
        rc = proc.wait()
    rec = {"rank": rank, "pid": proc.pid, "returncode": rc, "time": time.time()}
    tmp = run_dir / "status" / f".rank{rank}.exit.json.tmp"
    tmp.write_text(json.dumps(rec) + "\n")
    os.replace(tmp, run_dir / "status" / f"rank{rank}.exit.json")
    return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main())
