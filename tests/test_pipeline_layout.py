"""``parallelism.pipeline_layout``, Megatron-Core's custom pipeline layout (``--pipeline-model-parallel-layout``):
the parser against Megatron's own examples, the virtual stages it gives (DeepSeek-V3 on PP2 x VPP8), that
a layout equal to a built-in split gives the same stages, every check (exit 2 naming the field), and a
simulated step whose heavier stage computes more."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
import yaml
from conftest import ROOT, SCENARIOS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.api import load_scenario, scenario_from_dict
from sim.engine.simulate import simulate
from sim.errors import InputError
from sim.inputs.stages import parse_layout, rank_chunks, stage_layers

BIG = SCENARIOS / "128gpu.yaml"
DSV3 = ROOT / "tests" / "data" / "hf" / "DeepSeek-V3" / "config.json"
#: 128gpu.yaml cut to one node, 8 layers, PP2 x VPP2
SMALL = ["cluster.nodes=1", "parallelism.ep=4", "model.num_layers=8", "parallelism.pp=2", "parallelism.vpp=2",
         "training.grad_accum_steps=4"]  # fmt: skip
FIELD = "parallelism.pipeline_layout"


def small(layout: str | None, *extra: str):
    return load_scenario(BIG, [*SMALL, *([f"{FIELD}={layout}"] if layout is not None else []), *extra])


def deepseek_v3(pp: int, vpp: int, layout: str | None, **par):
    """The HF DeepSeek-V3 config (61 layers, 1 MTP layer) on 2 x 8 H100."""
    parallelism = {"pp": pp, "vpp": vpp, "ep": 16 // pp, **par}
    if layout is not None:
        parallelism["pipeline_layout"] = layout
    return scenario_from_dict({
        "cluster": {"topology": "dgx-h100", "nodes": 2}, "model": {"hf_config": str(DSV3)},
        "parallelism": parallelism, "training": {"micro_batch_size": 1, "seq_len": 4096, "grad_accum_steps": 8},
    }, source="dsv3")  # fmt: skip


def shape(stages):
    return [(v.index, v.rank, v.chunk, v.layers, v.embedding, v.head) for v in stages]


# ---- the parser ----------------------------------------------------------------------------------


def test_parser_on_megatrons_docstring_example():
    # PipelineParallelLayerLayout.parse_str_to_list: "Ettt|(tt|)*29,m|L" is
    # [["E","t","t","t"]] + [["t","t"]] * 29 + [["m"], ["L"]]: 1 + 29 + 2 = 32 stages
    stages = parse_layout("Ettt|(tt|)*29,m|L")
    assert stages == ("Ettt", *["tt"] * 29, "m", "L")
    assert len(stages) == 32 and "".join(stages).count("t") == 61


def test_parser_unrolls_as_megatrons_regexes():
    # the examples in Megatron's comments, with E/t/m/L letters: (|ab)*2,cd -> |ab|abcd; ab,(cd|)*2 -> abcd|cd|
    assert parse_layout("(|tt)*2,tm") == ("", "tt", "tttm")
    assert parse_layout("tt,(tm|)*2") == ("tttm", "tm", "")
    assert parse_layout("(tt)*3") == ("tttttt",)
    assert parse_layout("Et*3|t*2|*2L") == ("Ettt", "tt", "", "L")  # x*n repeats '|' too
    assert parse_layout("E,t,t|t,L") == ("Ett", "tL")  # commas are cosmetic


@pytest.mark.parametrize("text,bad", [("Et|x|L", "'x'"), ("Et | tL", "' '"), ("((t)*2)*2|L", "'('"),
                                      ("Et*2|T*2L", "'T'"), ("Et|t**2L", "'*'")])  # fmt: skip
def test_parser_refuses_unknown_characters(text, bad):
    with pytest.raises(ValueError, match=re.escape(f"invalid character {bad}")):
        parse_layout(text)


def test_parser_refuses_a_layout_that_unrolls_past_any_model():
    with pytest.raises(ValueError, match="unrolls to more than"):
        parse_layout("Et*99999999999|L")


# ---- the virtual stages --------------------------------------------------------------------------


def test_deepseek_v3_on_pp2_vpp8():
    s = deepseek_v3(2, 8, "Et*4|(t*4|)*14tmL")
    assert (s.model.num_layers, s.model.mtp_layers, s.parallelism.schedule) == (61, 1, "interleaved")
    stages = stage_layers(s)
    assert [len(v.layers) for v in stages] == [4] * 15 + [1]
    assert [v.rank for v in stages] == [0, 1] * 8
    assert [v.chunk for v in stages] == [c for c in range(8) for _ in range(2)]
    assert [v.layers for v in stages] == [tuple(range(4 * i, 4 * i + 4)) for i in range(15)] + [(60,)]
    assert [v.embedding for v in stages] == [True] + [False] * 15
    assert [v.head for v in stages] == [False] * 15 + [True]
    # rank 1 runs virtual stages 1, 3, ... 15: 7 x 4 layers and the last layer with the head and MTP
    rank1 = [(v.index, len(v.layers)) for v in rank_chunks(s)[1]]
    assert rank1 == [(2 * c + 1, 4) for c in range(7)] + [(15, 1)]


@pytest.mark.parametrize("layout,par", [
    ("Et*2|t*2|t*2|t*2L", []),  # the even split of 8 layers over PP2 x VPP2
    ("Et|t*2|t*2|t*2L", ["model.num_layers=7", "parallelism.embedding_as_layer=true"]),  # (7 + 1) / 4
    ("Et*3|t*2|t*2|tL", ["parallelism.first_stage_layers=5", "parallelism.last_stage_layers=3"]),  # 3+2, 2+1
])  # fmt: skip
def test_a_layout_equal_to_a_built_in_split_gives_the_same_stages(layout, par):
    built_in = stage_layers(small(None, *par))
    fields = [p for p in par if p.startswith("model.")]
    assert shape(stage_layers(small(layout, *fields))) == shape(built_in)


def test_deepseek_v3_first_and_last_stage_layers_as_a_layout():
    """scenarios/deepseek-v3-h800.yaml's 3 + 14 x 4 + 2 split on 1F1B, as first/last_stage_layers and as a layout."""
    split = deepseek_v3(16, 1, None, first_stage_layers=3, last_stage_layers=2)
    layout = deepseek_v3(16, 1, "Et*3|(t*4|)*14t*2mL")
    assert shape(stage_layers(layout)) == shape(stage_layers(split))
    assert [len(v.layers) for v in stage_layers(layout)] == [3] + [4] * 14 + [2]


def test_empty_stages_hold_no_decoder_layer():
    stages = stage_layers(small("E|t*4|t*4|L"))
    assert shape(stages) == [(0, 0, 0, (), True, False), (1, 1, 0, (0, 1, 2, 3), False, False),
                             (2, 0, 1, (4, 5, 6, 7), False, False), (3, 1, 1, (), False, True)]  # fmt: skip


def test_pp1_takes_a_one_stage_layout():
    s = load_scenario(BIG, ["cluster.nodes=1", "parallelism.ep=4", "model.num_layers=8", f"{FIELD}=Et*8L"])
    assert shape(stage_layers(s)) == [(0, 0, 0, tuple(range(8)), True, True)]
    with pytest.raises(InputError, match=r"7 decoder layers \(t\), model.num_layers is 8") as err:
        load_scenario(BIG, ["cluster.nodes=1", "parallelism.ep=4", "model.num_layers=8", f"{FIELD}=Et*7L"])
    assert str(err.value).startswith(f"{BIG}: {FIELD}: ")


# ---- the checks ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout,extra,field,message", [
    ("tEt|t*2|t*2|t*2L", [], FIELD, r"the first layer must be E \(embedding\) and the last L \(loss\), got 't'"),
    ("Et*2|t*2|t*2|t*2Lt", [], FIELD, "the last L .* got 'E' and 't'"),
    ("Et*2|t*2|t*2|tEtL", [], FIELD, "E and L must appear once each, got 2 E and 1 L"),
    ("Et*2|t*2|t*2|tLtL", [], FIELD, "E and L must appear once each, got 1 E and 2 L"),
    ("Et*2|t*2|t*2|t*3L", [], FIELD, r"9 decoder layers \(t\), model.num_layers is 8"),
    ("Et*2|t*2|t*2|t*2mL", [], FIELD, r"1 MTP layers \(m\), model.mtp_layers is 0"),
    ("Et*2|t*2|t*2|t*2L", ["model.mtp_layers=1"], FIELD, r"0 MTP layers \(m\), model.mtp_layers is 1"),
    ("Et*2|t*2|t*2|tmtL", ["model.mtp_layers=1"], FIELD, r"decoder layers \(t\) must all come before the MTP"),
    ("|Et*4|t*4|L", [], FIELD, r"E \(embedding\) is in virtual stage 1; the simulator puts the embedding on "
                               "virtual stage 0"),
    ("Et*4|t*4|L|", [], FIELD, r"L \(loss\) is in virtual stage 2; .* on the last \(3\)"),
    ("Et*2|t*3|t*3m|L", ["model.mtp_layers=1"], FIELD, "MTP layers .m. in virtual stage 2, not the last .3.: "
                                                       "standalone MTP .* is not modelled"),
    ("Et*2|t*2|t*2|t*2|L", [], FIELD, r"5 virtual stages \('\|'-separated\) where pp x vpp = 2 x 2 = 4: the "
                                      "stages must be a multiple of pp"),
    ("Et*2|t*2|t*2|t*2L", ["parallelism.vpp=1"], FIELD, "4 virtual stages .* = 2 x 1 = 2: set vpp: 2"),
    ("Et|t|t|t|t|t|t|tL", [], FIELD, "8 virtual stages .* = 2 x 2 = 4: set vpp: 4"),
    ("Et*2|t*2|x|t*2L", [], FIELD, "invalid character 'x' in virtual stage 2"),
    ("Et*2|t*2|t*2|t*2L", ["parallelism.vpp=1", "parallelism.pp_schedule=dualpipe"], FIELD,
     "dualpipe splits the model into its own pp stages"),
    ("Et*2|t*2|t*2|t*2L", ["parallelism.first_stage_layers=0"], "parallelism.first_stage_layers",
     "cannot be set with first_stage_layers"),
    ("Et*2|t*2|t*2|t*2L", ["parallelism.last_stage_layers=2"], "parallelism.last_stage_layers",
     "cannot be set with last_stage_layers"),
    ("Et*2|t*2|t*2|t*2L", ["parallelism.embedding_as_layer=true"], "parallelism.embedding_as_layer",
     "cannot be set with embedding_as_layer"),
    ("Et*2|t*2|t*2|t*2L", ["parallelism.loss_as_layer=true"], "parallelism.loss_as_layer",
     "cannot be set with loss_as_layer"),
])  # fmt: skip
def test_every_check_names_the_field(layout, extra, field, message):
    with pytest.raises(InputError, match=message) as err:
        small(layout, *extra)
    assert str(err.value).startswith(f"{BIG}: {field}: ")  # as the CLI prints it (exit 2)


def test_megatrons_docstring_example_is_refused_as_standalone_mtp():
    """Its MTP layer is a virtual stage of its own (rank 0 of PP2 x VPP16, chunk 15), which Megatron-Core
    runs as standalone MTP; the simulator runs the MTP modules with the LM head and loss."""
    standalone = r"MTP layers \(m\) in virtual stage 30, not the last \(31\): standalone MTP"
    with pytest.raises(InputError, match=standalone) as err:
        deepseek_v3(2, 16, "Ettt|(tt|)*29,m|L")
    assert str(err.value).startswith(f"dsv3: {FIELD}: pipeline_layout 'Ettt|(tt|)*29,m|L': ")
    moved = stage_layers(deepseek_v3(2, 16, "Ettt|(tt|)*29,|mL"))  # the MTP layer with the loss: accepted
    assert [len(v.layers) for v in moved] == [3] + [2] * 29 + [0, 0]
    assert moved[-1].head and moved[-1].rank == 1


def test_simulate_cli_exits_2_naming_the_file_and_field(cli, tmp_path):
    doc = yaml.safe_load(BIG.read_text())
    doc["cluster"]["nodes"] = 1
    doc["model"]["num_layers"] = 8
    doc["parallelism"].update(ep=4, pp=2, vpp=2, pipeline_layout="Et*2|t*2|t*2|t*3L")
    doc["training"]["grad_accum_steps"] = 4
    path = tmp_path / "bad-layout.yaml"
    path.write_text(yaml.safe_dump(doc))
    bad = cli("simulate", str(path))
    assert bad.returncode == 2, bad.stderr
    want = (
        f"{path}: {FIELD}: pipeline_layout 'Et*2|t*2|t*2|t*3L': 9 decoder layers (t), model.num_layers is 8"
    )
    assert want in bad.stderr
    assert "Traceback" not in bad.stderr
    doc["parallelism"]["pipeline_layout"] = "Et*4|t*2|t|tL"
    path.write_text(yaml.safe_dump(doc))
    ok = cli("check", str(path))
    assert ok.returncode == 0, ok.stderr


# ---- a simulated step ----------------------------------------------------------------------------


def test_the_stage_with_more_layers_computes_more():
    """Rank 0 runs virtual stages 0 and 2 (4 + 1 layers), rank 1 stages 1 and 3 (2 + 1 layers, the head):
    its attention time is 5 / 3 of rank 1's (3 / 3 under the even split), its peak memory larger."""
    even, uneven = small(None), small("Et*4|t*2|t|tL")
    assert [vs.layers for vs in rank_chunks(uneven)[0]] == [(0, 1, 2, 3), (6,)]
    stage0, stage1 = 0, uneven.layout.stage_size  # the first rank of each pipeline stage
    times = {}
    for name, s in (("even", even), ("uneven", uneven)):
        r = simulate(s, trace_ranks={stage0, stage1})
        busy: dict[tuple[int, str], float] = defaultdict(float)
        for sp in r.pop("_spans"):
            if sp.stream == "compute":
                busy[sp.rank, sp.name] += sp.end - sp.start
        times[name] = (r, busy)
    r_even, even_busy = times["even"]
    r, busy = times["uneven"]
    assert even_busy[stage0, "attention"] == pytest.approx(even_busy[stage1, "attention"], rel=1e-9)
    assert busy[stage0, "attention"] == pytest.approx(5 / 3 * busy[stage1, "attention"], rel=1e-9)
    assert busy[stage0, "experts"] > 1.5 * busy[stage1, "experts"]
    assert busy[stage0, "attention"] + busy[stage1, "attention"] == pytest.approx(
        even_busy[stage0, "attention"] + even_busy[stage1, "attention"], rel=1e-9
    )  # the same 8 layers
    per_stage = [st["peak_GiB_per_gpu"] for st in r["memory"]["per_stage"]]
    even_stage = [st["peak_GiB_per_gpu"] for st in r_even["memory"]["per_stage"]]
    assert per_stage[0] > even_stage[0] and per_stage[1] < even_stage[1]
    assert r["step_time_s"] != r_even["step_time_s"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet="Etm L|()*,0123456789x", max_size=40))
def test_any_text_loads_or_is_an_input_error(text):
    """Whatever the string, the scenario loads or fails with an InputError naming pipeline_layout."""
    doc = yaml.safe_load(BIG.read_text())
    doc["cluster"]["nodes"], doc["model"]["num_layers"], doc["training"]["grad_accum_steps"] = 1, 8, 4
    doc["parallelism"].update(ep=4, pp=2, vpp=2, pipeline_layout=text)
    try:
        s = scenario_from_dict(doc, source="fuzz")
    except InputError as exc:
        assert str(exc).startswith(f"fuzz: {FIELD}: ")
    else:
        assert sum(len(v.layers) for v in stage_layers(s)) == 8
