"""The calibration ``moesim validate`` uses when it is given none: one full ``moesim calibrate`` of
this machine, made the first time and cached, reused while the machine and the software are the
same.

A quick calibration (``--quick``: no reference job, fewer sizes and repetitions) left a first
validation of ``scenarios/cpu-2rank.yaml`` 20-30% short: on CPU ranks the in-job figures of the
reference job (compute scale, call overhead, stalls, late wake-ups; :mod:`hw_validate.desync`)
move the step most. So the cache holds a full calibration (microbenchmarks over the validated
scenario's shapes and the shipped ones, and the reference job), and on gloo ranks ``validate``
refits the in-job figures on a fresh reference job right before its own job
(:func:`hw_validate.calibrate.refit_reference_job`): they follow the machine's load, which on a
shared VM moves the step by up to 2x between minutes.

Where: ``$MOESIM_CACHE_DIR``, else ``$XDG_CACHE_HOME/moesim``, else ``~/.cache/moesim``; one file per
key, ``calibrations/<key>.json``. The key is the hash of :func:`machine_facts`: CPU model, core
count, GPU models, Python, torch and DeepSpeed versions, backend, ranks, the CPU ranks' malloc
setting and :data:`CACHE_VERSION` (raised when the microbenchmarks or fits change what they
measure). Any of them changing is another key: the old file is not read again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from sim.inputs.calibration import load_calibration

#: raise when the microbenchmarks or the fits change what a calibration holds
CACHE_VERSION = 1
ROOT = Path(__file__).resolve().parent.parent
#: shipped scenarios whose shapes every cached calibration measures, per backend
SHIPPED = {"gloo": [ROOT / "scenarios" / "cpu-2rank.yaml", *sorted((ROOT / "scenarios" / "accuracy").glob("*.yaml"))],
           "nccl": sorted((ROOT / "scenarios" / "accuracy" / "gpu").glob("*.yaml"))}  # fmt: skip


def cache_dir() -> Path:
    """The folder of cached calibrations (see the module docstring)."""
    base = os.environ.get("MOESIM_CACHE_DIR")
    if base:
        return Path(base) / "calibrations"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "moesim" / "calibrations"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; else what :mod:`platform` says)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def gpu_models() -> list[str]:
    """The GPUs ``nvidia-smi`` lists (empty without one)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=False).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    return [ln.strip() for ln in out.splitlines() if ln.strip()]


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def machine_facts(backend: str, nproc: int) -> dict[str, Any]:
    """What a cached calibration is valid for: this machine, its software and the ranks measured."""
    return {"cpu_model": cpu_model(), "cpu_count": os.cpu_count(), "gpus": gpu_models(),
            "python": platform.python_version(), "torch": _version("torch"), "deepspeed": _version("deepspeed"),
            "backend": backend, "ranks": nproc, "cpu_malloc": os.environ.get("MOESIM_CPU_MALLOC", "keep"),
            "cache_version": CACHE_VERSION}  # fmt: skip


def cache_key(facts: dict[str, Any]) -> str:
    """16 hex digits of the SHA-256 of ``facts`` (sorted JSON)."""
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def cached_path(facts: dict[str, Any]) -> Path:
    return cache_dir() / f"{cache_key(facts)}.json"


def lookup(facts: dict[str, Any]) -> Path | None:
    """The cached calibration for ``facts``, or None when there is none (or it does not load, or
    was made for other facts: a hash collision or a file copied in by hand)."""
    path = cached_path(facts)
    if not path.is_file():
        return None
    try:
        cal = load_calibration(path)
    except Exception:  # noqa: BLE001 - a damaged cache file is remade, never an error
        return None
    return path if (cal.hardware.get("cache") or {}).get("facts") == facts else None


def cached_calibration(scenario: str | Path, nproc: int, backend: str, timeout_s: float = 900.0, echo: bool = True,
                       log=print, recalibrate: bool = False) -> tuple[Path, bool]:  # fmt: skip
    """``(path, made_now)``: the cached full calibration of this machine for ``nproc`` ``backend``
    ranks, made now (a full ``moesim calibrate`` over ``scenario``'s shapes and the shipped
    scenarios', ~2 minutes on 2 CPU cores) when there is none or ``recalibrate``. Two validations
    starting at once make it once (a lock file beside it)."""
    import fcntl

    from hw_validate.calibrate import calibrate
    from sim.inputs.calibration import save_calibration

    facts = machine_facts(backend, nproc)
    path = cached_path(facts)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not recalibrate and lookup(facts) is not None:
            return path, False
        shapes = [Path(scenario), *(p for p in SHIPPED.get(backend, []) if p.resolve() != Path(scenario).resolve())]
        log(f"validate: no calibration of this machine in the cache yet: a full `moesim calibrate` ({backend}, "
            f"{nproc} ranks, {len(shapes)} scenarios' shapes) once, ~2 min on 2 cores -> {path}")  # fmt: skip
        run = calibrate(None, nproc=nproc, backend=backend, scenarios=[str(p) for p in shapes], quick=False,
                        timeout_s=timeout_s, echo=echo)  # fmt: skip
        run.calibration.hardware["cache"] = {"facts": facts, "key": cache_key(facts), "created_unix_s": time.time()}
        save_calibration(path, run.calibration)
    return path, True


__all__ = ["CACHE_VERSION", "cache_dir", "cache_key", "cached_calibration", "cached_path", "lookup", "machine_facts"]
