"""Fuzzing the loaders and the CLI: mutated scenarios, topologies and HF configs (deleted, added,
misspelt keys; values of the wrong type or size; damaged text; random bytes) either load or fail
with an InputError (exit 2), never another exception (exit 1) or a traceback."""

from __future__ import annotations

import contextlib
import copy
import io
import json
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, SCENARIOS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sim.api import load_scenario
from sim.cli.main import main
from sim.errors import InputError
from sim.inputs.hfconfig import model_fields_from_hf
from sim.inputs.topology import TOPOLOGY_DIR, load_topology

FAULTY = {
    "name": "fuzz-faults",
    "cluster": {"topology": "dgx-h100", "nodes": 2},
    "model": {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "moe_ffn_hidden_size": 32,
        "num_experts": 16,
        "top_k": 2,
    },
    "parallelism": {"ep": 16},
    "training": {"micro_batch_size": 1, "seq_len": 32},
    "faults": {
        "links": [
            {"nic": {"node": 1, "rail": 0}, "bw_factor": 0.5},
            {"nic": {"node": 0, "rail": 3}, "failed": True},
            {"link": "n0/gpu1 -> n0/switch", "bw_factor": 0.5},
        ],
        "stragglers": [{"rank": 3, "compute_factor": 1.5}],
        "jitter": {"kernel_cv": 0.1, "seed": 2},
    },
}
BASES = [
    yaml.safe_load((SCENARIOS / "cpu-2rank.yaml").read_text()),
    yaml.safe_load((SCENARIOS / "seed-4gpu.yaml").read_text()),
    FAULTY,
]
TOPOLOGY = yaml.safe_load((TOPOLOGY_DIR / "dgx-h100.yaml").read_text())
HF_CONFIG = json.loads((ROOT / "tests" / "data" / "hf" / "Qwen3-30B-A3B" / "config.json").read_text())

WORDS = ["nodes", "ep", "top_k", "num_experts", "hidden_size", "rank", "node", "rail", "bw_factor", "x", ""]
values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([0, 7, 10**6, 10**9, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        ["topk", "node_limited:M=2", "dgx-h100", "cpu-host", "missing.yaml", "../x.json", "n0/nic0"]
    ),
    st.lists(st.integers(min_value=-2, max_value=20), max_size=3),
    st.dictionaries(st.sampled_from(WORDS), st.integers(min_value=-1, max_value=5), max_size=2),
)


def _paths(node, prefix=()):
    """Every (path, value) in a nested dict/list, root first."""
    yield prefix, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


def _get(node, path):
    for p in path:
        node = node[p]
    return node


@st.composite
def mutated(draw, base):
    data = copy.deepcopy(base)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        paths = [p for p, _ in _paths(data) if p]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = _get(data, path[:-1])
        op = draw(st.sampled_from(["delete", "replace", "insert", "rename"]))
        if op == "delete":
            del parent[path[-1]]
        elif op == "replace":
            parent[path[-1]] = draw(values)
        elif op == "insert" and isinstance(parent, dict):
            parent[draw(st.sampled_from(WORDS[:-1]) | st.text(min_size=1, max_size=8))] = draw(values)
        elif op == "rename" and isinstance(parent, dict) and isinstance(path[-1], str) and len(path[-1]) > 1:
            key = path[-1]
            i = draw(st.integers(min_value=0, max_value=len(key) - 1))
            parent[key[:i] + key[i + 1 :]] = parent.pop(key)
    return data


@st.composite
def damaged_text(draw, text):
    """Delete, duplicate or insert characters or whole lines of a valid file's text."""
    lines = text.splitlines(keepends=True)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        if not lines:
            break
        i = draw(st.integers(min_value=0, max_value=len(lines) - 1))
        op = draw(st.sampled_from(["drop_line", "dup_line", "drop_char", "insert"]))
        if op == "drop_line":
            del lines[i]
        elif op == "dup_line":
            lines.insert(i, lines[i])
        elif op == "drop_char" and lines[i]:
            j = draw(st.integers(min_value=0, max_value=len(lines[i]) - 1))
            lines[i] = lines[i][:j] + lines[i][j + 1 :]
        else:
            lines.insert(
                i, draw(st.sampled_from(["\t", "  - ", ":", "{", "[", "&a ", "*a", "!!str ", "---\n", "%"]))
            )
    return "".join(lines)


def _dump(data) -> str:
    try:
        return yaml.safe_dump(data, allow_unicode=True)
    except (yaml.YAMLError, ValueError):
        return json.dumps(data, default=str)


def _cli(*args) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(list(args))
    return rc, err.getvalue()


def _small(path: Path) -> bool:
    """Small enough to route in a test (routing samples every token)."""
    try:
        s = load_scenario(path)
    except InputError:
        return True  # route fails at load with exit 2: cheap
    return s.world_size * s.tokens_per_micro_batch <= 200_000 and s.model.num_experts <= 4096


def check_scenario_file(path: Path) -> None:
    try:
        load_scenario(path)
    except InputError as exc:
        assert str(exc)
    for command in ("check", "params") + (("route",) if _small(path) else ()):
        rc, err = _cli(command, str(path))
        assert rc in (0, 2), (command, path.read_bytes()[:2000], err)
        assert "Traceback" not in err and "internal error" not in err
        if rc == 2:
            assert err.startswith("moesim: error: ")


FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


@FUZZ
@given(data=st.data())
def test_mutated_scenarios_load_or_exit_2(workdir, data):
    base = data.draw(st.sampled_from(BASES))
    path = workdir / "scenario.yaml"
    path.write_text(_dump(data.draw(mutated(base))))
    check_scenario_file(path)


@FUZZ
@given(data=st.data())
def test_damaged_scenario_text_loads_or_exits_2(workdir, data):
    text = data.draw(damaged_text(_dump(data.draw(st.sampled_from(BASES)))))
    path = workdir / "damaged.yaml"
    path.write_text(text)
    check_scenario_file(path)


@settings(FUZZ, max_examples=40)
@given(
    blob=st.one_of(
        st.binary(max_size=200), st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass"))
    )
)
def test_random_bytes_exit_2(workdir, blob):
    path = workdir / "junk.yaml"
    path.write_bytes(blob)
    for command in ("check", "params", "route"):
        rc, err = _cli(command, str(path))
        assert rc == 2, (command, blob, err)


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_mutated_topologies_load_or_exit_2(workdir, data):
    topo = workdir / "topo.yaml"
    topo.write_text(_dump(data.draw(mutated(TOPOLOGY))))
    with contextlib.suppress(InputError):
        load_topology(str(topo))
    scen = copy.deepcopy(FAULTY)
    scen["cluster"]["topology"] = str(topo)
    path = workdir / "with-topo.yaml"
    path.write_text(_dump(scen))
    check_scenario_file(path)


@settings(FUZZ, max_examples=40)
@given(data=st.data())
def test_mutated_hf_configs_load_or_exit_2(workdir, data):
    cfg = data.draw(mutated(HF_CONFIG))
    path = workdir / "config.json"
    try:
        path.write_text(json.dumps(cfg, allow_nan=True))
    except (TypeError, ValueError):
        path.write_text(str(cfg))
    with contextlib.suppress(InputError):
        model_fields_from_hf(path)
    rc, err = _cli("params", str(path))
    assert rc in (0, 2), (cfg, err)
    scen = copy.deepcopy(BASES[0])
    scen["model"] = {"hf_config": str(path)}
    scen["parallelism"] = {"ep": 1}
    spath = workdir / "hf-scenario.yaml"
    spath.write_text(_dump(scen))
    for command in ("check", "params"):
        rc, err = _cli(command, str(spath))
        assert rc in (0, 2), (command, cfg, err)
