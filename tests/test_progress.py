"""Progress bars (sim/reports/progress.py): drawn on a real pseudo-terminal, nothing on a pipe or a
file, report/part free without a reporter, and the CLI commands wired to it."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time

from conftest import ROOT, SCENARIOS

from sim.reports import progress


class Terminal:
    """A real pseudo-terminal (120 columns) whose output is drained by a thread."""

    def __init__(self) -> None:
        self.master, self.slave = pty.openpty()
        fcntl.ioctl(self.slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.chunks.append(data)

    def stream(self):
        return os.fdopen(os.dup(self.slave), "w", encoding="utf-8")

    def text(self, settle_s: float = 0.3) -> str:
        time.sleep(settle_s)
        return b"".join(self.chunks).decode("utf-8", "replace")

    def close(self) -> None:
        os.close(self.slave)
        self.reader.join(timeout=5)
        os.close(self.master)


def test_report_and_part_do_nothing_without_a_reporter(capsys):
    assert not progress.active()
    t0 = time.perf_counter()
    for i in range(100_000):
        progress.report(i / 100_000, "engine")
    assert time.perf_counter() - t0 < 1.0  # a global lookup per call
    with progress.part(0, 2, "case"):
        progress.report(0.5)
    assert capsys.readouterr() == ("", "")


def test_no_bar_when_not_a_terminal():
    out, err = io.StringIO(), io.StringIO()
    assert not progress.wanted(err, out)
    with progress.reporting("simulate", stream=err, stdout=out, delay_s=0):
        assert not progress.active()
        progress.report(0.5, "half")
        time.sleep(0.3)
    assert err.getvalue() == "" and out.getvalue() == ""


def test_bar_on_a_terminal_with_parts_and_counts():
    term = Terminal()
    tty = term.stream()
    try:
        assert progress.wanted(tty, tty)
        with progress.reporting("compare", total=4, unit="cases", stream=tty, stdout=tty, delay_s=0):
            assert progress.active()
            with progress.part(1, 4, "case 2/4 topk"):
                progress.report(0.5, "engine t=1.0 s")  # 1/4 + 0.5/4 = 37.5%
                time.sleep(0.4)
                text = term.text()
                assert "compare:  38%" in text and "1/4 cases | case 2/4 topk | engine t=1.0 s" in text
            time.sleep(0.3)
            assert "compare:  50%" in term.text()  # a part ends at its end
            progress.write("a line above the bar", tty)
            progress.report(3, "three")  # an int counts units of the total
            time.sleep(0.3)
            assert "3/4 cases | three" in term.text() and "a line above the bar" in term.text()
        assert not progress.active()
        tail = term.text().rsplit("\r", 2)
        assert tail[-1] == "" and tail[-2].strip() == ""  # the bar erased when the command ends
    finally:
        tty.close()
        term.close()


def test_bar_waits_for_its_delay():
    term = Terminal()
    tty = term.stream()
    try:
        with progress.reporting("route", stream=tty, stdout=tty, delay_s=5.0):
            progress.report(0.5)
            time.sleep(0.3)
        assert term.text() == ""  # a command shorter than the delay shows nothing
    finally:
        tty.close()
        term.close()


def _cli_on(args: list[str], tty: bool, delay_s: str = "0") -> tuple[str, str]:
    """Run ``moesim ARGS`` with stdout and stderr on a pseudo-terminal or on pipes."""
    env = dict(os.environ, MOESIM_PROGRESS_DELAY_S=delay_s)
    cmd = [sys.executable, "-m", "sim", *args]
    if not tty:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout, p.stderr
    term = Terminal()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, stdin=term.slave, stdout=term.slave, stderr=term.slave,
                           timeout=300)  # fmt: skip
        text = term.text()
        assert p.returncode == 0, text
        return text, ""
    finally:
        term.close()


def test_cli_compare_shows_cases_on_a_terminal_and_nothing_on_a_pipe():
    args = ["compare", str(SCENARIOS / "cpu-2rank.yaml"), "--policy", "topk", "--policy", "device_limited:M=1"]
    shown, _ = _cli_on(args, tty=True)
    assert "compare:" in shown and "case 2/2 device_limited:M=1" in shown
    assert shown.rstrip().endswith("this row's")  # the table follows the erased bar
    out, err = _cli_on(args, tty=False)
    assert err == "" and "compare:" not in out and "device_limited:M=1" in out


def test_cli_simulate_route_and_sweep_bars(tmp_path):
    scen = str(SCENARIOS / "cpu-2rank.yaml")
    assert "simulate:" in _cli_on(["simulate", scen], tty=True)[0]
    assert "route:" in _cli_on(["route", scen], tty=True)[0]
    assert "route:" not in _cli_on(["route", scen], tty=True, delay_s="30")[0]  # under its delay: nothing
    sweep = ["sweep", scen, "--vary", "training.micro_batch_size=2,4", "--jsonl"]
    shown, _ = _cli_on([*sweep, str(tmp_path / "a.jsonl")], tty=True)
    assert "sweep:" in shown and "2/2 runs" in shown
    out, err = _cli_on([*sweep, str(tmp_path / "b.jsonl")], tty=False)
    assert "sweep:" not in err + out
