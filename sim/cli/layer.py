"""``moesim layer SCEN``: one MoE layer's forward and backward, timed as Megatron-Core's ``moe_perf``
harness times them (:mod:`sim.studies.layer`): route, permute, dispatch, experts, combine, unpermute
for one micro-batch, no attention and no optimizer. Prints milliseconds; ``--json`` writes seconds."""

from __future__ import annotations

import argparse

from sim.cli.common import add_json_argument, add_scenario_arguments, scenario_from_args
from sim.ioutil import write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenario_arguments(parser)
    parser.add_argument("--policy", metavar="P", help="override routing.policy: topk, node_limited:M=2, ...")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from sim.studies.layer import layer_times

    s = scenario_from_args(args)
    r = layer_times(s, args.policy)
    if args.json:
        write_json(args.json, r)
    if args.json != "-":
        spans = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in sorted(r["compute_by_span_s"].items(), key=lambda kv: -kv[1]))
        print(f"{r['scenario']}: one MoE layer, {r['tokens_per_rank']} tokens per rank, dispatcher {r['dispatcher']}")
        print(f"forward  {r['forward_s'] * 1e3:9.3f} ms (slowest rank {r['forward_max_s'] * 1e3:.3f})")
        print(f"backward {r['backward_s'] * 1e3:9.3f} ms (slowest rank {r['backward_max_s'] * 1e3:.3f})")
        print(f"all-to-all {r['a2a_s'] * 1e3:.3f} ms, imbalance wait {r['imbalance_wait_s'] * 1e3:.3f} ms (forward + backward)")
        print(f"compute by span (forward + backward, ms): {spans}")
    return 0
