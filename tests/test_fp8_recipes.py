"""FP8 scaling recipes (training.fp8_recipe, sim/model/dtypes.py QUANT_BYTES_PER_ELEMENT, sim/frameworks/pricing.py)
against TransformerEngine's published GEMM profiling guide, and what each recipe changes in a step."""

from __future__ import annotations

import pytest

from sim.frameworks.pricing import Pricer
from sim.hardware.costs import CostModel
from sim.inputs.topology import load_gpu
from sim.model.dtypes import QUANT_BYTES_PER_ELEMENT, QUANT_KERNELS
from sim.studies.published import entries, scenario_of

#: TE docs/examples/gemm_profiling/gemm_profiling.rst (TE@8f2e635), H200 NVL, hidden 4096, FFN 16384,
#: M = 31 x 512 tokens: per-layer GEMM ms with FP8 current scaling, autocast minus pre-quantized
TE_H200_OVERHEAD_MS = {"fprop": 6.503 - 5.577, "dgrad": 6.795 - 5.661, "wgrad": 6.987 - 5.547}


def test_quantization_traffic_reproduces_transformer_engines_overhead():
    cost = CostModel(load_gpu("h200-sxm"), burst=True)
    m, h, f = 31 * 512, 4096, 16384
    gemms = [(h, 3 * h), (h, h), (h, f), (f, h)]  # (K, N): QKV, attention out, MLP up, MLP down

    def quant_s(elements: float) -> float:  # the benchmark quantizes both operands of every GEMM it times
        return (
            elements * QUANT_BYTES_PER_ELEMENT["current"] / cost.hbm_Bps
            + QUANT_KERNELS["current"] * cost.launch_s
        )

    model = {"fprop": sum(quant_s(m * k) + quant_s(k * n) for k, n in gemms),
             "dgrad": sum(quant_s(m * n) + quant_s(k * n) for k, n in gemms),
             "wgrad": sum(quant_s(m * k) + quant_s(m * n) for k, n in gemms)}  # fmt: skip
    for part, ms in TE_H200_OVERHEAD_MS.items():
        assert model[part] * 1e3 == pytest.approx(ms, rel=0.05), part
    assert sum(model.values()) * 1e3 == pytest.approx(sum(TE_H200_OVERHEAD_MS.values()), rel=0.03)


def _pricer(entry_id: str, **training):
    e = next(x for x in entries() if x["id"] == entry_id)
    s = scenario_of(e)
    s = s.model_copy(update={"training": s.training.model_copy(update=training)})
    s._topology = scenario_of(e).topology
    from sim.engine.simulate import cost_model

    return Pricer(s, None, cost_model(s), [1.0] * s.world_size)


def test_recipes_price_what_they_move():
    cur, dly = (
        _pricer("L-mixtral-a2a-fp8", fp8_recipe="current"),
        _pricer("L-mixtral-a2a-fp8", fp8_recipe="delayed"),
    )
    blk = _pricer("L-mixtral-a2a-fp8", fp8_recipe="blockwise")
    from sim.model.flops import expert_gemms

    g = expert_gemms(cur.m)[0]  # fc1: [rows, h] @ [h, ffn]
    rows = 8192.0
    f_cur, f_dly, f_blk = (p._gemm(g, rows)[0][0] for p in (cur, dly, blk))
    hbm = cur.cost.hbm_Bps
    # current scaling reads the activation and the weight once more than delayed scaling, and launches once more
    extra = (rows * g.k + g.n * g.k) * 2.0 / hbm + 2 * cur.cost.launch_s
    assert f_cur - f_dly == pytest.approx(extra, rel=1e-9)
    # H100: block-scaled GEMMs at fp8_block_gemm_fraction of the per-tensor rate
    assert blk.rate_scale == load_gpu("h100-sxm").fp8_block_gemm_fraction and blk.dt == "fp8"
    assert f_blk > f_dly
    # the weight is quantized once per step: its share falls with the micro-batches
    many = _pricer("L-mixtral-a2a-fp8", fp8_recipe="delayed", grad_accum_steps=4)
    w = g.n * g.k * QUANT_BYTES_PER_ELEMENT["delayed"] / hbm + many.cost.launch_s
    assert f_dly - many._gemm(g, rows)[0][0] == pytest.approx(w * 0.75, rel=1e-9)


def test_block_scaling_runs_as_mxfp8_on_blackwell():
    p = _pricer("D1", dtype="fp8", fp8_recipe="blockwise")
    assert p.dt == "mxfp8" and p.rate_scale == 1.0
    assert _pricer("D1", dtype="fp8", fp8_recipe="current").dt == "fp8"
