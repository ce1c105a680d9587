"""``moesim calibrate``: run the microbenchmarks as a real multi-rank job, fit the simulator's
models to them and write a calibration JSON (:mod:`sim.inputs.calibration`, ``moesim.calibration`` v1).

What is fitted, each through the simulator's own formula so that the fitted numbers reproduce the
measurements when the simulator uses them:

- ``links.intra``: alpha (per
  link) and bandwidth such that the simulator's all-to-all and ring all-reduce over the cluster of
  the benchmarked ranks give the measured times. The simulated time is linear in the link latency
  and in 1/bandwidth, so the fit is a non-negative linear least squares on relative error; the
  reported errors come from re-simulating every size with the fitted pair.
- ``gemm.<dtype>``: ``peak_TFLOPs``, ``m_half``, ``nk_half`` of :class:`sim.hardware.costs.CostModel`'s
  roofline ``max(2mnk / (peak h(m) h(n) h(k)), bytes / hbm) + launch`` (``h(x) = x / (x + c)``),
  least squares on log time (scipy), over the GEMM shapes the scenarios' layers produce (forward,
  input- and weight-gradient shapes, recorded from the simulator's schedule) plus a small grid.
- ``hbm_bw_GBps`` (the job's memory-bound ops -- add, GELU, LayerNorm, softmax, recorded by
  autograd -- over the scenarios' activation sizes, with the launch cost fixed), ``kernel_launch_us``
  (a tiny op recorded by autograd), ``attention_efficiency`` (scaled_dot_product_attention forward
  and backward against the fitted GEMM peak), ``optimizer_bytes_per_param`` and
  ``optimizer_step_overhead_us`` (DeepSpeed's ``engine.step()`` under the scenarios' ZeRO stage, its
  collectives taken off, with each rank stepping the scenarios' partition sizes; torch Adam on flat
  fp32 partitions when DeepSpeed is not installed).
- On >= 2 gloo ranks, from a short real job of a reference scenario (:mod:`hw_validate.desync`):
  the late wake-ups after blocking calls (``wake_delay_p``, ``wake_delay_cap_s``), the ranks'
  stalls (``pause_rate_per_s``, ``pause_mean_s``: each segment between calls against its median
  over the steps), the spread of the segments without them (``compute_noise_cv``), and the in-job
  compute factor (``compute_scale``: the job's forward and backward compute against the simulator's
  with the other figures, solved by simulating the job as it ran), then the in-job cost of each
  blocking call beyond its isolated time (``call_overhead_us``: the job's time in blocking calls
  against the simulator's, solved the same way with the compute scale in place).

Every item is timed in repetitions; the fits read the median (``stat="p25"``: the lower
quartile). Raw measurements (the nccl-tests-style table with algbw/busbw among them, each row's
model time ``fit_time_s``) are kept under ``sweeps``. One host is one node: there is no ``inter``
class to fit (a multi-node sweep is not implemented). The job is supervised: a rank that dies or a run past ``timeout_s`` is a
:class:`hw_validate.launch.JobError` with the log's last lines.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from hw_validate.calibrate_fit import STATS, CalibrationRun, bench_cluster, fit_all, format_report
from hw_validate.diagnose import cause_of
from hw_validate.jit_ops import accelerator_of, cpu_rank_env, needed_ops
from hw_validate.launch import JobError, free_port, launcher_head, prepare_ops, remove_shm_buffers, stop_group
from sim.errors import InputError
from sim.inputs.calibration import save_calibration

HERE = Path(__file__).resolve().parent
MICROBENCH = HERE / "microbench.py"
LAUNCHERS = ("torchrun", "deepspeed")
BACKENDS = ("gloo", "nccl")
COMM_SIZES = [4096 * 4**i for i in range(7)]  # 4 KiB .. 16 MiB
QUICK_COMM_SIZES = [4096 * 16**i for i in range(4)]  # 4 KiB, 64 KiB, 1 MiB, 16 MiB


# ---- shapes the scenarios produce -----------------------------------------------------------------
def scenario_shapes(paths: list[str | Path], accelerator: str = "cpu") -> dict[str, Any]:
    """GEMM shapes (m, n, k), attention shapes (batch, heads, seq, head_dim), activation sizes,
    optimizer partition sizes and dtypes of the scenarios, read off the simulator's own schedule
    (a cost model that records what it is asked to price)."""
    from hw_validate.dsconfig import effective_dtype
    from sim.api import load_scenario
    from sim.frameworks.deepspeed import build_schedule
    from sim.hardware.costs import CostModel
    from sim.routing.plan import route_scenario

    gemms: set[tuple[int, int, int]] = set()
    attention: set[tuple[int, int, int, int]] = set()
    act: set[int] = set()
    opt: set[int] = set()
    dispatcher: set[tuple] = set()
    stages: list[int] = []
    dtypes: set[str] = set()

    class Recording(CostModel):
        def gemm_times(self, m, n, k, dtype):
            for mm in np.unique(np.asarray(m, dtype=np.float64)):
                if mm > 0 and n > 0 and k > 0:
                    gemms.add((int(mm), int(n), int(k)))
            return super().gemm_times(m, n, k, dtype)

        def gemm_train_times(self, m, n, k, dtype):
            for mm in np.unique(np.asarray(m, dtype=np.float64)):
                if mm > 0:
                    gemms.add((int(mm), int(k), int(n)))  # input gradient [m, n] @ [n, k]
                    gemms.add((int(k), int(n), int(mm)))  # weight gradient [k, m] @ [m, n]
            return super().gemm_train_times(m, n, k, dtype)

    for p in paths:
        s = load_scenario(p)
        dtype, _ = effective_dtype(s.training.dtype, accelerator)
        dtypes.add(dtype)
        m = s.model
        plan = route_scenario(s) if m.num_moe_layers else None
        sched = build_schedule(s, plan, Recording(s.topology.gpu, None), np.ones(s.world_size))
        if m.attention != "none":
            attention.add((s.training.micro_batch_size, m.num_attention_heads, s.training.seq_len, m.head_size))
        t = s.tokens_per_micro_batch
        act.update({t * m.hidden_size, t * (m.moe_ffn_hidden_size or m.hidden_size)})
        opt.add(int(sched.stats["optimizer_params_per_rank"]))
        if m.num_moe_layers:
            r = s.routing
            drop = not (r.dispatch == "dropless" or r.capacity_factor is None)
            dispatcher.add((t, m.hidden_size, m.num_experts, m.top_k, r.capacity_factor, r.min_capacity, drop))
        stages.append(int(s.parallelism.zero_stage))
    return {
        "gemm": sorted(gemms),
        "attention": sorted(attention),
        "activation_elements": sorted(act),
        "optimizer_params": sorted(opt),
        # DeepSpeed's token dispatcher: (tokens per rank, d, experts, k, capacity factor, min capacity, drop)
        "dispatcher": sorted(dispatcher, key=lambda x: (x[0] * x[1] * x[3], repr(x))),
        # the stage most of the scenarios use (ties: the higher); the optimizer is timed under it
        "zero_stage": max(set(stages), key=lambda z: (stages.count(z), z)) if stages else None,
        "dtypes": sorted(dtypes),
    }


def _thin(shapes: list[tuple[int, int, int]], limit: int) -> list[tuple[int, int, int]]:
    """At most ``limit`` shapes, spread over the range of FLOPs (keeps the smallest and largest)."""
    if len(shapes) <= limit:
        return shapes
    order = sorted(shapes, key=lambda s: (s[0] * s[1] * s[2], s))
    idx = np.unique(np.round(np.linspace(0, len(order) - 1, limit)).astype(int))
    return [order[i] for i in idx]


def _spread(values: list[int], limit: int) -> list[int]:
    """At most ``limit`` of the sorted ``values``, evenly spaced in log (keeps the smallest and largest)."""
    if len(values) <= limit:
        return values
    logs = np.log(np.asarray(values, dtype=np.float64))
    picks = {int(np.argmin(np.abs(logs - g))) for g in np.linspace(logs[0], logs[-1], limit)}
    return [values[i] for i in sorted(picks)]


def optimizer_spec(zero_stage: int | None) -> dict[str, Any]:
    """How the microbenchmark times the optimizer step: DeepSpeed's own ``engine.step()`` under the
    scenarios' ZeRO stage (default 2) when DeepSpeed is installed -- what the training job runs --
    else torch Adam on a flat partition (which this VM's ZeRO-2 step exceeds by ~3x)."""
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        return {"impl": "torch"}
    return {"impl": "deepspeed", "zero_stage": 2 if zero_stage is None else int(zero_stage)}


def build_spec(
    shapes: dict[str, Any] | None, backend: str, quick: bool = False, max_gemms: int | None = None
) -> dict[str, Any]:
    """The microbenchmark job's spec (see :mod:`hw_validate.microbench`)."""
    shapes = shapes or {}
    gpu = backend == "nccl"
    grid_m = [16, 64, 256, 1024, 4096] if not gpu else [64, 256, 1024, 4096, 16384]
    grid_nk = [128, 512] if not gpu else [1024, 4096, 8192]
    grid = [(m, n, k) for m in grid_m for n in grid_nk for k in grid_nk]
    limit = max_gemms or (24 if quick else 64)
    gemm = sorted(set(_thin(list(shapes.get("gemm", [])), limit - (6 if quick else len(grid)))) | set(
        _thin(grid, 6) if quick else grid
    ))
    act = list(shapes.get("activation_elements", [])) or [32768, 131072]
    # the scenarios' activation sizes and a margin
    mem = sorted({int(a) for a in act} | {max(1024, min(act) // 4), max(act) * 4})
    opt = shapes.get("optimizer_params") or [400_000]
    opt_sizes = sorted({max(1000, int(p * f)) for p in opt for f in ((0.5, 2.0) if quick else (0.25, 1.0, 4.0))})
    optimizer = optimizer_spec(shapes.get("zero_stage"))
    if optimizer["impl"] == "deepspeed":  # an engine per size (~2-5 s each): spread over the range
        opt_sizes = _spread(opt_sizes, 3 if quick else 6)
    # DeepSpeed's gate / sparse encode / decode at the scenarios' shapes (needs DeepSpeed; ~1 s each)
    disp = [list(x) for x in shapes.get("dispatcher", [])] if optimizer["impl"] == "deepspeed" else []
    if len(disp) > (limit_d := 3 if quick else 8):
        disp = [disp[i] for i in np.unique(np.round(np.linspace(0, len(disp) - 1, limit_d)).astype(int))]
    return {
        "backend": backend,
        "dtypes": list(shapes.get("dtypes") or (["bf16"] if gpu else ["fp32"])),
        "comm": {"kinds": ["all_to_all", "all_reduce", "all_gather"], "sizes": QUICK_COMM_SIZES if quick else COMM_SIZES,
                 # many short repetitions: a median (or quartile) that bursts of interference move little
                 "reps": 9 if quick else 21, "target_s": 0.002 if quick else 0.005,
                 # blocking collectives (gloo): isolated calls after 1 ms of compute, as in the job
                 # (microbench.Bench.time_collective); NCCL queues calls, so its loops are the job's case
                 "gap_s": 0.0 if gpu else 0.001, "isolated_calls": 4 if quick else 8},
        "gemm": [list(s) for s in gemm],
        "attention": [list(a) for a in shapes.get("attention", [])] or [[4, 4, 64, 32]],
        "memory_elements": mem,
        "memory_ops": ["add", "gelu", "layer_norm", "softmax"],
        "launch_ops": 500 if quick else 2000,
        "optimizer_params": opt_sizes,
        "optimizer": optimizer,
        "dispatcher": disp,
        "reps": 3 if quick else 7,
        "target_s": 0.004 if quick and not gpu else (0.002 if gpu else 0.02),
        # CPU ranks: compute items timed with cold caches (hw_validate/microbench.py): in the job the
        # rest of a step evicts an op's operands before it runs again; tight warm loops read ~1.6x
        # (Experts forward) to 4x (GELU) too fast on this VM. Saturated by 32 MiB (2 to 128 MiB tried).
        # rank-to-rank spread of identical compute (microbench.bench_noise): the waits at every
        # all-to-all and blocking reduction of the job; CPU ranks only (on GPUs it is small and
        # mostly launch jitter, which NCCL's queued calls absorb)
        "noise": {"segments_s": [] if gpu else ([0.002, 0.008] if quick else [0.001, 0.003, 0.01]),
                  "calls": 10 if quick else 30},
        # late wake-ups after a blocking collective (microbench.bench_wake): CPU ranks only (gloo's
        # helper threads share the cores with the ranks' compute; NCCL on GPUs has no such wait)
        "wake": {"segments_s": [] if gpu else ([0.002, 0.006] if quick else [0.001, 0.002, 0.004, 0.008]),
                 "calls": 20 if quick else 60, "bytes": 65536},
        "flush_bytes": 0 if gpu else 32 * 1024 * 1024,
        "cold_iters": 4,
    }


# ---- running the job ------------------------------------------------------------------------------
class _ByteTail(deque):
    """The last ``limit`` bytes of the job's output, in the chunks they came in: tqdm redraws its bar
    in tiny chunks, so a count of chunks would lose the traceback that says why a rank failed."""

    def __init__(self, limit: int = 256 * 1024):
        super().__init__()
        self.limit, self.size = limit, 0

    def append(self, chunk: bytes) -> None:
        super().append(chunk)
        self.size += len(chunk)
        while self.size > self.limit and len(self) > 1:
            self.size -= len(self.popleft())


def _pump(stream, log_path: Path, echo: bool, tail: deque) -> None:
    """Copy the job's output to its log (and to our stderr), in raw chunks so tqdm's bar redraws."""
    with stream, open(log_path, "wb") as log:
        while True:
            chunk = os.read(stream.fileno(), 65536)
            if not chunk:
                return
            log.write(chunk)
            log.flush()
            tail.append(chunk)
            if echo:
                with contextlib.suppress(BrokenPipeError, OSError):
                    sys.stderr.buffer.write(chunk)
                    sys.stderr.flush()


def run_microbench(
    spec: dict[str, Any],
    nproc: int,
    launcher: str = "torchrun",
    timeout_s: float = 900.0,
    echo: bool = True,
    work_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Launch :mod:`hw_validate.microbench` on ``nproc`` local ranks and return rank 0's result."""
    if nproc < 1:
        raise InputError(f"must be >= 1, got {nproc}", field="--nproc")
    work = Path(tempfile.mkdtemp(prefix="moesim-calibrate-", dir=work_dir))
    spec_path, out_path, log_path = work / "spec.json", work / "result.json", work / "job.log"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    cmd = [*launcher_head(launcher, nproc, port), str(MICROBENCH), "--spec", str(spec_path), "--out", str(out_path)]
    env = dict(os.environ)
    root = str(HERE.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    if spec.get("backend") == "gloo":
        env.setdefault("DS_ACCELERATOR", "cpu")
    env = cpu_rank_env(env)
    uses_ds = launcher == "deepspeed" or (spec.get("optimizer") or {}).get("impl") == "deepspeed"
    if uses_ds and accelerator_of(env) == "cpu":
        try:
            prepare_ops(needed_ops("cpu", None), env, timeout_s, echo)
        except JobError:
            shutil.rmtree(work, ignore_errors=True)
            raise
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    tail = _ByteTail()
    pump = threading.Thread(target=_pump, args=(proc.stdout, log_path, echo, tail), daemon=True)
    pump.start()
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stop_group(proc)
        pump.join(timeout=5)
        raise JobError(
            f"calibration job timed out after {timeout_s:g} s ({nproc} ranks, {launcher}; "
            f"{_stage(tail)}), stopped; log: {log_path}\n" + _last_lines(tail),
            run_dir=work,
        ) from None
    except BaseException:
        stop_group(proc)
        raise
    finally:
        remove_shm_buffers(port)
    pump.join(timeout=10)
    if rc != 0 or not out_path.is_file():
        why = "exited 0 without writing its result" if rc == 0 else (_cause(tail) or f"exit status {rc}")
        raise JobError(
            f"calibration job failed ({nproc} ranks, {launcher}, exit status {rc}): {why}; log: {log_path}\n"
            + _last_lines(tail),
            run_dir=work,
            returncode=rc,
        )
    result = json.loads(out_path.read_text())
    result["command"] = cmd
    shutil.rmtree(work, ignore_errors=True)
    return result


def _lines(tail: deque) -> list[str]:
    text = b"".join(tail).decode("utf-8", "replace").replace("\r", "\n")
    return [ln for ln in text.splitlines() if ln.strip() and "microbenchmarks:" not in ln]


_RANK_PREFIX = re.compile(r"^\[(?:rank|default)(\d+)\]:\s?")


def _cause(tail: deque) -> str | None:
    """The last line stating a cause (an exception's ``SomeError: message``), with the rank that
    printed it when the launcher prefixed its lines (``[rank1]: ...``)."""
    for line in reversed(_lines(tail)):
        m = _RANK_PREFIX.match(line)
        text = line[m.end():] if m else line
        why = cause_of([text])
        if why and "ChildFailedError" not in why:
            return f"rank {m.group(1)}: {why}" if m else why
    return None


def _stage(tail: deque) -> str:
    """Where the job was: the last state of its progress bar, or that it never started measuring."""
    text = b"".join(tail).decode("utf-8", "replace").replace("\r", "\n")
    bars = [ln.strip() for ln in text.splitlines() if "microbenchmarks:" in ln]
    return f"last progress: {bars[-1]}" if bars else "no rank started measuring (hung in start-up or rendezvous)"


def _last_lines(tail: deque, n: int = 15) -> str:
    lines = _lines(tail)[-n:]
    return "  last lines of the job:\n" + "\n".join(f"    {ln}" for ln in lines)


def check_writable(out: str | Path, field: str = "--out") -> None:
    """Bad input unless ``out`` can be created: not a folder, and its nearest existing parent a
    writable folder (checked before the job runs, so a long measurement is not thrown away)."""
    p = Path(out)
    if p.is_dir():
        raise InputError(f"'{out}' is a folder; give a file path such as calib.json", field=field)
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InputError(f"cannot write '{out}': '{parent}' is not a folder", field=field)
    try:  # the permission bits do not tell (root, read-only mounts, /proc): try it
        fd, probe = tempfile.mkstemp(prefix=".moesim-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise InputError(f"cannot write '{out}': {exc.strerror or exc} in '{parent}'", field=field) from None


def calibrate(
    out: str | Path | None,
    nproc: int = 2,
    backend: str = "gloo",
    launcher: str = "torchrun",
    topology=None,
    scenarios: list[str | Path] = (),
    quick: bool = False,
    timeout_s: float = 900.0,
    echo: bool = True,
    stat: str = "median",
    progress=None,
    desync: str | Path | bool | None = "auto",
) -> CalibrationRun:
    """Measure, fit, write ``out`` (when given, atomically); see the module docstring.

    ``scenarios``: scenario files whose layers' GEMM, attention, activation and optimizer sizes are
    measured (besides a small grid); their first one's topology is the cluster the link fit runs on
    unless ``topology`` (a Topology, shipped name or YAML path) is given (default ``cpu-host`` for
    gloo, ``hgx-h200`` for nccl). ``stat``: which statistic of the repetitions the fits use
    (:data:`hw_validate.calibrate_fit.STATS`). ``progress``: callable taking one line of text
    (stages of the run); the job's own progress bar goes to stderr when ``echo``. Bad input is an
    :class:`~sim.errors.InputError` naming the CLI flag; a failed or hung job a :class:`JobError`.

    ``desync``: the reference scenario whose real job measures the ranks' drift between blocking
    calls (:mod:`hw_validate.desync`; its fit replaces the microbenchmarks' ``wake_delay_*`` and
    ``compute_noise_cv``). ``"auto"`` (default): ``scenarios/calibration/cpu-desync.yaml`` on gloo
    with >= 2 ranks, unless ``quick`` or DeepSpeed is not installed; None or False: never."""
    if backend not in BACKENDS:
        raise InputError(f"unknown backend '{backend}'; use one of {', '.join(BACKENDS)}", field="--backend")
    if launcher not in LAUNCHERS:
        raise InputError(f"unknown launcher '{launcher}'; use one of {', '.join(LAUNCHERS)}", field="--launcher")
    if not isinstance(nproc, int) or nproc < 1:
        raise InputError(f"must be a whole number >= 1, got {nproc}", field="--nproc")
    if stat not in STATS:
        raise InputError(f"unknown statistic '{stat}'; use one of {', '.join(STATS)}", field="--stat")
    if not timeout_s or timeout_s <= 0 or not math.isfinite(timeout_s):
        raise InputError(f"must be a positive number of seconds, got {timeout_s}", field="--timeout")
    if out is not None:
        check_writable(out)
    say = progress or (lambda line: None)
    for p in scenarios:
        if not Path(p).is_file():
            raise InputError(f"scenario file '{p}' does not exist", file=str(p), field="--scenario")
    accelerator = "cuda" if backend == "nccl" else "cpu"
    shapes = scenario_shapes(list(scenarios), accelerator) if scenarios else None
    if topology is None:
        if scenarios:
            from sim.api import load_scenario

            topology = load_scenario(scenarios[0]).topology
        else:
            topology = "cpu-host" if backend == "gloo" else "hgx-h200"
    try:
        bench_cluster(topology, nproc)  # a bad topology is bad input, before the job runs
    except InputError as exc:
        if exc.field in (None, "cluster.topology", "cluster.nodes", "cluster.gpus_per_node"):
            raise InputError(exc.message, file=exc.file, field="--topology") from None
        raise
    desync_path = _desync_scenario(desync, backend, nproc, quick)
    spec = build_spec(shapes, backend, quick)
    say(f"microbenchmarks: {nproc} {backend} ranks ({launcher}), {_count_items(spec, nproc)} items"
        f"{' (quick)' if quick else ''}")  # fmt: skip
    t0 = time.monotonic()
    raw = run_microbench(spec, nproc, launcher, timeout_s, echo)
    say(f"measured in {time.monotonic() - t0:.1f} s")
    with tempfile.TemporaryDirectory(prefix="moesim-refjob-") as job_dir:
        if desync_path is not None:
            from hw_validate.desync import profile_job

            say(f"rank desync: a real job of {desync_path} on {nproc} ranks, per-call spans")
            raw["desync"] = profile_job(nproc, desync_path, timeout_s=timeout_s, echo=echo, job_dir=job_dir)
            say(f"desync job: {raw['desync']['calls']} blocking calls in {raw['desync']['job_wall_s']:.1f} s")
        say("fitting links, GEMM, memory, attention, optimizer, desync")
        t1 = time.monotonic()
        run = fit_all(raw, topology, spec, stat=stat)
        desync_fit = run.calibration.sweeps.get("desync")
        if desync_fit:
            from hw_validate.desync import fit_call_overhead, fit_compute_scale

            scale = fit_compute_scale(run.calibration, desync_fit)
            desync_fit["compute"] = scale
            if scale is not None:
                run.calibration.compute_scale = scale["compute_scale"]
            overhead = fit_call_overhead(run.calibration, desync_fit)
            desync_fit.pop("job", None)  # temporary paths: not part of the record
            desync_fit["call_overhead"] = overhead
            if overhead is not None:
                run.calibration.call_overhead_us = overhead["call_overhead_us"]
    run.calibration.sweeps["fit_wall_s"] = time.monotonic() - t1
    run.calibration.sweeps["job_wall_s"] = t1 - t0
    if scenarios:
        run.calibration.hardware["scenarios"] = [str(p) for p in scenarios]
    if out is not None:
        try:
            save_calibration(out, run.calibration)
        except OSError as exc:
            raise InputError(f"cannot write '{out}': {exc.strerror or exc}", field="--out") from None
        say(f"wrote {out}")
    return run


def _desync_scenario(desync, backend: str, nproc: int, quick: bool) -> Path | None:
    """The reference scenario of the desync job, or None when it does not run (see :func:`calibrate`)."""
    import importlib.util

    from hw_validate.desync import REFERENCE

    if desync is None or desync is False:
        return None
    usable = backend == "gloo" and nproc >= 2
    if desync == "auto":
        return REFERENCE if usable and not quick and importlib.util.find_spec("deepspeed") is not None else None
    path = REFERENCE if desync is True else Path(desync)
    if not path.is_file():
        raise InputError(f"scenario file '{desync}' does not exist", file=str(desync), field="--desync-scenario")
    if not usable:
        raise InputError("the desync job runs on >= 2 gloo ranks", field="--desync-scenario")
    return path


def _count_items(spec: dict[str, Any], nproc: int) -> int:
    c = spec.get("comm") or {}
    n_comm = len(c.get("kinds", ())) * len(c.get("sizes", ())) if nproc > 1 else 0
    per_dtype = len(spec.get("gemm", ())) + len(spec.get("attention", ()))
    return (n_comm + per_dtype * len(spec.get("dtypes", ())) + len(spec.get("memory_elements", ())) * len(spec.get("memory_ops", ())) + 1
            + len(spec.get("optimizer_params", ())))  # fmt: skip


__all__ = ["BACKENDS", "LAUNCHERS", "CalibrationRun", "build_spec", "calibrate", "check_writable", "fit_all",
           "format_report", "run_microbench", "scenario_shapes"]  # fmt: skip
