"""The GPU kernel probe (hw_validate/gpu_kernels.py) without a GPU: the shapes it reads off the published
rows, its plan and moesim's predictions (--dry-run), the record's arithmetic, the no-CUDA exit, and a
CPU smoke run of every measuring code path on shrunken shapes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hw_validate import gpu_kernels
from hw_validate.kernel_probe.plan import (
    attention_cases,
    cost_models,
    expert_cases,
    gpu_description,
    plan,
    pricer_gemm,
)
from hw_validate.kernel_probe.report import factors, markdown, summarize
from sim.frameworks.kernels import ATTENTION_BWD_FACTOR
from sim.hardware.costs import CostModel
from sim.inputs.topology import load_gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cases():
    return {c.name: c for c in expert_cases()}


@pytest.fixture(scope="module")
def h100():
    return CostModel(load_gpu("h100-sxm"))


@pytest.fixture(scope="module")
def h100_burst():
    """moesim's microbenchmark curve where its CostModel has one (``burst=True``), else None."""
    return cost_models(load_gpu("h100-sxm"))[1]


def test_expert_cases_come_from_the_layer_rows(cases):
    assert set(cases) == {"mixtral-8x7b-layer", "deepseek-like-layer"}
    mix, ds = cases["mixtral-8x7b-layer"], cases["deepseek-like-layer"]
    # Mixtral layer: 4096 tokens x EP8 x top-2 over 8 experts = 8192 rows on the one local expert
    assert (mix.experts, mix.tokens, mix.hidden, mix.width, mix.ffn_type) == (1, 8192, 4096, 14336, "plain")
    # DeepSeek-like layer: 4096 x 8 x top-8 over 32 experts = 8192 rows on each of 4 local experts
    assert (ds.experts, ds.tokens, ds.hidden, ds.width, ds.ffn_type) == (4, 8192, 7168, 2048, "plain")
    assert "L-mixtral-a2a-bf16" in mix.rows and "L-mixtral-a2a-fp8" in mix.rows and len(mix.rows) == 4
    assert "L-deepseek-hybridep-fp8" in ds.rows and len(ds.rows) == 4
    assert set(mix.dtypes) == set(ds.dtypes) == {"bf16", "fp8"}
    # the six GEMMs of a layer: fwd, then dgrad + wgrad in reverse order; wgrad reduces over the tokens
    roles = {f"{g.name}.{r}": (M, N, K) for g, r, M, N, K in mix.roles()}
    assert roles == {
        "expert.linear_fc1.fwd": (8192, 14336, 4096),
        "expert.linear_fc2.fwd": (8192, 4096, 14336),
        "expert.linear_fc2.dgrad": (8192, 14336, 4096),
        "expert.linear_fc2.wgrad": (14336, 4096, 8192),
        "expert.linear_fc1.dgrad": (8192, 4096, 14336),
        "expert.linear_fc1.wgrad": (4096, 14336, 8192),
    }
    assert {f"{g.name}.{r}": (M, N, K) for g, r, M, N, K in ds.roles()}["expert.linear_fc1.fwd"] == (
        8192,
        2048,
        7168,
    )


def test_attention_cases_from_d6_d7():
    a = {x.row: x for x in attention_cases()}
    assert (a["D6"].batch, a["D6"].heads, a["D6"].kv_heads, a["D6"].head_dim, a["D6"].seq) == (
        4,
        32,
        4,
        128,
        4096,
    )
    assert (a["D7"].batch, a["D7"].heads, a["D7"].head_dim, a["D7"].seq) == (2, 64, 64, 4096)
    # causal: s(s+1)/2 pairs, QK^T and PV, per head and sequence
    assert a["D6"].core_flops == 2 * 32 * 256 * (4096 * 4097 // 2) * 4


def test_gpu_description_by_device_name():
    assert gpu_description("NVIDIA H100 80GB HBM3") == ("h100-sxm", True)
    assert gpu_description("NVIDIA H200") == ("h200-sxm", True)
    assert gpu_description("NVIDIA H800") == ("h800-sxm", True)
    assert gpu_description("NVIDIA B200") == ("b200-sxm", True)
    assert gpu_description("NVIDIA GB200") == ("gb200", True)
    assert gpu_description("NVIDIA A100-SXM4-80GB") == ("h100-sxm", False)


def test_dry_run_plan_is_moesims_cost_model(tmp_path, capsys, cases, h100, h100_burst):
    assert gpu_kernels.main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert doc["dry_run"] and doc["moesim"]["gpu"] == "h100-sxm"
    rows = doc["rows"]
    assert {r["part"] for r in rows} == {"a", "b", "c", "d", "f"}
    assert all(r["predicted_ms"] > 0 and r["ms"] is None for r in rows)

    def one(**kw):
        sel = [r for r in rows if all(r[k] == v for k, v in kw.items())]
        assert len(sel) == 1, (kw, len(sel))
        return sel[0]

    mix = one(
        case="mixtral-8x7b-layer", impl="dense", mode="burst", data="randn", role="expert.linear_fc1.fwd"
    )
    assert mix["shape"] == {"M": 8192, "N": 14336, "K": 4096, "groups": 1}
    ds = one(
        case="deepseek-like-layer", impl="grouped", mode="burst", data="randn", role="expert.linear_fc1.fwd"
    )
    assert ds["shape"] == {"M": 8192, "N": 2048, "K": 7168, "groups": 4}
    # every GEMM row is CostModel.gemm_time of its shape (x the local experts for grouped rows): the step
    # pricing, and the microbenchmark (burst) curve where moesim has one
    for r in rows:
        s = r["shape"]
        if "M" in s:
            want = s["groups"] * h100.gemm_time(s["M"], s["N"], s["K"], r["dtype"])
            assert r["predicted_ms"] == pytest.approx(want * 1e3, rel=1e-12), r
            assert r["predicted_TFLOPs"] == pytest.approx(r["flops"] / want / 1e12, rel=1e-12)
            if h100_burst is None:
                assert r["predicted_burst_ms"] is None
            else:
                burst = s["groups"] * h100_burst.gemm_time(s["M"], s["N"], s["K"], r["dtype"])
                assert r["predicted_burst_ms"] == pytest.approx(burst * 1e3, rel=1e-12)
                assert r["predicted_burst_ms"] <= r["predicted_ms"] * (1 + 1e-12)
    assert mix["predicted_ms"] == pytest.approx(h100.gemm_time(8192, 14336, 4096, "bf16") * 1e3)
    # the microbenchmark curve at these shapes: ~780 / ~750 TFLOP/s (docs/research/gemm-fit.md, H100 BF16)
    for r in (mix, ds):
        assert 700 < (r["predicted_burst_TFLOPs"] or r["predicted_TFLOPs"]) < 800
    fp8 = one(case="mixtral-8x7b-layer", impl="fp8_tensor", role="expert.linear_fc1.fwd")
    assert fp8["predicted_ms"] == pytest.approx(h100.gemm_time(8192, 14336, 4096, "fp8") * 1e3)
    # attention: the Pricer's attention_time, forward and forward + backward
    a = one(case="Qwen3-30B-A3B", impl="sdpa_flash", role="attention.fwd")
    core, io = a["flops"], 4 * 4 * 4096 * 32 * 128 * 2
    assert a["predicted_ms"] == pytest.approx(h100.attention_time(core, io, "bf16") * 1e3)
    ab = one(case="Qwen3-30B-A3B", impl="sdpa_flash", role="attention.fwd+bwd")
    want = h100.attention_time(core, io, "bf16") + h100.attention_time(
        ATTENTION_BWD_FACTOR * core, 2 * io, "bf16"
    )
    assert ab["predicted_ms"] == pytest.approx(want * 1e3)
    # TransformerEngine rows: the experts block as the Pricer prices it (FP8: casts included)
    c = cases["deepseek-like-layer"]
    g = c.gemms[0]
    te = one(case=c.name, impl="te_fp8", role=f"{g.name}.fwd+bwd")
    f, d, w = pricer_gemm(c, h100, "fp8", g)
    assert te["predicted_ms"] == pytest.approx((f + d + w) * 1e3)
    assert f > 4 * h100.gemm_time(8192, 2048, 7168, "fp8")  # the casts are on top of the GEMMs
    cast = one(case=c.name, impl="cast_plain", role=f"{g.name}.x")
    assert cast["predicted_ms"] == pytest.approx(4 * (8192 * 7168 * 3 / h100.hbm_Bps + h100.launch_s) * 1e3)
    # what it prints: the cases and a row per measurement with moesim's TFLOP/s
    assert (
        "case mixtral-8x7b-layer" in out and "1 local expert(s) x 8192 rows, h 4096, expert FFN 14336" in out
    )
    assert "4 local expert(s) x 8192 rows, h 7168, expert FFN 2048" in out
    assert (
        f"| expert.linear_fc1.fwd | 8192x14336x4096 | bf16 | burst | randn | {mix['predicted_ms']:.3f} |"
        in out
    )
    assert (tmp_path / "gpu_kernels.md").read_text().startswith("# GPU kernels")
    assert doc["moesim"]["sustained_compute_fraction"] == getattr(h100.gpu, "sustained_compute_fraction", 1.0)


def test_dry_run_other_gpu(capsys):
    assert gpu_kernels.main(["--dry-run", "--gpu", "h200-sxm"]) == 0
    assert "predictions for h200-sxm" in capsys.readouterr().out


def test_summary_and_factors(cases, h100):
    """Measured = predicted x a factor per (impl, mode, data): the summary and the factors recover them."""
    cs = list(cases.values())
    rows = plan(cs, attention_cases(), h100)
    scale = {("dense", "burst", "randn"): 1.0, ("dense", "sustained", "randn"): 1.2,
             ("dense", "sustained", "zeros"): 1.05, ("grouped", "burst", "randn"): 1.3,
             ("grouped", "sustained", "randn"): 1.4, ("fp8_tensor", "burst", "randn"): 1.1,
             ("fp8_block", "burst", "randn"): 1.32}  # fmt: skip
    for r in rows:
        k = (r["impl"], r["mode"], r["data"])
        if k in scale:
            r["ms"] = r["predicted_ms"] * scale[k]
    summary = summarize(rows, cs)
    got = {(e["case"], e["impl"], e["mode"], e["data"]): e for e in summary}
    e = got[("deepseek-like-layer", "grouped", "sustained", "randn")]
    assert e["fwd_ratio"] == pytest.approx(1.4) and e["bwd_ratio"] == pytest.approx(1.4)
    assert e["total_ms"] == pytest.approx(1.4 * e["total_predicted_ms"])
    assert got[("mixtral-8x7b-layer", "loop", "burst", "randn")]["total_ratio"] is None  # not measured
    f = {(x["case"], x["factor"]): x["value"] for x in factors(summary)}
    for case in cases:
        assert f[(case, "dense burst / moesim")] == pytest.approx(1.0)
        assert f[(case, "dense sustained / dense burst")] == pytest.approx(1.2)
        assert f[(case, "dense sustained randn / zeros")] == pytest.approx(1.2 / 1.05)
        # per unit of work: a grouped row does 4 experts' work, a dense row one
        assert f[(case, "grouped burst / dense burst, per unit of work")] == pytest.approx(1.3)
        assert f[(case, "fp8 blocks / fp8 per-tensor")] == pytest.approx(1.2)
        assert (case, "TE bf16 / moesim") not in f
    doc = {"device": {"name": "test"}, "moesim": {"gpu": "h100-sxm", "matched": True}, "sampler": {"source": "x"},
           "cases": [c.to_json() for c in cs], "attention_cases": [], "rows": rows, "summary": summary,
           "factors": factors(summary), "errors": []}  # fmt: skip
    md = markdown(doc)
    assert "| deepseek-like-layer | grouped sustained / moesim | 1.400 |" in md


def test_without_cuda_exits_2(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    assert gpu_kernels.main(["--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "gpu_kernels.json").exists()


@pytest.mark.slow
def test_cpu_smoke_runs_every_part(tmp_path):
    """Every measuring path on CPU with every dimension / 64 (timings meaningless; what fails on a CPU,
    such as cuDNN attention or FP8 grouped GEMMs, must land in its row's error and the rest go on)."""
    pytest.importorskip("torch")
    out = tmp_path / "probe"
    p = subprocess.run([sys.executable, "-m", "hw_validate.gpu_kernels", "--cpu-smoke", "64", "--out", str(out),
                        "--quick", "--seconds", "0.4"], capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads((out / "gpu_kernels.json").read_text())
    rows = doc["rows"]
    assert all(r["ms"] is not None or r["error"] for r in rows)
    bf16 = [r for r in rows if r["part"] in ("a", "b")]
    assert bf16 and all(r["ms"] is not None and r["ms"] > 0 for r in bf16), [
        r["error"] for r in bf16 if r["error"]
    ]
    sus = [r for r in bf16 if r["mode"] == "sustained"]
    assert len(sus) == 2 * 2 * 2 * 6 and all(r["cycles"] >= 3 and r["samples"] == "unavailable" for r in sus)
    assert all(np.isfinite(r["ratio"]) for r in bf16)
    # per-tensor FP8 and the plain cast run on CPU too; TE is reported unavailable, not skipped silently
    assert all(r["ms"] is not None for r in rows if r["impl"] in ("fp8_tensor", "cast_plain"))
    assert all(r["error"] for r in rows if r["part"] == "f")  # no TransformerEngine here, or no CUDA
    assert {f["factor"] for f in doc["factors"]} >= {"dense burst / moesim", "dense sustained / dense burst"}
    assert "## Summary" in (out / "gpu_kernels.md").read_text()
