"""``moesim params SCEN_OR_HF_CONFIG_JSON``: parameter counts, bytes per dtype and, for a scenario,
memory per GPU. A ``.json`` file (or one whose text starts with ``{``) is read as a HuggingFace
config; anything else as a scenario YAML. ``--set model.FIELD=VALUE`` works on both."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sim.api import load_scenario
from sim.cli.common import add_json_argument, add_set_argument
from sim.errors import InputError
from sim.inputs.scenario import ModelConfig, Scenario
from sim.inputs.scenario_file import parse_override
from sim.inputs.yamlio import read_text, validate_model
from sim.ioutil import write_json

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", metavar="SCEN_OR_HF_CONFIG_JSON", help="scenario YAML or HuggingFace config.json"
    )
    add_set_argument(parser)
    add_json_argument(parser)


def is_hf_config(path: Path) -> bool:
    """A ``.json`` suffix, or text that opens with ``{`` (YAML scenarios open with keys or comments)."""
    if path.suffix.lower() == ".json":
        return True
    return read_text(path, "input file").lstrip().startswith("{")


def model_from_hf(path: Path, overrides: list[str]) -> ModelConfig:
    """A ModelConfig from a config.json, with ``--set model.FIELD=VALUE`` overrides applied."""
    from sim.inputs.hfconfig import model_fields_from_hf

    fields = model_fields_from_hf(path)
    for text in overrides:
        key, value = parse_override(text)
        name = key.removeprefix("model.")
        if not key.startswith("model.") or name not in ModelConfig.model_fields:
            raise InputError(
                f"'{key}': with a config.json only model.<field> overrides apply, e.g. model.num_experts=64",
                field="--set",
            )
        fields[name] = value
    return validate_model(ModelConfig, fields, str(path))


def params_report(model: ModelConfig) -> dict[str, Any]:
    """The parameter part of the JSON result."""
    from sim.model.flops import matmul_active_params
    from sim.model.params import count_params

    counts = count_params(model)
    report: dict[str, Any] = {"model": model.name, **counts.as_dict()}
    report["matmul_active"] = matmul_active_params(model)
    report["bytes"] = {
        f"{dtype}_{which}": getattr(counts, which) * size
        for dtype, size in DTYPE_BYTES.items()
        for which in ("total", "active")
    }
    return report


def _units(n: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def print_table(report: dict[str, Any], memory: dict[str, Any] | None) -> None:
    print(f"model {report['model']}  ({report['moe_layers']} MoE layers)")
    rows = [
        ("total", "total"),
        ("active per token", "active"),
        ("  in matmuls (6N)", "matmul_active"),
        ("routed experts", "expert"),
        ("  one expert", "expert_each"),
        ("shared experts", "shared_expert"),
        ("non-expert", "non_expert"),
        ("embedding + head", "embedding"),
        ("attention", "attention"),
        ("Mamba-2 mixers", "mamba"),
        ("dense FFN", "dense_ffn"),
        ("router", "router"),
        ("norms", "norms"),
        ("MTP (not in total)", "mtp"),
    ]
    for label, key in rows:
        if key == "mamba" and not report[key]:
            continue  # a transformer: no Mamba-2 row
        print(f"  {label:<22} {_units(report[key]):>10}  ({report[key]:,})")
    print("  bytes:  " + "  ".join(f"{k} {report['bytes'][k] / 1e9:.2f} GB" for k in sorted(report["bytes"])))
    if memory is None:
        return
    print("memory per GPU (GiB)")
    for key in ("weights_GiB", "gradients_GiB", "optimizer_GiB", "activations_GiB", "comm_buffers_GiB"):
        print(f"  {key.removesuffix('_GiB'):<22} {memory[key]:10.2f}")
    verdict = "fits" if memory["fits"] else "DOES NOT FIT"
    print(f"  {'peak':<22} {memory['peak_GiB_per_gpu']:10.2f}  of {memory['capacity_GiB']:.1f}: {verdict}")
    print(f"  {'host per node':<22} {memory['host_GiB_per_node']:10.2f}")


def scenario_report(s: Scenario) -> dict[str, Any]:
    from sim.model.memory import memory_per_gpu

    mem = memory_per_gpu(s).as_dict()
    return {
        "scenario": s.name,
        "layout": {
            "world_size": s.world_size,
            "dp": s.dp,
            "ep": s.ep,
            "edp": s.edp,
            "zero_stage": s.parallelism.zero_stage,
        },
        "memory": mem,
    }


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    memory = None
    if is_hf_config(path):
        report = params_report(model_from_hf(path, args.overrides))
    else:
        s = load_scenario(path, args.overrides)
        report = params_report(s.model)
        extra = scenario_report(s)
        report.update(extra)
        memory = extra["memory"]
    if args.json:
        write_json(args.json, report)
    else:
        print_table(report, memory)
    return 0
