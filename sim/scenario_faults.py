"""The ``faults`` section of a scenario (schema only; :mod:`sim.faults` applies it to a cluster)."""

from __future__ import annotations

from pydantic import BaseModel

from sim.scenario_sections import _STRICT


class FaultsConfig(BaseModel):
    """Reserved for simulated faults (degraded/failed links, stragglers)."""

    model_config = _STRICT


__all__ = ["FaultsConfig"]
