"""Shared fixtures: paths of the repository, a helper that runs the real ``moesim`` CLI, and one
that writes a scenario pointing at a calibration file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ROOT / "scenarios"


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m sim ARGS`` in a subprocess; returns the completed process (text output)."""
    return subprocess.run(
        [sys.executable, "-m", "sim", *args],
        cwd=cwd or ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def megatron_scenario(tmp_path: Path, model: dict, topology: str = "dgx-h100", parallelism: dict | None = None,
                      seq_len: int = 4096, **training) -> Path:
    """A one-node Megatron scenario file (EP8 x DP8, two micro-batches of one sequence, balanced dropless
    routing) around ``model``, written to ``tmp_path``."""
    doc = {
        "name": "megatron",
        "cluster": {"topology": topology, "nodes": 1},
        "model": model,
        "parallelism": {"tp": 1, "ep": 8, "dp": 8, **(parallelism or {})},
        "training": {"micro_batch_size": 1, "seq_len": seq_len, "grad_accum_steps": 2, "framework": "megatron",
                     **training},
        "routing": {"generator": "balanced", "dispatch": "dropless", "capacity_factor": None},
    }
    path = tmp_path / "megatron.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def calibrated_scenario(cal, d: Path, name: str = "s", base: Path | None = None, edit=None) -> Path:
    """``base`` (default scenarios/cpu-2rank.yaml) written to ``d/name.yaml`` with ``calibration:``
    naming ``cal`` saved as ``d/name.json`` (a path relative to the scenario file); ``edit(doc)``
    changes the YAML document first."""
    import yaml

    from sim.inputs.calibration import save_calibration

    save_calibration(d / f"{name}.json", cal)
    doc = yaml.safe_load((base or SCENARIOS / "cpu-2rank.yaml").read_text())
    if edit is not None:
        edit(doc)
    doc["calibration"] = f"{name}.json"
    p = d / f"{name}.yaml"
    p.write_text(yaml.safe_dump(doc))
    return p


@pytest.fixture
def cli():
    return run_cli
