"""Progress of long commands, on a terminal only.

A command installs a reporter around its work (:func:`reporting`); any layer below it -- a study's
loop over cases, the engine's event loop, the harness's job -- says how far it is with
:func:`report`, and narrows the range its callee reports into with :func:`part`::

    with reporting("compare"):                     # sim/cli: the bar, if stdout and stderr are TTYs
        for i, case in enumerate(cases):
            with part(i, len(cases), case.label):  # a study: case i covers [i/n, (i+1)/n]
                simulate(case)                     #   the engine: report(now / horizon, "t=1.2 s")

Without a reporter (the Python API, a pipe, ``MOESIM_PROGRESS=0``, ``--no-progress``) :func:`report`
and :func:`part` cost one global lookup and do nothing. With one, :func:`report` stores two
attributes; a background thread draws the tqdm bar on stderr every 0.1 s, only once the command has
run ``MOESIM_PROGRESS_DELAY_S`` (default 2 s), and the bar is erased when the command ends, so
short commands and their output look exactly as without it. Lines printed while the bar shows go
through :func:`write` (above the bar). Leaf module: any layer of ``sim`` may import it; it imports
nothing of ``sim`` (tests/architecture/test_imports.py).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

#: seconds a command runs before its bar appears (``MOESIM_PROGRESS_DELAY_S`` overrides)
DELAY_S = 2.0
#: seconds between redraws of the bar
TICK_S = 0.1

_active: _Reporter | None = None


def report(done: float | int, label: str = "") -> None:
    """How far the current work is: a float is the fraction done of the current :func:`part` (of
    the whole command outside any), in [0, 1]; an int is units done of the ``total`` that
    :func:`part` or :func:`reporting` gave (ignored where none was given). ``label`` (may be empty)
    says what runs now. A no-op when no reporter is installed; cheap enough to call per event."""
    r = _active
    if r is not None:
        r.update(done, label)


@contextmanager
def part(index: int, count: int, label: str = "", total: int | None = None) -> Iterator[None]:
    """Scope the reports inside it to part ``index`` of ``count`` equal parts of the current range
    (nests); ``label`` is shown before the reports' own; ``total``: what an int :func:`report`
    inside counts up to. At the end the bar stands at the end of the part."""
    r = _active
    if r is None:
        yield
        return
    outer = r.push(index, count, label, total)
    try:
        yield
    finally:
        r.pop(outer)


def active() -> bool:
    """True while a bar is installed (drawn or waiting for its delay)."""
    return _active is not None


def write(text: str, stream: TextIO | None = None) -> None:
    """Print ``text`` (one line, no newline needed) to ``stream`` (default stdout) above the bar,
    which is redrawn below it; without a reporter a plain print."""
    r = _active
    out = stream if stream is not None else sys.stdout
    if r is None:
        print(text, file=out, flush=True)
        return
    r.write_line(text, out)


def wanted(stream: TextIO | None = None, stdout: TextIO | None = None) -> bool:
    """Whether a bar would show: ``stream`` (default stderr) and stdout are terminals and
    ``MOESIM_PROGRESS`` is not ``0``."""
    if os.environ.get("MOESIM_PROGRESS", "1") == "0":
        return False
    return all(_isatty(s) for s in (stream or sys.stderr, stdout or sys.stdout))


@contextmanager
def reporting(desc: str, total: int | None = None, unit: str = "", *, enabled: bool = True,
              stream: TextIO | None = None, stdout: TextIO | None = None,
              delay_s: float | None = None) -> Iterator[None]:  # fmt: skip
    """Install a reporter for the command ``desc`` while the block runs: a bar on ``stream``
    (default stderr) when :func:`wanted` and ``enabled``, else nothing. ``total`` and ``unit``: the
    whole command counts ``total`` ``unit`` (an int :func:`report` counts them; the bar shows
    ``n/total unit``). Inside another reporter it adds nothing (the outer one keeps drawing)."""
    global _active
    if _active is not None or not enabled or not wanted(stream, stdout):
        yield
        return
    if delay_s is None:
        delay_s = _env_float("MOESIM_PROGRESS_DELAY_S", DELAY_S)
    r = _Reporter(desc, total, unit, stream or sys.stderr, delay_s)
    _active = r
    r.start()
    try:
        yield
    finally:
        _active = None
        r.stop()


class _Reporter:
    """The installed reporter: state written by :func:`report` (main thread), drawn by a thread."""

    def __init__(self, desc: str, total: int | None, unit: str, stream: TextIO, delay_s: float) -> None:
        self.desc, self.unit, self.stream, self.delay_s = desc, unit, stream, delay_s
        self.count_total = total if unit else None  # the bar shows "n/total unit"
        self.lo, self.hi, self.total, self.prefix = 0.0, 1.0, total, ""
        self.fraction, self.label = 0.0, ""
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="moesim-progress", daemon=True)
        self.bar = None
        self.t0 = time.monotonic()

    # -- called by the work (main thread) --------------------------------------------------------
    def update(self, done: float | int, label: str) -> None:
        if isinstance(done, int) and not isinstance(done, bool):
            if not self.total:
                self.label = label
                return
            done = done / self.total
        self.fraction = self.lo + (self.hi - self.lo) * min(1.0, max(0.0, float(done)))
        self.label = label

    def push(self, index: int, count: int, label: str, total: int | None) -> tuple:
        outer = (self.lo, self.hi, self.total, self.prefix)
        width = (self.hi - self.lo) / max(1, count)
        self.lo, self.hi = self.lo + width * index, self.lo + width * (index + 1)
        self.total = total
        self.prefix = f"{self.prefix} > {label}" if self.prefix and label else (label or self.prefix)
        self.fraction, self.label = self.lo, ""
        self._draw()  # a new part shows at once, however short the tick before it ends
        return outer

    def pop(self, outer: tuple) -> None:
        end = self.hi
        self.lo, self.hi, self.total, self.prefix = outer
        self.fraction, self.label = end, ""

    def write_line(self, text: str, out: TextIO) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.clear()
            print(text, file=out, flush=True)
            if self.bar is not None:
                self.bar.refresh()

    # -- the drawing thread ----------------------------------------------------------------------
    def start(self) -> None:
        if self.delay_s <= 0:
            self._open()  # no delay: the bar shows before the work starts
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join()
        if self.bar is not None:
            self._draw()  # the final state, however short the last tick
            with self.lock:
                self.bar.close()  # leave=False: the line is erased

    def _open(self) -> None:
        from tqdm import tqdm

        with self.lock:
            if self.bar is None:
                self.bar = tqdm(total=1.0, desc=self.desc, file=self.stream, leave=False, dynamic_ncols=True,
                                bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}{postfix}")  # fmt: skip

    def _draw(self) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.n = self.fraction
                self.bar.set_postfix_str(self._postfix(), refresh=False)
                self.bar.refresh()

    def _run(self) -> None:
        if self.bar is None and self.stop_event.wait(self.delay_s):
            return
        self._open()
        while True:
            self._draw()
            if self.stop_event.wait(TICK_S):
                return

    def _postfix(self) -> str:
        words = [w for w in (self.prefix, self.label) if w]
        if self.count_total:
            words.insert(0, f"{int(self.fraction * self.count_total + 1e-9)}/{self.count_total} {self.unit}")
        return " | ".join(words)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


def _env_float(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, default)))
    except ValueError:
        return default


__all__ = ["active", "part", "report", "reporting", "wanted", "write"]
