"""Entry point of ``moesim``. Exit status: 0 success, 2 bad input, 1 internal error, 130 interrupted."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from sim import __version__
from sim.errors import InputError

#: subcommand -> (module under sim.cli, one-line help). Modules are imported only when used.
COMMANDS: dict[str, tuple[str, str]] = {
    "check": ("check", "validate a scenario file and print its layout"),
    "simulate": ("simulate", "simulate one training step of a scenario"),
    "layer": ("layer", "one MoE layer's forward and backward (as Megatron's moe_perf times it)"),
    "params": ("params", "parameter and memory accounting of a scenario or HF config.json"),
    "route": ("route", "routing statistics and traffic matrices of a scenario"),
    "compare": ("compare", "routing policies side by side on the same gate scores"),
    "collective": ("collective", "one collective on a topology, nccl-tests style"),
    "sweep": ("sweep", "many scenarios (cartesian product of --vary), locally or on Ray"),
    "plan": ("plan", "the best layouts of a model on N GPUs, searched with the simulator"),
    "topo": ("topo", "summary and drawing of a topology's cluster graph"),
    "calibrate": ("calibrate", "microbenchmarks on this hardware -> calibration JSON"),
    "validate": ("validate", "run the real DeepSpeed job and compare it with the simulator"),
}


class _Parser(argparse.ArgumentParser):
    """argparse exits 2 on usage errors already; keep its message but prefix the program name."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="moesim",
        description="Discrete-event simulator of distributed Mixture-of-Experts training, "
        "validated against real DeepSpeed expert-parallel jobs.",
        epilog="Exit status: 0 success, 2 bad input, 1 internal error. GB/s = 1e9 bytes/s; times in seconds.",
    )
    parser.add_argument("--version", action="version", version=f"moesim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = _load(module)
        if mod is None:
            p.set_defaults(_unavailable=name)
            continue
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def _load(module: str):
    try:
        return importlib.import_module(f"sim.cli.{module}")
    except ModuleNotFoundError as exc:
        if exc.name == f"sim.cli.{module}":
            return None
        raise


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_unavailable", None):
        print(f"moesim: error: '{args.command}' is not available in this build", file=sys.stderr)
        return 1
    try:
        return int(args._run(args) or 0)
    except InputError as exc:
        print(f"moesim: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moesim: interrupted; results already written are intact", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # noqa: BLE001 - last line of defence: exit 1, never a bare traceback
        if os.environ.get("MOESIM_DEBUG"):
            traceback.print_exc()
        print(
            f"moesim: internal error: {type(exc).__name__}: {exc}\n"
            "  (this is a bug in moesim; rerun with MOESIM_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
