"""Closed-form step time (``moesim simulate --engine analytic``): no SimPy, no barriers.

Mean-field: every compute op takes its mean over ranks (so the most loaded rank does not set the
pace, which is exactly what the DES adds); every all-to-all takes the alpha-beta estimate of the
EP-group-mean byte matrix on one group alone (busiest link's serialisation + latency chain,
:func:`~sim.network.closed_form.estimate_time_s`; no contention between groups); gradient buckets
and ZeRO-3 gathers run on a comm-stream clock (a bucket starts when it is full and the stream is
free), and what the compute clock must wait for is exposed. Optimizer and ZeRO gathers as the engine times them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.frameworks.ops import AllToAll, CapacitySync, Compute, Gather, GradReady, Schedule, WaitGather
from sim.hardware.alltoall_links import for_all_to_all
from sim.network.closed_form import estimate_time_s
from sim.network.collectives import all_to_all_dag
from sim.network.comm import group_node_bytes, reduction_model


def analytic_step(s, sched: Schedule, plan, cluster, cost) -> dict[str, Any]:
    bpe = sched.grad_bytes_per_param
    d = s.model.hidden_size
    group = s.ep_groups()[0]
    groups = s.ep_groups()
    hier = s.collectives.all_to_all == "hierarchical"
    a2a_cache: dict[tuple, float] = {}
    red_cache: dict[tuple, float] = {}
    sent = inter = 0.0

    def a2a_time(op: AllToAll) -> float:
        nonlocal sent, inter
        key = (op.moe, op.micro, op.direction)
        if key not in a2a_cache:
            pair_w = plan.dispatch_bytes(op.moe, op.micro, d, bpe).astype(np.float64)
            blocks = [pair_w[np.ix_(g, g)] for g in groups]
            pair = np.mean(blocks, axis=0)
            nb = None
            if hier and plan.padded is None:
                nm = plan.dispatch_node_tokens(op.moe, op.micro) * float(d * bpe)
                nb = np.mean([group_node_bytes(cluster, g, nm) for g in groups], axis=0)
            view = for_all_to_all(cluster)  # NVLink at the GPU's all-to-all figure
            dag = all_to_all_dag(view, group, pair, s.collectives.all_to_all, nb, op.direction)
            a2a_cache[key] = estimate_time_s(view, dag)
            off = pair.copy()
            np.fill_diagonal(off, 0.0)
            node = np.asarray(group) // cluster.gpus_per_node
            cross = node[:, None] != node[None, :]
            a2a_cache[key + ("bytes",)] = (off.sum() / len(group), (off * cross).sum() / len(group))
        b = a2a_cache[key + ("bytes",)]
        sent += b[0]
        inter += b[1]
        return a2a_cache[key]

    def red_time(kind: str, g: list[int], nbytes: float) -> float:
        if len(g) <= 1 or nbytes <= 0:
            return 0.0
        key = (kind, tuple(g))
        if key not in red_cache:
            red_cache[key] = reduction_model(cluster, kind, g, "ring")
        per_byte, latency, _ = red_cache[key]
        return latency + per_byte * nbytes

    compute = a2a = exposed = grad_total = 0.0
    bucket = s.collectives.reduce_bucket_elements * bpe
    acc = [0.0, 0.0]
    edp_group = s.edp_groups()[0]
    ep_group = s.ep_groups()[0]
    dp_group = list(range(s.world_size))
    clock = comm_free = 0.0  # compute-stream clock; when the comm stream is next free
    gathers: dict[tuple, float] = {}

    def on_comm(t: float) -> float:
        nonlocal comm_free, grad_total
        comm_free = max(clock, comm_free) + t
        grad_total += t
        return comm_free

    def wait_until(t_end: float) -> None:
        nonlocal clock, exposed
        if t_end > clock:
            exposed += t_end - clock
            clock = t_end

    for op in sched.ops:
        if isinstance(op, Compute):
            dt = float(op.total.mean())
            compute += dt
            clock += dt
        elif isinstance(op, AllToAll):
            t = a2a_time(op)
            a2a += t
            clock += t
        elif isinstance(op, CapacitySync):  # blocking all-reduce over the EP group, after the comm stream
            wait_until(on_comm(red_time("all_reduce", ep_group, op.nbytes)))
        elif isinstance(op, GradReady):
            acc[0] += op.nonexpert * bpe
            acc[1] += op.expert * bpe
            end = clock
            for which, g in ((0, dp_group), (1, edp_group)):
                if len(g) <= 1:
                    acc[which] = 0.0
                elif acc[which] >= bucket or (op.flush and acc[which] > 0):
                    end = on_comm(red_time(sched.grad_kind, g, acc[which]))
                    acc[which] = 0.0
            if op.blocking:
                wait_until(end)
        elif isinstance(op, Gather):
            on_comm(red_time("all_gather", dp_group, op.nonexpert * bpe))
            gathers[op.key] = on_comm(red_time("all_gather", edp_group, op.expert * bpe))
        elif isinstance(op, WaitGather):
            wait_until(gathers.pop(op.key))
    wait_until(comm_free)
    tail = sched.tail
    norm_compute = 0.0
    if tail.norm_reduce:  # the gradient norm, blocking (sim.engine.des.Engine._grad_norm)
        norm = len(tail.norm_s) * red_time("all_reduce", dp_group, 4.0)
        if len(tail.norm_s) > 1:
            norm += red_time("all_reduce", edp_group, 4.0)
        norm_compute = float(sum(np.mean(part) for part in tail.norm_s))
        exposed += norm
        grad_total += norm
    if tail.offload_bytes:
        pcie = s.topology.node.pcie_host
        hop = tail.offload_bytes / (pcie.bw_GBps * 1e9) + pcie.latency_us * 1e-6
        optimizer = 2 * hop + tail.cpu_adam_s
    else:
        optimizer = float(tail.optimizer_s.mean())
    optimizer += norm_compute
    gather = red_time("all_gather", dp_group, tail.gather_nonexpert * bpe) + red_time(
        "all_gather", edp_group, tail.gather_expert * bpe
    )
    exposed += gather
    grad_total += gather
    step = compute + a2a + exposed + optimizer
    return {
        "step_time_s": step,
        "breakdown_s": {
            "compute": compute,
            "a2a": a2a,
            "grad_sync": grad_total,
            "optimizer": optimizer,
            "exposed_comm": exposed,
            "imbalance_wait": 0.0,
        },
        "traffic_core": {"a2a_bytes": sent, "inter_node_bytes": inter},
        "simulator": {"engine": "analytic"},
    }


__all__ = ["analytic_step"]
