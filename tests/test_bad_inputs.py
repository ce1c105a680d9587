"""The bad-input corpus (tests/bad_inputs/, described in its expected.yaml): every broken scenario,
topology, HF config, calibration and router-trace file makes ``moesim check``, ``params`` and
``route`` exit 2 with one line that names the file and the field, never a traceback."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from sim.cli.main import main

CORPUS = ROOT / "tests" / "bad_inputs"
EXPECTED: dict[str, dict] = yaml.safe_load((CORPUS / "expected.yaml").read_text())

#: A small valid scenario (2 x DGX H100, 16 experts) that names the file under test.
BASE = {
    "name": "wrapper",
    "cluster": {"topology": "dgx-h100", "nodes": 2},
    "model": {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "vocab_size": 1000,
        "moe_ffn_hidden_size": 32,
        "num_experts": 16,
        "top_k": 2,
    },
    "parallelism": {"ep": 16},
    "training": {"micro_batch_size": 1, "seq_len": 32},
}

#: wrap -> the commands that read such a file's content.
COMMANDS = {
    None: ("check", "params", "route"),
    "topology": ("check", "params", "route"),
    "hf": ("check", "params", "route"),
    "calibration": ("check",),
    "trace": ("check", "route"),
}


def wrapper(tmp_path: Path, wrap: str, target: Path) -> Path:
    data = yaml.safe_load(yaml.safe_dump(BASE))
    if wrap == "topology":
        data["cluster"]["topology"] = str(target)
    elif wrap == "hf":
        data["model"] = {"hf_config": str(target)}
    elif wrap == "calibration":
        data["calibration"] = str(target)
    elif wrap == "trace":
        data["routing"] = {"generator": "trace", "trace": str(target)}
    path = tmp_path / "wrapper.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(list(args))
    return rc, err.getvalue()


def invocations(name: str, tmp_path: Path) -> list[tuple[str, str]]:
    entry = EXPECTED[name]
    target = CORPUS / name
    wrap = entry.get("wrap")
    path = target if wrap is None else wrapper(tmp_path, wrap, target)
    calls = [(command, str(path)) for command in COMMANDS[wrap]]
    if wrap == "hf":
        calls.append(("params", str(target)))  # a config.json straight to params
    return calls


def assert_good_message(name: str, command: str, rc: int, err: str) -> None:
    entry = EXPECTED[name]
    where = f"{command} on {name}: {err!r}"
    assert rc == 2, where
    assert "Traceback" not in err and "internal error" not in err, where
    assert err.startswith("moesim: error: ") and err.count("\n") == 1, where
    assert Path(entry.get("names") or name).name in err, where  # the message names the file
    if entry["field"] is not None:
        assert entry["field"] in err, where
    for fragment in entry["contains"]:
        assert fragment in err, where


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_input_exits_2_naming_file_and_field(name, tmp_path):
    for command, path in invocations(name, tmp_path):
        rc, err = run(command, path)
        assert_good_message(name, command, rc, err)


def test_every_corpus_file_has_an_expectation():
    files = {str(p.relative_to(CORPUS)) for p in CORPUS.rglob("*") if p.is_file() and p.name != "expected.yaml"}
    assert files == set(EXPECTED)
    kinds = {name.split("/")[0] for name in files}
    assert kinds == {"scenarios", "topologies", "hf", "files"}
    assert len(files) >= 100


def test_an_oversized_yaml_file_is_refused_before_parsing(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("".join(f"key{i:07d}: {i}\n" for i in range(200_000)))  # 3.5 MiB
    for command in ("check", "params", "route"):
        rc, err = run(command, str(path))
        assert rc == 2 and "huge.yaml" in err and "limited to 2 MiB" in err, err


#: One of each kind through a real ``python -m sim`` process: the exit status and stderr a shell sees.
SUBPROCESS_SAMPLE = [
    "scenarios/binary_junk.yaml",
    "scenarios/misspelt_nested_key.yaml",
    "scenarios/ep_not_dividing_world.yaml",
    "scenarios/deep_nesting.yaml",
    "scenarios/faults_partition.yaml",
    "topologies/negative_nvlink_bw.yaml",
    "hf/not_an_object.json",
    "files/trace_counts_wrong.json",
]


@pytest.mark.parametrize("name", SUBPROCESS_SAMPLE)
def test_bad_input_through_a_real_process(name, tmp_path, cli):
    command, path = invocations(name, tmp_path)[-1]
    proc = cli(command, path)
    assert_good_message(name, command, proc.returncode, proc.stderr)
    assert proc.stdout == ""
