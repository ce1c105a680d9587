"""``moesim calibrate --from-profile``: a PyTorch profiler (Kineto) trace read (hw_validate/profile_trace.py)
and fitted (hw_validate/fits/from_profile.py).

Two traces: a GPU-shaped one written here by hand in the Kineto format (CUDA kernels named as
cuBLAS, FlashAttention and NCCL name them, on streams, linked to their CPU ops by ``External id``,
shapes on the CPU ops) whose kernel times come from planted figures, which the fits must recover;
and a real trace of the cpu-2rank DeepSpeed job recorded here (``train_moe.py --profile``), whose
shapes are checked against the simulator's own schedule and whose solved fits are checked by
simulating again with the result."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hw_validate.profile_trace import read_trace, read_traces
from sim.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
CPU2 = ROOT / "scenarios" / "cpu-2rank.yaml"

# planted figures of the hand-made GPU trace
PEAK, M_HALF, NK_HALF = 600e12, 300.0, 80.0  # bf16 GEMM roofline
INTERCEPT_US, GAP_US, HBM = 3.0, 2.0, 3.0e12  # kernel fixed time, idle gap between kernels, bytes/s
ATT_EFF = 0.55
ALPHA_US, LINK_GBPS, GATHER_FACTOR = 4.0, 350.0, 1.5


class KinetoWriter:
    """Events of one rank's Kineto trace: CPU ops on a CPU thread, their kernels back to back (with
    :data:`GAP_US` between) on a GPU stream, each kernel carrying its op's ``External id``."""

    def __init__(self, rank: int = 0, world: int = 8):
        self.events: list[dict] = []
        self.cpu_ts, self.gpu_ts = {7: 1000.0, 20: 1000.0}, 1000.0
        self.ext = 0
        self.rank, self.world = rank, world
        self.cpu_clock = 1000.0

    def op(self, name: str, dims: list, types: list, kernels: list[tuple[str, float]], stream: int = 7, args=None) -> None:
        self.ext += 1
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": self.cpu_clock,
                            "dur": 5.0, "args": {"External id": self.ext, "Input Dims": dims, "Input type": types,
                                                 **(args or {})}})  # fmt: skip
        self.cpu_clock += 6.0
        for kname, dur_us in kernels:
            start = self.cpu_ts[stream]
            self.events.append({"ph": "X", "cat": "kernel", "name": kname, "pid": 0, "tid": stream, "ts": start,
                                "dur": dur_us, "args": {"External id": self.ext, "stream": stream, "device": 0,
                                                        "correlation": 10_000 + self.ext}})  # fmt: skip
            self.cpu_ts[stream] = start + dur_us + GAP_US

    def write(self, path: Path, gz: bool = False) -> Path:
        t1 = max(self.cpu_ts.values()) + 10
        self.events.append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#5", "pid": 1, "tid": 1,
                            "ts": 900.0, "dur": t1 - 900.0, "args": {}})  # fmt: skip
        doc = {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": self.rank, "world_size": self.world},
               "traceEvents": self.events}  # fmt: skip
        data = json.dumps(doc).encode()
        path.write_bytes(gzip.compress(data) if gz else data)
        return path


def h(x: float, c: float) -> float:
    return x / (x + c)


def gemm_us(m: int, n: int, k: int) -> float:
    """The planted GEMM kernel time: roofline of the planted peak, plus the kernel's own fixed time."""
    flops = 2.0 * m * n * k
    bytes_ = 2 * (m * k + k * n + m * n)
    return max(flops / (PEAK * h(m, M_HALF) * h(n, NK_HALF) * h(k, NK_HALF)), bytes_ / HBM) * 1e6 + INTERCEPT_US


def _planted_links():
    """Planted all-reduce / all-gather times over 8 GPUs of an HGX H200 node: the simulator's
    collectives with the planted link (the model ``moesim calibrate`` fits too), all-gather with
    :data:`GATHER_FACTOR` times its bytes."""
    from hw_validate.fits.links import bench_cluster, simulate_sweep, with_link

    cl = with_link(bench_cluster("hgx-h200", 8), "intra", ALPHA_US, LINK_GBPS)
    ar = [{"kind": "all_reduce", "bytes": b} for b in (2**12, 2**16, 2**20, 2**24, 2**27)]
    ag = [{"kind": "all_gather", "bytes": b} for b in (2**16, 2**22, 2**26)]
    t_ar = simulate_sweep(cl, ar)
    lat = simulate_sweep(cl, [{"kind": "all_gather", "bytes": 1}] * len(ag))
    t_ag = lat + GATHER_FACTOR * (simulate_sweep(cl, ag) - lat)
    return list(zip(ar, t_ar, strict=True)) + list(zip(ag, t_ag, strict=True))


def gpu_trace(path: Path, gz: bool = False) -> Path:
    """The hand-made trace: GEMMs (cuBLAS / CUTLASS kernel names), FlashAttention forward and
    backward, elementwise kernels, NCCL all-reduces and all-gathers on their own stream."""
    w = KinetoWriter()
    bf = ["c10::BFloat16", "c10::BFloat16"]
    for i, (m, n, k) in enumerate([(m, n, k) for m in (16, 64, 256, 1024, 4096) for n in (128, 2048) for k in (256, 4096)]):
        kname = ["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas",
                 "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn"][i % 2]  # fmt: skip
        for _ in range(3):
            w.op("aten::mm", [[m, k], [k, n]], bf, [(kname, gemm_us(m, n, k))])
        # a linear's addmm launches one kernel too (bias first)
        w.op("aten::addmm", [[n], [m, k], [k, n], [], []], ["c10::BFloat16"] * 3 + ["Scalar", "Scalar"],
             [(kname, gemm_us(m, n, k))])  # fmt: skip
    for b, hd, s, d in ((2, 16, 1024, 128), (4, 32, 2048, 128)):
        f = 2.0 * hd * 2 * d * (s * (s + 1) // 2) * b
        fwd = INTERCEPT_US + f / (ATT_EFF * PEAK) * 1e6
        bwd = INTERCEPT_US + 2.5 * f / (ATT_EFF * PEAK) * 1e6
        q = [b, hd, s, d]
        w.op("aten::_scaled_dot_product_flash_attention", [q, q, q, [], [], []], ["c10::BFloat16"] * 3 + [""] * 3,
             [("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>, true, false, false, false, false, true, false, false>(pytorch_flash::Flash_fwd_params)", fwd)])  # fmt: skip
        w.op("aten::_scaled_dot_product_flash_attention_backward", [q, q, q, q, q], ["c10::BFloat16"] * 5,
             [("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, false, false, cutlass::bfloat16_t>, true, false, false, false, false, false, false>(pytorch_flash::Flash_bwd_params)", bwd)])  # fmt: skip
    for n in (2**12, 2**16, 2**20, 2**24):
        for op, ins, nb in (("aten::add", 2, 3 * 2 * n), ("aten::mul_", 2, 3 * 2 * n), ("aten::gelu", 1, 2 * 2 * n)):
            w.op(op, [[n]] * ins, ["c10::BFloat16"] * ins,
                 [("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<c10::BFloat16>>", INTERCEPT_US + nb / HBM * 1e6)])  # fmt: skip
    for row, t in _planted_links():
        nelem = row["bytes"] // 2
        coll = "allreduce" if row["kind"] == "all_reduce" else "allgather"
        kname = ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)" if coll == "allreduce"
                 else "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)")  # fmt: skip
        for _ in range(4):
            w.op("record_param_comms", [[nelem]], ["c10::BFloat16"], [(kname, t * 1e6)], stream=20,
                 args={"Collective name": coll, "In msg nelems": nelem // (8 if coll == "allgather" else 1),
                       "Out msg nelems": nelem, "Group size": 8, "dtype": "BFloat16", "Process Group Ranks": list(range(8))})  # fmt: skip
    return w.write(path, gz)


# ---- the hand-made GPU trace: every fit recovers what was planted ----------------------------------
def test_gpu_trace_is_read_kernel_by_kernel(tmp_path):
    tr = read_trace(gpu_trace(tmp_path / "gpu.json.gz", gz=True))
    assert tr.device == "cuda" and tr.world == 8 and tr.rank == 0
    assert len(tr.gemm) == 20 * 4 and {r["dtype"] for r in tr.gemm} == {"bf16"}
    r = next(r for r in tr.gemm if (r["m"], r["n"], r["k"]) == (1024, 2048, 4096))
    assert r["time_s"] == pytest.approx(gemm_us(1024, 2048, 4096) * 1e-6, rel=1e-9)  # the kernel's, not the op's 5 us
    assert sorted(a["dir"] for a in tr.attention) == ["bwd", "bwd", "fwd", "fwd"]
    assert {(c.kind, c.ranks) for c in tr.calls} == {("all_reduce", 8), ("all_gather", 8)}
    assert sorted({c.bytes for c in tr.calls if c.kind == "all_gather"}) == [2**16, 2**22, 2**26]
    assert tr.gaps_s and np.median(tr.gaps_s) == pytest.approx(GAP_US * 1e-6)


def test_gpu_trace_fits_recover_the_planted_figures(tmp_path):
    from hw_validate.fits.from_profile import fit_traces

    cal, rep = fit_traces(read_traces([gpu_trace(tmp_path / "gpu.json")]), topology="hgx-h200")
    g = cal.gemm["bf16"]
    assert g.peak_TFLOPs == pytest.approx(PEAK / 1e12, rel=0.02)
    assert g.m_half == pytest.approx(M_HALF, rel=0.05) and g.nk_half == pytest.approx(NK_HALF, rel=0.05)
    assert g.fit_rel_err < 0.01
    assert cal.hbm_bw_GBps == pytest.approx(HBM / 1e9, rel=0.01)
    assert cal.kernel_launch_us == pytest.approx(INTERCEPT_US + GAP_US, rel=0.02)  # own time + idle gap
    assert cal.attention_efficiency == pytest.approx(ATT_EFF, rel=0.02)
    link = cal.links["intra"]
    assert link.alpha_us == pytest.approx(ALPHA_US, rel=0.02) and link.bw_GBps == pytest.approx(LINK_GBPS, rel=0.02)
    assert cal.collective_bytes_factor["all_gather"] == pytest.approx(GATHER_FACTOR, rel=0.02)
    assert cal.hardware["backend"] == "nccl" and cal.hardware["world_size"] == 8
    # what a trace alone cannot say stays absent (no scenario: no optimizer, no in-job factors)
    assert {"optimizer_bytes_per_param", "compute_scale", "dispatcher_op_us", "zero_grad_hook_ns_per_param"} <= set(rep["absent"])
    assert cal.optimizer_bytes_per_param is None and cal.compute_scale is None
    assert set(rep["fits"]) >= {"gemm.bf16", "hbm_bw_GBps", "kernel_launch_us", "attention_efficiency", "links.intra",
                                "collective_bytes_factor.all_gather"}  # fmt: skip
    assert all(f["fit_rel_err"] is not None for f in rep["fits"].values())


def test_memory_fit_equals_numpy_least_squares(tmp_path):
    """The launch/bandwidth fit on noisy rows against an independent weighted least squares."""
    from hw_validate.fits.from_profile import fit_launch_memory

    rng = np.random.default_rng(0)
    rows = [{"op": "aten::add", "bytes": b, "time_s": (2e-6 + b / 2e11) * (1 + 0.05 * rng.standard_normal())}
            for b in np.geomspace(1e3, 1e8, 12).astype(int)]  # fmt: skip
    launch, bw, err = fit_launch_memory(rows)
    t = np.array([r["time_s"] for r in rows])
    x = np.array([r["bytes"] for r in rows], dtype=float)
    coef, *_ = np.linalg.lstsq(np.stack([1 / t, x / t], axis=1), np.ones_like(t), rcond=None)
    assert launch == pytest.approx(coef[0], rel=1e-6) and bw == pytest.approx(1 / coef[1], rel=1e-6)
    assert err["points"] == 12 and err["fit_rel_err"] < 0.1


# ---- bad input: exit 2, naming the file and what is missing ---------------------------------------
@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"this is not json", "not Kineto JSON"),
        (b'{"schemaVersion": 1}', "no 'traceEvents'"),
        (b'{"traceEvents": [{"ph": "M", "name": "process_name"}]}', "no CPU ops or device kernels"),
        (json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1, "dur": 2, "tid": 1,
                                      "args": {"Input Dims": [[4], [4]], "Input type": ["float", "float"]}}]}).encode(),
         "no GEMM with its shapes"),
        (json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 2, "tid": 1,
                                      "args": {}}]}).encode(), "record_shapes=True"),
    ],
)  # fmt: skip
def test_bad_traces_exit_2_naming_the_file(tmp_path, content, needle):
    bad = tmp_path / "trace.json"
    bad.write_bytes(content)
    with pytest.raises(InputError) as exc:
        read_traces([bad])
    assert needle in exc.value.message and exc.value.file == str(bad)
    p = subprocess.run([sys.executable, "-m", "sim", "calibrate", "--from-profile", str(bad), "--out",
                        str(tmp_path / "c.json")], cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 2 and str(bad) in p.stderr and needle in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "c.json").exists()


def test_missing_trace_and_scenario_flags_exit_2(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "sim", "calibrate", *args, "--out", str(tmp_path / "c.json")],
                              cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip

    p = run("--from-profile", str(tmp_path / "nope.json"))
    assert p.returncode == 2 and "nope.json" in p.stderr and "not found" in p.stderr
    trace = gpu_trace(tmp_path / "gpu.json")
    p = run("--from-profile", str(trace), "--router-trace", "x.json")
    assert p.returncode == 2 and "--scenario" in p.stderr
    p = run("--set", "training.steps=3")
    assert p.returncode == 2 and "only with --from-profile" in p.stderr


def test_cli_from_profile_writes_a_calibration_simulate_reads(tmp_path):
    from sim.inputs.calibration import load_calibration

    out, js = tmp_path / "c.json", tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "sim", "calibrate", "--from-profile", str(gpu_trace(tmp_path / "g.json")),
                        "--out", str(out), "--json", str(js), "--no-progress"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "gemm.bf16" in p.stdout and "fit error median" in p.stdout and "not in the trace" in p.stdout
    cal = load_calibration(out)
    assert cal.gemm["bf16"].peak_TFLOPs == pytest.approx(PEAK / 1e12, rel=0.02)
    assert json.loads(js.read_text())["report"]["fits"]["links.intra"]["points"] == 5


# ---- a real trace of the cpu-2rank job ------------------------------------------------------------
@pytest.fixture(scope="module")
def cpu_job(tmp_path_factory) -> Path:
    """cpu-2rank run as a real DeepSpeed job on 2 gloo ranks with ``--profile``: 3 steps profiled."""
    pytest.importorskip("deepspeed")
    out = tmp_path_factory.mktemp("job")
    p = subprocess.run([sys.executable, "-m", "hw_validate.launch", "--scenario", str(CPU2), "--out", str(out),
                        "--steps", "6", "--launcher", "torchrun", "--quiet", "--", "--profile", str(out / "profile"),
                        "--warmup", "2"], cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    return out


@pytest.mark.deepspeed
@pytest.mark.slow
def test_cpu_job_trace_has_the_simulators_shapes_and_windows(cpu_job):
    from hw_validate.microbenchmarks.spec import scenario_shapes

    traces = read_traces([cpu_job / "profile"])
    assert sorted(t.rank for t in traces) == [0, 1] and all(t.device == "cpu" for t in traces)
    tr = traces[0]
    assert [s.index for s in tr.steps] == [2, 3, 4] and all(s.annotated for s in tr.steps)
    for s in tr.steps:  # the job's forward, backward and optimizer regions, in order, inside the step
        (f0, f1), (b0, b1), (o0, o1) = s.windows["forward"], s.windows["backward"], s.windows["optimizer"]
        assert s.start_s <= f0 < f1 <= b0 < b1 <= o0 < o1 <= s.end_s
    sim_shapes = set(scenario_shapes([CPU2])["gemm"])
    got = {(r["m"], r["n"], r["k"]) for r in tr.gemm}
    # the model's dense GEMMs (attention projections, experts, output) are the simulator's shapes
    assert {(256, 128, 128), (320, 256, 128), (320, 128, 256), (256, 512, 128)} <= got & sim_shapes
    # per step: 2 MoE layers x (dispatch + combine) x (forward + backward) all-to-alls of 4 x 160 x 128 fp32
    a2a = [c for c in tr.calls if c.kind == "all_to_all"]
    assert len(a2a) == 8 * 3 and {c.bytes for c in a2a} == {4 * 160 * 128 * 4}
    att = [a for a in tr.attention if a["dir"] == "fwd"]
    assert len(att) == 2 * 3 and (att[0]["batch"], att[0]["heads"], att[0]["seq"], att[0]["head_dim"]) == (4, 4, 64, 32)
    # the profiler's cost a step, as the job measured it with its own timers, is taken off the windows
    import statistics

    from hw_validate.fits.from_profile import measured_phases

    meta = json.loads((cpu_job / "profile" / "rank-0.json").read_text())["moesim"]
    assert meta["profiled_steps"] == [2, 3, 4] and len(meta["unprofiled_step_s"]) == 1  # steps 2..5 measured
    from hw_validate.train_profiler import PROFILER_COST_MAX

    on, off = statistics.median(meta["profiled_step_s"]), statistics.median(meta["unprofiled_step_s"])
    cost = min(max(0.0, on - off), PROFILER_COST_MAX * on)  # capped: a loaded machine inflates the difference
    assert tr.profiler_cost_s == pytest.approx(cost)
    fwd = [max(t.steps[i].windows["forward"][1] - t.steps[i].windows["forward"][0]
               - t.profiler_cost_s * t.steps[i].events["forward"] / t.steps[i].events["step"] for t in traces)
           for i in range(3)]  # fmt: skip
    assert measured_phases(traces)["forward"] == pytest.approx(statistics.median(fwd))


@pytest.mark.deepspeed
@pytest.mark.slow
def test_cpu_job_fit_reproduces_the_trace_when_simulated(cpu_job, tmp_path):
    """The solved fits, checked by simulating the job again with the calibration written: its
    forward+backward compute, blocking time and optimizer compute equal the trace's."""
    from hw_validate.fits.from_profile import measured_phases
    from hw_validate.fits.reference_job import blocking_time, compute_time, optimizer_compute
    from hw_validate.phases import simulate_median, simulation_scenario
    from sim.inputs.calibration import load_calibration

    traces = read_traces([cpu_job / "profile"])
    out, js = tmp_path / "c.json", tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "sim", "calibrate", "--from-profile", str(cpu_job / "profile"),
                        "--scenario", str(CPU2), "--router-trace", str(cpu_job / "router_trace.json"), "--out", str(out),
                        "--json", str(js), "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr
    cal = load_calibration(out)
    for field in ("gemm", "hbm_bw_GBps", "kernel_launch_us", "attention_efficiency", "optimizer_bytes_per_param",
                  "compute_scale", "call_overhead_us", "compute_noise_cv"):  # fmt: skip
        assert getattr(cal, field) not in (None, {}), field
    assert cal.dispatcher_op_us is None and cal.zero_grad_hook_ns_per_param is None  # not in a trace
    meas = measured_phases(traces)
    s = simulation_scenario(CPU2, [], out, cpu_job / "router_trace.json", "fp32")
    _, phases, _, _ = simulate_median(s)
    rep = json.loads(js.read_text())["report"]["fits"]
    for name, f in (("optimizer_bytes_per_param", optimizer_compute), ("compute_scale", compute_time),
                    ("call_overhead_us", blocking_time)):  # fmt: skip
        err = abs(f(phases) / f(meas) - 1)  # the re-simulated job against the trace, computed here
        assert rep[name]["fit_rel_err"] == pytest.approx(err, abs=1e-9), name
        if name == "call_overhead_us" and cal.call_overhead_us == 0.0:
            assert f(phases) > f(meas)  # the isolated calls alone take longer: no overhead, clipped at 0
        else:  # each field is solved to SOLVE_TOL (1%) in turn; solving the later ones moves the earlier by ~1-2%
            assert err < 0.03, (name, err)
    # the GEMM fit's reported error, recomputed from the roofline written out by hand
    g = cal.gemm["fp32"]
    rows = cal.sweeps["gemm"]
    errs = []
    for r in rows:
        m, n, k = r["m"], r["n"], r["k"]
        rate = g.peak_TFLOPs * 1e12 * m / (m + g.m_half) * n / (n + g.nk_half) * k / (k + g.nk_half)
        t = max(2 * m * n * k / rate, 4 * (m * k + k * n + m * n) / (cal.hbm_bw_GBps * 1e9)) + r["fit_launch_s"]
        errs.append(abs(t / r["time_s"] - 1))
    assert float(np.median(errs)) == pytest.approx(g.fit_rel_err, rel=1e-6)
    assert all(r["fit_launch_s"] <= cal.kernel_launch_us * 1e-6 for r in rows)  # an op's own time, less the gap
