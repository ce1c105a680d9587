"""Options and helpers shared by subcommands."""

from __future__ import annotations

import argparse

from sim.scenario import Scenario, load_scenario


def add_scenario_arguments(parser: argparse.ArgumentParser) -> None:
    """``SCEN`` plus repeatable ``--set path=value`` overrides."""
    parser.add_argument("scenario", metavar="SCEN", help="scenario YAML file")
    add_set_argument(parser)


def add_set_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a scenario field, typed by the schema (repeatable), e.g. --set cluster.nodes=32",
    )


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write the machine-readable result ('-' for stdout)")


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    return load_scenario(args.scenario, args.overrides)
