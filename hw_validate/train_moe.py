"""Train the scenario's MoE model as a real DeepSpeed expert-parallel job; write measurement + trace.

Run it with any launcher that sets the torch.distributed environment::

    deepspeed --num_gpus=4 hw_validate/train_moe.py --scenario scenarios/seed-4gpu.yaml      # a GPU node
    deepspeed --hostfile H --num_nodes 2 hw_validate/train_moe.py --scenario S                # multi-node
    DS_ACCELERATOR=cpu deepspeed --num_gpus=2 hw_validate/train_moe.py --scenario scenarios/cpu-2rank.yaml
    DS_ACCELERATOR=cpu torchrun --nproc_per_node=2 hw_validate/train_moe.py --scenario scenarios/cpu-2rank.yaml

Flags: ``--set k=v`` (scenario override, repeatable), ``--steps N`` (default ``training.steps``),
``--warmup N`` (default ``training.warmup_steps``), ``--out DIR`` (default ``runs/<scenario>``),
``--init random|upcycle`` with ``--dense-checkpoint P``, ``--aux-loss-coef`` (default 0.01),
``--seed`` (default ``routing.seed``), ``--verbose`` (DeepSpeed's INFO logs), ``--profile DIR``
(``torch.profiler`` around ``--profile-steps`` measured steps, default 3: ``DIR/rank-<r>.json``,
Chrome/Kineto JSON with input shapes, what ``moesim calibrate --from-profile`` reads).

Rank 0 prints one line per step with the loss; at the end ``DIR/router_trace.json`` and
``DIR/measurement.json`` are written atomically (see :mod:`hw_validate.measurement`).
Exit status: 0 ok, 2 bad input (scenario, world size, checkpoint), 1 anything else.

Fault injection for the launcher's tests: ``MOESIM_KILL_RANK=r MOESIM_KILL_AT_STEP=s`` makes rank r
``os._exit(1)`` at the start of step s (``MOESIM_FAULT=hang``: sleep forever instead). With
``MOESIM_RUN_DIR`` set (the launcher sets it) each rank writes a heartbeat ``status/rank<r>.json``
every step, and ``SIGUSR1`` dumps every rank's Python stacks to its stderr (``faulthandler``).

This module holds the command line and the training loop; the rank's preflight, heartbeat and fault
injection are :mod:`hw_validate.train_rank`'s, the profiler of ``--profile`` is
:mod:`hw_validate.train_profiler`'s (their public names stay importable from here).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script by deepspeed/torchrun
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hw_validate.train_profiler import PROFILER_COST_MAX, start_profiler  # noqa: E402, F401  (re-exported)
from hw_validate.train_rank import Heartbeat, _threads, inject_fault, preflight  # noqa: E402
from sim.api import load_scenario  # noqa: E402
from sim.errors import InputError  # noqa: E402
from sim.inputs.scenario import Scenario  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="train_moe.py", description="real DeepSpeed MoE job from a scenario")
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--init", choices=("random", "upcycle"), default="random")
    ap.add_argument("--dense-checkpoint", default=None)
    ap.add_argument("--aux-loss-coef", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="record a PyTorch profiler (Kineto) trace of a few measured steps: DIR/rank-<r>.json")  # fmt: skip
    ap.add_argument("--profile-steps", type=int, default=3, metavar="N", help="steps the profiler records (default 3)")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        scenario = load_scenario(args.scenario, args.overrides)
        from hw_validate.model import check_supported

        notices = check_supported(scenario)
        if args.init == "upcycle" and not args.dense_checkpoint:
            raise InputError("--init upcycle needs --dense-checkpoint P (python -m hw_validate.upcycle makes one)", field="--dense-checkpoint")
        steps = args.steps if args.steps is not None else scenario.training.steps
        warmup = args.warmup if args.warmup is not None else scenario.training.warmup_steps
        if steps < 1 or warmup < 0:
            raise InputError("--steps must be >= 1 and --warmup >= 0", field="--steps")
        if args.profile_steps < 1:
            raise InputError(f"must be >= 1, got {args.profile_steps}", field="--profile-steps")
    except InputError as exc:
        print(f"train_moe: error: {exc}", file=sys.stderr)
        return 2
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    why = preflight()
    if why:
        print(f"train_moe: error: {why}", file=sys.stderr, flush=True)
        return 2
    return _run(args, scenario, notices, steps, warmup)


def _run(args: argparse.Namespace, scenario: Scenario, notices: list[str], steps: int, warmup: int) -> int:
    import deepspeed
    import numpy as np
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.accelerator import get_accelerator
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from hw_validate.data import NextTokenTask, split
    from hw_validate.dsconfig import build_ds_config, gate_settings
    from hw_validate.model import build_model, count_params, init_experts
    from hw_validate.results import detect_launcher, finish
    from hw_validate.router_trace import RouterRecorder
    from hw_validate.timing import COMM_PHASES, PHASES, StepTimer, install_model_hooks
    from hw_validate.upcycle import ROUTER_STD, load_dense, upcycle_

    if not args.verbose:
        deepspeed.utils.logger.setLevel(logging.WARNING)
        # DeepSpeed's ZeRO calls torch's deprecated all_gather_into_tensor; not ours to fix
        warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    accel = get_accelerator()
    accelerator = "cuda" if accel.device_name() == "cuda" else "cpu"
    _threads(accelerator)
    deepspeed.init_distributed(dist_backend=accel.communication_backend_name())
    rank, world = dist.get_rank(), dist.get_world_size()
    if accelerator == "cuda":
        accel.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    beat = Heartbeat(rank)
    beat.beat(None, "init")
    say = print if rank == 0 else (lambda *a, **k: None)
    try:
        settings = build_ds_config(scenario, world, accelerator)
        gate = gate_settings(scenario)
        dense_blob = load_dense(args.dense_checkpoint) if args.init == "upcycle" else None
    except InputError as exc:
        if rank == 0:
            print(f"train_moe: error: {exc}", file=sys.stderr)
        return 2
    for n in [*notices, *gate.notices, *settings.notices]:
        say(f"notice: {n}")
    seed = scenario.routing.seed if args.seed is None else args.seed
    ep = scenario.ep
    ep_rank = rank % ep  # DeepSpeed's EP groups are `ep` contiguous ranks
    model = build_model(scenario, gate, ep_size=ep, seed=seed)
    init_experts(model, seed, ep_rank)
    upcycle_info = None
    if dense_blob is not None:
        try:
            upcycle_info = upcycle_(model, dense_blob["state_dict"], seed=seed)
        except InputError as exc:
            if rank == 0:
                print(f"train_moe: error: {exc.with_file(args.dense_checkpoint)}", file=sys.stderr)
            return 2
    params = count_params(model)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "params"})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=settings.ds_config)
    from deepspeed.utils import groups as ds_groups

    if ep > 1 and ds_groups._get_expert_parallel_rank(f"ep_size_{ep}") != ep_rank:
        raise RuntimeError("DeepSpeed's EP layout differs from the contiguous layout the scenario assumes")
    device = engine.device
    m = scenario.model
    say(
        f"train_moe: {scenario.name}: {world} ranks ({accelerator}, {dist.get_backend()}), ep {ep}, edp {scenario.edp}, "
        f"{m.num_experts} experts top-{m.top_k}, {m.num_moe_layers} MoE layers, ZeRO-{scenario.parallelism.zero_stage}, "
        f"{settings.dtype}, train batch {settings.train_batch_size} = {scenario.training.micro_batch_size} x "
        f"{scenario.training.grad_accum_steps} x {scenario.dp}, {steps} steps ({warmup} warm-up)"
    )
    task = NextTokenTask(m.vocab_size, scenario.training.seq_len, scenario.training.micro_batch_size, seed=seed)
    timer = StepTimer(accelerator)
    install_model_hooks(engine.module, timer)
    import deepspeed.comm.comm as ds_comm

    timer.wrap_comm(ds_comm.cdb)
    moe_layers = engine.module.moe_layers()
    recorder = RouterRecorder(m.num_experts, len(moe_layers))
    recorder.install([f.gate for f in moe_layers])

    if dense_blob is not None:
        upcycle_info = {**(upcycle_info or {}), **_upcycle_check(engine, scenario, dense_blob, task, rank, device, seed)}
        upcycle_info.update(checkpoint=str(args.dense_checkpoint), router_std=ROUTER_STD, dense_steps=dense_blob.get("steps"))
        say(f"upcycle: step-0 max |MoE - dense| = {upcycle_info['step0_max_abs_diff']:.3e} over logits up to {upcycle_info['step0_max_abs_logit']:.3f}")

    accum = scenario.training.grad_accum_steps
    vocab = m.vocab_size
    phase_rows, losses, aux_losses = [], [], []
    comm_keys = list(COMM_PHASES)
    comm_bytes, comm_calls, async_calls = [], [], 0
    prof = start_profiler(args.profile, rank, accelerator, steps, warmup, args.profile_steps) if args.profile else None
    # the timers' regions as record_function ranges in the trace: the windows --from-profile reads
    region = torch.profiler.record_function if prof is not None else (lambda _name: contextlib.nullcontext())
    for step in range(steps):
        beat.beat(step, "step")
        inject_fault(rank, step)
        batches = [tuple(t.to(device) for t in split(task.batch(step, mb, rank))) for mb in range(accum)]
        dist.barrier()
        timer.begin_step()
        recorder.enabled, recorder.step = True, step
        t0 = timer.mark()
        ce_sum = torch.zeros((), device=device)
        aux_sum = torch.zeros((), device=device)
        for mb, (x, y) in enumerate(batches):
            recorder.micro_batch = mb
            with timer.phase("forward", "forward"), region("forward"):
                logits, aux = engine(x)
                ce = F.cross_entropy(logits.float().reshape(-1, vocab), y.reshape(-1))
                loss = ce + args.aux_loss_coef * aux
            with timer.phase("backward", "backward"), region("backward"):
                engine.backward(loss)
            with timer.phase("optimizer", "optimizer"), region("optimizer"):
                engine.step()
            ce_sum += ce.detach()
            aux_sum += aux.detach()
        timer.add("step", t0, timer.mark())
        times = timer.end_step()
        recorder.enabled = False
        recorder.flush()
        phase_rows.append([times[p] for p in PHASES])
        comm_bytes.append([timer.comm_bytes.get(k, 0) for k in comm_keys])
        comm_calls.append([timer.comm_calls.get(k, 0) for k in comm_keys])
        async_calls += timer.async_calls
        red = torch.stack([ce_sum, aux_sum]).float() / accum
        dist.all_reduce(red)
        ce_v, aux_v = (red / world).tolist()
        losses.append(ce_v)
        aux_losses.append(aux_v)
        say(f"step {step + 1:4d}/{steps}  loss {ce_v:.4f}  aux {aux_v:.4f}  time {times['step']:.3f} s", flush=True)
        if prof is not None:
            prof.step()
    if prof is not None:
        prof.stop()
        if prof.path.is_file():
            cost = prof.annotate([row[PHASES.index("step")] for row in phase_rows], warmup)
            say(f"profiler trace of {prof.active} steps written to {prof.path} (the profiler cost {1e3 * cost:.2f} ms a step)")
    beat.beat(steps, "writing")
    config = {
        "dtype": settings.dtype,
        "dtype_requested": settings.dtype_requested,
        "zero_stage": scenario.parallelism.zero_stage,
        "offload_optimizer": scenario.training.offload_optimizer,
        "micro_batch_size": scenario.training.micro_batch_size,
        "grad_accum_steps": accum,
        "train_batch_size": settings.train_batch_size,
        "seq_len": scenario.training.seq_len,
        "tokens_per_micro_batch": scenario.tokens_per_micro_batch,
        "num_experts": m.num_experts,
        "top_k": m.top_k,
        "ep": ep,
        "edp": scenario.edp,
        "dp": scenario.dp,
        "moe_layers": len(moe_layers),
        "capacity_factor": gate.capacity_factor,
        "min_capacity": gate.min_capacity,
        "drop_tokens": gate.drop_tokens,
        "aux_loss_coef": args.aux_loss_coef,
        "init": args.init,
        "seed": seed,
        "params": params,
        "ds_config": settings.ds_config,
        "notices": [*notices, *gate.notices, *settings.notices],
    }
    out_dir = Path(args.out) if args.out else Path("runs") / scenario.name
    path = finish(
        out_dir=out_dir,
        scenario=scenario,
        overrides=list(args.overrides),
        accelerator=accelerator,
        launcher=detect_launcher(sys.argv),
        device=device,
        phase_times=np.asarray(phase_rows, dtype=np.float64),
        comm={"bytes": np.asarray(comm_bytes, dtype=np.int64), "calls": np.asarray(comm_calls, dtype=np.int64)},
        comm_keys=comm_keys,
        async_calls=async_calls,
        counts=recorder.as_array(steps, accum),
        losses=losses,
        aux_losses=aux_losses,
        config=config,
        upcycle=upcycle_info,
        steps=steps,
        warmup=warmup,
    )
    if path is not None:
        _print_summary(path)
    dist.barrier()
    beat.beat(steps, "done")
    dist.destroy_process_group()
    return 0


def _upcycle_check(engine, scenario: Scenario, blob: dict, task, rank: int, device, seed: int) -> dict:
    """Step-0 logits of the upcycled MoE vs its dense parent on this rank's first batch (collective)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from hw_validate.data import split
    from hw_validate.model import build_model
    from hw_validate.upcycle import compare_outputs

    dense = build_model(scenario, None, dense=True, seed=seed)
    dense.load_state_dict(blob["state_dict"])
    dense.to(device).eval()
    x, y = (t.to(device) for t in split(task.batch(0, 0, rank)))
    with torch.no_grad():
        moe_logits, _ = engine.module(x)
        dense_logits, _ = dense(x)
    cmp = compare_outputs(moe_logits, dense_logits)
    v = float(scenario.model.vocab_size)
    ce_m = F.cross_entropy(moe_logits.float().reshape(-1, int(v)), y.reshape(-1))
    ce_d = F.cross_entropy(dense_logits.float().reshape(-1, int(v)), y.reshape(-1))
    red = torch.tensor([cmp["max_abs_diff"], cmp["max_abs_logit"], float((ce_m - ce_d).abs())], device=device)
    dist.all_reduce(red, op=dist.ReduceOp.MAX)
    return {"step0_max_abs_diff": float(red[0]), "step0_max_abs_logit": float(red[1]), "step0_max_abs_loss_diff": float(red[2])}


def _print_summary(path: Path) -> None:
    data = json.loads(path.read_text())
    s = data["timing"]["summary"]
    keys = ("step", "forward", "attention", "route", "permute", "dispatch", "experts", "combine", "unpermute",
            "backward", "grad_sync", "optimizer")  # fmt: skip
    print(f"median over {len(data['measured_steps'])} measured steps (slowest rank), seconds:")
    print("  " + "  ".join(f"{k} {s[k]['median']:.4f}" for k in keys if s[k]["median"] is not None))
    print(f"dropped fraction {data['routing']['dropped_fraction']:.4f}; wrote {path} and {path.parent / data['trace_file']}")


if __name__ == "__main__":
    sys.exit(main())
