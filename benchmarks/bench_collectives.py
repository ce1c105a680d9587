"""Wall time of the flow-level network on big all-to-alls and on EP-style all-to-allv batches.

Run: ``python benchmarks/bench_collectives.py [--out benchmarks/results/collectives]``.
Case 1: one direct all-to-all over 128, 512 and 1024 GPUs of dgx-h100 (16k, 262k, 1M flows);
targets 128 GPUs < 50 ms, 1024 GPUs < 5 s. Case 2: what the step engine issues per MoE layer
phase: 8 expert-parallel groups of 16 ranks (2 nodes each) at once, all-to-allv with uneven
sizes from skewed expert popularity, exact and with ``rel_tol`` (error vs exact reported).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
import simpy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sim.hardware.cluster import build_cluster  # noqa: E402
from sim.inputs.topology import load_topology  # noqa: E402
from sim.ioutil import atomic_write_text, write_json  # noqa: E402
from sim.network.collectives import all_to_all, all_to_all_dag, uniform_pairs  # noqa: E402
from sim.network.dag import run_dag  # noqa: E402
from sim.network.flows import Network  # noqa: E402

MACHINE = "2-core x86_64 CI VM, Python 3.11"


def big_all_to_all(nodes: int, repeats: int) -> dict:
    cluster = build_cluster(load_topology("dgx-h100"), nodes)
    group = list(range(cluster.world_size))
    walls, build, sim_time, recomputes = [], [], 0.0, 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        dag = all_to_all_dag(cluster, group, uniform_pairs(len(group), 2**30))
        t1 = time.perf_counter()
        env = simpy.Environment()
        net = Network(env, cluster)
        h = run_dag(net, group, dag)
        env.run()
        t2 = time.perf_counter()
        walls.append(t2 - t0)
        build.append(t1 - t0)
        sim_time, recomputes = h.time_s, net.recomputes
    return {
        "gpus": cluster.world_size,
        "flows": int(len(dag.src)),
        "wall_s": min(walls),
        "dag_build_s": min(build),
        "recomputes": recomputes,
        "simulated_time_s": sim_time,
    }


def ep_traffic(rng: np.random.Generator, tokens_per_rank: int = 4096, experts: int = 64, top_k: int = 8):
    """Pair bytes of one EP dispatch per group: 16 ranks x 4 experts, Zipf-ish popularity."""
    popularity = 1.0 / np.arange(1, experts + 1) ** 0.8
    popularity = rng.permutation(popularity / popularity.sum())
    pair = np.zeros((16, 16))
    for src in range(16):
        counts = rng.multinomial(tokens_per_rank * top_k, popularity)
        pair[src] = counts.reshape(16, 4).sum(axis=1) * 7168 * 2  # hidden 7168, bf16
    return pair


def ep_batch(rel_tol: float, pairs: list[np.ndarray], cluster) -> tuple[float, np.ndarray, int]:
    env = simpy.Environment()
    net = Network(env, cluster, rel_tol=rel_tol)
    t0 = time.perf_counter()
    handles = [all_to_all(net, list(range(16 * g, 16 * g + 16)), pairs[g]) for g in range(8)]
    env.run()
    wall = time.perf_counter() - t0
    return wall, np.concatenate([h.rank_time_s for h in handles]), net.recomputes


def ep_cases(tolerances: list[float], repeats: int) -> list[dict]:
    cluster = build_cluster(load_topology("dgx-h100"), 16)
    rng = np.random.default_rng(0)
    pairs = [ep_traffic(rng) for _ in range(8)]
    exact = None
    rows = []
    for tol in tolerances:
        best = None
        for _ in range(repeats):
            wall, ranks, rec = ep_batch(tol, pairs, cluster)
            best = wall if best is None else min(best, wall)
        if exact is None:
            exact = ranks
        err = np.abs(ranks - exact) / exact
        rows.append(
            {
                "rel_tol": tol,
                "flows": 8 * 16 * 15,
                "wall_ms": best * 1e3,
                "recomputes": rec,
                "makespan_s": float(ranks.max()),
                "makespan_rel_error": float(abs(ranks.max() - exact.max()) / exact.max()),
                "max_rank_rel_error": float(err.max()),
            }
        )
    return rows


def markdown(result: dict) -> str:
    lines = [
        "# Collectives benchmark",
        "",
        f"Machine: {result['machine']} ({result['platform']}). Command: `python benchmarks/bench_collectives.py`.",
        "",
        "## One direct all-to-all (dgx-h100, 1 GiB per rank)",
        "",
        "| GPUs | flows | wall s | of which DAG build s | rate recomputes | simulated s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["all_to_all"]:
        lines.append(
            f"| {r['gpus']} | {r['flows']} | {r['wall_s']:.3f} | {r['dag_build_s']:.3f} | "
            f"{r['recomputes']} | {r['simulated_time_s']:.4f} |"
        )
    lines += [
        "",
        "## EP batch: 8 groups x 16 ranks, all-to-allv with uneven sizes (dgx-h100, 16 nodes)",
        "",
        "| rel_tol | flows | wall ms | rate recomputes | makespan s | makespan error | worst rank error |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["ep"]:
        lines.append(
            f"| {r['rel_tol']:g} | {r['flows']} | {r['wall_ms']:.1f} | {r['recomputes']} | {r['makespan_s']:.6f} | "
            f"{r['makespan_rel_error']:.2%} | {r['max_rank_rel_error']:.2%} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    parser.add_argument("--nodes", default="16,64,128", help="node counts of the direct all-to-all")
    args = parser.parse_args()
    a2a = [big_all_to_all(n, repeats=3 if n <= 16 else 1) for n in map(int, args.nodes.split(","))]
    for r in a2a:
        print(f"all-to-all {r['gpus']:5d} GPUs {r['flows']:8d} flows: {r['wall_s']:.3f} s")
    ep = ep_cases([0.0, 0.01, 0.02, 0.05, 0.1], repeats=3)
    for r in ep:
        print(
            f"EP 8x16 rel_tol={r['rel_tol']:<5g} {r['wall_ms']:8.1f} ms, {r['recomputes']} recomputes, "
            f"makespan error {r['makespan_rel_error']:.2%}, worst rank {r['max_rank_rel_error']:.2%}"
        )
    result = {
        "machine": MACHINE,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "all_to_all": a2a,
        "ep": ep,
    }
    if args.out:
        write_json(args.out + ".json", result)
        atomic_write_text(args.out + ".md", markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
