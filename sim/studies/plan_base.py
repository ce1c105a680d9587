"""What ``moesim plan`` plans from: the model (a HuggingFace config or a scenario), the cluster and the
batch turned into one base scenario, and each candidate of :mod:`sim.studies.plan_space` turned into
a checked scenario with its memory.

A scenario given as ``--model`` (a validation/published entry included) lends everything but its
layout: precision, framework, routing, dispatcher, overlap, calibration, its batch when ``--global-batch``
and ``--seq`` are not given, and its embedding/loss accounting in the pipeline split. A config.json
gets Megatron-Core defaults: the distributed optimizer, bf16, dropless routing with uniform gate
scores, direct all-to-alls. Candidates are the base with the candidate's fields replaced, checked by
the schema's section models and :meth:`Scenario.check_layout`: the same checks as a scenario file,
without reading the topology again for each of thousands of candidates.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.api import scenario_from_dict
from sim.errors import InputError
from sim.inputs.scenario import Scenario
from sim.inputs.sections import CollectivesConfig, ParallelismConfig, RoutingConfig, TrainingConfig
from sim.inputs.yamlio import validate_model
from sim.studies.plan_space import Candidate, ModelShape, Space, Split

#: global batch (sequences) when neither --global-batch nor a scenario gives one
DEFAULT_GLOBAL_BATCH = 1024
DEFAULT_SEQ_LEN = 4096
#: layout fields every candidate sets (a scenario's own values are dropped from the base)
_LAYOUT = ("tp", "cp", "pp", "vpp", "dp", "ep", "etp", "pp_schedule", "first_stage_layers", "last_stage_layers",
           "embedding_as_layer", "loss_as_layer", "pipeline_layout")  # fmt: skip


@dataclass
class PlanBase:
    """The base scenario of a plan, the space to search and what identifies the plan in its log."""

    scenario: Scenario  # the base: every knob but the layout, with a trivial valid layout
    space: Space
    model_file: str
    model_sha256: str
    options: list[str]  # the plan's inputs as path=value strings (the log's "set")
    headroom_GiB: float = 0.0  # memory per GPU kept free beyond the memory model's peak

    @property
    def shape(self) -> ModelShape:
        return ModelShape.of(self.scenario.model)


def is_hf_config(path: Path, text: str) -> bool:
    """A ``.json`` suffix, or text that opens with ``{`` (as ``moesim params`` decides)."""
    return path.suffix.lower() == ".json" or text.lstrip().startswith("{")


def _model_input(path: Path) -> tuple[dict[str, Any], Path, bool]:
    """(scenario mapping with the model inline, folder its paths resolve against, is a scenario)."""
    from sim.inputs.hfconfig import model_fields_from_hf
    from sim.inputs.yamlio import load_yaml_mapping, read_text

    if not path.is_file():
        raise InputError(f"'{path}' is not a file; give a HuggingFace config.json or a scenario YAML", field="--model")
    text = read_text(path, "model file")
    try:
        if is_hf_config(path, text):
            return {"model": model_fields_from_hf(path)}, Path.cwd(), False
        data = load_yaml_mapping(path, "scenario file")
    except InputError as exc:
        raise InputError(f"'{path}' is neither a HuggingFace config.json nor a scenario YAML: {exc}",
                         field="--model") from None  # fmt: skip
    if isinstance(data.get("scenario"), dict) and "measured" in data:  # a validation/published entry
        data = dict(data["scenario"])
    if not isinstance(data.get("model"), dict) or not isinstance(data.get("training", {}), dict):
        raise InputError(f"'{path}' is neither a HuggingFace config.json nor a scenario YAML (no model: "
                         "section)", field="--model")  # fmt: skip
    base_dir = path.resolve().parent
    model = dict(data["model"])
    if model.get("hf_config") is not None:
        hf = Path(str(model.pop("hf_config")))
        model = {**model_fields_from_hf(hf if hf.is_absolute() else base_dir / hf), **model}
    return {**data, "model": model}, base_dir, True


def _topology(name: str):
    from sim.inputs.topology import load_topology

    path = Path(name)
    name = str(path.resolve()) if path.is_file() else name
    try:
        return name, load_topology(name, Path.cwd())
    except InputError as exc:
        raise InputError(str(exc), field="--topology") from None


def _choices(given: tuple[str, ...] | None, default: str, allowed: tuple[str, ...] | None, option: str) -> tuple[str, ...]:
    values = given or (default,)
    if allowed is not None:
        bad = [v for v in values if v not in allowed]
        if bad:
            raise InputError(f"'{bad[0]}' is not one of {', '.join(allowed)}", field=option)
    if len(set(values)) != len(values):
        raise InputError("repeats a value", field=option)
    return tuple(values)


def build_base(model: str | Path, topology: str, gpus: int, *, global_batch: int | None = None,
               seq_len: int | None = None, dtype: str | None = None, frameworks: tuple[str, ...] | None = None,
               dispatchers: tuple[str, ...] | None = None, policies: tuple[str, ...] | None = None,
               recomputes: tuple[str, ...] | None = None, headroom_GiB: float = 0.0) -> PlanBase:  # fmt: skip
    """The base scenario and search space of a plan (bad input: :class:`InputError` naming the option)."""
    from sim.inputs.sections import parse_policy
    from sim.studies.plan_space import DISPATCHERS, FRAMEWORKS, RECOMPUTES

    path = Path(model)
    data, base_dir, is_scenario = _model_input(path)
    topo_name, topo = _topology(topology)
    gpn = topo.node.gpus_per_node
    if gpus < 1 or gpus % gpn:
        raise InputError(f"must be a positive multiple of the {gpn} GPUs of a {topo.name} node, got {gpus}",
                         field="--gpus")  # fmt: skip
    t = dict(data.get("training") or {})
    par = {k: v for k, v in (data.get("parallelism") or {}).items() if k not in _LAYOUT}
    routing = dict(data.get("routing") or {"generator": "uniform", "dispatch": "dropless", "capacity_factor": None})
    coll = dict(data.get("collectives") or {})
    given = data.get("parallelism") or {}
    split = Split(bool(given.get("embedding_as_layer", False)), bool(given.get("loss_as_layer", False)))
    if global_batch is None and is_scenario:
        global_batch = t.get("global_batch_size") or _scenario_batch(data, base_dir)
    global_batch = global_batch or DEFAULT_GLOBAL_BATCH
    if global_batch < 1:
        raise InputError(f"must be at least 1, got {global_batch}", field="--global-batch")
    seq = seq_len or t.get("seq_len") or DEFAULT_SEQ_LEN
    if seq < 1:
        raise InputError(f"must be at least 1, got {seq}", field="--seq")
    fw = _choices(frameworks, t.get("framework", "megatron" if not is_scenario else "deepspeed"), FRAMEWORKS,
                  "--framework")  # fmt: skip
    disp = _choices(dispatchers, coll.get("all_to_all", "direct"), DISPATCHERS, "--dispatcher")
    pol_default = validate_model(RoutingConfig, routing, str(path)).policy_string if routing.get("policy") else "topk"
    pols = _choices(policies, pol_default, None, "--policy")
    for p in pols:
        try:
            parse_policy(p)
        except ValueError as exc:
            raise InputError(str(exc), field="--policy") from None
    rec = _choices(recomputes, "none", RECOMPUTES, "--recompute") if recomputes else RECOMPUTES
    if not 0 <= headroom_GiB < topo.gpu.hbm_GiB:
        raise InputError(f"must be at least 0 and below the GPU's {topo.gpu.hbm_GiB:g} GiB, got {headroom_GiB:g}",
                         field="--headroom")  # fmt: skip
    t.update({"micro_batch_size": 1, "grad_accum_steps": 1, "global_batch_size": None, "seq_len": seq,
              "framework": fw[0]})  # fmt: skip
    # recompute is searched whole: none / selective (layernorm + moe_act) / full of every layer
    t.pop("recompute_num_layers", None)
    t.pop("recompute_modules", None)
    if dtype:
        t["dtype"] = dtype
    if not is_scenario:
        par.setdefault("zero_stage", 1)
    routing.update({"policy": "topk", "max_groups": None})
    base = {**data, "name": f"plan-{data['model'].get('name', path.stem)}".replace("/", "-"),
            "cluster": {"topology": topo_name, "nodes": gpus // gpn}, "parallelism": par, "training": t,
            "routing": routing, "collectives": coll}  # fmt: skip
    try:
        scenario = scenario_from_dict(base, source=str(path), base_dir=base_dir)
    except InputError as exc:
        raise InputError(f"the plan's base scenario is not valid: {exc}", field="--model") from None
    space = Space(gpus, gpn, global_batch, seq, rec, disp, fw, pols, split)
    options = [f"plan.topology={topo_name}", f"plan.gpus={gpus}", f"training.global_batch_size={global_batch}",
               f"training.seq_len={seq}", f"training.dtype={scenario.training.dtype}",
               f"plan.frameworks={','.join(fw)}", f"plan.dispatchers={','.join(disp)}", f"plan.policies={','.join(pols)}",
               f"plan.recomputes={','.join(rec)}", f"plan.headroom_GiB={headroom_GiB:g}"]  # fmt: skip
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return PlanBase(scenario, space, str(path), digest, options, headroom_GiB)


def _scenario_batch(data: dict[str, Any], base_dir: Path) -> int | None:
    """The global batch a scenario without ``global_batch_size`` implies (micro x accumulation x dp)."""
    try:
        return scenario_from_dict(copy.deepcopy(data), base_dir=base_dir).global_batch_size
    except InputError:
        return None


def candidate_scenario(base: PlanBase, c: Candidate) -> Scenario:
    """The base with ``c``'s fields, checked as a scenario file would be (raises :class:`InputError`)."""
    s = base.scenario
    o = c.overrides()
    sections: dict[str, dict[str, Any]] = {"parallelism": {}, "training": {}, "collectives": {}, "routing": {}}
    for path, value in o.items():
        sec, key = path.split(".", 1)
        sections[sec][key] = value
    sections["training"]["global_batch_size"] = c.micro_batch_size * c.grad_accum_steps * c.dp
    sections["routing"]["max_groups"] = None
    built = {}
    for sec, cls in (("parallelism", ParallelismConfig), ("training", TrainingConfig),
                     ("collectives", CollectivesConfig), ("routing", RoutingConfig)):  # fmt: skip
        try:
            built[sec] = validate_model(cls, {**getattr(s, sec).model_dump(), **sections[sec]}, s.source)
        except InputError as exc:
            exc.message = f"{sec}.{exc.message}"
            raise
    out = s.model_copy(update=built)
    out.check_layout()
    return out


def memory_record(s: Scenario) -> dict[str, Any]:
    """The ``memory`` record ``simulate`` reports: per GPU for DeepSpeed data + expert layouts, else per
    pipeline stage."""
    from sim.model.memory import memory_per_gpu, zero_memory_applies
    from sim.model.stage_memory import stage_memory_record

    if zero_memory_applies(s):
        return memory_per_gpu(s).as_dict()
    return stage_memory_record(s)


def fits(memory: dict[str, Any], headroom_GiB: float = 0.0) -> bool:
    """Whether a ``memory`` record fits the GPU with ``headroom_GiB`` kept free."""
    return bool(memory["fits"]) and memory["peak_GiB_per_gpu"] <= memory["capacity_GiB"] - headroom_GiB


def states_exceed(s: Scenario, headroom_GiB: float = 0.0) -> bool:
    """Whether some pipeline stage's weights, gradients and optimizer states alone exceed the GPU's
    memory less ``headroom_GiB`` (then no micro-batch size or recompute makes the layout fit)."""
    from sim.model.memory import GiB, memory_per_gpu, zero_memory_applies
    from sim.model.stage_memory import memory_per_stage

    stages = [memory_per_gpu(s)] if zero_memory_applies(s) else memory_per_stage(s)
    return any(b.weights + b.gradients + b.optimizer_states > (b.capacity_GiB - headroom_GiB) * GiB for b in stages)


__all__ = ["DEFAULT_GLOBAL_BATCH", "DEFAULT_SEQ_LEN", "PlanBase", "build_base", "candidate_scenario", "fits", "is_hf_config",
           "memory_record", "states_exceed"]
