"""Options and helpers shared by subcommands."""

from __future__ import annotations

import argparse

from sim.api import load_scenario
from sim.inputs.scenario import Scenario


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


ENGINES = ("des", "analytic")
COMM_MODELS = ("auto", "flow", "ps")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """``--engine`` and ``--comm-model``: every command that simulates steps takes them."""
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="des",
        help="des: the SimPy discrete-event engine (default); analytic: closed-form mean-field estimate",
    )
    parser.add_argument(
        "--comm-model",
        choices=COMM_MODELS,
        default="auto",
        help="flow: every transfer through the max-min network (exact, slow); ps: processor-sharing "
        "timing per launch (fast); auto: flow up to 8 GPUs, ps above (default)",
    )


def add_force_argument(parser: argparse.ArgumentParser, what: str | None = None) -> None:
    """``--force``: run past the resource guard (:mod:`sim.studies.guard`); ``what`` names the runs of a batch."""
    help_ = (f"run {what} the resource guard estimates would exhaust this machine" if what
             else "run even if the resource guard estimates it would exhaust this machine")  # fmt: skip
    parser.add_argument("--force", action="store_true", help=help_)


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write the machine-readable result ('-' for stdout)")


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    return load_scenario(args.scenario, args.overrides)
