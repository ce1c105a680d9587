"""The jobs' output moves moesim's progress bar (hw_validate/launch.py, hw_validate/microbenchmarks/runner.py):
the training job's step lines and the microbenchmark job's own bar, read through real pipes while a
bar is drawn on a real pseudo-terminal; without a bar the output is echoed as before."""

from __future__ import annotations

import collections
import os
import threading
import time

from test_progress import Terminal

from hw_validate.launch import _pump as pump_lines
from hw_validate.microbenchmarks.runner import _ByteTail
from hw_validate.microbenchmarks.runner import _pump as pump_chunks
from sim.reports import progress


def _feed(pump, chunks: list[bytes], *args) -> None:
    r, w = os.pipe()
    t = threading.Thread(target=pump, args=(os.fdopen(r, "rb"), *args), daemon=True)
    t.start()
    for c in chunks:
        os.write(w, c)
        time.sleep(0.15)
    os.close(w)
    t.join(timeout=5)


def test_training_steps_move_the_bar_and_lines_print_above_it(tmp_path):
    term = Terminal()
    tty = term.stream()
    try:
        with progress.reporting("validate", stream=tty, stdout=tty, delay_s=0), progress.part(1, 2, "real job"):
            import sys

            old = sys.stdout
            sys.stdout = tty  # the pump echoes to stdout: the terminal here
            try:
                _feed(pump_lines, [b"train_moe: cpu-2rank: 2 ranks\n", b"step    1/4  loss 6.4\n",
                                   b"step    2/4  loss 6.2\n"], tmp_path / "job.log", True, collections.deque())  # fmt: skip
                time.sleep(0.3)
            finally:
                sys.stdout = old
        text = term.text()
        assert "validate:  75%" in text and "real job | step 2/4" in text  # half + 2/4 of the second half
        assert "train_moe: cpu-2rank: 2 ranks" in text and "step    2/4  loss 6.2" in text
        assert (tmp_path / "job.log").read_bytes().count(b"step") == 2
    finally:
        tty.close()
        term.close()


def test_microbenchmark_bar_moves_ours_instead_of_being_echoed(tmp_path, capfd):
    term = Terminal()
    tty = term.stream()
    try:
        with progress.reporting("calibrate", stream=tty, stdout=tty, delay_s=0):
            _feed(pump_chunks, [b"\rmicrobenchmarks:  10%|#  | 4/40 [00:01<00:09]", b"\rmicrobenchmarks:  50%|#####  | 20/40 [",
                                b"00:05<00:05]\nnotice: something\n"], tmp_path / "job.log", True, _ByteTail())  # fmt: skip
            time.sleep(0.3)
        text = term.text()
        assert "calibrate:  50%" in text and "20/40 items" in text
        assert "microbenchmarks:" not in text  # the job's own bar is not drawn over ours
        assert "notice: something" in capfd.readouterr().err  # other lines still printed
    finally:
        tty.close()
        term.close()


def test_without_a_bar_the_output_is_echoed_as_it_came(tmp_path, capfd):
    _feed(pump_chunks, [b"\rmicrobenchmarks:  10%| 4/40", b"\rmicrobenchmarks:  50%| 20/40"], tmp_path / "j.log", True, _ByteTail())
    assert capfd.readouterr().err == "\rmicrobenchmarks:  10%| 4/40\rmicrobenchmarks:  50%| 20/40"
    _feed(pump_lines, [b"step    1/4  loss 6.4\n"], tmp_path / "k.log", True, collections.deque())
    assert capfd.readouterr().out == "step    1/4  loss 6.4\n"
