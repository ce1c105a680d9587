"""Locks left by killed torch extension builds are cleared before a job starts (the CI hang of
2026-12-03: every rank of the seed job waited in ``file_baton.wait`` on a dead ``cpu_adam/lock``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hw_validate import jit_ops

ROOT = Path(__file__).resolve().parents[2]


def _lock(folder: Path, age_s: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lk = folder / "lock"
    lk.write_text("")
    t = time.time() - age_s
    os.utime(lk, (t, t))
    return lk


def test_dead_lock_is_removed_live_and_fresh_ones_are_kept(tmp_path):
    dead = _lock(tmp_path / "cpu_adam", age_s=600)
    fresh = _lock(tmp_path / "fused_adam", age_s=0)
    busy = _lock(tmp_path / "deepspeed_shm_comm", age_s=600)
    (busy.parent / "build").mkdir()
    # a build in progress: ninja runs with the build folder (or below) as its working directory
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=busy.parent / "build")
    try:
        time.sleep(0.3)
        seen = []
        removed = jit_ops.clear_stale_locks(tmp_path, seen.append)
    finally:
        holder.kill()
        holder.wait()
    assert removed == [dead]
    assert not dead.exists() and fresh.exists() and busy.exists()
    assert len(seen) == 1 and str(dead) in seen[0] and "stale" in seen[0]
    # once the holder is gone its lock is dead too
    assert jit_ops.clear_stale_locks(tmp_path) == [busy]
    assert jit_ops.clear_stale_locks(tmp_path / "missing") == []


def test_ops_a_job_loads():
    assert jit_ops.needed_ops("cpu", None) == ["deepspeed_shm_comm"]
    assert jit_ops.needed_ops("cpu", "cpu") == ["deepspeed_shm_comm", "cpu_adam"]
    assert jit_ops.needed_ops("cuda", "cpu") == []
    assert jit_ops.prepare([]) == []
    assert jit_ops.accelerator_of({"DS_ACCELERATOR": "cpu"}) == "cpu"


@pytest.mark.deepspeed
def test_load_after_a_killed_build_does_not_hang(tmp_path):
    """A real DeepSpeed op load through torch's FileBaton, with a dead lock in its build folder."""
    pytest.importorskip("deepspeed")
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(ROOT))
    root = jit_ops.extensions_root(env=env)
    assert root.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}")
    jit_ops.prepare(["deepspeed_shm_comm"], env=env, timeout_s=600)  # built (once) before the test
    assert (root / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").is_file()
    dead = _lock(root / "deepspeed_shm_comm", age_s=600)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hw_validate.jit_ops", "--build", "deepspeed_shm_comm"],
            capture_output=True, text=True, env=env, timeout=300,
        )  # fmt: skip
    finally:
        dead.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "removed a stale torch extension lock" in proc.stderr and "deepspeed_shm_comm ready" in proc.stderr


def test_cpu_ranks_keep_freed_memory_unless_told_otherwise():
    env = jit_ops.cpu_rank_env({"DS_ACCELERATOR": "cpu", "PATH": "/bin"})
    assert env["GLIBC_TUNABLES"] == jit_ops.CPU_MALLOC_TUNABLES and env["PATH"] == "/bin"
    # every tunable is one glibc knows, with a value it accepts (mmap_threshold at most 32 MiB on 64-bit)
    tun = dict(kv.split("=") for kv in jit_ops.CPU_MALLOC_TUNABLES.split(":"))
    assert set(tun) == {"glibc.malloc.mmap_threshold", "glibc.malloc.trim_threshold", "glibc.malloc.top_pad"}
    assert int(tun["glibc.malloc.mmap_threshold"]) <= 32 << 20
    # the user's own settings, an untuned run on request, and GPU ranks are left alone
    assert jit_ops.cpu_rank_env({"DS_ACCELERATOR": "cpu", "GLIBC_TUNABLES": "x=1"})["GLIBC_TUNABLES"] == "x=1"
    assert "GLIBC_TUNABLES" not in jit_ops.cpu_rank_env({"DS_ACCELERATOR": "cpu", "MOESIM_CPU_MALLOC": "default"})
    assert "GLIBC_TUNABLES" not in jit_ops.cpu_rank_env({"DS_ACCELERATOR": "cuda"})


def test_glibc_takes_the_cpu_malloc_tunables():
    """glibc ignores a tunable it rejects without a word, so check its effect: with the 32 MiB mmap
    threshold an 8 MiB block comes from the heap (below the program break), by default from a
    fresh mmap (far above it)."""
    probe = (
        "import ctypes; libc = ctypes.CDLL(None); libc.malloc.restype = ctypes.c_void_p; "
        "libc.sbrk.restype = ctypes.c_void_p; p = libc.malloc(8 << 20); "
        "print('heap' if p < libc.sbrk(0) else 'mmap')"
    )
    base = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    runs = [subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env)
            for env in ({**base, "GLIBC_TUNABLES": jit_ops.CPU_MALLOC_TUNABLES}, base)]  # fmt: skip
    assert [r.stdout.strip() for r in runs] == ["heap", "mmap"]
