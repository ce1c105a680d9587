"""Scenario schema: shipped files load, layout is derived as DeepSpeed does it, and every class of
bad input is an InputError naming the field (exit 2 through the CLI)."""

import pytest
from conftest import SCENARIOS

from sim.api import load_scenario, scenario_from_dict
from sim.errors import InputError
from sim.inputs.scenario import parse_policy


def _base() -> dict:
    return {
        "cluster": {"topology": "dgx-h100", "nodes": 2},
        "model": {
            "num_layers": 2,
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_experts": 8,
            "top_k": 2,
            "moe_ffn_hidden_size": 128,
        },
        "parallelism": {"ep": 8},
        "training": {"micro_batch_size": 2, "seq_len": 128},
    }


def _err(data: dict) -> InputError:
    with pytest.raises(InputError) as info:
        scenario_from_dict(data, source="x.yaml")
    return info.value


@pytest.mark.parametrize("name", ["128gpu", "cpu-2rank", "seed-4gpu"])
def test_shipped_scenarios_load(name):
    s = load_scenario(SCENARIOS / f"{name}.yaml")
    assert s.world_size == s.dp
    assert s.dp % s.ep == 0
    assert s.model.num_experts % s.ep == 0


def test_128gpu_layout():
    s = load_scenario(SCENARIOS / "128gpu.yaml")
    assert (s.world_size, s.ep, s.edp, s.experts_per_rank) == (128, 16, 8, 8)
    assert s.ep_group_of(17) == list(range(16, 32))
    # DeepSpeed groups.py: EP groups contiguous, expert-data-parallel groups strided
    assert s.edp_groups()[1] == list(range(1, 128, 16))


def test_seed_batch_arithmetic():
    s = load_scenario(SCENARIOS / "seed-4gpu.yaml")
    assert s.global_batch_size == 64 == 8 * 2 * 4


def test_deepspeed_group_example_world16_ep2():
    d = _base()
    d["cluster"] = {"topology": "dgx-h100", "nodes": 2}
    d["parallelism"] = {"ep": 2}
    s = scenario_from_dict(d)
    assert s.ep_groups()[:2] == [[0, 1], [2, 3]]
    assert s.edp_groups() == [list(range(0, 16, 2)), list(range(1, 16, 2))]


def test_unknown_key_names_path_allowed_and_suggestion():
    d = _base()
    d["model"]["num_expert"] = 4
    e = _err(d)
    assert e.file == "x.yaml"
    assert "model.num_expert" in str(e) and "did you mean 'num_experts'" in str(e)
    assert "allowed keys:" in str(e)


def test_unknown_section():
    d = _base()
    d["routng"] = {}
    assert "did you mean 'routing'" in str(_err(d))


def test_type_and_range_errors_name_field():
    d = _base()
    d["training"]["seq_len"] = 0
    assert "training.seq_len" in str(_err(d))
    d = _base()
    d["cluster"]["nodes"] = "many"
    assert "cluster.nodes" in str(_err(d))


def test_missing_section():
    d = _base()
    del d["training"]
    e = _err(d)
    assert "training" in str(e) and "missing" in str(e)


def test_ep_must_divide_experts_and_world():
    d = _base()
    d["parallelism"]["ep"] = 3
    e = _err(d)
    assert e.field == "parallelism.ep" and "must divide model.num_experts" in str(e)
    d = _base()
    d["model"]["num_experts"] = 32
    d["parallelism"]["ep"] = 32
    e = _err(d)
    assert "world size" in str(e)


def test_dp_must_match_world():
    d = _base()
    d["parallelism"]["dp"] = 8
    e = _err(d)
    assert e.field == "parallelism.dp" and "16" in str(e)


def test_topk_le_experts():
    d = _base()
    d["model"]["top_k"] = 9
    assert "model.top_k" in str(_err(d))


def test_limited_groups_must_hold_topk():
    d = _base()
    d["model"].update(num_experts=16, top_k=4)
    d["parallelism"]["ep"] = 16
    d["routing"] = {"policy": "device_limited:M=1"}  # 1 expert per device < top_k 4
    e = _err(d)
    assert e.field == "routing.max_groups" and "raise M to at least 4" in str(e)
    d["routing"] = {"policy": "device_limited:M=4"}
    scenario_from_dict(d)
    d["routing"] = {"policy": "node_limited:M=3"}  # EP16 over 2 nodes: only 2 node groups
    assert "exceeds" in str(_err(d))


def test_policy_strings():
    assert parse_policy("topk") == ("topk", None)
    assert parse_policy("node_limited:M=4") == ("node_limited", 4)
    with pytest.raises(ValueError):
        parse_policy("node_limited:4")
    d = _base()
    d["routing"] = {"policy": "node_limited"}
    assert "routing.max_groups" in str(_err(d))


def test_global_batch_check():
    d = _base()
    d["training"]["global_batch_size"] = 31
    e = _err(d)
    assert e.field == "training.global_batch_size" and "= 32" in str(e)


def test_unknown_topology_suggests():
    d = _base()
    d["cluster"]["topology"] = "dgx-h10"
    e = _err(d)
    assert "did you mean 'dgx-h100'" in str(e) and e.field == "cluster.topology"


def test_overrides_typed_and_checked():
    s = load_scenario(
        SCENARIOS / "128gpu.yaml",
        ["cluster.nodes=4", "routing.policy=node_limited:M=2", "routing.capacity_factor=1.5"],
    )
    assert s.world_size == 32 and s.routing.policy == "node_limited" and s.routing.max_groups == 2
    assert s.routing.capacity_factor == 1.5
    with pytest.raises(InputError) as info:
        load_scenario(SCENARIOS / "128gpu.yaml", ["model.num_expert=3"])
    assert "did you mean 'num_experts'" in str(info.value)
    with pytest.raises(InputError):
        load_scenario(SCENARIOS / "128gpu.yaml", ["cluster.nodes"])


def test_yaml_problems(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster: {topology: dgx-h100\n")
    with pytest.raises(InputError, match="YAML syntax error at line"):
        load_scenario(bad)
    bad.write_text("")
    with pytest.raises(InputError, match="empty"):
        load_scenario(bad)
    bad.write_bytes(b"\x00\x01\x02junk")
    with pytest.raises(InputError, match="binary"):
        load_scenario(bad)
    bad.write_text("cluster: 1\ncluster: 2\n")
    with pytest.raises(InputError, match="duplicate key 'cluster'"):
        load_scenario(bad)
    with pytest.raises(InputError, match="not found"):
        load_scenario(tmp_path / "missing.yaml")


def test_cli_exit_codes(cli):
    ok = cli("check", "scenarios/128gpu.yaml")
    assert ok.returncode == 0, ok.stderr
    bad = cli("check", "scenarios/128gpu.yaml", "--set", "parallelism.ep=3")
    assert bad.returncode == 2
    assert "scenarios/128gpu.yaml: parallelism.ep:" in bad.stderr
    assert "Traceback" not in bad.stderr
    missing = cli("check", "nope.yaml")
    assert missing.returncode == 2 and "nope.yaml" in missing.stderr
