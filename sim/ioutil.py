"""Atomic result files: write to a temp file in the target folder, fsync, rename. Ctrl-C mid-write
leaves the previous file (or none), never half of one."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def _clean(obj: Any) -> Any:
    """JSON-safe copy: numpy scalars/arrays to Python, non-finite floats to None."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, str | bytes):
        return _clean(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def dumps_json(obj: Any) -> str:
    """Deterministic JSON text (sorted keys, fixed float repr) for results."""
    return json.dumps(_clean(obj), indent=2, sort_keys=True, allow_nan=False) + "\n"


def _umask_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


_FILE_MODE = _umask_mode()


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file + fsync + rename)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _FILE_MODE)  # mkstemp makes 0600; results are ordinary files
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Binary twin of :func:`atomic_write_text` (PNGs, npz files)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, _FILE_MODE)  # mkstemp makes 0600; results are ordinary files
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: str, obj: Any) -> None:
    """``--json PATH`` semantics: ``-`` is stdout, anything else an atomic file write."""
    text = dumps_json(obj)
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        try:
            atomic_write_text(path, text)
        except OSError as exc:
            from sim.errors import InputError

            raise InputError(f"cannot write '{path}': {exc.strerror or exc}", field="--json") from None
