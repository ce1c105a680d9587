"""The optimizer step per parameters stepped by one rank: DeepSpeed's own ``engine.step()`` under
the scenarios' ZeRO stage with its collectives taken off, and what ZeRO's ``engine.backward()``
costs beyond plain autograd (gradient hooks, bucket copies); torch Adam on a flat partition when
DeepSpeed is not installed. What :mod:`hw_validate.fits.optimizer` reads."""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from hw_validate.microbenchmarks.harness import Bench, stats


def bench_optimizer(b: Bench, progress) -> list[dict]:
    """The optimizer step per ``optimizer_params`` (parameters stepped by one rank).

    ``optimizer: {"impl": "deepspeed", "zero_stage": S}`` (what ``moesim calibrate`` asks for when
    DeepSpeed is installed): DeepSpeed's own ``engine.step()`` under ZeRO stage ``S`` with torch Adam
    (the job's ds_config), its collectives (gradient-norm all-reduce, parameter all-gather) timed
    apart and taken off, because the simulator prices those as communication. Measured on this VM
    (2 ranks, fp32, 0.4 M parameters a rank): the ZeRO-2 step is 7.4 ms without its collectives,
    torch Adam on the same flat partition 2.5 ms: the gradient norm, clipping, the fp32 partition
    copies and bookkeeping cost more than Adam itself. Otherwise (``impl`` "torch"): torch Adam on
    one flat fp32 tensor, like a ZeRO partition."""
    opt_spec = b.spec.get("optimizer") or {}
    if opt_spec.get("impl") == "deepspeed":
        return bench_optimizer_deepspeed(b, progress, int(opt_spec.get("zero_stage", 2)))
    rows = []
    for n in b.spec.get("optimizer_params", ()):
        p = torch.nn.Parameter(torch.zeros(int(n), dtype=torch.float32, device=b.device))
        p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.Adam([p], lr=1e-4)
        t, q = b.time_local(opt.step)
        rows.append({"params": int(n), "time_s": t, "p25_s": q})
        progress.update()
    return rows


def bench_optimizer_deepspeed(b: Bench, progress, zero_stage: int) -> list[dict]:
    """``engine.step()`` of a DeepSpeed engine whose ranks each step ``n`` parameters (see
    :func:`bench_optimizer`); seconds per step without the step's collectives. Also
    ``grad_hooks_s``: what ``engine.backward()`` costs beyond the same layers' plain autograd
    backward and its own collectives (ZeRO's gradient hooks, copies into the reduce bucket,
    partition bookkeeping) for ``model_params`` parameters on a rank. Measured on this VM (2 ranks,
    ZeRO-2, fp32): 5.6 ms at 0.2 M parameters, 11.0 at 0.8 M, 31.7 at 3.2 M; in the e8-top1-t512 job
    (0.79 M a rank) ~9 ms of the backward lies around its gradient all-reduce, outside every timed
    module."""
    if b.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    from hw_validate.timing import StepTimer

    world = dist.get_world_size()
    deepspeed.init_distributed(dist_backend=b.spec.get("backend", "gloo"))
    dtype = (b.spec.get("dtypes") or ["fp32"])[0]
    timer = StepTimer(b.device.type)
    rows = []
    width, tensors = 256, 8
    for n in b.spec.get("optimizer_params", ()):
        total = int(n) * (world if zero_stage >= 1 else 1)  # ZeRO partitions the optimizer over the ranks
        out_f = max(1, -(-total // (width * tensors)))
        torch.manual_seed(0)
        model = torch.nn.ModuleList(torch.nn.Linear(width, out_f, bias=False) for _ in range(tensors))
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "steps_per_print": 10**9,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": zero_stage, "overlap_comm": True, "contiguous_gradients": True,
                                  "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000},
        }  # fmt: skip
        if dtype in ("bf16", "fp16"):
            config[dtype] = {"enabled": True}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        timer.wrap_comm(ds_comm.cdb)
        x = torch.ones(1, width, device=b.device, dtype=next(engine.module.parameters()).dtype)
        # the same layers outside DeepSpeed: their plain autograd backward is the baseline that
        # DeepSpeed's engine.backward() (gradient hooks, bucket copies, partition bookkeeping) exceeds
        plain = torch.nn.ModuleList(torch.nn.Linear(width, out_f, bias=False) for _ in range(tensors)).to(
            device=b.device, dtype=x.dtype)

        def flush() -> None:
            if b._flush is not None:
                b._flush.sum()
            b.sync()
            dist.barrier()

        def one_step(engine=engine, x=x, plain=plain) -> tuple[float, float, float, float]:
            flush()
            timer.begin_step()
            with timer.phase("backward", "backward"):
                engine.backward(sum(m(x).float().sum() for m in engine.module))
            flush()
            with timer.phase("optimizer", "optimizer"):
                engine.step()
            b.sync()
            t = timer.end_step()
            flush()
            loss = sum(m(x).float().sum() for m in plain)
            t0 = time.perf_counter()
            loss.backward()
            b.sync()
            base = time.perf_counter() - t0
            plain.zero_grad(set_to_none=True)
            return (t["optimizer"] - t["optimizer_comm"], t["optimizer_comm"],
                    max(t["backward"] - t["grad_sync"] - base, 0.0), t["grad_sync"])  # fmt: skip

        for _ in range(2):  # the first steps allocate states
            one_step()
        iters = max(1, b.cold_iters)
        reps = [[one_step() for _ in range(iters)] for _ in range(b.reps)]
        times = [sum(c[0] for c in r) / iters for r in reps]
        comm = [sum(c[1] for c in r) / iters for r in reps]
        grads = [sum(c[2] for c in r) / iters for r in reps]
        t, q = stats(times)
        g, gq = stats(grads)
        rows.append({"params": int(n), "time_s": t, "p25_s": q, "comm_s": statistics.median(comm),
                     "grad_hooks_s": g, "grad_hooks_p25_s": gq, "model_params": int(total),
                     "grad_comm_s": statistics.median([sum(c[3] for c in r) / iters for r in reps]),
                     "impl": "deepspeed", "zero_stage": zero_stage, "param_tensors": tensors})  # fmt: skip
        engine.destroy() if hasattr(engine, "destroy") else None
        del engine, model
        progress.update()
    return rows
