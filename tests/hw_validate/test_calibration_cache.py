"""The cached calibration of this machine (hw_validate/calibration_cache.py): where it lives, what
its key holds, and that any change of machine or software is another key."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest

from hw_validate.calibration_cache import (
    CACHE_VERSION,
    cache_dir,
    cache_key,
    cached_path,
    lookup,
    machine_facts,
)
from sim.inputs.calibration import Calibration, save_calibration


def test_the_facts_are_this_machines():
    f = machine_facts("gloo", 2)
    assert f["cpu_count"] == os.cpu_count() and f["python"] == platform.python_version()
    with open("/proc/cpuinfo") as fh:
        assert any(f["cpu_model"] in line for line in fh if line.startswith("model name"))
    from importlib.metadata import version

    assert f["torch"] == version("torch") and f["ranks"] == 2 and f["cache_version"] == CACHE_VERSION


@pytest.mark.parametrize(
    ("field", "other"),
    [("cpu_model", "AMD EPYC 9654"), ("cpu_count", 96), ("gpus", ["NVIDIA H100 80GB HBM3"]), ("torch", "2.99.0"),
     ("deepspeed", "0.99.0"), ("ranks", 4), ("backend", "nccl"), ("cache_version", CACHE_VERSION + 1)],
)  # fmt: skip
def test_any_change_of_machine_or_software_is_another_key(field, other):
    f = machine_facts("gloo", 2)
    assert cache_key({**f, field: other}) != cache_key(f)
    assert len(cache_key(f)) == 16 and cache_key(dict(reversed(list(f.items())))) == cache_key(f)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("MOESIM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "moesim" / "calibrations"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "moesim" / "calibrations"
    monkeypatch.setenv("MOESIM_CACHE_DIR", str(tmp_path / "m"))
    assert cache_dir() == tmp_path / "m" / "calibrations"


def test_lookup_finds_only_a_loadable_file_made_for_these_facts(monkeypatch, tmp_path):
    monkeypatch.setenv("MOESIM_CACHE_DIR", str(tmp_path))
    facts = machine_facts("gloo", 2)
    path = cached_path(facts)
    assert lookup(facts) is None  # nothing cached yet
    path.parent.mkdir(parents=True)
    save_calibration(path, Calibration(hardware={"cache": {"facts": {**facts, "torch": "0.0"}}}, kernel_launch_us=5.0))
    assert lookup(facts) is None  # a file for other facts under this key (copied by hand): not used
    save_calibration(path, Calibration(hardware={"cache": {"facts": facts}}, kernel_launch_us=5.0))
    assert lookup(facts) == path
    path.write_text("{ damaged")
    assert lookup(facts) is None  # remade, never an error
