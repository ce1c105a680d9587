"""``moesim plan``: the space's rules and layer splits, a small plan end to end (Qwen3-30B-A3B's
config on 16 H100: valid layouts only, the published EP8-in-a-node layout found, counts that add up,
the JSON contract, the plot), resume from the log running nothing, the fast candidate path equal to
a scenario file's, the estimate's extrapolation, bad input (exit 2 naming the option), Ray."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT

from sim.api import scenario_from_dict, simulate
from sim.cli.main import main
from sim.errors import InputError
from sim.inputs.scenario_file import apply_override
from sim.studies.plan import estimate_point, prune
from sim.studies.plan_base import build_base, candidate_scenario, memory_record
from sim.studies.plan_plot import pareto_front
from sim.studies.plan_space import ModelShape, Space, Split, enumerate_space, layer_split

QWEN30 = ROOT / "validation" / "published" / "models" / "Qwen3-30B-A3B" / "config.json"
#: a small plan: one recompute choice, 64 sequences (few micro-batches), 3 layouts simulated
SMALL = ["--model", str(QWEN30), "--topology", "dgx-h100", "--gpus", "16", "--global-batch", "64",
         "--recompute", "none", "--top", "3", "--shortlist", "8", "--jobs", "1", "--no-progress"]  # fmt: skip
CONTRACT = ("layout", "step_time_s", "tokens_per_s_per_gpu", "mfu", "memory", "bound_by")


def test_layer_split_follows_megatron_options():
    assert layer_split(94, 8, 4, Split(True, True)) == Split(True, True)  # Qwen3-235B's 96 units, 3 per chunk
    assert layer_split(94, 8, 1, Split()) == Split(True, True)  # nothing even without counting the ends
    assert layer_split(36, 8, 1, Split()) == Split(first_stage_layers=3, last_stage_layers=3)  # 3 + 6 x 5 + 3
    assert layer_split(36, 4, 1, Split()) == Split()
    assert layer_split(36, 8, 2, Split()) is None  # uneven stages only without interleaving
    assert layer_split(94, 64, 1, Split()) is None  # the ends would carry more than a middle stage
    assert layer_split(48, 1, 1, Split()) == Split() and layer_split(48, 1, 2, Split()) is None


def test_space_keeps_sensible_divisors_only():
    shape = ModelShape(num_layers=48, heads=32, kv_heads=4, num_experts=128)
    space = Space(gpus=16, gpus_per_node=8, global_batch=64, seq_len=4096)
    cands, dropped = enumerate_space(shape, space)
    assert dropped == {"tp does not divide the attention / key-value heads": 1}  # tp 8 > 4 key/value heads
    assert cands and len({c.key() for c in cands}) == len(cands)
    for c in cands:
        assert c.tp in (1, 2, 4) and c.cp == 1 and c.tp * c.cp * c.pp * c.dp == 16
        assert 128 % c.ep == 0 and (c.tp * c.cp * c.dp) % (c.ep * c.etp) == 0 and c.etp in (1, c.tp)
        assert c.micro_batch_size * c.grad_accum_steps * c.dp == 64 and c.micro_batch_size * 4096 <= 16384
        assert c.vpp == 1 or c.grad_accum_steps % c.pp == 0
    assert {c.recompute for c in cands} == {"none", "selective", "full"}


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    out = d / "plan.json"
    code = main(["plan", *SMALL, "--json", str(out), "--plot", str(d / "plan.png")])
    assert code == 0
    return d, json.loads(out.read_text())


def test_small_plan_json_contract_and_ranking(small_plan):
    d, doc = small_plan
    plans = doc["plans"]
    assert 1 <= len(plans) <= 3
    for p in plans:
        assert all(k in p for k in CONTRACT)
        assert {"tp", "cp", "pp", "vpp", "ep", "etp", "dp", "edp", "micro_batch_size", "recompute"} <= set(p["layout"])
        assert p["memory"]["fits"] and p["fidelity"] == "folded" and p["bound_by"] in p["shares"]
        assert p["tokens_per_s_per_gpu"] == pytest.approx(64 * 4096 / p["step_time_s"] / 16)
    assert [p["rank"] for p in plans] == list(range(1, len(plans) + 1))
    assert [p["step_time_s"] for p in plans] == sorted(p["step_time_s"] for p in plans)
    assert len({json.dumps(p["layout"], sort_keys=True) for p in plans}) == len(plans)
    for e in doc["estimates"]:  # the closed form that shortlisted them is in the estimate's neighbourhood
        assert e["screen_step_time_s"] == pytest.approx(e["step_time_s"], rel=0.3)
    assert (d / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = (d / "plan.jsonl").read_text().splitlines()
    assert len(log) == 1 + doc["counts"]["estimated"] + doc["counts"]["simulated"]


def test_small_plan_ranks_valid_layouts_only(small_plan):
    _, doc = small_plan
    base = build_base(QWEN30, "dgx-h100", 16, global_batch=64, recomputes=("none",))
    data = base.scenario.model_dump()
    for p in [*doc["plans"], *doc["estimates"]]:  # each as a scenario file would say it: valid, and fits
        lay = p["layout"]
        overrides = {"parallelism.tp": lay["tp"], "parallelism.cp": lay["cp"], "parallelism.pp": lay["pp"],
                     "parallelism.vpp": lay["vpp"], "parallelism.ep": lay["ep"], "parallelism.etp": lay["etp"],
                     "parallelism.dp": lay["dp"], "training.micro_batch_size": lay["micro_batch_size"],
                     "training.grad_accum_steps": lay["grad_accum_steps"], "training.global_batch_size": 64,
                     **{f"parallelism.{k}": v for k, v in lay["layer_split"].items()}}  # fmt: skip
        one = json.loads(json.dumps(data))
        for path, value in overrides.items():
            apply_override(one, path, value)
        s = scenario_from_dict(one)
        assert memory_record(s)["fits"]


def test_small_plan_finds_the_published_layout(small_plan):
    """Qwen3-30B-A3B trains with EP8 inside a node, TP1 PP1 (D1, D2, D6 of validation/published). The closed
    form ranks it 6th (1.9% behind PP2 x VPP8), the DES first by 6%: the shortlist holds 8."""
    _, doc = small_plan
    found = [p for p in doc["plans"] if (p["layout"]["tp"], p["layout"]["pp"], p["layout"]["ep"]) == (1, 1, 8)]
    assert found and found[0]["rank"] <= 2


def test_small_plan_counts_add_up(small_plan):
    _, doc = small_plan
    c = doc["counts"]
    assert c["combinations"] == sum(c["dropped_by_rules"].values()) + c["candidates"]
    assert c["candidates"] == sum(c["invalid"].values()) + sum(c["do_not_fit"].values()) + c["fit"]
    assert c["fit"] == c["not_shortlisted"] + c["estimated"]
    assert c["simulated"] == len(doc["plans"]) and c["estimated"] == len(doc["estimates"]) == 8
    assert sum(c["do_not_fit"].values()) > 0 and c["fit"] > 0


def test_resume_from_the_log_runs_nothing(small_plan, monkeypatch, capsys):
    d, doc = small_plan

    def no(*args, **kwargs):
        raise AssertionError("simulated again")

    monkeypatch.setattr("sim.engine.simulate.simulate", no)
    out = d / "again.json"
    assert main(["plan", *SMALL, "--json", str(out), "--log", str(d / "plan.jsonl")]) == 0
    assert json.loads(out.read_text()) == doc
    runs = doc["counts"]["estimated"] + doc["counts"]["simulated"]
    assert f"({runs} runs from it)" in capsys.readouterr().out


def test_pruning_matches_scenario_files_and_memory():
    """The fast candidate path (sections validated, ``check_layout``) says what a scenario file says,
    and the memory shortcuts (states alone, larger micro-batches) prune what the memory model would."""
    base = build_base(QWEN30, "dgx-h100", 16, global_batch=64, policies=("topk", "node_limited:M=2"))
    cands, _ = enumerate_space(base.shape, base.space)
    sample = cands[::23]
    fits, invalid, no_fit = prune(base, sample)
    assert sum(invalid.values()) > 0  # node_limited:M=2 on an EP group inside one node
    fitting = {f.candidate for f in fits}
    data = base.scenario.model_dump()
    for c in sample:
        one = json.loads(json.dumps(data))
        for path, value in c.overrides().items():
            apply_override(one, path, value)
        apply_override(one, "training.global_batch_size", 64)
        try:
            s = scenario_from_dict(one)
        except InputError:
            with pytest.raises(InputError):
                candidate_scenario(base, c)
            assert c not in fitting
            continue
        assert candidate_scenario(base, c).model_dump() == s.model_dump()
        assert (c in fitting) == memory_record(s)["fits"]
    assert len(sample) == len(fits) + sum(invalid.values()) + sum(no_fit.values())


def test_headroom_keeps_memory_free():
    plain = build_base(QWEN30, "dgx-h100", 16, global_batch=64, recomputes=("none",))
    kept = build_base(QWEN30, "dgx-h100", 16, global_batch=64, recomputes=("none",), headroom_GiB=20)
    cands, _ = enumerate_space(plain.shape, plain.space)
    loose, _, _ = prune(plain, cands)
    tight, _, no_fit = prune(kept, cands)
    assert 0 < len(tight) < len(loose) and sum(no_fit.values()) == len(cands) - len(tight)
    assert all(f.memory["peak_GiB_per_gpu"] <= f.memory["capacity_GiB"] - 20 for f in tight)
    assert {f.candidate for f in tight} == {f.candidate for f in loose if f.memory["peak_GiB_per_gpu"]
                                            <= f.memory["capacity_GiB"] - 20}  # fmt: skip


def test_estimate_extrapolates_the_micro_batches():
    base = build_base(QWEN30, "dgx-h100", 16, global_batch=96)
    cands, _ = enumerate_space(base.shape, base.space)
    c = next(c for c in cands if (c.tp, c.pp, c.vpp, c.ep, c.micro_batch_size, c.recompute) == (1, 2, 1, 8, 1, "none"))
    s = candidate_scenario(base, c)
    assert s.training.grad_accum_steps == 12
    est = estimate_point(s)
    assert est["micro_batches_run"] == [2, 4]
    full = simulate(s, fidelity="estimate")
    assert est["step_time_s"] == pytest.approx(full.step_time_s, rel=2e-3)
    assert est["mfu"] == pytest.approx(full.mfu, rel=2e-3)
    for k, v in full.breakdown_s.items():
        assert est["breakdown_s"][k] == pytest.approx(v, rel=0.02, abs=2e-3)


def test_pareto_front():
    pts = [(10, 5), (20, 4), (20, 9), (30, 9), (40, 12), (5, 1)]
    assert pareto_front(pts) == [(5, 1), (10, 5), (20, 9), (40, 12)]


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--gpus", "12"], "--gpus"),
        (["--topology", "no-such-topology"], "--topology"),
        (["--model", "README.md"], "--model"),
        (["--model", "no/such/config.json"], "--model"),
        (["--dispatcher", "carrier-pigeon"], "--dispatcher"),
        (["--framework", "jax"], "--framework"),
        (["--policy", "random"], "--policy"),
        (["--top", "0"], "--top"),
        (["--headroom", "-1"], "--headroom"),
        (["--address", "auto"], "--address"),
    ],
)
def test_bad_input_exits_2_naming_the_option(args, option, capsys, tmp_path):
    base = {"--model": str(QWEN30), "--topology": "dgx-h100", "--gpus": "16"}
    for k, v in zip(args[::2], args[1::2], strict=True):
        base[k] = v
    argv = ["plan", *[x for kv in base.items() for x in kv], "--no-progress", "--log", str(tmp_path / "l.jsonl")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert option in err and "Traceback" not in err


def test_a_model_file_that_is_neither(tmp_path, capsys):
    p = tmp_path / "notes.yaml"
    p.write_text("just: some\nkeys: here\n")
    assert main(["plan", "--model", str(p), "--topology", "dgx-h100", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "neither" in err


@pytest.mark.slow
def test_ray_backend_gives_the_local_plan(small_plan, tmp_path):
    pytest.importorskip("ray")
    _, doc = small_plan
    out = tmp_path / "ray.json"
    assert main(["plan", *SMALL, "--backend", "ray", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["plans"] == doc["plans"]


def test_published_entry_as_model_keeps_its_knobs():
    base = build_base(ROOT / "validation" / "published" / "D9.yaml", "dgx-h100", 256)
    s = base.scenario
    assert (s.training.framework, s.collectives.all_to_all, s.routing.generator) == ("megatron", "deepep", "balanced")
    assert (base.space.global_batch, base.space.seq_len, base.space.base_split) == (2048, 4096, Split(True, True))


def test_a_published_scenario_with_a_layout_string_and_recompute_modules_plans():
    """X2 (DeepSeek-V3 on 256 B200) gives a pipeline layout and Megatron recompute modules: the plan
    searches stages and recompute itself, so its base keeps neither (it would refuse every other vpp)."""
    base = build_base(ROOT / "validation" / "published" / "X2.yaml", "dgx-b200", 256)
    p, t = base.scenario.parallelism, base.scenario.training
    assert p.pipeline_layout is None and t.recompute_modules is None
    assert base.space.recomputes == ("none", "selective", "full") and base.space.dispatchers == ("deepep",)
