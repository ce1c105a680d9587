"""``moesim route SCEN``: routing statistics, touched experts and traffic of a scenario's router."""

from __future__ import annotations

import argparse
from typing import Any

from sim.cli.common import add_force_argument, add_json_argument, add_scenario_arguments, scenario_from_args
from sim.errors import InputError
from sim.ioutil import write_json
from sim.studies.guard import check_resources

DEFAULT_TOUCHED = "1,4,16,64,256,1024"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenario_arguments(parser)
    parser.add_argument("--policy", metavar="P", help="override routing.policy: topk, node_limited:M=2, ...")
    parser.add_argument(
        "--touched",
        default=DEFAULT_TOUCHED,
        metavar="N,N,...",
        help=f"batch sizes (tokens) for distinct experts touched (default {DEFAULT_TOUCHED})",
    )
    parser.add_argument(
        "--method",
        choices=("auto", "exact", "pooled"),
        default="auto",
        help="exact: every token sampled; pooled: counts drawn from an exact pool (fast); auto: exact while small",
    )
    parser.add_argument("--plot", metavar="PNG", help="write the traffic heatmap and expert-load histogram")
    add_force_argument(parser)
    add_json_argument(parser)


def parse_touched(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise InputError(
            f"'{text}' must be a comma-separated list of positive integers, e.g. 1,4,16", field="--touched"
        )
    return values


def run(args: argparse.Namespace) -> int:
    from sim.reports.progress import reporting
    from sim.routing.plan import route_scenario
    from sim.studies.compare import effective_policy

    touched_sizes = parse_touched(args.touched)
    scenario = scenario_from_args(args)
    check_resources(scenario, engine="route", force=args.force)
    policy, note = effective_policy(scenario, args.policy)  # an M that limits nothing runs, as in compare
    with reporting("route"):  # a bar on a terminal after 2 s
        plan = route_scenario(scenario, policy, method=args.method)
        stats = plan.summary()
    result: dict[str, Any] = {
        "scenario": scenario.name,
        "policy": args.policy if note else plan.policy,
        "method": plan.method,
        "dispatch": plan.dispatch,
        "summary": stats["summary"],
        "per_layer": stats["per_layer"],
        "touched": plan.touched(touched_sizes),
        "balancing": plan.arrays.balancing,
    }
    if note:
        result["ran_as"] = plan.policy
        result["note"] = note
    if args.plot:
        from sim.reports.routing_plot import plot_routing

        plot_routing(plan, args.plot)
    if args.json:
        write_json(args.json, result)
    if args.json != "-":
        print(format_table(result, plan.layout.world, plan.layout.ep))
    return 0


def _fmt(v: Any, pct: bool = False) -> str:
    if v is None:
        return "n/a"
    if pct:
        return f"{100 * v:.2f} %"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _gb(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 1e9:.4g}"


def format_table(result: dict[str, Any], world: int, ep: int) -> str:
    s = result["summary"]
    lines = [
        f"{result['scenario']}: policy {result['policy']}, {world} ranks, EP {ep}, "
        f"dispatch {result['dispatch']}, {result['method']} routing",
        f"  {'local fraction':<34} {_fmt(s['local_fraction'], True)}",
        f"  {'intra-node fraction':<34} {_fmt(s['intra_node_fraction'], True)}",
        f"  {'inter-node fraction':<34} {_fmt(s['inter_node_fraction'], True)}",
        f"  {'max/mean load (ranks)':<34} {_fmt(s['max_over_mean_load'])}",
        f"  {'max/mean load (experts)':<34} {_fmt(s['max_over_mean_expert_load'])}",
        f"  {'dropped fraction':<34} {_fmt(s['dropped_fraction'], True)}",
        f"  {'retained gate mass':<34} {_fmt(s['retained_gate_mass'])}",
        f"  {'mean nodes per token':<34} {_fmt(s['mean_nodes_per_token'])}",
        f"  {'mean ranks per token':<34} {_fmt(s['mean_ranks_per_token'])}",
        f"  {'capacity per rank (C)':<34} {_fmt(s['capacity_per_rank'])}",
        f"  {'dispatch GB per layer+micro-batch':<34} {_fmt(s['dispatch_bytes_per_layer'] / 1e9)}",
        f"  {'  of which inter-node GB':<34} {_fmt(s['inter_node_dispatch_bytes_per_layer'] / 1e9)}",
        f"  {'  inter-node GB, once per node':<34} {_gb(s['inter_node_dedup_bytes_per_layer'])}",
        f"  {'mean routing weight sum':<34} {_fmt(s['mean_routing_weight_sum'])}",
        "  touched experts per batch of n tokens (measured vs uniform E(1-(1-k/E)^n)), expert MB read per token:",
    ]
    for row in result["touched"]:
        per_tok = row["expert_bytes_per_token"]
        lines.append(
            f"    n={row['tokens']:<6} measured {_fmt(row['measured']):>8}  uniform {row['uniform']:>8.4g}  "
            f"MB/token {_fmt(None if per_tok is None else per_tok / 1e6):>8}"
        )
    if result["balancing"]:
        h = result["balancing"]
        lines.append(
            f"  aux-free balancing: expert max/mean {h[0]:.3g} before, {h[-1]:.3g} after {len(h) - 1} steps"
        )
    if result.get("note"):
        lines.append(f"note: {result['policy']}: {result['note']}")
    return "\n".join(lines)
