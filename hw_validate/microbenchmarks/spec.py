"""What the microbenchmark job measures (its ``SPEC.json``, see ``hw_validate/microbench.py``): the
GEMM, attention, activation, optimizer and dispatcher shapes the scenarios' layers produce, read off
the simulator's own schedule (:func:`scenario_shapes`), plus a small grid, the collective sizes and
the repetition counts (:func:`build_spec`). No torch here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

COMM_SIZES = [4096 * 4**i for i in range(7)]  # 4 KiB .. 16 MiB
QUICK_COMM_SIZES = [4096 * 16**i for i in range(4)]  # 4 KiB, 64 KiB, 1 MiB, 16 MiB


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
        def gemm_times(self, m, n, k, dtype, rate_scale=1.0):
            for mm in np.unique(np.asarray(m, dtype=np.float64)):
                if mm > 0 and n > 0 and k > 0:
                    gemms.add((int(mm), int(n), int(k)))
            return super().gemm_times(m, n, k, dtype, rate_scale)

        def gemm_train_times(self, m, n, k, dtype, rate_scale=1.0):
            for mm in np.unique(np.asarray(m, dtype=np.float64)):
                if mm > 0:
                    gemms.add((int(mm), int(k), int(n)))  # input gradient [m, n] @ [n, k]
                    gemms.add((int(k), int(n), int(mm)))  # weight gradient [k, m] @ [m, n]
            return super().gemm_train_times(m, n, k, dtype, rate_scale)

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
    """The microbenchmark job's spec (see ``hw_validate/microbench.py``)."""
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
        "comm": {"kinds": ["all_to_all", "all_reduce", "all_gather", "reduce_scatter"], "sizes": QUICK_COMM_SIZES if quick else COMM_SIZES,
                 # many short repetitions: a median (or quartile) that bursts of interference move little
                 "reps": 9 if quick else 21, "target_s": 0.002 if quick else 0.005,
                 # blocking collectives (gloo): isolated calls after 1 ms of compute, as in the job
                 # (harness.Bench.time_collective); NCCL queues calls, so its loops are the job's case
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
        # CPU ranks: compute items timed with cold caches (microbenchmarks.harness): in the job the
        # rest of a step evicts an op's operands before it runs again; tight warm loops read ~1.6x
        # (Experts forward) to 4x (GELU) too fast on this VM. Saturated by 32 MiB (2 to 128 MiB tried).
        # rank-to-rank spread of identical compute (microbenchmarks.cpu_ranks.bench_noise): the waits at every
        # all-to-all and blocking reduction of the job; CPU ranks only (on GPUs it is small and
        # mostly launch jitter, which NCCL's queued calls absorb)
        "noise": {"segments_s": [] if gpu else ([0.002, 0.008] if quick else [0.001, 0.003, 0.01]),
                  "calls": 10 if quick else 30},
        # late wake-ups after a blocking collective (microbenchmarks.cpu_ranks.bench_wake): CPU ranks only (gloo's
        # helper threads share the cores with the ranks' compute; NCCL on GPUs has no such wait)
        "wake": {"segments_s": [] if gpu else ([0.002, 0.006] if quick else [0.001, 0.002, 0.004, 0.008]),
                 "calls": 20 if quick else 60, "bytes": 65536},
        "flush_bytes": 0 if gpu else 32 * 1024 * 1024,
        "cold_iters": 4,
    }
