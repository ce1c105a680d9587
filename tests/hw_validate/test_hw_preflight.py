"""Harness faults that are the machine's, not the job's: no GPU for the CUDA accelerator, DeepSpeed
missing. Each must end in a one-line cause (the first line of the error) and a non-zero exit, with
what an earlier run left in the output folder intact. Real launches: the ranks start and stop at
their preflight check, so each case takes seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from hw_validate.diagnose import cause_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CPU2 = ROOT / "scenarios" / "cpu-2rank.yaml"
pytestmark = [pytest.mark.deepspeed]
SENTINEL = '{"earlier": "result"}\n'


def _launch(tmp_path: Path, launcher: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    (tmp_path / "measurement.json").write_text(SENTINEL)
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-m", "hw_validate.launch", "--scenario", str(CPU2), "--steps", "2",
                           "--out", str(tmp_path), "--launcher", launcher, "--quiet"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


def _first_line(p: subprocess.CompletedProcess) -> str:
    return p.stderr.strip().splitlines()[0]


def test_cuda_accelerator_without_a_gpu_is_one_line(tmp_path):
    p = _launch(tmp_path, "torchrun", {"DS_ACCELERATOR": "cuda"})
    assert p.returncode == 1, p.stderr
    first = _first_line(p)
    if "sees 0 GPU(s)" not in first:  # a machine with GPUs: the check passed, nothing to see here
        pytest.skip(f"this machine has CUDA devices: {first}")
    assert first.startswith("launch: error: rank ") and "before its first step" in first
    assert "DS_ACCELERATOR=cuda" in first and "set DS_ACCELERATOR=cpu" in first
    assert (tmp_path / "measurement.json").read_text() == SENTINEL


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_deepspeed_missing_is_one_line(tmp_path, launcher):
    # a package named deepspeed that is not importable: what `import deepspeed` does where it is
    # absent (the same ModuleNotFoundError), shadowing the installed one in the job's processes only
    shim = tmp_path / "shim" / "deepspeed"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'deepspeed\'", name="deepspeed")\n')
    out = tmp_path / "out"
    out.mkdir()
    p = _launch(out, launcher, {"PYTHONPATH": str(shim.parent)})
    assert p.returncode == 1, p.stderr
    first = _first_line(p)
    assert first.startswith("launch: error: ")
    assert "No module named 'deepspeed'" in first, first
    if launcher == "torchrun":  # the ranks start and say what to install
        assert "pip install" in first and "before its first step" in first
    assert (out / "measurement.json").read_text() == SENTINEL
    assert not (out / "router_trace.json").exists()


def test_cause_of_picks_the_last_stated_cause():
    lines = ["Traceback (most recent call last):", '  File "x.py", line 3, in f', "ValueError: first",
             "During handling...", "torch.distributed.DistBackendError: gloo closed", "  (hint)"]  # fmt: skip
    assert cause_of(lines) == "torch.distributed.DistBackendError: gloo closed"
    assert cause_of(["train_moe: error: the CUDA accelerator is selected", "bye"]) == (
        "train_moe: error: the CUDA accelerator is selected"
    )
    assert cause_of(["all fine", "step 3 loss 1.0"]) is None


def test_launcher_refuses_when_this_python_lacks_deepspeed(tmp_path):
    """The launcher's own check, before any process starts: a Python where ``import deepspeed``
    fails (``sys.modules['deepspeed'] = None``, Python's way to block an import) gets one line
    saying what to install, and no run folder is left behind."""
    code = (
        "import sys\n"
        "sys.modules['deepspeed'] = None\n"
        "from hw_validate.launch import main\n"
        f"sys.exit(main(['--scenario', {str(CPU2)!r}, '--out', {str(tmp_path)!r}, '--steps', '2']))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    first = _first_line(p)
    assert "deepspeed is not installed for" in first and "pip install" in first, first
    assert not list(tmp_path.glob(".staging-*")) and not list(tmp_path.glob("failed-*"))
