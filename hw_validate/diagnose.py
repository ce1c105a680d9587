"""Why a launched job failed: which rank died or hung, at which step, and its last log lines.

Reads what :mod:`hw_validate.rankwrap` and :mod:`hw_validate.train_moe` leave in the run folder:
``status/rank<r>.exit.json`` (return code and time of each rank's end), ``status/rank<r>.json``
(the heartbeat: last step started) and ``logs/rank<r>.log``.

A dead rank: the ranks that ended with a non-zero status are ordered by time; ranks whose log
shows a lost peer (gloo/NCCL "connection closed/reset by peer" and the like) are victims of
another rank, so the earliest non-victim is named; failing that, the earliest of all.

A hung job (timeout): each rank's heartbeat and the innermost frame of its last ``faulthandler``
dump (the launcher sends SIGUSR1 first); a rank not waiting inside a collective is the suspect.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

_PEER_LOST = re.compile(
    r"connection (closed|reset) by peer|broken pipe|recvBytes|Connection refused|"
    r"NCCL communicator was aborted|ProcessGroupGloo.*(timeout|closed)|Socket Timeout|"
    r"Application timeout caused pair closure|terminated by launcher",
    re.IGNORECASE,
)
#: the line that says why a process stopped: our own "<tool>: error: ..." or a Python exception
_CAUSE = re.compile(r"^\s*(?:\w+: error: .+|(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception|Interrupt)(?:: .+)?)$")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')
_COLLECTIVE_PATHS = ("/torch/distributed/", "/deepspeed/comm/", "/torch/nn/parallel/")


@dataclass
class RankState:
    rank: int
    returncode: int | None = None
    ended_at: float | None = None
    step: int | None = None
    beat_at: float | None = None
    pid: int | None = None
    last_lines: list[str] = field(default_factory=list)
    top_frame: str | None = None

    @property
    def lost_peer(self) -> bool:
        return any(_PEER_LOST.search(line) for line in self.last_lines)

    @property
    def in_collective(self) -> bool:
        return self.top_frame is not None and any(p in self.top_frame for p in _COLLECTIVE_PATHS)


def tail(path: Path, n: int = 20) -> list[str]:
    try:
        text = path.read_bytes()[-64_000:].decode("utf-8", "replace")
    except OSError:
        return []
    return text.splitlines()[-n:]


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def innermost_frame(lines: list[str]) -> str | None:
    """The first frame after the last ``(most recent call first)`` header of a faulthandler dump."""
    start = max((i for i, line in enumerate(lines) if "most recent call first" in line), default=None)
    if start is None:
        return None
    for line in lines[start + 1 :]:
        m = _FRAME.match(line)
        if m:
            return f"{m.group(1)}:{m.group(2)} in {m.group(3)}"
    return None


def cause_of(lines: list[str]) -> str | None:
    """The last line of ``lines`` that states a cause (``train_moe: error: ...`` or an exception's
    ``SomeError: message``), stripped and shortened to one screen line; None if there is none."""
    for line in reversed(lines):
        if _CAUSE.match(line) or "No module named" in line:
            text = line.strip()
            return text if len(text) <= 300 else text[:297] + "..."
    return None


def read_states(run_dir: Path, nproc: int, n_lines: int = 20, logs: bool = True) -> list[RankState]:
    """Exit records, heartbeats and (when ``logs``) the last ``n_lines`` log lines of every rank."""
    out = []
    for r in range(nproc):
        s = RankState(rank=r)
        ex = _json(run_dir / "status" / f"rank{r}.exit.json")
        if ex:
            s.returncode, s.ended_at = ex.get("returncode"), ex.get("time")
        hb = _json(run_dir / "status" / f"rank{r}.json")
        if hb:
            s.step, s.beat_at, s.pid = hb.get("step"), hb.get("time"), hb.get("pid")
        if logs:
            s.last_lines = tail(run_dir / "logs" / f"rank{r}.log", n_lines)
            s.top_frame = innermost_frame(tail(run_dir / "logs" / f"rank{r}.log", 200))
        out.append(s)
    return out


def _where(s: RankState) -> str:
    if s.step is None:
        return "before its first step"
    return f"at step {s.step}"


def _status(rc: int) -> str:
    return f"status {rc}" if rc >= 0 else f"signal {-rc}"


def culprit_of_exit(states: list[RankState]) -> RankState | None:
    failed = sorted((s for s in states if s.returncode not in (None, 0)), key=lambda s: s.ended_at or 0.0)
    if not failed:
        return None
    first_cause = [s for s in failed if not s.lost_peer and (s.returncode or 0) > 0]
    return (first_cause or failed)[0]


def explain_exit(states: list[RankState], launcher_rc: int, run_dir: Path) -> tuple[int | None, str]:
    """(rank to blame or None, message) for a job whose launcher exited with ``launcher_rc``."""
    bad = culprit_of_exit(states)
    if bad is None:
        missing = [s.rank for s in states if s.returncode is None]
        head = f"the launcher exited with status {launcher_rc}"
        if len(missing) == len(states):
            return None, f"{head} before any rank started; logs in {run_dir}"
        return None, f"{head}; ranks {missing} did not report an exit; logs in {run_dir}"
    others = [
        f"rank {s.rank} {_status(s.returncode)}" if s.returncode is not None else f"rank {s.rank} no exit recorded"
        for s in states
        if s.rank != bad.rank
    ]
    lines = "\n".join(f"    {line}" for line in bad.last_lines) or "    (no output)"
    cause = cause_of(bad.last_lines)
    msg = (
        f"rank {bad.rank} exited with {_status(bad.returncode or 0)} {_where(bad)}"
        + (f" ({'; '.join(others)})" if others else "")
        + (f": {cause}" if cause else "")
        + f"\n  last lines of rank {bad.rank} ({run_dir / 'logs' / f'rank{bad.rank}.log'}):\n{lines}"
    )
    return bad.rank, msg


def explain_timeout(states: list[RankState], reason: str, run_dir: Path) -> tuple[int | None, str]:
    """(suspected rank or None, message) for a job that ran too long or stalled (``reason`` says which)."""
    now = time.time()
    suspects = [s for s in states if s.top_frame is not None and not s.in_collective]
    if not suspects:
        started = [s for s in states if s.step is not None]
        if started:
            suspects = [min(started, key=lambda s: (s.step, s.beat_at or 0.0))]
    parts = []
    for s in states:
        beat = f"{now - s.beat_at:.0f} s ago" if s.beat_at else "never"
        where = "waiting in a collective" if s.in_collective else (f"in {s.top_frame}" if s.top_frame else "no stack dump")
        parts.append(f"  rank {s.rank}: last step started {s.step if s.step is not None else '-'} (heartbeat {beat}), {where}")
    sus = suspects[0] if suspects else None
    msg = reason + (f"; rank {sus.rank} looks hung {_where(sus)}" if sus else "")
    msg += "\n" + "\n".join(parts)
    for s in [sus] if sus else states:
        lines = "\n".join(f"    {line}" for line in s.last_lines) or "    (no output)"
        msg += f"\n  last lines of rank {s.rank} ({run_dir / 'logs' / f'rank{s.rank}.log'}):\n{lines}"
    return (sus.rank if sus else None), msg
