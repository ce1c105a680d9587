"""Shared fixtures: paths of the repository, a helper that runs the real ``moesim`` CLI, and one
that writes a scenario pointing at a calibration file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
