"""Collectives measured the way nccl-tests measures them, in simulation: one fresh run per size over
every rank of a cluster, reported as nccl-tests' rows (``algbw``, ``busbw``; doc/PERFORMANCE.md).
``moesim collective`` prints them and ``moesim calibrate`` fits link figures through them."""

from __future__ import annotations

import simpy

from sim.hardware.alltoall_links import for_all_to_all
from sim.hardware.cluster import Cluster
from sim.network.closed_form import bandwidths_GBps, estimate_time_s
from sim.network.collectives import collective_dag
from sim.network.dag import run_dag
from sim.network.flows import Network


def measure(cluster: Cluster, kind: str, algo: str, sizes: list[int]) -> list[dict]:
    """One fresh simulation per size; rows of nccl-tests figures plus the analytic estimate. An
    all-to-all runs on the cluster's all-to-all view (:func:`~sim.hardware.alltoall_links.for_all_to_all`)."""
    if kind == "all_to_all":
        cluster = for_all_to_all(cluster)
    group = list(range(cluster.world_size))
    rows = []
    for size in sizes:
        dag = collective_dag(cluster, kind, group, float(size), algo)
        env = simpy.Environment()
        handle = run_dag(Network(env, cluster), group, dag)
        env.run()
        algbw, busbw = bandwidths_GBps(kind, len(group), size, handle.time_s)
        rows.append(
            {
                "bytes": size,
                "time_s": handle.time_s,
                "algbw_GBps": algbw,
                "busbw_GBps": busbw,
                "estimate_time_s": estimate_time_s(cluster, dag),
            }
        )
    return rows


__all__ = ["measure"]
