"""``moesim params`` through the real CLI: exit codes, JSON keys and figures."""

from __future__ import annotations

import json

from conftest import ROOT, SCENARIOS

HF = ROOT / "tests" / "data" / "hf"


def params_json(cli, *args: str) -> dict:
    proc = cli("params", *args, "--json", "-")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_128gpu_scenario_matches_qwen3_30b_a3b(cli):
    out = params_json(cli, str(SCENARIOS / "128gpu.yaml"))
    assert abs(out["total"] - 30.5e9) / 30.5e9 < 0.01
    assert abs(out["active"] - 3.3e9) / 3.3e9 < 0.02
    assert out["expert"] + out["non_expert"] == out["total"] and out["mtp"] == 0
    assert out["bytes"]["bf16_total"] == 2 * out["total"] and out["bytes"]["fp8_active"] == out["active"]
    assert out["bytes"]["fp32_total"] == 4 * out["total"] and out["bytes"]["bf16_active"] == 2 * out["active"]
    mem = out["memory"]
    for key in ("weights_GiB", "gradients_GiB", "optimizer_GiB", "activations_GiB", "peak_GiB_per_gpu"):
        assert 0 < mem[key] < mem["capacity_GiB"], key
    assert mem["fits"] is True and mem["capacity_GiB"] == 79.6 and mem["host_GiB_per_node"] == 0
    assert out["layout"] == {"world_size": 128, "dp": 128, "ep": 16, "edp": 8, "zero_stage": 2}


def test_same_config_as_hf_file_gives_the_same_counts(cli):
    scen = params_json(cli, str(SCENARIOS / "128gpu.yaml"))
    hf = params_json(cli, str(HF / "Qwen3-30B-A3B" / "config.json"))
    for key in ("total", "active", "expert", "non_expert", "embedding", "bytes"):
        assert scen[key] == hf[key], key
    assert "memory" not in hf


def test_deepseek_v3_config_reports_mtp_apart(cli):
    out = params_json(cli, str(HF / "DeepSeek-V3" / "config.json"))
    assert abs(out["total"] - 671e9) / 671e9 < 0.01 and abs(out["mtp"] - 11.5e9) / 11.5e9 < 0.01
    assert out["moe_layers"] == 58


def test_offloaded_scenario_reports_host_memory(cli):
    out = params_json(cli, str(SCENARIOS / "seed-4gpu.yaml"))
    assert out["memory"]["optimizer_GiB"] == 0 and out["memory"]["host_GiB_per_node"] > 0


def test_overrides_on_an_hf_config(cli):
    out = params_json(cli, str(HF / "Llama-3.1-8B" / "config.json"), "--set", "model.num_layers=16")
    full = params_json(cli, str(HF / "Llama-3.1-8B" / "config.json"))
    per_layer = (full["total"] - full["embedding"] - 4096) // 32
    assert full["total"] - out["total"] == 16 * per_layer


def test_human_table(cli):
    proc = cli("params", str(SCENARIOS / "128gpu.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert "30.53B" in proc.stdout and "3.35B" in proc.stdout and "fits" in proc.stdout


def test_json_is_deterministic(cli, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        assert cli("params", str(SCENARIOS / "128gpu.yaml"), "--json", str(path)).returncode == 0
    assert a.read_bytes() == b.read_bytes()


def test_bad_inputs_exit_2_naming_file_and_field(cli, tmp_path):
    unsupported = tmp_path / "config.json"
    unsupported.write_text(json.dumps({"model_type": "gpt2"}))
    proc = cli("params", str(unsupported))
    assert proc.returncode == 2 and "model_type" in proc.stderr and "mixtral" in proc.stderr
    assert str(unsupported) in proc.stderr and "Traceback" not in proc.stderr

    broken = tmp_path / "broken.json"
    broken.write_text('{"model_type": ')
    proc = cli("params", str(broken))
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr

    proc = cli("params", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "not found" in proc.stderr

    proc = cli("params", str(HF / "Mixtral-8x7B-v0.1" / "config.json"), "--set", "training.seq_len=8")
    assert proc.returncode == 2 and "--set" in proc.stderr

    proc = cli("params", str(HF / "Mixtral-8x7B-v0.1" / "config.json"), "--set", "model.top_k=9")
    assert proc.returncode == 2 and "top_k" in proc.stderr

    proc = cli("params", str(SCENARIOS / "128gpu.yaml"), "--set", "model.num_expert=64")
    assert proc.returncode == 2 and "num_experts" in proc.stderr


def test_json_content_without_suffix_is_read_as_hf_config(cli, tmp_path):
    path = tmp_path / "mixtral.cfg"
    path.write_text((HF / "Mixtral-8x7B-v0.1" / "config.json").read_text())
    out = params_json(cli, str(path))
    assert out["total"] == 46_702_792_704
