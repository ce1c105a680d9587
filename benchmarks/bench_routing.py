"""Routing speed and accuracy benchmark; writes benchmarks/results/routing.{json,md}.

Speed target (issue 3): route every MoE layer, micro-batch and rank of ``scenarios/128gpu.yaml``
(128 ranks x 4096 tokens x 8 micro-batches x 48 layers = 201M tokens, top-8 of 128) in under 1 s.
Scale (issue 28): the same at 1,024 / 8,192 / 16,384 GPUs, route + statistics, with the peak memory
of a fresh process (part of 8,192 GPUs in 60 s and 4 GiB for the whole simulation).
Accuracy: the pooled path's statistics against exact per-token sampling on a mid-size scenario.

    python benchmarks/bench_routing.py            # full run (~3 min on 2 cores)
    python benchmarks/bench_routing.py --quick    # fewer repeats
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sim.api import load_scenario, scenario_from_dict  # noqa: E402
from sim.ioutil import atomic_write_text, dumps_json  # noqa: E402
from sim.routing.plan import route_scenario  # noqa: E402

MACHINE = "2-core x86_64 CI VM, Python 3.11"
TARGET_S = 1.0
SCEN = ROOT / "scenarios" / "128gpu.yaml"

#: Nodes of 128gpu (8 GPUs each) for the scale rows: 1,024, 8,192 and 16,384 GPUs.
SCALE_NODES = (128, 1024, 2048)
#: The same rows measured with the routing before the compact plan (commit 964227b) by SCALE_CODE on
#: this VM within the same hour: (route s, statistics s, peak RSS GiB).
SCALE_BEFORE = {128: (3.83, 0.46, 0.40), 1024: (26.15, 5.74, 2.56), 2048: (54.77, 12.91, 5.02)}
#: One fresh process per row: route_scenario and summary() timed, peak RSS from getrusage (KiB on Linux).
SCALE_CODE = """
import json, resource, sys, time
from sim.api import load_scenario
from sim.routing.plan import route_scenario
s = load_scenario(sys.argv[1], ["cluster.nodes=" + sys.argv[2]])
c0, t0 = time.process_time(), time.perf_counter()
plan = route_scenario(s)
t1 = time.perf_counter()
plan.summary()
t2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"route_s": t1 - t0, "summary_s": t2 - t1, "cpu_s": c2 - c0, "method": plan.method,
                  "kept_wide": plan.arrays.kept is not None,
                  "peak_rss_GiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
"""

SPEED_CASES = [
    ("topk (as shipped)", [], None),
    ("node_limited:M=2", [], "node_limited:M=2"),
    ("node_limited:M=1", [], "node_limited:M=1"),
    ("device_limited:M=2", [], "device_limited:M=2"),
    ("capacity 1.25, padded", ["routing.capacity_factor=1.25", "routing.dispatch=capacity_padded"], None),
    ("drift 0.3 (48 distinct layers)", ["routing.drift=0.3"], None),
    ("sequence_correlation 0.3", ["routing.sequence_correlation=0.3"], None),
    (
        "aux-free balancing, 100 steps",
        ["routing.aux_free_balancing.enabled=true", "routing.aux_free_balancing.steps=100"],
        None,
    ),
]

ACCURACY_KEYS = (
    "local_fraction",
    "inter_node_fraction",
    "max_over_mean_load",
    "max_over_mean_expert_load",
    "dropped_fraction",
    "retained_gate_mass",
    "mean_nodes_per_token",
    "mean_ranks_per_token",
)


def time_case(overrides: list[str], policy: str | None, repeats: int) -> dict:
    s = load_scenario(SCEN, overrides)
    times = []
    plan = None
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan = route_scenario(s, policy)
        times.append(time.perf_counter() - t0)
    assert plan is not None
    tokens = plan.num_moe_layers * plan.micro_batches * plan.layout.world * plan.tokens_per_rank
    return {
        "best_s": min(times),
        "median_s": statistics.median(times),
        "tokens_routed": tokens,
        "method": plan.method,
        "max_over_mean_load": plan.summary()["summary"]["max_over_mean_load"],
    }


def scale_case(nodes: int, repeats: int) -> dict:
    """Best of ``repeats`` fresh processes routing 128gpu on ``nodes`` nodes (wall time; its CPU time too)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = []
    for _ in range(repeats):
        out = subprocess.run(
            [sys.executable, "-c", SCALE_CODE, str(SCEN), str(nodes)],
            capture_output=True, text=True, check=True, cwd=ROOT, env=env,
        )  # fmt: skip
        runs.append(json.loads(out.stdout.splitlines()[-1]))
    best = min(runs, key=lambda r: r["route_s"] + r["summary_s"])
    before = SCALE_BEFORE.get(nodes)
    return {
        "gpus": nodes * 8,
        **best,
        "peak_rss_GiB": max(r["peak_rss_GiB"] for r in runs),
        "before": None if before is None else dict(zip(("route_s", "summary_s", "peak_rss_GiB"), before, strict=True)),
    }


def machine() -> str:
    """CPU model, cores and memory of this machine (``lscpu``, ``/proc/meminfo``), else ``platform``."""
    try:
        info = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        with open("/proc/meminfo", encoding="ascii") as fh:
            mem_kib = int(next(line for line in fh if line.startswith("MemTotal")).split()[1])
        return f"{fields['Model name'].strip()}, {fields['CPU(s)'].strip()} CPUs, {mem_kib / 2**20:.0f} GiB (KVM guest)"
    except (OSError, subprocess.CalledProcessError, KeyError, StopIteration, ValueError):
        return platform.processor() or platform.machine()


def exact_rate() -> float:
    """Seconds per million tokens of exact per-token routing at E=128, top-8 (one 128gpu layer slice)."""
    s = load_scenario(
        SCEN, ["model.num_layers=1", "training.grad_accum_steps=1", "cluster.nodes=2", "parallelism.ep=16"]
    )
    t0 = time.perf_counter()
    plan = route_scenario(s, method="exact")
    dt = time.perf_counter() - t0
    return dt / (plan.layout.world * plan.tokens_per_rank / 1e6)


def mid_scenario(**routing) -> dict:
    return {
        "cluster": {"topology": "dgx-h100", "nodes": 4, "gpus_per_node": 4},
        "model": {
            "num_layers": 4,
            "hidden_size": 64,
            "num_experts": 64,
            "top_k": 4,
            "moe_ffn_hidden_size": 32,
        },
        "parallelism": {"ep": 16},
        "training": {"micro_batch_size": 4, "seq_len": 128, "grad_accum_steps": 8},
        "routing": {
            "generator": "skewed",
            "skew": 0.5,
            "capacity_factor": None,
            "dispatch": "dropless",
            **routing,
        },
    }


ACCURACY_CASES = [
    ("topk", {}),
    ("node_limited:M=2", {"policy": "node_limited:M=2"}),
    ("capacity_factor 1.0", {"capacity_factor": 1.0}),
    ("sequence_correlation 0.3", {"sequence_correlation": 0.3}),
]


def accuracy(seeds: int) -> list[dict]:
    rows = []
    for label, routing in ACCURACY_CASES:
        for seed in range(seeds):
            s = scenario_from_dict(mid_scenario(seed=seed, **routing))
            exact = route_scenario(s, method="exact").summary()["summary"]
            pooled = route_scenario(s, method="pooled").summary()["summary"]
            rows.append(
                {
                    "case": label,
                    "seed": seed,
                    "exact": {k: exact[k] for k in ACCURACY_KEYS},
                    "pooled": {k: pooled[k] for k in ACCURACY_KEYS},
                }
            )
    return rows


def markdown(result: dict) -> str:
    lines = [
        "# Routing benchmark",
        "",
        f"Machine: {result['machine']} ({result['platform']}). Recorded by `python benchmarks/bench_routing.py`.",
        "",
        f"## Speed: every layer, micro-batch and rank of scenarios/128gpu.yaml (target < {TARGET_S:g} s)",
        "",
        "| case | method | tokens routed | best s | median s | meets target |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["speed"]:
        ok = "yes" if row["best_s"] < TARGET_S else f"no ({row['best_s'] / TARGET_S:.1f}x)"
        lines.append(
            f"| {row['case']} | {row['method']} | {row['tokens_routed']:,} | {row['best_s']:.3f} | "
            f"{row['median_s']:.3f} | {ok} |"
        )
    rate = result["exact_s_per_million_tokens"]
    lines += [
        "",
        "The target is the shipped scenario (first rows). The slowest variants spend their time on the exact",
        "pools: with `routing.drift > 0` every layer has its own popularity, so 48 pools of 4096 tokens",
        "(196k tokens routed exactly, ~3x the shared 65536-token pool) plus 48 covariance roots; aux-free",
        "balancing re-routes 8192 pool tokens once per simulated step. Timings vary by ~30 % with the",
        "load other jobs put on the 2 shared cores; best-of-5 is reported with the median.",
        "",
        f"Exact per-token routing runs at {rate:.2f} s per million tokens here (E=128, top-8), so the "
        f"{result['speed'][0]['tokens_routed'] / 1e6:.0f}M tokens of one 128gpu step would take "
        f"~{rate * result['speed'][0]['tokens_routed'] / 1e6:.0f} s exactly.",
    ]
    lines += [
        "",
        "## Scale: every layer, micro-batch and rank of 128gpu at 1,024 to 16,384 GPUs",
        "",
        f"One fresh process per row, best of {result['scale_repeats']} (wall time; CPU time of that run); peak",
        "RSS of the process (Python, numpy and the scenario included). Before: the routing of commit 964227b,",
        "measured the same way on this VM (E-wide (layers, micro, world, E) int32 counts, statistics over them).",
        "",
        "| GPUs | method | route s | statistics s | CPU s | peak RSS GiB | E-wide counts kept | before: route s | "
        "statistics s | peak RSS GiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["scale"]:
        b = row["before"] or {}
        lines.append(
            f"| {row['gpus']:,} | {row['method']} | {row['route_s']:.2f} | {row['summary_s']:.2f} | "
            f"{row['cpu_s']:.2f} | {row['peak_rss_GiB']:.2f} | {'yes' if row['kept_wide'] else 'no'} | "
            f"{b.get('route_s', float('nan')):.2f} | {b.get('summary_s', float('nan')):.2f} | "
            f"{b.get('peak_rss_GiB', float('nan')):.2f} |"
        )
    lines += [
        "",
        "The plan keeps per (layer, micro-batch, rank) world x ep arrays (copies per EP peer, rows per local",
        "expert, distinct tokens per rank and node slot) written as each layer is drawn, and per-layer sums",
        "for the statistics; E-wide counts only up to 2^26 elements (1,024 GPUs here). The cores are shared",
        "with other jobs: where the wall time exceeds the CPU time the process waited for a core; where it",
        "is below, the noise of the next layer was drawn on the other core meanwhile.",
        "",
    ]
    lines += [
        "## Accuracy: pooled path vs exact per-token sampling",
        "",
        "16 ranks on 4 nodes, EP 16, 64 experts top-4, 512 tokens per rank, 4 layers x 8 micro-batches, skew 0.5.",
        "",
        "| case | seed | statistic | exact | pooled | rel. diff |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["accuracy"]:
        for key in ACCURACY_KEYS:
            a, b = row["exact"][key], row["pooled"][key]
            rel = "" if not a else f"{100 * (b - a) / a:+.1f} %"
            lines.append(f"| {row['case']} | {row['seed']} | {key} | {a:.4f} | {b:.4f} | {rel} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, 1 accuracy seed")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="results folder")
    args = parser.parse_args()
    repeats = 1 if args.quick else 5
    route_scenario(load_scenario(SCEN))  # warm imports and caches
    speed = []
    for label, overrides, policy in SPEED_CASES:
        row = {
            "case": label,
            "overrides": overrides,
            "policy": policy,
            **time_case(overrides, policy, repeats),
        }
        print(f"{label:<34} {row['method']:<7} best {row['best_s']:.3f} s  median {row['median_s']:.3f} s")
        speed.append(row)
    scale = []
    for nodes in SCALE_NODES:
        row = scale_case(nodes, repeats=1 if args.quick else 2)
        print(f"{row['gpus']:>6} GPUs: route {row['route_s']:.2f} s, statistics {row['summary_s']:.2f} s, "
              f"CPU {row['cpu_s']:.2f} s, peak RSS {row['peak_rss_GiB']:.2f} GiB")  # fmt: skip
        scale.append(row)
    result = {
        "machine": f"{MACHINE}: {machine()}",
        "platform": f"{platform.machine()}, Python {platform.python_version()}",
        "target_s": TARGET_S,
        "speed": speed,
        "scale_repeats": 1 if args.quick else 2,
        "scale": scale,
        "exact_s_per_million_tokens": exact_rate(),
        "accuracy": accuracy(1 if args.quick else 3),
    }
    out = Path(args.out)
    atomic_write_text(out / "routing.json", dumps_json(result))
    atomic_write_text(out / "routing.md", markdown(result))
    print(f"exact path: {result['exact_s_per_million_tokens']:.2f} s per million tokens")
    print(f"wrote {out / 'routing.json'} and {out / 'routing.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
