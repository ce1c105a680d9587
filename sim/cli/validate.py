"""``moesim validate SCEN``: run the scenario's real DeepSpeed job, simulate it with the calibration
and the job's own routing decisions, print measured vs predicted per phase (hw_validate.validate).

Needs the ``hw`` extra (torch, deepspeed); imported only when the subcommand runs, so ``sim`` itself
never imports torch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sim.cli.common import add_json_argument, add_scenario_arguments
from sim.errors import InputError
from sim.ioutil import write_json
from sim.reports.progress import reporting, write


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenario_arguments(parser)
    parser.add_argument("--calibration", metavar="C",
                        help="calibration JSON (default: the cached full calibration of this machine, made "
                        "the first time (~2 min on 2 CPU cores), its in-job figures refitted on a reference "
                        "job now on CPU ranks)")  # fmt: skip
    parser.add_argument("--recalibrate", action="store_true",
                        help="without --calibration: remake the cached calibration of this machine first")  # fmt: skip
    parser.add_argument("--steps", type=int, default=None, help="training steps of the real job (default: training.steps)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks (default: the scenario's world size)")
    parser.add_argument("--launcher", choices=("deepspeed", "torchrun"), default="deepspeed")
    parser.add_argument("--timeout", type=float, default=900.0, metavar="S", help="seconds before the job counts as hung (default 900)")
    parser.add_argument("--keep", metavar="DIR", help="keep measurement, trace, logs and validation.json in DIR; "
                        "a finished measurement of the same scenario and steps there is reused")  # fmt: skip
    parser.add_argument("--profile", action="store_true",
                        help="with --keep DIR: the job records PyTorch profiler traces of 3 measured steps into "
                        "DIR/profile (what `moesim calibrate --from-profile` reads)")  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="do not echo the job's output")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    if not Path(args.scenario).is_file():
        raise InputError("scenario file not found", file=args.scenario)
    if args.steps is not None and args.steps < 1:
        raise InputError(f"must be >= 1, got {args.steps}", field="--steps")
    if args.calibration is not None and not Path(args.calibration).is_file():
        raise InputError("calibration file not found", file=args.calibration, field="--calibration")
    from hw_validate.launch import JobError
    from hw_validate.validate import format_table, validate

    to_stdout = args.json == "-"

    if args.recalibrate and args.calibration is not None:
        raise InputError("--recalibrate remakes the cached calibration used without --calibration; drop one",
                         field="--recalibrate")  # fmt: skip

    def log(msg: str) -> None:
        write(msg, sys.stderr if to_stdout else sys.stdout)  # above the progress bar when one shows

    try:
        with reporting("validate"):  # a bar on a terminal: calibration, the real job's steps, simulation
            result = validate(
                args.scenario, args.calibration, args.steps, args.nproc, args.launcher, args.timeout, args.keep,
                args.overrides, echo=not (args.quiet or to_stdout), log=log, recalibrate=args.recalibrate,
                profile=args.profile,
            )  # fmt: skip
    except JobError as exc:
        text = str(exc)
        head, _, tail = text.partition("\n")
        print(f"moesim: error: the real job failed: {head}", file=sys.stderr)
        if tail:
            print(tail, file=sys.stderr)
        if exc.run_dir is not None:
            print(f"  logs kept in {exc.run_dir}", file=sys.stderr)
        return 1
    if args.json:
        write_json(args.json, result)
    if not to_stdout:
        print(format_table(result))
    return 0
