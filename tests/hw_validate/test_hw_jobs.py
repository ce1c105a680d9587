"""Real DeepSpeed jobs on gloo CPU ranks, started by the launcher exactly as a user would.

Values are checked against closed forms: DeepSpeed's top-2 capacity C = max(ceil(S/E x cf x 2),
min_capacity) and its position-based drops (kept_e = min(assigned_e, C)); the padded all-to-all
buffer E x C x d x 4 bytes; fp32 gradients of every local parameter reduced once per step."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("deepspeed")

from hw_validate.jit_ops import CPU_MALLOC_TUNABLES  # noqa: E402
from hw_validate.launch import JobError, run_job  # noqa: E402
from hw_validate.measurement import load_measurement  # noqa: E402
from sim.api import load_scenario  # noqa: E402
from sim.inputs.router_trace import load_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CPU2 = ROOT / "scenarios" / "cpu-2rank.yaml"
SEED = ROOT / "scenarios" / "seed-4gpu.yaml"
pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]
TRAIN_STEPS = 30
CPU2_SET = ["routing.capacity_factor=1.0"]  # C = 128 = the mean load: some drops every step


def _top2_capacity(scen) -> int:
    s, e = scen.tokens_per_micro_batch, scen.model.num_experts
    return max(math.ceil(s / e * scen.routing.capacity_factor * 2), scen.routing.min_capacity)


@pytest.fixture(scope="module")
def cpu2_job(tmp_path_factory):
    out = tmp_path_factory.mktemp("cpu2")
    res = run_job(CPU2, nproc=2, out_dir=out, steps=TRAIN_STEPS, overrides=CPU2_SET, timeout_s=600, echo=False)
    return res, load_measurement(res.measurement), load_trace(res.trace), load_scenario(CPU2, CPU2_SET)


def test_two_rank_ep2_zero2_job_trains(cpu2_job):
    res, m, _, _ = cpu2_job
    losses = m["loss"]["per_step"]
    assert len(losses) == TRAIN_STEPS and all(math.isfinite(v) for v in losses)
    assert losses[0] == pytest.approx(math.log(512), abs=0.5)  # untrained: about ln(vocab)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
    assert (res.out_dir / "logs" / "rank1.log").is_file()
    log = (res.logs / "rank0.log").read_text()
    assert f"step {TRAIN_STEPS:4d}/{TRAIN_STEPS}  loss" in log


def test_measurement_records_environment_config_and_phases(cpu2_job):
    _, m, _, scen = cpu2_job
    env, cfg = m["environment"], m["config"]
    assert env["world_size"] == 2 and env["backend"] == "gloo" and env["accelerator"] == "cpu"
    assert env["torch"] == version("torch") and env["deepspeed"] == version("deepspeed")
    assert len(env["devices"]) == 2 and len(env["hostnames"]) == 2 and env["launcher"] == "deepspeed"
    expect = os.environ.get("GLIBC_TUNABLES") or (None if os.environ.get("MOESIM_CPU_MALLOC") == "default" else CPU_MALLOC_TUNABLES)
    assert env["glibc_tunables"] == expect  # CPU ranks keep their freed memory (hw_validate.jit_ops)
    assert (cfg["ep"], cfg["edp"], cfg["zero_stage"], cfg["dtype"], cfg["train_batch_size"]) == (2, 1, 2, "fp32", 8)
    assert m["measured_steps"] == list(range(scen.training.warmup_steps, TRAIN_STEPS))
    t = m["timing"]
    ps = {k: np.asarray(v) for k, v in t["per_step"].items()}
    for phase in ("embedding", "attention", "route", "permute", "dispatch", "experts", "combine", "unpermute",
                  "output", "forward", "attention_bwd", "experts_bwd", "combine_bwd", "dispatch_bwd", "grad_sync",
                  "backward", "optimizer", "step"):  # fmt: skip
        assert (ps[phase] > 0).all(), phase
    assert (ps["mlp"] == 0).all() and (ps["shared_experts"] == 0).all()  # none in this model
    tol = 1e-6
    fwd_parts = ("embedding", "attention", "route", "permute", "dispatch", "experts", "combine", "unpermute", "output")
    assert (sum(ps[k] for k in fwd_parts) <= ps["forward"] + tol).all()
    bwd_parts = ("attention_bwd", "experts_bwd", "combine_bwd", "dispatch_bwd", "grad_sync")
    assert (sum(ps[k] for k in bwd_parts) <= ps["backward"] + tol).all()
    assert (ps["forward"] + ps["backward"] + ps["optimizer"] <= ps["step"] + tol).all()
    worst = ps["step"][m["measured_steps"]].max(axis=1)
    assert t["summary"]["step"]["median"] == pytest.approx(float(np.median(worst)))
    # every all-to-all: one per MoE layer (2) and direction per micro-batch, E x C x d fp32 (padded)
    c, e, d = _top2_capacity(scen), scen.model.num_experts, scen.model.hidden_size
    calls, nbytes = t["comm_calls_per_step"], t["comm_bytes_per_step"]
    for name in ("dispatch", "combine", "combine_bwd", "dispatch_bwd"):
        assert (np.asarray(calls[name]) == 2).all(), name
        assert (np.asarray(nbytes[name]) == 2 * e * c * d * 4).all(), name
    # every local fp32 gradient is reduced once per step (dense over DP, experts over EDP)
    assert (np.asarray(t["comm_bytes_per_step"]["grad_sync"]) == 4 * cfg["params"]["total_local"]).all()


def test_router_trace_counts_follow_deepspeed_capacity(cpu2_job):
    _, m, trace, scen = cpu2_job
    assert trace.assigned.shape == (TRAIN_STEPS, 1, 2, 2, 4)  # steps, micro-batches, layers, ranks, experts
    assert (trace.assigned.sum(axis=-1) == scen.tokens_per_micro_batch * 2).all()  # tokens x top-k
    c = _top2_capacity(scen)
    assert c == 128
    assert np.array_equal(trace.kept, np.minimum(trace.assigned, c))
    dropped = trace.assigned.sum() - trace.kept.sum()
    assert dropped > 0
    assert m["routing"]["dropped_fraction"] == pytest.approx(dropped / trace.assigned.sum())


def test_seed_scenario_runs_ten_steps_on_four_ranks(tmp_path):
    res = run_job(SEED, out_dir=tmp_path, timeout_s=900, echo=False)
    m, trace = load_measurement(res.measurement), load_trace(res.trace)
    scen = load_scenario(SEED)
    cfg = m["config"]
    assert m["steps"] == 10 and len(m["loss"]["per_step"]) == 10
    assert all(math.isfinite(v) for v in m["loss"]["per_step"]) and m["loss"]["per_step"][-1] < m["loss"]["per_step"][0]
    assert (cfg["dtype"], cfg["dtype_requested"], cfg["train_batch_size"], cfg["ep"]) == ("bf16", "fp16", 64, 4)
    assert cfg["ds_config"]["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert any("bf16" in n for n in cfg["notices"])
    assert trace.assigned.shape == (10, 2, 2, 4, 8)
    assert np.array_equal(trace.kept, np.minimum(trace.assigned, _top2_capacity(scen)))
    log = (res.logs / "rank0.log").read_text()
    assert "notice: training.dtype fp16 needs CUDA" in log and "step   10/10  loss" in log


def test_upcycled_job_starts_at_the_dense_function_and_trains(tmp_path):
    import torch
    import torch.nn.functional as F

    from hw_validate.data import NextTokenTask, split
    from hw_validate.upcycle import save_dense, train_dense

    sets = ["routing.capacity_factor=null", "routing.dispatch=dropless"]
    scen = load_scenario(CPU2, sets)
    dense, losses = train_dense(scen, 30)
    ckpt = tmp_path / "dense.pt"
    save_dense(ckpt, dense, scen.name, 30, losses)
    res = run_job(CPU2, out_dir=tmp_path / "run", steps=5, overrides=sets, echo=False, launcher="torchrun",
                  extra_args=["--init", "upcycle", "--dense-checkpoint", str(ckpt)])  # fmt: skip
    m = load_measurement(res.measurement)
    up = m["upcycle"]
    assert m["config"]["init"] == "upcycle" and up["experts_copied"] == 2 * 2  # 2 local experts x 2 layers
    assert m["environment"]["launcher"] == "torchrun"
    assert up["step0_max_abs_diff"] < 1e-5 and up["step0_max_abs_loss_diff"] < 1e-5
    # independent: the dense parent's loss on both ranks' step-0 batches equals the job's step-0 loss
    task = NextTokenTask(scen.model.vocab_size, scen.training.seq_len, scen.training.micro_batch_size, seed=0)
    with torch.no_grad():
        ce = []
        for rank in range(2):
            x, y = split(task.batch(0, 0, rank))
            ce.append(float(F.cross_entropy(dense(x)[0].reshape(-1, scen.model.vocab_size), y.reshape(-1))))
    assert m["loss"]["per_step"][0] == pytest.approx(np.mean(ce), abs=1e-4)
    assert all(math.isfinite(v) for v in m["loss"]["per_step"]) and m["routing"]["dropped_fraction"] == 0.0


def _launch_cli(*args, env_extra, timeout=300):
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-m", "hw_validate.launch", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_killed_rank_is_named_and_earlier_results_are_kept(tmp_path):
    sentinel = '{"earlier": "result"}\n'
    (tmp_path / "measurement.json").write_text(sentinel)
    p = _launch_cli("--scenario", str(CPU2), "--steps", "4", "--out", str(tmp_path), "--launcher", "torchrun", "--quiet",
                    env_extra={"MOESIM_KILL_RANK": "1", "MOESIM_KILL_AT_STEP": "2"})  # fmt: skip
    assert p.returncode == 1, p.stderr
    assert "rank 1 exited with status 1 at step 2" in p.stderr
    assert "fault injection: exiting with status 1 at step 2" in p.stderr  # its last log lines
    assert (tmp_path / "measurement.json").read_text() == sentinel
    assert not (tmp_path / "router_trace.json").exists()
    failed = list(tmp_path.glob("failed-*"))
    assert len(failed) == 1 and (failed[0] / "logs" / "rank1.log").is_file()


def test_hung_rank_is_named_after_the_stall_timeout(tmp_path):
    with pytest.raises(JobError) as e:
        run_job(CPU2, out_dir=tmp_path, steps=4, launcher="torchrun", echo=False, timeout_s=300, stall_timeout_s=6,
                env={**os.environ, "MOESIM_KILL_RANK": "1", "MOESIM_KILL_AT_STEP": "1", "MOESIM_FAULT": "hang"})  # fmt: skip
    assert e.value.rank == 1
    msg = str(e.value)
    assert "rank 1 looks hung at step 1" in msg and "in inject_fault" in msg and "waiting in a collective" in msg
    assert not (tmp_path / "measurement.json").exists()
