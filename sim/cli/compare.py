"""``moesim compare SCEN --policy P [--policy P ...] [--vary k=v1,v2]``: routing policies side by
side on the same seed and gate scores; a table, ``--json`` (DESIGN.md's ``policies`` rows) and
``--plot`` (grouped bars)."""

from __future__ import annotations

import argparse
import sys

from sim.cli.common import add_engine_arguments, add_force_argument, add_json_argument, add_scenario_arguments
from sim.errors import InputError
from sim.ioutil import write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenario_arguments(parser)
    parser.add_argument(
        "--policy",
        action="append",
        default=[],
        metavar="P",
        help="a routing policy to compare (repeatable): topk, node_limited:M=2, device_limited:M=3; "
        "node_limited without M takes M from --vary routing.max_groups=...",
    )
    parser.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="PATH=V1,V2,...",
        help="also compare these values of a scenario field (repeatable; product with --policy), "
        "e.g. --vary routing.max_groups=1,2,4,8",
    )
    parser.add_argument("--healthy", action="store_true",
                        help="for a scenario with faults: add a row with the faults removed after each case")  # fmt: skip
    add_engine_arguments(parser)
    parser.add_argument("--plot", metavar="PNG", help="grouped bars: step time split, inter-node bytes, load, gate mass")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (it shows on a terminal only)")
    add_force_argument(parser, "cases")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from sim.reports.progress import reporting
    from sim.studies.compare import format_table, plot_compare, run_compare
    from sim.studies.sweep import parse_varies

    varies = parse_varies(args.vary)
    for p in args.policy:
        _check_policy(p)

    with reporting("compare", enabled=not args.no_progress):  # a bar on a terminal, one part per case
        doc = run_compare(args.scenario, args.overrides, args.policy, varies, engine=args.engine,
                          comm_model=args.comm_model, healthy=args.healthy, force=args.force)  # fmt: skip
    if args.plot:
        try:
            plot_compare(args.plot, doc)
        except OSError as exc:
            raise InputError(f"cannot write '{args.plot}': {exc.strerror or exc}", field="--plot") from None
    if args.json:
        write_json(args.json, doc)
    if args.json != "-":
        print(format_table(doc))
    return 0


def _check_policy(text: str) -> None:
    from sim.inputs.scenario import parse_policy

    try:
        parse_policy(text)
    except ValueError as exc:
        raise InputError(str(exc), field="--policy") from None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
