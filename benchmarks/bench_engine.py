"""Step-simulator speed and DES-vs-analytic benchmark; writes benchmarks/results/engine-per-rank.{json,md}.

Targets (issue 5), on this machine: a whole step of scenarios/128gpu.yaml at 128 GPUs in under
5 s, at 1024 GPUs under 60 s. DES vs analytic: within 10% with uniform routing and no contention;
the DES shows the imbalance penalty of skewed routing that the mean-field analytic cannot.

    python benchmarks/bench_engine.py             # full run (several minutes on 2 cores)
    python benchmarks/bench_engine.py --quick     # 2 and 16 nodes only
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sim.api import load_scenario  # noqa: E402
from sim.engine.des import Engine  # noqa: E402
from sim.engine.simulate import _cluster, compute_factors, cost_model, resolve_comm_model, simulate  # noqa: E402
from sim.engine.step import build_step  # noqa: E402
from sim.ioutil import atomic_write_text, dumps_json  # noqa: E402
from sim.routing.plan import route_scenario  # noqa: E402

SCEN = ROOT / "scenarios" / "128gpu.yaml"
MACHINE = "2-core x86_64 CI VM, Python 3.11"


def speed_row(nodes: int) -> dict:
    s = load_scenario(SCEN, [f"cluster.nodes={nodes}"])
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    plan = route_scenario(s)
    t1 = time.perf_counter()
    sched = build_step(s, plan, cost_model(s), compute_factors(s))
    t2 = time.perf_counter()
    model = resolve_comm_model(s, "auto")
    res = Engine(s, sched, plan, _cluster(s), model).run()
    t3 = time.perf_counter()
    return {
        "nodes": nodes, "gpus": s.world_size, "comm_model": model, "wall_s": t3 - t0, "route_s": t1 - t0,
        "schedule_s": t2 - t1, "engine_s": t3 - t2, "events": res.events,
        "events_per_s": res.events / (t3 - t2), "step_time_s": res.step_time_s, "load_avg_1m": load,
    }  # fmt: skip


ACCURACY = [
    ("uniform, 2 nodes (EP16 over both)", ["cluster.nodes=2", "routing.generator=uniform"]),
    ("uniform, 16 nodes", ["routing.generator=uniform"]),
    ("uniform, 2 nodes, capacity 1.25 padded", ["cluster.nodes=2", "routing.generator=uniform",
                                                "routing.capacity_factor=1.25", "routing.dispatch=capacity_padded"]),
    ("skewed 0.5 (as shipped), 16 nodes", []),
    ("skewed 1.5, 16 nodes", ["routing.skew=1.5"]),
]  # fmt: skip


def accuracy_row(label: str, sets: list[str]) -> dict:
    s = load_scenario(SCEN, sets)
    des, ana = simulate(s), simulate(s, engine="analytic")
    return {
        "case": label, "overrides": sets, "des_step_s": des["step_time_s"], "analytic_step_s": ana["step_time_s"],
        "rel_diff": des["step_time_s"] / ana["step_time_s"] - 1, "des_imbalance_wait_s": des["breakdown_s"]["imbalance_wait"],
        "des_a2a_s": des["breakdown_s"]["a2a"], "analytic_a2a_s": ana["breakdown_s"]["a2a"],
        "des_compute_s": des["breakdown_s"]["compute"], "analytic_compute_s": ana["breakdown_s"]["compute"],
        "max_over_mean_load": des["traffic"]["max_over_mean_load"],
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    nodes = [2, 16] if args.quick else [2, 16, 64, 128]
    speed = []
    for n in nodes:
        speed.append(speed_row(n))
        print(speed[-1], flush=True)
    acc = []
    for label, sets in ACCURACY:
        acc.append(accuracy_row(label, sets))
        print(acc[-1], flush=True)
    out = {"machine": MACHINE, "platform": platform.platform(), "speed": speed, "des_vs_analytic": acc}
    res = ROOT / "benchmarks" / "results"
    atomic_write_text(res / "engine-per-rank.json", dumps_json(out))
    lines = [
        "# Step-simulator benchmark", "",
        f"Machine: {MACHINE} ({platform.platform()}); shared with other jobs (1-minute load average in the",
        "table: above 2 the wall times are inflated). Command: `python benchmarks/bench_engine.py`.", "",
        "## Speed: one whole step of scenarios/128gpu.yaml (EP16, skewed routing) at N nodes", "",
        "| nodes | GPUs | comm model | wall s | route s | schedule s | engine s | events | events/s | step s | load |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in speed:
        lines.append(
            f"| {r['nodes']} | {r['gpus']} | {r['comm_model']} | {r['wall_s']:.2f} | {r['route_s']:.2f} | "
            f"{r['schedule_s']:.2f} | {r['engine_s']:.2f} | {r['events']:,} | {r['events_per_s']:,.0f} | "
            f"{r['step_time_s']:.4f} | {r['load_avg_1m']:.1f} |"
        )
    lines += ["", "Targets: 128 GPUs < 5 s, 1024 GPUs < 60 s.", "",
              "## DES vs analytic (mean-field) step time", "",
              "| case | DES s | analytic s | DES/analytic - 1 | DES imbalance wait s | max/mean load |",
              "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in acc:
        lines.append(
            f"| {r['case']} | {r['des_step_s']:.4f} | {r['analytic_step_s']:.4f} | {100 * r['rel_diff']:+.1f}% | "
            f"{r['des_imbalance_wait_s']:.4f} | {r['max_over_mean_load']:.2f} |"
        )
    atomic_write_text(res / "engine-per-rank.md", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
