"""One BLAS thread while the pooled path draws its counts.

Drawing makes one large matrix product per layer and small ones per chunk, between single-threaded
numpy work. OpenBLAS's other threads spin between calls and, where cores are shared, take the core
that work needs: 8,192 GPUs of 128gpu drew in 2.5x the time with two threads than with one on the
2-core VM. A product is the same with any thread count (OpenBLAS splits its rows and columns among
threads, never a sum), so only time changes. The OpenBLAS numpy loaded is found in ``/proc/self/maps``
(Linux); elsewhere, or with another BLAS, nothing is changed (threadpoolctl does this generally).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterator
from contextlib import contextmanager


@functools.lru_cache(maxsize=1)
def _openblas() -> tuple[tuple, ...]:
    """(get_num_threads, set_num_threads) of every loaded OpenBLAS (numpy's wheels: scipy-openblas)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            paths = sorted({line.split()[-1] for line in fh if "openblas" in line.lower() and "/" in line})
    except OSError:
        return ()
    found = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (
            ("openblas_", ""),
            ("scipy_openblas_", "64_"),
            ("scipy_openblas_", ""),
            ("openblas_", "64_"),
        ):
            get = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
            put = getattr(lib, f"{prefix}set_num_threads{suffix}", None)
            if get is not None and put is not None:
                get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
                found.append((get, put))
                break
    return tuple(found)


@contextmanager
def single_blas_thread() -> Iterator[None]:
    """Run the block with one OpenBLAS thread, then restore the previous count."""
    libs = _openblas()
    before = [get() for get, _ in libs]
    for _, put in libs:
        put(1)
    try:
        yield
    finally:
        for (_, put), n in zip(libs, before, strict=True):
            put(n)


__all__ = ["single_blas_thread"]
