"""Routing speed and accuracy benchmark; writes benchmarks/results/routing.{json,md}.

Speed target (issue 3): route every MoE layer, micro-batch and rank of ``scenarios/128gpu.yaml``
(128 ranks x 4096 tokens x 8 micro-batches x 48 layers = 201M tokens, top-8 of 128) in under 1 s.
Accuracy: the pooled path's statistics against exact per-token sampling on a mid-size scenario.

    python benchmarks/bench_routing.py            # full run (~1-2 min on 2 cores)
    python benchmarks/bench_routing.py --quick    # fewer repeats
"""

from __future__ import annotations

import argparse
import platform
import statistics
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
        "The target is the shipped scenario (first rows). Where a variant misses, the cause is the exact",
        "pool: with `routing.drift > 0` every layer has its own popularity, so 48 pools of 4096 tokens",
        "(196k tokens routed exactly, ~3x the shared 65536-token pool) plus 48 covariance roots; aux-free",
        "balancing re-routes 8192 pool tokens once per simulated step. Timings vary by ~30 % with the",
        "load other jobs put on the 2 shared cores; best-of-5 is reported with the median.",
        "",
        f"Exact per-token routing runs at {rate:.2f} s per million tokens here (E=128, top-8), so the "
        f"{result['speed'][0]['tokens_routed'] / 1e6:.0f}M tokens of one 128gpu step would take "
        f"~{rate * result['speed'][0]['tokens_routed'] / 1e6:.0f} s exactly.",
        "",
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
    result = {
        "machine": MACHINE,
        "platform": f"{platform.machine()}, Python {platform.python_version()}",
        "target_s": TARGET_S,
        "speed": speed,
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
