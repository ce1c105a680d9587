"""The Python API for notebooks and scripts: load a scenario, simulate a step, read a typed result.

    >>> from sim import load_scenario, simulate
    >>> s = load_scenario("scenarios/128gpu.yaml", ["cluster.nodes=32"])
    >>> r = simulate(s)
    >>> r.step_time_s, r.breakdown_s["a2a"], r.memory["fits"]

:func:`load_scenario` reads and checks a scenario file (schema, layout, and fault targets against
the cluster graph; an :class:`~sim.errors.InputError` names the file and the field).
:func:`simulate` runs one training step and returns a :class:`StepResult`, whose :meth:`~StepResult.to_dict`
is exactly what ``moesim simulate --json`` writes. The ``moesim`` command line is a thin layer over
these functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sim.errors import InputError
from sim.hardware.faults import check_faults
from sim.inputs.scenario import Scenario
from sim.inputs.scenario_file import parse_scenario, read_scenario


def _checked(scenario: Scenario) -> Scenario:
    if scenario.faults.any:
        try:
            check_faults(scenario)
        except InputError as exc:
            raise (exc.with_file(scenario.source) if scenario.source else exc) from None
    return scenario


def load_scenario(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read a scenario YAML, apply ``--set``-style ``overrides`` (``"cluster.nodes=32"``), resolve its
    HF config and topology, and check it: schema, layout, and fault targets against the cluster."""
    return _checked(read_scenario(path, overrides))


def scenario_from_dict(data: dict[str, Any], source: str | None = None, base_dir: Path | None = None) -> Scenario:
    """:func:`load_scenario` for a mapping already in memory (``source`` names it in messages;
    relative paths in it resolve against ``base_dir``, default the current directory)."""
    return _checked(parse_scenario(data, source=source, base_dir=base_dir))


@dataclass(frozen=True)
class StepResult:
    """One simulated training step. The attributes are the headline figures (seconds, tokens/s, a
    fraction for ``mfu``); :meth:`to_dict` is the full JSON record of ``moesim simulate --json``."""

    scenario: str
    num_gpus: int
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    breakdown_s: dict[str, float]
    traffic: dict[str, Any]
    memory: dict[str, Any]
    params: dict[str, Any]
    layout: dict[str, Any]
    data: dict[str, Any] = field(repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepResult:
        return cls(
            scenario=data["scenario"], num_gpus=data["num_gpus"], step_time_s=data["step_time_s"],
            tokens_per_s=data["tokens_per_s"], tokens_per_s_per_gpu=data["tokens_per_s_per_gpu"],
            mfu=data["mfu"], breakdown_s=dict(data["breakdown_s"]), traffic=dict(data["traffic"]),
            memory=dict(data["memory"]), params=dict(data["params"]), layout=dict(data["layout"]), data=data,
        )  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        """The JSON record (every key of ``moesim simulate --json``)."""
        return {k: v for k, v in self.data.items() if not k.startswith("_")}

    @property
    def spans(self) -> list:
        """Per-rank spans (:class:`sim.engine.spans.Span`) when ``trace_ranks`` was given, else []."""
        return self.data.get("_spans", [])


def simulate(
    scenario: Scenario | str | Path,
    *,
    engine: str = "des",
    comm_model: str = "auto",
    policy: str | None = None,
    trace_ranks: set[int] | None = None,
    fidelity: str = "folded",
    micro_window: bool = True,
) -> StepResult:
    """Simulate one training step of ``scenario`` (a loaded :class:`Scenario` or a YAML path).
    ``engine``: ``des`` (SimPy, every rank) or ``analytic`` (closed form); ``comm_model``: ``auto``,
    ``flow`` or ``ps``; ``policy`` overrides ``routing.policy``; ``trace_ranks`` keeps those ranks'
    spans (:attr:`StepResult.spans`); ``fidelity``: ``folded`` (the DES follows the lanes that can
    set the pace, and a steady-state window of the micro-batches) or ``full`` (every rank and every
    micro-batch); ``micro_window=False``: the folded fidelity simulates every micro-batch."""
    from sim.engine.simulate import simulate as simulate_step

    s = scenario if isinstance(scenario, Scenario) else load_scenario(scenario)
    return StepResult.from_dict(simulate_step(s, engine=engine, comm_model=comm_model, policy=policy,
                                              trace_ranks=trace_ranks, fidelity=fidelity,
                                              micro_window=micro_window))  # fmt: skip


__all__ = ["Scenario", "StepResult", "load_scenario", "scenario_from_dict", "simulate"]
