"""A scenario from its file: ``--set`` overrides (a dotted path that must exist in the schema, a
YAML value), the HF config a ``model.hf_config`` names, validation and the topology it binds.
:func:`sim.api.load_scenario` adds the checks against the cluster graph."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from sim.errors import InputError, did_you_mean
from sim.inputs.scenario import Scenario
from sim.inputs.topology import Topology, load_topology
from sim.inputs.yamlio import _sub_model, load_yaml_mapping, validate_model


# ---- overrides -----------------------------------------------------------------------------------
def parse_override(text: str) -> tuple[str, Any]:
    """``'model.num_experts=64'`` -> ``('model.num_experts', 64)``; the value is parsed as YAML."""
    if "=" not in text:
        raise InputError(f"override '{text}' must look like path=value, e.g. cluster.nodes=32", field="--set")
    path, raw = text.split("=", 1)
    path = path.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return path, value


def apply_override(data: dict[str, Any], path: str, value: Any) -> None:
    """Set ``data[a][b]... = value`` for ``path = 'a.b...'``; the path must exist in the schema."""
    parts = path.split(".")
    cls: type[BaseModel] | None = Scenario
    node = data
    for i, part in enumerate(parts):
        assert cls is not None
        if part not in cls.model_fields:
            prefix = ".".join(parts[:i])
            allowed = sorted(cls.model_fields)
            raise InputError(
                f"unknown override path '{path}'{did_you_mean(part, allowed)}; "
                f"keys under {prefix or 'the top level'}: {', '.join(allowed)}",
                field="--set",
            )
        if i == len(parts) - 1:
            node[part] = value
            return
        sub = _sub_model(cls.model_fields[part].annotation)
        if sub is None:
            raise InputError(
                f"'{'.'.join(parts[: i + 1])}' is a value, not a section, in '{path}'", field="--set"
            )
        nxt = node.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            node[part] = nxt
        node, cls = nxt, sub


# ---- loading -------------------------------------------------------------------------------------
def read_scenario(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read, override, resolve the HF config, validate and bind the topology of a scenario file.
    The fault targets are checked against the cluster by :func:`sim.api.load_scenario`."""
    path = Path(path)
    data = load_yaml_mapping(path, "scenario file")
    if isinstance(data.get("scenario"), dict) and "measured" in data:  # a validation/published entry
        data = dict(data["scenario"])
    for text in overrides:
        key, value = parse_override(text)
        apply_override(data, key, value)
    return parse_scenario(data, source=str(path), base_dir=path.resolve().parent)


def parse_scenario(
    data: dict[str, Any], source: str | None = None, base_dir: Path | None = None
) -> Scenario:
    """Validate a scenario mapping (as read from YAML) and bind its topology (schema and layout
    checks; :func:`sim.api.scenario_from_dict` adds the checks against the cluster graph)."""
    base_dir = base_dir or Path.cwd()
    data = dict(data)
    model = data.get("model")
    hf_note = None
    if isinstance(model, dict) and model.get("hf_config") is not None:
        from sim.inputs.hfconfig import model_fields_from_hf

        hf = model["hf_config"]
        if not isinstance(hf, str) or not hf.strip():
            raise InputError(
                f"must be the path of a HuggingFace config.json, got {hf!r}",
                file=source,
                field="model.hf_config",
            )
        hf_path = Path(hf)
        if not hf_path.is_absolute():
            hf_path = base_dir / hf_path
        fields = model_fields_from_hf(hf_path)
        data["model"] = {**fields, **model}
        hf_note = str(hf_path)
    try:
        scenario = validate_model(Scenario, data, source)
    except InputError as exc:
        if hf_note and "model." in exc.message:
            exc.message += f" (model fields not set in the scenario come from {hf_note})"
        raise
    scenario._source = source
    scenario._base_dir = base_dir
    try:
        scenario._topology = _placed(load_topology(scenario.cluster.topology, base_dir), scenario)
        scenario.check_layout()
    except InputError as exc:
        raise (exc.with_file(source) if source else exc) from None
    return scenario


def _placed(topology: Topology, scenario: Scenario) -> Topology:
    """``topology`` with the job's NVLink domains (``cluster.nvlink_domain_nodes`` nodes each, no more
    than the topology joins): a job placed in part of each rack sees smaller domains."""
    want = scenario.cluster.nvlink_domain_nodes
    if want is None:
        return topology
    g = scenario.cluster.gpus_per_node or topology.node.gpus_per_node
    have = (topology.nvlink_domain_gpus or topology.node.gpus_per_node) // g
    if want > have:
        raise InputError(
            f"cluster.nvlink_domain_nodes ({want}) exceeds the nodes one NVLink domain of topology "
            f"'{topology.name}' joins ({have})",
            field="cluster.nvlink_domain_nodes",
        )
    return topology.model_copy(update={"nvlink_domain_gpus": want * g})


__all__ = ["apply_override", "parse_override", "parse_scenario", "read_scenario"]
