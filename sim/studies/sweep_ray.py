"""``moesim sweep --backend ray``: the sweep's points as Ray tasks, on a local Ray instance or on a
cluster joined with ``--address`` (``auto``, or ``ray://HOST:10001``).

Ray is the optional extra ``cluster`` (``pip install 'moesim[cluster]'``); without it the backend
exits 2 saying so. Each task gets the loaded, validated :class:`~sim.inputs.scenario.Scenario` (pickled,
topology included); the worker nodes need moesim installed, and any calibration or router-trace
file the scenario names at the same path. Results come back in completion order and go straight
into the sweep's JSONL log, so killing the driver loses only the runs in flight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sim.errors import InputError
from sim.inputs.scenario import Scenario

INSTALL_HINT = "pip install 'moesim[cluster]'"


def import_ray():
    try:
        import ray
    except ImportError:
        raise InputError(
            f"--backend ray needs Ray, which is not installed here; install it with {INSTALL_HINT} "
            "(or use --backend local)",
            field="--backend",
        ) from None
    return ray


def run_ray(
    jobs: list[tuple[int, Scenario]],
    engine: str,
    comm_model: str,
    workers: int,
    address: str | None,
    on_result: Callable[[int, dict[str, Any]], None],
    run_point: Callable[[Scenario, str, str], dict[str, Any]],
) -> None:
    """Run ``run_point(scenario, engine, comm_model)`` for each of ``jobs`` as a Ray task (one CPU
    each); a local instance gets ``workers`` CPUs."""
    ray = import_ray()
    if not jobs:
        return
    started = not ray.is_initialized()
    if started:
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if address:
            kwargs["address"] = address
        else:
            kwargs["num_cpus"] = max(1, workers)
        try:
            ray.init(**kwargs)
        except ConnectionError as exc:
            raise InputError(f"cannot reach the Ray cluster at {address!r}: {exc}", field="--address") from None
    try:
        task = ray.remote(num_cpus=1)(run_point)
        pending = {task.remote(s, engine, comm_model): i for i, s in jobs}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                on_result(pending.pop(ref), ray.get(ref))
    except BaseException:
        for ref in list(locals().get("pending", {})):
            ray.cancel(ref, force=True)
        raise
    finally:
        if started:
            ray.shutdown()


__all__ = ["INSTALL_HINT", "import_ray", "run_ray"]
