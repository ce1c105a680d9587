"""Attention rates per shape and precision (GPU ``attention_shapes``, training.fp8_attention): a layer's
attention core runs at the GPU's ``attention`` figure x (its shape's measured rate in its precision /
the reference shape's BF16 rate), from cuDNN's SDPA tables (cudnn-frontend@3929da2, GB200): MLA's
192 / 128 head dims, GPT-OSS's 128-token windows, FP8 and MXFP8. Checked as closed forms against the
tables' numbers; bad combinations exit 2 naming the field."""

from __future__ import annotations

import pytest
from conftest import ROOT, run_cli

from sim.engine.simulate import cost_model
from sim.errors import InputError
from sim.frameworks.pricing import Pricer
from sim.inputs.topology import load_gpu
from sim.model.flops import attention_core_flops_layer
from sim.studies.published import entries, scenario_of

#: cuDNN 9.22 SDPA on GB200, seq 4096, causal, TFLOP/s (forward, backward non-deterministic)
GB200 = {"gqa": {"bf16": (1408, 1148), "fp8": (1805, 1178), "mxfp8": (1685, 1054)},
         "mla": {"bf16": (1406, 1057), "mxfp8": (1925, 1364)},
         "window128": {"bf16": (161, 182), "mxfp8": (161, 41)}}  # fmt: skip


def test_ratios_are_the_tables_rates_over_the_reference():
    f = load_gpu("gb200").attention_shapes
    ref = GB200["gqa"]["bf16"]

    def want(shape, dt):
        return tuple(a / b for a, b in zip(GB200[shape][dt], ref, strict=True))

    assert f.ratio(False, None, "bf16") == (1.0, 1.0)
    assert f.ratio(False, None, "fp8") == pytest.approx(want("gqa", "fp8"))
    assert f.ratio(False, None, "mxfp8") == pytest.approx(want("gqa", "mxfp8"))
    assert f.ratio(True, None, "bf16") == pytest.approx(want("mla", "bf16"))
    assert f.ratio(True, None, "mxfp8") == pytest.approx(want("mla", "mxfp8"))
    assert f.ratio(False, 128, "bf16") == pytest.approx(want("window128", "bf16"))
    assert f.ratio(False, 128, "mxfp8") == pytest.approx(want("window128", "mxfp8"))
    assert f.ratio(False, 4096, "bf16") == (1.0, 1.0)  # a window wider than the measured one: the reference
    assert load_gpu("b200-sxm").attention_shapes.ratio(False, 128, "bf16") == f.ratio(False, 128, "bf16")
    assert load_gpu("h100-sxm").attention_shapes is None


def _pricer(entry_id: str, **training):
    e = next(x for x in entries() if x["id"] == entry_id)
    s0 = scenario_of(e)
    s = s0.model_copy(update={"training": s0.training.model_copy(update=training)})
    s._topology = s0.topology
    return s, Pricer(s, None, cost_model(s), [1.0] * s.world_size)


@pytest.mark.parametrize("fp8", [False, True])
def test_each_layer_runs_at_its_shapes_rate(fp8):
    s, p = _pricer("Y1", fp8_attention=fp8)  # GPT-OSS on GB200: even layers windowed (128), odd ones full
    m, cost = s.model, p.cost
    assert m.attention_window(0) == 128 and m.attention_window(1) is None
    shapes = cost.gpu.attention_shapes
    for layer in (0, 1):
        core = attention_core_flops_layer(m, s.training.seq_len, layer) * s.training.micro_batch_size
        rf, rb = shapes.ratio(False, m.attention_window(layer), "mxfp8" if fp8 else "bf16")
        fwd, bwd, flops = p._attention_core(layer)
        rate = cost.attention_flops_per_s("bf16")
        assert flops == core  # the FLOPs counted (MFU) do not change with the kernel's rate
        assert fwd == pytest.approx(core / rf / rate + cost.launch_s, rel=1e-9)
        assert bwd == pytest.approx(2.5 * core / rb / rate + cost.launch_s, rel=1e-9)


def test_mla_backward_is_slower_than_the_reference_shape():
    s, p = _pricer("X1")  # DeepSeek-V3 on GB200, BF16: MLA's 192 / 128 head dims
    m, cost = s.model, p.cost
    core = attention_core_flops_layer(m, s.training.seq_len, 0) * s.training.micro_batch_size / p.tp
    fwd, bwd, _ = p._attention_core(0)
    rate = cost.attention_flops_per_s("bf16")
    mla, ref = GB200["mla"]["bf16"], GB200["gqa"]["bf16"]
    assert fwd == pytest.approx(core / (mla[0] / ref[0]) / rate + cost.launch_s, rel=1e-9)
    assert bwd == pytest.approx(2.5 * core / (mla[1] / ref[1]) / rate + cost.launch_s, rel=1e-9)


@pytest.mark.parametrize(
    "sets, says",
    [
        (["training.dtype=bf16", "training.cutedsl_fused_grouped_mlp=false"], "training.dtype is 'bf16'"),
        (["cluster.topology=dgx-h100", "training.dtype=fp8", "training.cutedsl_fused_grouped_mlp=false",
          "collectives.all_to_all=deepep", "collectives.a2a_overlap=false"], "has no attention_shapes"),
    ],
)  # fmt: skip
def test_fp8_attention_needs_fp8_and_a_measured_gpu(sets, says, tmp_path):
    import yaml

    from sim.api import load_scenario

    published = ROOT / "validation" / "published"
    doc = yaml.safe_load((published / "Y4.yaml").read_text())["scenario"]
    doc["model"] = {"hf_config": str(published / "models" / "Qwen3-30B-A3B" / "config.json")}
    path = tmp_path / "y4.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(InputError) as err:
        load_scenario(path, sets)
    assert err.value.field == "training.fp8_attention" and says in str(err.value)
    r = run_cli("simulate", str(path), *sum((["--set", x] for x in sets), []))
    assert r.returncode == 2 and "fp8_attention" in r.stderr


def test_the_plan_screen_prices_the_same_shapes():
    from sim.frameworks.kernels import ATTENTION_BWD_FACTOR
    from sim.studies.plan_screen import Screen

    s, p = _pricer("Y1")  # windowed and full layers, MXFP8 attention
    off = s.model_copy(update={"training": s.training.model_copy(update={"fp8_attention": False})})
    off._topology = s.topology
    screen = Screen(s)
    for layer in (0, 1):
        core = attention_core_flops_layer(s.model, s.training.seq_len, layer) * s.training.micro_batch_size
        on_f, on_b = screen.layer(s, layer)[:2]
        off_f, off_b = screen.layer(off, layer)[:2]
        (rf, rb), (qf, qb) = (shapes_ratio(x, p.cost, layer) for x in (s, off))
        rate = p.cost.attention_flops_per_s("bf16")
        assert off_f - on_f == pytest.approx(core / qf / rate - core / rf / rate, rel=1e-6, abs=1e-12)
        assert off_b - on_b == pytest.approx(ATTENTION_BWD_FACTOR * core * (1 / qb - 1 / rb) / rate, rel=1e-6, abs=1e-12)


def shapes_ratio(s, cost, layer):
    from sim.frameworks.pricing import attention_ratio

    return attention_ratio(s, cost, layer, "mxfp8")
