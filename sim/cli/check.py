"""``moesim check SCEN``: validate a scenario (schema, layout, topology) and print the layout."""

from __future__ import annotations

import argparse

from sim.cli.common import add_json_argument, add_scenario_arguments, scenario_from_args
from sim.ioutil import write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenario_arguments(parser)
    add_json_argument(parser)


def read_referenced_files(s) -> None:
    """Parse the calibration and router trace the scenario names (load only checks they exist)."""
    if s.calibration is not None:
        from sim.inputs.calibration import load_calibration

        load_calibration(s.resolve_path(s.calibration))
    if s.routing.trace is not None:
        from sim.inputs.router_trace import load_trace

        load_trace(s.resolve_path(s.routing.trace))


def run(args: argparse.Namespace) -> int:
    s = scenario_from_args(args)
    read_referenced_files(s)
    layout = {
        "scenario": s.name,
        "topology": s.topology.name,
        "nodes": s.cluster.nodes,
        "gpus_per_node": s.gpus_per_node,
        "world_size": s.world_size,
        "dp": s.dp,
        "ep": s.ep,
        "edp": s.edp,
        "experts_per_rank": s.experts_per_rank,
        "moe_layers": s.model.num_moe_layers,
        "global_batch_sequences": s.global_batch_size,
        "tokens_per_step": s.global_batch_size * s.training.seq_len,
        "routing_policy": s.routing.policy_string,
        "faults": s.faults.summary(),
    }
    if args.json:
        write_json(args.json, layout)
    else:
        print(f"{args.scenario}: OK")
        for k, v in layout.items():
            print(f"  {k:<24} {v}")
    return 0
