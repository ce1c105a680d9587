"""The published-runs suite (validation/published/*.yaml and dense/, sim/studies/published.py,
benchmarks/bench_published.py) and ``moesim layer`` (sim/cli/layer.py, sim/studies/layer.py).

- every entry loads with its id, kind, measurement and source; its scenario validates and describes the
  run (GPUs, global batch); measured step times follow GBS x seq / (tokens/s/GPU x GPUs);
- the predictions of a cheap subset (the layer rows, the small training and all-to-all rows) equal the
  committed record benchmarks/results/published.json (a model change that was not re-recorded fails here),
  and the record's errors, targets and summary follow from its own rows;
- ``moesim layer``: one MoE layer's forward and backward equal the MoE spans of a full simulated step of
  the same scenario; its refusals (pp > 1, a dense model) exit 2 naming the file and the field.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict

import pytest
import yaml
from conftest import ROOT, run_cli

from sim.api import load_scenario, simulate
from sim.cli.main import main
from sim.errors import InputError
from sim.studies.layer import layer_times
from sim.studies.published import FOLDER, as_json, entries, measured_step_s, predict, scenario_of, summary
from sim.studies.published_row import TARGET, Row

RECORD = ROOT / "benchmarks" / "results" / "published.json"
ALL = entries() + entries(FOLDER / "dense")
BY_ID = {e["id"]: e for e in ALL}
TRAINING = [e["id"] for e in ALL if e["kind"] == "training"]
LAYER_ROWS = [e["id"] for e in ALL if e["kind"] == "layer"]
MIXTRAL = FOLDER / "L-mixtral-a2a-bf16.yaml"
DENSE_8B = FOLDER / "dense" / "DENSE-H100-8B.yaml"
SHA = re.compile(r"^[0-9a-f]{40}$")


# ---- the entries ---------------------------------------------------------------------------------
def test_every_entry_has_id_kind_measurement_and_source():
    assert len(ALL) == len(list(FOLDER.glob("*.yaml"))) + len(list((FOLDER / "dense").glob("*.yaml"))) > 30
    ids = [e["id"] for e in ALL]
    assert len(ids) == len(set(ids))
    for e in ALL:
        assert e["id"] == e["_path"].stem, e["_path"]
        assert e["kind"] in TARGET, e["id"]
        assert isinstance(e["title"], str) and e["title"], e["id"]
        assert isinstance(e["measured"], dict) and e["measured"], e["id"]
        src = e["source"]
        assert src.get("repo"), e["id"]
        if src.get("url"):
            assert src["url"].startswith("https://"), e["id"]
        elif re.match(r"^[\w.-]+/[\w.-]+$", src["repo"]):  # a GitHub repository: a full commit
            assert SHA.match(str(src["commit"])), e["id"]
        else:  # a paper (P1): its version
            assert src.get("commit"), e["id"]
        assert isinstance(src.get("quote"), str) and src["quote"].strip(), e["id"]


@pytest.mark.parametrize("eid", TRAINING + LAYER_ROWS)
def test_scenario_validates_and_describes_the_run(eid):
    e = BY_ID[eid]
    s = scenario_of(e)
    assert s.world_size == int(e["run"]["gpus"])
    t = e["scenario"]["training"]
    assert s.training.seq_len == t["seq_len"]
    assert s.global_batch_size == s.training.micro_batch_size * s.training.grad_accum_steps * s.dp
    if "global_batch_size" in t:
        assert s.global_batch_size == t["global_batch_size"]
    if e["kind"] == "layer":  # one micro-batch of one layer
        assert s.parallelism.pp == 1 and s.model.num_moe_layers >= 1


def _gbs_tokens(e) -> float:
    t = e["scenario"]["training"]
    return t["global_batch_size"] * t["seq_len"]


@pytest.mark.parametrize("eid", TRAINING)
def test_measured_step_is_the_published_step_or_derived_from_throughput(eid):
    e = BY_ID[eid]
    m, gpus = e["measured"], int(e["run"]["gpus"])
    got = measured_step_s(e)
    if "step_time_s" in m:
        assert got == float(m["step_time_s"])
    else:
        assert got == pytest.approx(_gbs_tokens(e) / (m["tokens_per_s_per_gpu"] * gpus), rel=1e-12)
    if "step_time_s" in m and "tokens_per_s_per_gpu" in m:  # both published: consistent up to their rounding
        assert m["step_time_s"] == pytest.approx(
            _gbs_tokens(e) / (m["tokens_per_s_per_gpu"] * gpus), rel=1e-3
        )


def _decimals(x: float) -> int:
    """Decimals written in the YAML (an int has none; 9.660 reads back as 9.66, two)."""
    if isinstance(x, int):
        return 0
    text = repr(x)
    return len(text.split(".")[1]) if "." in text and "e" not in text else 0


DERIVED = [e["id"] for e in ALL if any(k.endswith("_derived") for k in e["measured"])]


@pytest.mark.parametrize("eid", DERIVED)
def test_derived_figures_follow_the_step_convention(eid):
    """``*_derived`` keys are GBS x seq / (tok/s/GPU x GPUs) (or its inverse), rounded as written."""
    e = BY_ID[eid]
    m, gpus = e["measured"], int(e["run"]["gpus"])
    if "step_time_s_derived" in m:
        exact, written = _gbs_tokens(e) / (m["tokens_per_s_per_gpu"] * gpus), m["step_time_s_derived"]
    else:
        exact, written = _gbs_tokens(e) / (m["step_time_s"] * gpus), m["tokens_per_s_per_gpu_derived"]
    assert abs(written - exact) <= 0.5 * 10 ** -_decimals(written) * (1 + 1e-9), (written, exact)


@pytest.mark.parametrize("eid", LAYER_ROWS)
def test_layer_measurements_are_the_exact_figures_rounded(eid):
    m = BY_ID[eid]["measured"]
    for k in ("forward_ms", "backward_ms"):
        assert m[k] == round(m[f"{k}_exact"], 3), k


# ---- predictions against the committed record ------------------------------------------------------
CHEAP = LAYER_ROWS + ["D3", "D4", "D6", "D7", "C1", "C3", "C5", "C6", "C7"]


@pytest.fixture(scope="module")
def record():
    return json.loads(RECORD.read_text())


def test_the_record_covers_every_entry_of_the_suite(record):
    """bench_published runs validation/published/*.yaml (not dense/): every entry has rows in the record."""
    assert {r["id"] for r in record["rows"]} == {e["id"] for e in entries()}
    assert set(record["wall_s"]) == {e["id"] for e in entries()}


@pytest.mark.parametrize("eid", CHEAP)
def test_prediction_equals_the_committed_record(eid, record):
    got = as_json(predict(BY_ID[eid]))
    want = [r for r in record["rows"] if r["id"] == eid]
    assert [r["metric"] for r in got] == [r["metric"] for r in want]
    for g, w in zip(got, want, strict=True):
        if w["predicted"] is None:
            assert g["predicted"] is None and g["note"] == w["note"] and g["note"].startswith("not simulated")
            continue
        assert g["predicted"] == pytest.approx(w["predicted"], rel=1e-6), g["metric"]
        assert g["measured"] == pytest.approx(w["measured"], rel=1e-12)
        assert g["within_target"] == w["within_target"]
        for k in ("breakdown_s",):
            if k in w:
                assert g[k] == pytest.approx(w[k], rel=1e-6, abs=1e-12)


def test_training_row_of_the_record_is_simulate_over_the_measured_step(record):
    """A training row is ``simulate(scenario).step_time_s`` against measured_step_s (D7, FSDP2)."""
    e = BY_ID["D7"]
    r = simulate(scenario_of(e))
    row = next(x for x in record["rows"] if x["id"] == "D7")
    assert row["predicted"] == pytest.approx(r.step_time_s, rel=1e-6)
    assert row["measured"] == pytest.approx(measured_step_s(e), rel=1e-12)
    assert row["memory_fits"] == r.memory["fits"]


def test_record_errors_targets_and_summary_follow_from_its_rows(record):
    rows = []
    for r in record["rows"]:
        if r["predicted"] is None:
            assert r["error"] is None and r["within_target"] is None
        else:
            assert r["error"] == pytest.approx(r["predicted"] / r["measured"] - 1, rel=1e-9, abs=1e-12)
            assert r["within_target"] == (abs(r["error"]) <= TARGET[r["kind"]])
        measured = float("nan") if r["measured"] is None else r["measured"]
        rows.append(Row(r["id"], r["kind"], "", r["metric"], measured, r["predicted"], r["error"]))
    assert summary(rows) == record["summary"]
    layer = [abs(r.error) for r in rows if r.kind == "layer"]
    assert record["summary"]["layer"]["rows"] == 2 * len(LAYER_ROWS) == len(layer)
    assert record["summary"]["layer"]["max_abs_error"] == max(layer)


def test_an_entry_the_simulator_cannot_run_becomes_a_note_row():
    e = dict(BY_ID["L-mixtral-a2a-bf16"])
    e["scenario"] = {**e["scenario"], "parallelism": {**e["scenario"]["parallelism"], "pp": 2, "dp": 4, "ep": 4},
                     "model": {**e["scenario"]["model"], "num_layers": 2}}  # fmt: skip
    (row,) = predict(e)
    assert row.predicted is None and row.error is None and row.within is None and math.isnan(row.measured)
    assert row.note.startswith("not simulated") and "parallelism.pp" in row.note
    with pytest.raises(InputError, match="kind"):
        predict({**e, "kind": "inference"})


def test_bench_published_writes_the_record_rows(tmp_path, record):
    out = tmp_path / "pub"
    p = run_cli_script("benchmarks/bench_published.py", "--only", "L-mixtral-a2a-bf16,C6", "--out", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.with_suffix(".json").read_text())
    want = [r for r in record["rows"] if r["id"] in ("L-mixtral-a2a-bf16", "C6")]
    assert [(r["id"], r["metric"]) for r in doc["rows"]] == [(r["id"], r["metric"]) for r in want]
    for g, w in zip(doc["rows"], want, strict=True):
        assert g["predicted"] == pytest.approx(w["predicted"], rel=1e-6)
    assert set(doc["wall_s"]) == {"L-mixtral-a2a-bf16", "C6"}
    md = out.with_suffix(".md").read_text()
    assert sum(line.startswith("| L-mixtral-a2a-bf16 | ") for line in md.splitlines()) == 2
    assert doc["summary"]["layer"]["rows"] == 2 and doc["summary"]["a2a"]["rows"] == 1


def run_cli_script(script: str, *args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


# ---- moesim layer ----------------------------------------------------------------------------------
MOE_KERNELS = ("route", "permute", "experts", "unpermute", "shared_experts")


def _full_step_moe_spans(s) -> tuple[float, float]:
    """Rank 0's MoE-block seconds of the forward and of the backward of a full simulated step of ``s``
    (one micro-batch): the MoE kernels by their phase, the all-to-alls by whether they start before the
    first backward kernel."""
    r = simulate(s, trace_ranks={0})
    spans = [sp for sp in r.spans if sp.rank == 0 and sp.stream == "compute"]
    first_bwd = min(sp.start for sp in spans if sp.args.get("phase") == "bwd")
    out = defaultdict(float)
    for sp in spans:
        if sp.name in MOE_KERNELS:
            out[sp.args["phase"]] += sp.end - sp.start
        elif sp.name in ("dispatch", "combine", "imbalance_wait"):
            out["fwd" if sp.start < first_bwd else "bwd"] += sp.end - sp.start
    return out["fwd"], out["bwd"]


@pytest.mark.parametrize("overrides", [[], ["parallelism.ep=1"], ["model.num_shared_experts=1"]])
def test_layer_times_are_the_moe_spans_of_a_full_step(overrides):
    s = load_scenario(MIXTRAL, overrides)
    lt = layer_times(s)
    fwd, bwd = _full_step_moe_spans(s)
    assert lt["forward_s"] == pytest.approx(fwd, rel=1e-9)
    assert lt["backward_s"] == pytest.approx(bwd, rel=1e-9)
    # every rank's time is tiled by compute, all-to-all and waits; no attention in it
    total = lt["compute_s"] + lt["a2a_s"] + lt["imbalance_wait_s"]
    assert lt["forward_s"] + lt["backward_s"] == pytest.approx(total, rel=1e-12)
    assert sum(lt["compute_by_span_s"].values()) == pytest.approx(lt["compute_s"], rel=1e-12)
    spans = {"route", "permute", "experts", "unpermute"} | (
        {"shared_experts"} if s.model.num_shared_experts else set()
    )
    assert set(lt["compute_by_span_s"]) == spans
    assert lt["tokens_per_rank"] == s.training.micro_batch_size * s.training.seq_len
    if s.ep == 1:
        assert lt["a2a_s"] == lt["imbalance_wait_s"] == 0.0
    else:
        assert lt["a2a_s"] > 0


def test_layer_times_one_layer_whatever_the_depth():
    one = layer_times(load_scenario(MIXTRAL))
    four = layer_times(load_scenario(MIXTRAL, ["model.num_layers=4"]))
    for k in ("forward_s", "backward_s", "a2a_s", "compute_s"):
        assert four[k] == pytest.approx(one[k], rel=1e-12), k


def test_moesim_layer_prints_and_writes_the_same_times(tmp_path, capsys):
    out = tmp_path / "layer.json"
    assert main(["layer", str(MIXTRAL), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert set(doc) == {"scenario", "forward_s", "backward_s", "forward_max_s", "backward_max_s", "a2a_s",
                        "imbalance_wait_s", "compute_s", "compute_by_span_s", "tokens_per_rank", "dispatcher"}  # fmt: skip
    assert doc["scenario"] == "published-l-mixtral-a2a-bf16" and doc["dispatcher"] == "direct"
    want = layer_times(load_scenario(MIXTRAL))
    assert doc == json.loads(json.dumps(want))
    fwd = re.search(r"^forward\s+([\d.]+) ms", text, re.M)
    bwd = re.search(r"^backward\s+([\d.]+) ms", text, re.M)
    assert fwd and bwd, text
    assert float(fwd.group(1)) == round(doc["forward_s"] * 1e3, 3)
    assert float(bwd.group(1)) == round(doc["backward_s"] * 1e3, 3)
    # --json - writes the record on stdout and nothing else
    assert main(["layer", str(MIXTRAL), "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out) == doc


def test_moesim_layer_is_the_published_layer_row(record):
    row = next(r for r in record["rows"] if r["id"] == "L-mixtral-a2a-bf16" and r["metric"] == "forward_ms")
    p = run_cli("layer", str(MIXTRAL), "--json", "-")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["forward_s"] * 1e3 == pytest.approx(row["predicted"], rel=1e-9)


@pytest.mark.parametrize("path,overrides,field", [
    (MIXTRAL, ["parallelism.pp=2", "parallelism.dp=4", "parallelism.ep=4", "model.num_layers=2"], "parallelism.pp"),
    (DENSE_8B, [], "model.num_experts"),
])  # fmt: skip
def test_moesim_layer_refusals_name_the_file_and_field(path, overrides, field, capsys):
    sets = [x for o in overrides for x in ("--set", o)]
    assert main(["layer", str(path), *sets]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and f"{field}:" in err, err


def test_layer_entries_are_read_as_their_scenario_block():
    """A published entry given as a scenario file is its ``scenario:`` mapping."""
    doc = yaml.safe_load(MIXTRAL.read_text())["scenario"]
    s = load_scenario(MIXTRAL)
    assert s.name == doc["name"]
    assert (s.model.hidden_size, s.model.num_experts, s.model.top_k) == (4096, 8, 2)
    assert s.training.framework == "megatron" and s.ep == 8
