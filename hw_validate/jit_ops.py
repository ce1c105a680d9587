"""DeepSpeed's JIT-compiled ops: build them once before the ranks start; clear a killed build's lock.

DeepSpeed compiles some of its C++ ops at first use through ``torch.utils.cpp_extension.load``:
on CPU ranks the shared-memory collectives (``deepspeed_shm_comm``) and, with
``training.offload_optimizer: cpu``, ``DeepSpeedCPUAdam`` (``cpu_adam``). torch guards each op's
build folder ``<TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions/pyXY_cpu>/<op>/`` with a lock
file (``FileBaton``) that every process loading the op takes, even when the op is already built,
and that records no owner. A process killed while it holds the file (a job stopped at its
timeout, a rank killed during start-up) leaves it behind, and from then on every load of that op
waits on it forever: the job hangs before its first step with its ranks in ``file_baton.wait``.

Before it launches a job, the harness therefore

1. removes every such lock that no process is using: a build holds the lock while ``ninja`` (and
   the compilers it starts) run with the build folder as their working directory, and only for
   milliseconds outside that; a lock older than :data:`MIN_AGE_S` that no live process has its
   working directory under, checked :data:`CHECKS` times over about a second, is a dead one;
2. compiles the ops the job will load that are not built yet, in one process with its own timeout,
   so that the first-use compile (1-2 minutes on a small VM) is not paid by every rank at once
   inside the job's time limit, and a compile error is reported as such.

The parent side (:func:`prepare`) imports neither torch nor DeepSpeed; it asks a child Python once
per process for the extensions folder, and the compile runs in a child (``python -m
hw_validate.jit_ops --build OP``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

#: a lock younger than this (seconds) may belong to a load that has not started ninja yet
MIN_AGE_S = 2.0
#: how many times, 0.4 s apart, no process may be found in the build folder before its lock is removed
CHECKS = 3
#: op name -> the DeepSpeed op builder that compiles it (looked up through the accelerator)
BUILDERS = {"deepspeed_shm_comm": "ShareMemCommBuilder", "cpu_adam": "CPUAdamBuilder"}

_ROOTS: dict[tuple[str, str | None], Path] = {}


class BuildError(RuntimeError):
    """An op failed to compile, or its compile ran past the time limit."""


def needed_ops(accelerator: str, offload_optimizer: str | None) -> list[str]:
    """The JIT ops a DeepSpeed job loads on this accelerator (``cpu`` or ``cuda``)."""
    if accelerator != "cpu":
        return []  # on CUDA the job's ops are torch's own (FusedAdam is optional and prebuilt or JIT-free)
    ops = ["deepspeed_shm_comm"]
    if offload_optimizer == "cpu":
        ops.append("cpu_adam")
    return ops


#: glibc malloc settings for CPU ranks (``GLIBC_TUNABLES``): keep freed memory in the process
#: instead of giving it back to the kernel. By default glibc serves buffers over 128 KiB-32 MiB
#: with fresh mmaps and trims its heap, so every step unmaps and refaults megabytes of gradient
#: and optimizer buffers; in a VM a refault is cheap at the median and slow in its tail (a fresh
#: 16 MiB buffer: 0.6 ms median, 42 ms max), and those stalls land in the step's tail (ZeRO's
#: gradient copies, the optimizer). PyTorch's CUDA caching allocator keeps its blocks, so with
#: these settings a CPU rank's memory behaves as a GPU job's does. Measured on a 2-core VM
#: (e8-top3-dropless, 30 steps, 2 runs each): optimizer 19.1-19.6 -> 14.7-15.9 ms.
CPU_MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=4294967296:glibc.malloc.top_pad=67108864"


def cpu_rank_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for the ranks of a job: on CPU ranks :data:`CPU_MALLOC_TUNABLES` is added, unless
    ``GLIBC_TUNABLES`` is set already (the user's own settings win) or ``MOESIM_CPU_MALLOC=default``
    (glibc's defaults, to measure a job as an untuned CPU run)."""
    out = dict(env)
    if accelerator_of(out) == "cpu" and not out.get("GLIBC_TUNABLES") and out.get("MOESIM_CPU_MALLOC") != "default":
        out["GLIBC_TUNABLES"] = CPU_MALLOC_TUNABLES
    return out


def accelerator_of(env: dict[str, str]) -> str:
    """The accelerator DeepSpeed will pick in a job run with ``env``: ``DS_ACCELERATOR`` when set,
    else ``cuda`` where an NVIDIA driver is present (what DeepSpeed's auto-detection finds), else ``cpu``."""
    name = env.get("DS_ACCELERATOR")
    if name:
        return name
    return "cuda" if Path("/dev/nvidiactl").exists() or shutil.which("nvidia-smi") else "cpu"


def extensions_root(python: str = sys.executable, env: dict[str, str] | None = None) -> Path:
    """The folder torch builds extensions in for ``python`` under ``env`` (the same rule torch uses)."""
    env = dict(os.environ if env is None else env)
    key = (python, env.get("TORCH_EXTENSIONS_DIR"))
    if key not in _ROOTS:
        code = (
            "import sys, torch\n"
            "from torch.utils.cpp_extension import _get_build_directory\n"
            "print(_get_build_directory('moesim_probe', False).rsplit('/', 1)[0])\n"
        )
        # _get_build_directory creates <root>/moesim_probe; remove it again below
        res = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        if res.returncode != 0:
            raise BuildError(f"could not find torch's extensions folder: {res.stderr.strip()[-500:]}")
        root = Path(res.stdout.strip().splitlines()[-1])
        probe = root / "moesim_probe"
        if probe.is_dir() and not any(probe.iterdir()):
            probe.rmdir()
        _ROOTS[key] = root
    return _ROOTS[key]


def _cwds() -> list[str] | None:
    """Working directories of the live processes we can see; None where /proc is not available."""
    proc = Path("/proc")
    if not proc.is_dir():
        return None
    out = []
    for p in proc.iterdir():
        if p.name.isdigit():
            try:
                out.append(os.readlink(p / "cwd"))
            except OSError:
                continue  # ended meanwhile, or not ours to read
    return out


def _in_use(folder: Path, cwds: list[str]) -> bool:
    f = os.path.realpath(folder)
    return any(c == f or c.startswith(f + os.sep) for c in cwds)


def clear_stale_locks(root: Path, log=None) -> list[Path]:
    """Remove the build locks under ``root`` that no live process holds; return the removed paths."""
    if not root.is_dir():
        return []
    candidates = [lk for lk in root.glob("*/lock") if lk.is_file()]
    if not candidates:
        return []
    for i in range(CHECKS):
        cwds = _cwds()
        if cwds is None:
            return []  # no way to tell a live build from a dead one here: leave the locks alone
        now = time.time()
        keep = []
        for lk in candidates:
            try:
                young = now - lk.stat().st_mtime < MIN_AGE_S
            except FileNotFoundError:
                continue  # released meanwhile
            if not young and not _in_use(lk.parent, cwds):
                keep.append(lk)
        candidates = keep
        if not candidates:
            return []
        if i + 1 < CHECKS:
            time.sleep(0.4)
    removed = []
    for lk in candidates:
        try:
            lk.unlink()
        except FileNotFoundError:
            continue
        removed.append(lk)
        if log:
            log(f"moesim: removed a stale torch extension lock {lk} (left by a build or load that was killed)")
    return removed


def _built(root: Path, op: str) -> bool:
    return (root / op / f"{op}.so").is_file()


def prepare(
    ops: list[str],
    python: str = sys.executable,
    env: dict[str, str] | None = None,
    timeout_s: float = 900.0,
    log=None,
) -> list[str]:
    """Clear dead locks and compile the ``ops`` that are not built yet; return the ops compiled.

    Raises :class:`BuildError` when a compile fails or runs past ``timeout_s``."""
    if not ops:
        return []
    root = extensions_root(python, env)
    clear_stale_locks(root, log)
    todo = [op for op in ops if not _built(root, op)]
    if not todo:
        return []
    if log:
        log(f"moesim: compiling DeepSpeed ops {', '.join(todo)} (first use; 1-2 minutes on a small CPU machine)")
    run_env = dict(os.environ if env is None else env)
    here = str(Path(__file__).resolve().parent.parent)
    run_env["PYTHONPATH"] = here + (os.pathsep + run_env["PYTHONPATH"] if run_env.get("PYTHONPATH") else "")
    cmd = [python, "-m", "hw_validate.jit_ops", *[a for op in todo for a in ("--build", op)]]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=run_env, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        clear_stale_locks(root, log)  # the killed compile's lock
        raise BuildError(f"compiling DeepSpeed ops {', '.join(todo)} timed out after {timeout_s:g} s") from None
    if res.returncode != 0:
        tail = "\n".join((res.stdout + res.stderr).strip().splitlines()[-15:])
        raise BuildError(f"compiling DeepSpeed ops {', '.join(todo)} failed (exit status {res.returncode}):\n{tail}")
    return todo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hw_validate.jit_ops",
        description="Compile DeepSpeed's JIT ops for this Python, after removing build locks left by killed builds.",
    )
    ap.add_argument("--build", action="append", default=[], choices=sorted(BUILDERS), metavar="OP",
                    help=f"op to compile (repeatable): {', '.join(sorted(BUILDERS))}")  # fmt: skip
    ap.add_argument("--clear-locks", action="store_true", help="only remove stale locks, print what was removed")
    args = ap.parse_args(argv)
    root = extensions_root()
    clear_stale_locks(root, lambda m: print(m, file=sys.stderr))
    if args.clear_locks:
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    for op in args.build:
        builder = get_accelerator().create_op_builder(BUILDERS[op])
        if builder is None:
            print(f"jit_ops: error: the {get_accelerator().device_name()} accelerator has no {BUILDERS[op]}", file=sys.stderr)
            return 2
        builder.load()
        print(f"jit_ops: {op} ready", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
