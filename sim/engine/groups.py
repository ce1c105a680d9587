"""Vectorised compute streams: one SimPy process per EP group carries the clocks of its ranks.

Used with the ``ps`` comm model, where an all-to-all's per-rank end times are known at its launch.
Between all-to-alls the ranks of an EP group interact with nobody (their gradient buckets are
handed to their own comm streams at their own times), so one process can advance all their clocks
as a vector: ``t += kernel seconds``; at an all-to-all the group launches at ``max(t)`` (its last
member's arrival, exactly as the per-rank processes of :mod:`sim.engine.des` meet), every rank's wait
is ``launch - t`` and its clock becomes ``launch + its part``. Same numbers as one process per
rank, with one SimPy event per group and all-to-all instead of one per rank.
"""

from __future__ import annotations

import numpy as np
import simpy

from sim.frameworks.ops import AllToAll, CapacitySync, Compute, Gather, GradReady, WaitGather


def _stamp(env: simpy.Environment, ev: simpy.Event, times: np.ndarray, i: int) -> None:
    """Record in ``times[i]`` when ``ev`` fires."""

    def cb(_e):
        times[i] = env.now

    if ev.processed:
        times[i] = env.now
    else:
        ev.callbacks.append(cb)


def _block(env: simpy.Environment, eng, ranks: list[int], t: np.ndarray, start):
    """Each rank of ``ranks`` calls ``start(rank)`` (its comm event or events) at its own time
    ``t[i]`` and waits for them; returns when each rank's wait ended (``yield from`` it)."""
    done = np.array(t)
    evs = []
    for i, r in enumerate(ranks):
        holder = env.event()
        evs.append(holder)

        def fire(r=r, holder=holder):
            got = start(r)  # one event, or a list of them (possibly empty)
            if isinstance(got, list):
                got = env.all_of(got) if got else env.timeout(0)
            got.callbacks.append(lambda _e: holder.succeed())

        eng._at(float(t[i]), fire)
        _stamp(env, holder, done, i)
    yield env.all_of(evs)
    return done


def group_proc(eng, gid: int):
    """Compute streams of EP group ``gid`` (see the module docstring)."""
    env, key, ep = eng.env, eng.key, eng.ep
    lo, hi = gid * ep, (gid + 1) * ep
    ranks = list(range(lo, hi))
    traced = [r for r in ranks if r in eng.trace]
    t = np.full(ep, env.now)
    accs = {r: [0.0, 0.0] for r in ranks}
    seqs = {r: [0, 0] for r in ranks}
    gathers: dict[tuple, tuple[list[simpy.Event], np.ndarray]] = {}
    for idx, op in enumerate(eng.sched.ops):
        if isinstance(op, Compute):
            for r in traced:
                tt = float(t[r - lo])
                for i, name in enumerate(op.names):
                    d = float(op.durs[i, r])
                    eng._span(r, name, tt, tt + d, phase=op.phase, layer=op.layer, micro=op.micro,
                              flops=float(op.flops[i, r]))  # fmt: skip
                    tt += d
            t = t + eng._total_arr[idx][lo:hi]
        elif isinstance(op, AllToAll):
            fin = yield eng._arrive_group(idx, op, gid, t)
            start = eng._launched[(idx, gid)]
            key["imbalance_wait"][lo:hi] += start - t
            key["a2a"][lo:hi] += fin
            for r in traced:
                eng._span(r, "imbalance_wait", float(t[r - lo]), start, layer=op.layer, micro=op.micro)
                eng._span(r, op.name, start, start + float(fin[r - lo]), phase=op.phase, layer=op.layer,
                          micro=op.micro)  # fmt: skip
            t = start + fin
        elif isinstance(op, CapacitySync):
            done = yield from _block(env, eng, ranks, t, lambda r, op=op, idx=idx: eng._capacity_sync(idx, op, r))
            key["exposed_comm"][lo:hi] += done - t
            for r in traced:
                eng._span(r, "capacity_sync_wait", float(t[r - lo]), float(done[r - lo]), phase=op.phase,
                          layer=op.layer, micro=op.micro)  # fmt: skip
            t = np.maximum(t, done)
        elif isinstance(op, GradReady):
            if op.blocking:
                done = yield from _block(env, eng, ranks, t, lambda r, op=op: eng._grads(r, op, accs[r], seqs[r]))
                key["exposed_comm"][lo:hi] += done - t
                for r in traced:
                    eng._span(r, "grad_sync_wait", float(t[r - lo]), float(done[r - lo]))
                t = np.maximum(t, done)
            else:
                for i, r in enumerate(ranks):
                    eng._at(float(t[i]), lambda r=r, op=op: eng._grads(r, op, accs[r], seqs[r]))
        elif isinstance(op, Gather):
            holders = [env.event() for _ in ranks]
            when = np.zeros(ep)
            for i, r in enumerate(ranks):

                def start_g(r=r, i=i, op=op, holders=holders):
                    eng._gather(r, op.key, op.nonexpert, op.expert).callbacks.append(
                        lambda _e: holders[i].succeed()
                    )

                eng._at(float(t[i]), start_g)
                _stamp(env, holders[i], when, i)
            gathers[op.key] = (holders, when)
        elif isinstance(op, WaitGather):
            holders, when = gathers.pop(op.key)
            yield env.all_of(holders)
            done = np.maximum(t, when)
            key["exposed_comm"][lo:hi] += done - t
            for r in traced:
                eng._span(r, "param_gather_wait", float(t[r - lo]), float(done[r - lo]))
            t = done
    tails = []
    for i, r in enumerate(ranks):
        key["compute"][r] = float(eng._compute_total[r])
        key["exposed_comm"][r] += float(eng._wake_total[r])
        tails.append(env.process(_rank_tail(eng, r, float(t[i]))))
    yield env.all_of(tails)


def _rank_tail(eng, rank: int, t: float):
    if t > eng.env.now:
        yield eng.env.timeout(t - eng.env.now)
    yield from eng._tail(rank)
    eng.end[rank] = eng.env.now


__all__ = ["group_proc"]
