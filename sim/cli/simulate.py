"""``moesim simulate SCEN``: one training step — step time, breakdown, traffic, memory."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from sim.cli.common import (
    add_engine_arguments,
    add_force_argument,
    add_json_argument,
    add_scenario_arguments,
    scenario_from_args,
)
from sim.errors import InputError
from sim.ioutil import write_json
from sim.reports.progress import reporting
from sim.studies.guard import check_resources


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenario_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument(
        "--fidelity",
        choices=("folded", "full"),
        default="folded",
        help="folded (default): the DES follows the lanes that can set the pace and accounts for the others "
        "by estimate, and simulates a steady-state window of the micro-batches when there are many (the output "
        "says what it folded); full: every rank and every micro-batch simulated, the exact reference",
    )
    parser.add_argument("--policy", metavar="P", help="override routing.policy: topk, node_limited:M=2, ...")
    parser.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace-event JSON of the step")
    parser.add_argument("--trace-flows", action="store_true",
                        help="with --trace: at every all-to-all an arrow from the rank that arrived last to each peer that waited for it")  # fmt: skip
    parser.add_argument(
        "--trace-ranks",
        metavar="R,R-R",
        help="ranks in the trace (default: every rank up to 64 GPUs, else the first two nodes)",
    )
    parser.add_argument("--plot", metavar="DIR", help="write breakdown and per-rank PNGs into DIR")
    add_force_argument(parser)
    add_json_argument(parser)


def parse_ranks(text: str, world: int) -> set[int]:
    out: set[int] = set()
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                a, b = (int(x) for x in part.split("-", 1))
                out.update(range(a, b + 1))
            else:
                out.add(int(part))
    except ValueError:
        out = set()
    if not out or min(out) < 0 or max(out) >= world:
        raise InputError(f"'{text}' must list ranks in 0..{world - 1}, e.g. 0,1,8-15", field="--trace-ranks")
    return out


def default_trace_ranks(scenario) -> set[int]:
    world = scenario.world_size
    return set(range(world if world <= 64 else 2 * scenario.gpus_per_node))


def run(args: argparse.Namespace) -> int:
    from sim.engine.simulate import simulate

    scenario = scenario_from_args(args)
    check_resources(scenario, engine=args.engine, comm_model=args.comm_model, force=args.force, fidelity=args.fidelity)
    trace_ranks = None
    if args.trace or args.plot:
        trace_ranks = (
            parse_ranks(args.trace_ranks, scenario.world_size) if args.trace_ranks else default_trace_ranks(scenario)
        )
    t0 = time.perf_counter()
    with reporting("simulate"):  # a bar on a terminal after 2 s; the engine reports into it
        result = simulate(scenario, engine=args.engine, comm_model=args.comm_model, policy=args.policy,
                          trace_ranks=trace_ranks, fidelity=args.fidelity)  # fmt: skip
    wall = time.perf_counter() - t0
    spans = result.pop("_spans", None)
    if args.trace:
        from sim.reports.chrome_trace import write_chrome_trace

        write_chrome_trace(args.trace, spans or [], scenario, result, flows=args.trace_flows)
    if args.plot:
        from sim.reports.plots import step_plots

        step_plots(args.plot, result, spans or [], scenario)
    if args.json:
        write_json(args.json, result)
    if args.json != "-":
        print(format_table(scenario, result, wall))
    return 0


def _pct(x: float, total: float) -> str:
    return f"{100 * x / total:5.1f}%" if total > 0 else "     -"


def _layout_text(lay: dict[str, Any]) -> str:
    """``dp 128, ep 16, edp 8, ZeRO-2`` plus the degrees above 1 of tp, cp, pp (vpp) and etp."""
    parts = [f"{k} {lay[k]}" for k in ("tp", "cp", "pp") if lay.get(k, 1) > 1]
    if lay.get("vpp", 1) > 1:
        parts.append(f"vpp {lay['vpp']} ({lay.get('pp_schedule')})")
    elif lay.get("pp", 1) > 1:
        parts.append(lay.get("pp_schedule", "1f1b"))
    parts += [f"dp {lay['dp']}", f"ep {lay['ep']}"] + ([f"etp {lay['etp']}"] if lay.get("etp", 1) > 1 else [])
    parts.append(f"edp {lay['edp']}")
    fw = lay.get("framework", "deepspeed")
    parts.append(f"ZeRO-{lay['zero_stage']}" if fw == "deepspeed" else fw)
    return ", ".join(parts)


def format_table(scenario, r: dict[str, Any], wall_s: float | None = None) -> str:
    lay, b, tr, mem = r["layout"], r["breakdown_s"], r["traffic"], r["memory"]
    step = r["step_time_s"]
    lines = [
        f"{r['scenario']}: {r['num_gpus']} GPUs ({lay['nodes']} nodes x {lay['gpus_per_node']} "
        f"{scenario.topology.name}), {_layout_text(lay)}, {scenario.training.dtype}, policy {r['policy']}, "
        f"engine {r['engine']}",
        f"step time {step:.4f} s   tokens/s {r['tokens_per_s']:,.0f} ({r['tokens_per_s_per_gpu']:,.0f} per GPU)"
        f"   MFU {100 * r['mfu']:.1f}%",
        "breakdown, mean over ranks" + (f" (the pace was set by rank {r['critical_rank']})" if "critical_rank" in r else "") + ":",
    ]
    rows = [
        ("compute", b["compute"]),
        ("all-to-all", b["a2a"]),
        ("imbalance wait", b["imbalance_wait"]),
        ("tp comm", b.get("tp_comm", 0.0)),
        ("pipeline bubble", b.get("pipeline_bubble", 0.0)),
        ("exposed comm", b["exposed_comm"]),
        ("optimizer", b["optimizer"]),
    ]
    rows = [(k, v) for k, v in rows if v > 0 or k not in ("tp comm", "pipeline bubble")]
    for name, v in rows:
        lines.append(f"  {name:<15} {v:10.4f} s  {_pct(v, step)}")
    lines.append(f"  {'grad sync':<15} {b['grad_sync']:10.4f} s  (comm stream; the part not hidden is exposed comm)")
    if "phases_s" in r:
        top = sorted(r["phases_s"].items(), key=lambda kv: -kv[1])[:6]
        lines.append("  compute by span: " + ", ".join(f"{k} {v:.3f}" for k, v in top))
    lines.append(
        f"traffic per GPU per step: all-to-all {tr['a2a_bytes'] / 1e9:.2f} GB sent, inter-node "
        f"{tr['inter_node_bytes'] / 1e9:.2f} GB ({100 * tr['inter_node_fraction']:.0f}%), max/mean load "
        f"{tr['max_over_mean_load']:.2f}, dropped {100 * tr['dropped_fraction']:.2f}%"
    )
    lines.append(
        f"memory per GPU: {mem['peak_GiB_per_gpu']:.1f} GiB of {mem['capacity_GiB']:.1f} GiB "
        f"({'fits' if mem['fits'] else 'DOES NOT FIT'})"
    )
    p = r["params"]
    lines.append(f"params: total {p['total'] / 1e9:.2f}B, active {p['active'] / 1e9:.2f}B")
    if "ranks" in r and r["ranks"]["most_waiting"]:
        w = r["ranks"]["most_waiting"][0]
        if w["imbalance_wait_s"] > 0:
            lines.append(
                f"most waiting: rank {w['rank']} sat {w['imbalance_wait_s']:.4f} s at all-to-all barriers, "
                f"mostly for rank {w['waited_on']}"
            )
    if "faults" in r:
        f = r["faults"]
        lines.append(
            f"faults: step {f['step_time_s']:.4f} s vs healthy {f['healthy_step_time_s']:.4f} s "
            f"({100 * f['slowdown']:+.1f}%)"
        )
    if wall_s is not None:
        sim = r.get("simulator", {})
        extra = f", {sim['comm_model']} comm model, {sim['events']:,} events" if "events" in sim else ""
        lines.append(f"simulated in {wall_s:.2f} s{extra}")
        folded = sim.get("folded")
        if folded and folded["lanes_simulated"] < folded["lanes_total"]:
            lines.append(f"folded: {folded['what']} (--fidelity full simulates every rank)")
        win = sim.get("micro_window")
        if win:
            lines.append(f"micro-batch window: {win['what']}; bound +-{win['bound_s']:.3g} s "
                         f"({win['bound_fraction']:.2%} of the step; --fidelity full simulates every micro-batch)")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
