"""Microbenchmarks of one machine, run as a real multi-rank job (one process per rank).

Launched by :mod:`hw_validate.calibrate` (``moesim calibrate``) with ``torchrun`` or the
``deepspeed`` launcher; every rank runs::

    python hw_validate/microbench.py --spec SPEC.json --out RESULT.json

``SPEC.json`` (written by the driver) says what to measure::

    {"backend": "gloo" | "nccl", "dtypes": ["fp32"],
     "comm": {"kinds": ["all_to_all", "all_reduce"], "sizes": [4096, ...], "reps": 5, "target_s": 0.02},
     "gemm": [[m, n, k], ...],                      # (m x k) @ (k x n)
     "attention": [[batch, heads, seq, head_dim], ...],
     "memory_elements": [65536, ...], "memory_ops": ["add", "gelu", "layer_norm", "softmax"],
     "launch_ops": 2000,
     "optimizer_params": [100000, 1000000], "optimizer": {"impl": "deepspeed", "zero_stage": 2},
     "dispatcher": [[tokens, d, experts, k, capacity_factor, min_capacity, drop_tokens], ...],  # DeepSpeed's gate/permute
     "reps": 5, "target_s": 0.02,
     "flush_bytes": 33554432, "cold_iters": 4,      # optional: cold-cache compute timing
     "noise": {"segments_s": [0.001, 0.004], "calls": 20},  # optional: rank-to-rank compute spread
     "wake": {"segments_s": [0.001, 0.002, 0.004, 0.008], "calls": 40, "bytes": 65536}}  # optional (CPU)

Cold caches (``flush_bytes`` > 0, what ``moesim calibrate`` asks for on CPU ranks): every timed GEMM
and optimizer step is preceded by a read of a buffer larger than the last-level cache, because in
the training job the rest of the step evicts an op's weights (and the optimizer's states) before it
runs again; the GEMM's activation operand is then touched again (the previous op just wrote it).
Memory-bound ops and attention's core read only activations just written, so they stay warm. Measured inside a 2-rank e4-top2-d128 job (2026-12-03): the
``Experts`` forward took 2.57 ms a call in the job, 1.63 ms when re-run in a tight loop on the same
input in the same process, and 2.49 ms in that loop with a 32 MiB read before each call.

Rank 0 writes ``RESULT.json`` (atomically): seconds per call for every item, the median over
``reps`` timed repetitions (each a loop long enough to last ``target_s``), and for compute items
the median over ranks. Every rank computes at the same time (a barrier before each item), as the
ranks of the training job do, so shared memory bandwidth and cores are shared the same way.
Collectives: each repetition's time is the slowest rank's (all-reduce MAX), nccl-tests style.

Threads: on CPU ranks each rank uses ``cpu_count // local ranks`` threads unless
``OMP_NUM_THREADS`` is set -- the rule of ``hw_validate/train_moe.py`` -- so that calibration and
the training job see the same compute. Progress goes to rank 0's stderr (tqdm).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script by torchrun / deepspeed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

COMPUTE_KEYS = ("gemm", "attention", "memory", "optimizer", "dispatcher")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32}


def set_threads(device: str) -> int:
    """train_moe.py's rule: ``cpu_count // LOCAL_WORLD_SIZE`` threads per CPU rank unless OMP_NUM_THREADS."""
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local)))
    return torch.get_num_threads()


def stats(times: list[float]) -> tuple[float, float]:
    """(median, lower quartile) of repetition times. The fits read the median by default (what a
    call in a job typically pays); the quartile (``--stat p25``) is the least disturbed by other
    processes on a shared host while not the lucky extreme."""
    p25 = statistics.quantiles(times, n=4, method="inclusive")[0] if len(times) > 1 else times[0]
    return statistics.median(times), float(p25)


class Bench:
    def __init__(self, spec: dict, device: torch.device):
        self.spec, self.device = spec, device
        self.cuda = device.type == "cuda"
        self.reps = int(spec.get("reps", 5))
        self.target_s = float(spec.get("target_s", 0.02))
        self.max_iters = int(spec.get("max_iters", 1000))
        # cold-cache compute timing (CPU ranks): see _loop_cold; 0 = warm tight loops
        flush = int(spec.get("flush_bytes", 0))
        self._flush = torch.ones(flush // 4, dtype=torch.float32, device=device) if flush > 0 else None
        self.cold_iters = int(spec.get("cold_iters", 4))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _loop(self, fn, iters: int) -> float:
        self.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        self.sync()
        return (time.perf_counter() - t0) / iters

    def _loop_cold(self, fn, iters: int, warm=None) -> float:
        """Seconds per call of ``fn`` with cold caches: before each timed call, read the flush buffer
        (larger than the last-level cache), as the rest of a training step evicts an op's weights
        between two calls of it; then ``warm()`` (untimed) touches what the previous op of the job
        has just written (the activation input). The flush itself is not timed."""
        total = 0.0
        for _ in range(iters):
            self._flush.sum()
            if warm is not None:
                warm()
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            total += time.perf_counter() - t0
        return total / iters

    def _time_isolated(self, fn, reps: int, gap_s: float) -> list[float]:
        calls = max(1, int(self.spec.get("comm", {}).get("isolated_calls", 8)))
        fn()
        out = []
        for _ in range(reps):
            mine = []
            for _ in range(calls):
                dist.barrier()
                _spin(gap_s)
                self.sync()
                t0 = time.perf_counter()
                fn()
                self.sync()
                mine.append(time.perf_counter() - t0)
            t = torch.tensor(mine, dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            out.append(float(t.mean().item()))
        return out

    def iters_for(self, fn, agree: bool = False, target_s: float | None = None) -> int:
        """Iterations per repetition so that one lasts ``target_s``; ``agree``: the same on every rank."""
        fn()
        once = max(self._loop(fn, 1), 1e-7)
        if agree:
            t = torch.tensor([once], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            once = float(t.item())
        return int(min(self.max_iters, max(1, round((target_s or self.target_s) / once))))

    def time_local(self, fn, cold: bool = True, warm=None) -> tuple[float, float]:
        """(median, lower quartile) over repetitions of seconds per call of ``fn`` on this rank (all
        ranks run it at the same time). ``cold`` (and a ``flush_bytes`` spec): every call starts
        with cold caches (``cold_iters`` calls a repetition; ``warm``: see _loop_cold), as in the job."""
        dist.barrier()
        if cold and self._flush is not None:
            fn()
            times = [self._loop_cold(fn, self.cold_iters, warm) for _ in range(self.reps)]
            dist.barrier()
            return stats(times)
        iters = self.iters_for(fn)
        times = [self._loop(fn, iters) for _ in range(self.reps)]
        dist.barrier()
        return stats(times)

    def time_collective(self, fn, reps: int | None = None, target_s: float | None = None,
                        gap_s: float = 0.0) -> list[float]:  # fmt: skip
        """The slowest rank's seconds per call in each of ``reps`` repetitions (nccl-tests style:
        every repetition starts at a barrier, and its time is the MAX over ranks).

        ``gap_s`` > 0 (blocking backends, gloo): isolated calls instead of a back-to-back loop. Each
        call starts at a barrier followed by ``gap_s`` of busy compute on every rank, as a call in
        the training job follows the layer's compute; its time is the MIN over ranks of the time
        inside the call -- the last rank to arrive waits for nobody, so that is the collective's
        own cost, while the earlier ranks' extra time is waiting (the simulator's rendezvous).
        Measured on this VM (2 ranks): a 256 KiB all_to_all takes 0.23 ms a call in a loop, where
        gloo's calls pipeline, and ~0.5 ms isolated after 1 ms of compute (0.54-0.84 ms inside
        the e8-top1-t512 job from the last arrival to the first exit)."""
        if gap_s > 0:
            return self._time_isolated(fn, reps or self.reps, gap_s)
        iters = self.iters_for(fn, agree=True, target_s=target_s)
        out = []
        for _ in range(reps or self.reps):
            dist.barrier()
            dt = self._loop(fn, iters)
            t = torch.tensor([dt], dtype=torch.float64, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out.append(float(t.item()))
        return out


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def bench_comm(b: Bench, world: int, progress) -> list[dict]:
    c = b.spec.get("comm") or {}
    rows = []
    if world < 2:
        return rows
    for kind in c.get("kinds", ("all_to_all", "all_reduce")):
        for size in c.get("sizes", ()):
            n = max(world, int(size) // 4 // world * world)  # fp32 elements, a multiple of world
            x = torch.ones(n, dtype=torch.float32, device=b.device)
            if kind == "all_to_all":
                y = torch.empty_like(x)

                def fn(x=x, y=y):
                    dist.all_to_all_single(y, x)
            elif kind == "all_reduce":

                def fn(x=x):
                    dist.all_reduce(x)
            elif kind == "all_gather":  # nccl-tests' size: the gathered output (ZeRO's post-step gather)
                part = torch.ones(n // world, dtype=torch.float32, device=b.device)

                def fn(x=x, part=part):
                    dist.all_gather_into_tensor(x, part)
            else:
                raise ValueError(f"unknown collective {kind}")
            gap = float(c.get("gap_s", 0.0))
            reps = b.time_collective(fn, int(c.get("reps", b.reps)), c.get("target_s"), gap)
            # isolated blocking calls (gloo) have a heavy tail: on this VM (2 ranks, 2026-12-04) a
            # 4 KiB all_reduce after 1 ms of compute takes 0.35-0.5 ms at the median and 0.8-1.9 ms
            # on average, a 64 KiB all_to_all 0.31 / 0.46 ms. A job pays every call, so the mean is
            # its cost; NCCL's back-to-back loops (gap 0) keep nccl-tests' median
            mid = statistics.fmean(reps) if gap > 0 else statistics.median(reps)
            rows.append({"kind": kind, "bytes": n * 4, "ranks": world, "time_s": mid,
                         "median_rep_s": statistics.median(reps), "p25_s": stats(reps)[1],
                         "min_s": min(reps), "reps_s": reps, "stat": "mean" if gap > 0 else "median"})  # fmt: skip
            progress.update()
    return rows


def bench_gemm(b: Bench, dtype: str, progress) -> list[dict]:
    rows = []
    dt = DTYPES[dtype]
    for m, n, k in b.spec.get("gemm", ()):
        # the weight requires grad, as in the training job: every call pays autograd's recording,
        # which is what ``kernel_launch_us`` (measured the same way) stands for in the cost model
        a = torch.randn(int(m), int(k), device=b.device).to(dt)
        w = torch.randn(int(k), int(n), device=b.device).to(dt).requires_grad_()

        def fn(a=a, w=w):
            torch.matmul(a, w)

        # cold weight, warm activation (the previous op's output)
        t, q = b.time_local(fn, warm=lambda a=a: a.sum())
        rows.append({"dtype": dtype, "m": int(m), "n": int(n), "k": int(k), "time_s": t, "p25_s": q})
        progress.update()
    return rows


def bench_attention(b: Bench, dtype: str, progress) -> list[dict]:
    import torch.nn.functional as F

    rows = []
    dt = DTYPES[dtype]
    for bs, h, t, hd in b.spec.get("attention", ()):
        q, k, v = (torch.randn(bs, h, t, hd, device=b.device).to(dt).requires_grad_() for _ in range(3))

        def fwd(q=q, k=k, v=v):
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def fwd_bwd(q=q, k=k, v=v):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        # q, k, v are the projections' outputs just written: warm, like the memory-bound ops
        (tf, qf), (tb, qb) = b.time_local(fwd, cold=False), b.time_local(fwd_bwd, cold=False)
        rows.append({"dtype": dtype, "batch": bs, "heads": h, "seq": t, "head_dim": hd, "fwd_s": tf, "fwd_p25_s": qf,
                     "bwd_s": max(tb - tf, 0.0), "bwd_p25_s": max(qb - qf, 0.0)})  # fmt: skip
        progress.update()
    return rows


#: memory-bound ops of the training job (elementwise, activation, norm, softmax) and the bytes each
#: moves per element in fp32: an add reads 2 and writes 1; the others read 1 and write 1
MEMORY_OPS = {"add": 12, "gelu": 8, "layer_norm": 8, "softmax": 8}


def bench_memory(b: Bench, progress) -> list[dict]:
    """The job's memory-bound ops over activation sizes, recorded by autograd as in the job (rows of
    width 128 where the size allows, as a hidden dimension)."""
    import torch.nn.functional as F

    rows = []
    for op in b.spec.get("memory_ops", list(MEMORY_OPS)):
        for n in b.spec.get("memory_elements", ()):
            n = int(n)
            shape = (n // 128, 128) if n % 128 == 0 else (1, n)
            x = torch.ones(shape, dtype=torch.float32, device=b.device, requires_grad=True)
            y = torch.ones_like(x)
            fn = {
                "add": lambda x=x, y=y: torch.add(x, y),
                "gelu": lambda x=x: F.gelu(x),
                "layer_norm": lambda x=x: F.layer_norm(x, x.shape[-1:]),
                "softmax": lambda x=x: torch.softmax(x, dim=-1),
            }[op]
            # the input is the previous op's output: warm (cold weights are the GEMMs')
            t, q = b.time_local(fn, cold=False)
            rows.append({"op": op, "elements": n, "bytes": MEMORY_OPS[op] * n, "time_s": t, "p25_s": q})
            progress.update()
    return rows


def bench_launch(b: Bench, progress) -> dict:
    """Per-op cost of a tiny op recorded by autograd (eager dispatch + graph node): forward and backward."""
    ops = int(b.spec.get("launch_ops", 2000))
    x = torch.ones(8, device=b.device, requires_grad=True)

    def chain():
        y = x
        for _ in range(ops):
            y = y * 1.0001
        return y

    def fwd():
        chain()

    def fwd_bwd():
        chain().sum().backward()

    # warm: a chain of one tiny op measures the eager dispatch + autograd cost, not the caches
    (tf, qf), (tb, qb) = b.time_local(fwd, cold=False), b.time_local(fwd_bwd, cold=False)
    progress.update()
    return {"ops": ops, "fwd_op_s": tf / ops, "fwd_op_p25_s": qf / ops,
            "bwd_op_s": max(tb - tf, 0.0) / ops, "bwd_op_p25_s": max(qb - qf, 0.0) / ops}  # fmt: skip


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


def bench_dispatcher(b: Bench, progress) -> list[dict]:
    """DeepSpeed's token dispatcher at the scenarios' shapes (``dispatcher: [[tokens, d, experts, k,
    capacity_factor, min_capacity, drop_tokens], ...]``): the real ``TopKGate`` (its router GEMM
    included), ``_route_slots`` + ``_sparse_encode`` and ``_sparse_decode``, forward and backward
    (fwd+bwd less fwd), every rank at once with cold caches, as in the job. The simulator prices
    them by eager-op counts and bytes (``sim.frameworks.deepspeed.dispatcher_work``); a tight loop of a
    tiny op (``kernel_launch_us``) underrates them: measured on this VM (1 rank, 512 tokens, d 128,
    8 experts, top-1), sparse encode forward 0.13 ms hot, 0.57 ms cold; 0.78 ms inside the job.
    The drop-free gate's capacity all-reduce runs on a one-rank group, so no collective is timed."""
    shapes = b.spec.get("dispatcher") or ()
    if not shapes:
        return []
    if b.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.moe.sharded_moe import TopKGate, _route_slots, _sparse_decode, _sparse_encode

    deepspeed.init_distributed(dist_backend=b.spec.get("backend", "gloo"))  # the gate's capacity all-reduce
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    dt = DTYPES[(b.spec.get("dtypes") or ["fp32"])[0]]
    rows = []
    for tokens, d, experts, k, cf, min_cap, drop in shapes:
        tokens, d, experts, k = int(tokens), int(d), int(experts), int(k)
        torch.manual_seed(1234 + rank)
        gate = TopKGate(d, experts, k, float(cf or 1.0), float(cf or 1.0), int(min_cap), None, bool(drop),
                        ep_group=solo).to(b.device)  # fmt: skip
        x = torch.randn(tokens, d, device=b.device, dtype=torch.float32, requires_grad=True)
        with torch.no_grad():
            _, cap, _, ind, loc, gts, _ = gate(x, None, True)
        cap = int(cap)
        xe = torch.randn(tokens, d, device=b.device, dtype=dt, requires_grad=True)
        eo = torch.randn(experts * cap, d, device=b.device, dtype=dt, requires_grad=True)
        g = gts.detach().clone().requires_grad_()
        slots = _route_slots(ind, loc, experts, cap)

        def gate_f(gate=gate, x=x):  # with autograd recording, as in the job
            gate(x, None, True)

        def gate_fb(gate=gate, x=x):
            l_aux, _, _, _, _, gates, _ = gate(x, None, True)
            (l_aux + gates.sum()).backward()

        def enc_f(xe=xe, ind=ind, loc=loc, experts=experts, cap=cap):
            _sparse_encode(xe, _route_slots(ind, loc, experts, cap), experts, cap)

        def enc_fb(xe=xe, ind=ind, loc=loc, experts=experts, cap=cap):
            _sparse_encode(xe, _route_slots(ind, loc, experts, cap), experts, cap).sum().backward()

        def dec_f(eo=eo, slots=slots, g=g, tokens=tokens):
            _sparse_decode(eo, slots, g, tokens)

        def dec_fb(eo=eo, slots=slots, g=g, tokens=tokens):
            _sparse_decode(eo, slots, g, tokens).sum().backward()

        for _ in range(3):  # first calls of a shape (and of the first shape: lazy initialisation)
            gate_fb(), enc_fb(), dec_fb()
        row = {"tokens": tokens, "d": d, "experts": experts, "k": k, "capacity": cap, "slots": experts * cap,
               "drop_tokens": bool(drop), "bytes_per_element": torch.finfo(dt).bits // 8}  # fmt: skip
        for piece, fwd, both in (("gate", gate_f, gate_fb), ("encode", enc_f, enc_fb), ("decode", dec_f, dec_fb)):
            (tf, qf), (tb, qb) = b.time_local(fwd, warm=lambda x=x: x.sum()), b.time_local(both, warm=lambda x=x: x.sum())
            row.update({f"{piece}_fwd_s": tf, f"{piece}_fwd_p25_s": qf,
                        f"{piece}_bwd_s": max(tb - tf, 0.0), f"{piece}_bwd_p25_s": max(qb - qf, 0.0)})  # fmt: skip
        rows.append(row)
        progress.update()
    return rows


def _gemm_unit(b: Bench):
    """A 256x256 GEMM and how many of them make 1 ms (the same count on every rank): the unit of
    the compute segments of :func:`bench_noise` and :func:`bench_wake`."""
    a = torch.randn(256, 256, device=b.device)
    w = torch.randn(256, 256, device=b.device)

    def gemm():
        torch.mm(a, w)

    return gemm, b.iters_for(gemm, agree=True, target_s=1e-3)


def bench_noise(b: Bench, world: int, progress) -> list[dict]:
    """Rank-to-rank spread of identical compute (``noise: {"segments_s": [...], "calls": N}``).

    Every rank runs the same GEMM loop, lasting about each of ``segments_s``, right after a barrier,
    then joins a tiny all-reduce (as a layer's compute ends at an all-to-all); each rank's segment
    time is recorded per call. The row keeps, per call, every rank's time: the fit
    (:func:`hw_validate.calibrate_fit.fit_noise`) turns the spread across ranks into the relative
    standard deviation of a rank's segment time, which the simulator draws per compute segment
    and rank, so the ranks reach each all-to-all at different times and wait for the last, as in
    the job. Measured on this VM (2 ranks, 1 thread each, segments of 1-65 ms): the ranks differ by
    ~10% of the segment, partly persistently (one vCPU faster for a while); in the e8-top1-t512 job
    the later rank reaches each all-to-all 1-2 ms after the first (segments of 3-7 ms)."""
    cfg = b.spec.get("noise") or {}
    rows: list[dict] = []
    if world < 2 or not cfg.get("segments_s"):
        return rows
    tiny = torch.zeros(1, device=b.device)
    gemm, per = _gemm_unit(b)
    calls = int(cfg.get("calls", 20))
    for seg in cfg["segments_s"]:
        n = max(1, round(per * float(seg) / 1e-3))
        gemm()
        mine = []
        for _ in range(calls):
            dist.barrier()
            b.sync()
            t0 = time.perf_counter()
            for _ in range(n):
                gemm()
            b.sync()
            mine.append(time.perf_counter() - t0)
            dist.all_reduce(tiny)
        t = torch.tensor(mine, dtype=torch.float64, device=b.device)
        every = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(every, t)
        rows.append({"segment_s": float(seg), "gemms": n, "calls": calls,
                     "per_rank_s": [e.cpu().tolist() for e in every]})  # fmt: skip
        progress.update()
    return rows


def bench_wake(b: Bench, world: int, progress) -> list[dict]:
    """Late wake-ups after a blocking collective (``wake: {"segments_s": [...], "calls": N, "bytes": B}``).

    Every call: a barrier, 1 ms of GEMMs on every rank, an ``all_to_all_single`` of ``bytes`` per
    rank, then a compute segment of each of ``segments_s`` -- as a layer's all-to-all is followed by
    the next op's compute. Each rank records when it left the collective; the row keeps, per call,
    the spread of the exits (last rank's exit - first rank's). Measured on this VM (2 ranks, 1
    thread each, 2 vCPUs, 2026-12-04): with nothing after the call the ranks leave within
    0.1-0.3 ms; with a 2 ms segment after it, one call in 3-5 has one rank leaving 1-2.5 ms late
    (gloo's completion wakes it on the core the peer is computing on, so it waits for the peer's
    segment to end); in the e8-top1-t512 job the exit spreads are 0 or 0.5-4.3 ms. The fit
    (:func:`hw_validate.calibrate_fit.fit_wake`) gives ``wake_delay_p`` and ``wake_delay_cap_s``."""
    cfg = b.spec.get("wake") or {}
    rows: list[dict] = []
    if world < 2 or not cfg.get("segments_s"):
        return rows
    n = int(cfg.get("bytes", 65536)) // 4 // world * world
    x = torch.ones(max(world, n), device=b.device)
    y = torch.empty_like(x)
    gemm, per = _gemm_unit(b)
    calls = int(cfg.get("calls", 40))
    dist.all_to_all_single(y, x)
    for seg in [0.0, *cfg["segments_s"]]:
        after = max(0, round(per * float(seg) / 1e-3))
        exits = []
        for _ in range(calls):
            dist.barrier()
            for _ in range(per):
                gemm()
            dist.all_to_all_single(y, x)
            exits.append(time.perf_counter())
            for _ in range(after):
                gemm()
        t = torch.tensor(exits, dtype=torch.float64, device=b.device)
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t)  # perf_counter is one clock for the ranks of one host
        every = torch.stack(parts)
        spread = (every.max(0).values - every.min(0).values).cpu().tolist()
        rows.append({"segment_s": float(seg), "gemms_after": after, "calls": calls, "bytes": n * 4,
                     "exit_spread_s": spread})  # fmt: skip
        progress.update()
    return rows


def _count(spec: dict, world: int) -> int:
    c = spec.get("comm") or {}
    n_comm = len(c.get("kinds", ())) * len(c.get("sizes", ())) if world > 1 else 0
    per_dtype = len(spec.get("gemm", ())) + len(spec.get("attention", ()))
    n_noise = len((spec.get("noise") or {}).get("segments_s", ())) if world > 1 else 0
    wake = (spec.get("wake") or {}).get("segments_s", ())
    n_noise += len(wake) + 1 if world > 1 and wake else 0
    n_comm += len(spec.get("dispatcher", ()))
    return n_comm + n_noise + per_dtype * len(spec.get("dtypes", ["fp32"])) + len(
        spec.get("memory_elements", ())) * len(spec.get("memory_ops", MEMORY_OPS)) + 1 + len(
        spec.get("optimizer_params", ())
    )


def _progress(total: int, enabled: bool):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="microbenchmarks", file=sys.stderr, disable=not enabled, dynamic_ncols=True)
    except ImportError:  # tqdm is a dependency of moesim; keep going without a bar if it is missing

        class _Null:
            def update(self, n=1):
                pass

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass

        return _Null()


def hardware(device: torch.device, backend: str, world: int, threads: int) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.processor() or platform.machine()})"
    return {
        "device": device.type,
        "device_name": name,
        "backend": backend,
        "world_size": world,
        "threads_per_rank": threads,
        "cpu_count": os.cpu_count(),
        "host": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES") or None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="microbench.py")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    backend = spec.get("backend", "gloo")
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    threads = set_threads(device.type)
    dist.init_process_group(backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    b = Bench(spec, device)
    bar = _progress(_count(spec, world), rank == 0)
    t0 = time.time()
    out: dict = {"hardware": hardware(device, backend, world, threads)}
    bar.set_postfix_str("collectives")
    out["comm"] = bench_comm(b, world, bar)
    bar.set_postfix_str("compute noise")
    out["noise"] = bench_noise(b, world, bar)
    bar.set_postfix_str("late wake-ups")
    out["wake"] = bench_wake(b, world, bar)
    out["gemm"], out["attention"] = [], []
    for dtype in spec.get("dtypes", ["fp32"]):
        bar.set_postfix_str(f"GEMM {dtype}")
        out["gemm"] += bench_gemm(b, dtype, bar)
        bar.set_postfix_str(f"attention {dtype}")
        out["attention"] += bench_attention(b, dtype, bar)
    bar.set_postfix_str("memory")
    out["memory"] = bench_memory(b, bar)
    out["launch"] = bench_launch(b, bar)
    bar.set_postfix_str("token dispatcher")
    out["dispatcher"] = bench_dispatcher(b, bar)
    bar.set_postfix_str("optimizer")
    out["optimizer"] = bench_optimizer(b, bar)
    bar.close()
    # compute items: median over ranks of each rank's statistics (collectives are already the MAX)
    local = {k: [{f: r[f] for f in r if f.endswith("_s")} for r in out[k]] for k in COMPUTE_KEYS}
    local["launch"] = [{f: v for f, v in out["launch"].items() if f.endswith("_s")}]
    every = [None] * world
    dist.all_gather_object(every, local)
    if rank == 0:
        for key in (*COMPUTE_KEYS, "launch"):
            rows = out[key] if key != "launch" else [out["launch"]]
            for i, r in enumerate(rows):
                for f in list(local[key][i]):
                    per_rank = [e[key][i][f] for e in every]
                    r[f] = statistics.median(per_rank)
                    if f == "time_s":
                        r["per_rank_s"] = per_rank
        out["wall_s"] = time.time() - t0
        tmp = Path(args.out + ".tmp")
        tmp.write_text(json.dumps(out, indent=1, sort_keys=True))
        os.replace(tmp, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
