"""moesim: a discrete-event simulator of distributed Mixture-of-Experts training.

``from sim import load_scenario, simulate`` is the Python API (:mod:`sim.api`). Importing :mod:`sim`
stays light: the API loads on first use, and ``sim`` never imports torch or deepspeed (a test checks it).
"""

__version__ = "0.1.0"

_API = ("Scenario", "StepResult", "load_scenario", "scenario_from_dict", "simulate")


def __getattr__(name: str):
    if name in _API:
        import importlib

        return getattr(importlib.import_module("sim.api"), name)
    raise AttributeError(f"module 'sim' has no attribute {name!r}")


__all__ = ["__version__", *_API]
