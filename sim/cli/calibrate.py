"""``moesim calibrate --out CALIB.json``: microbenchmarks on this hardware as a real multi-rank
job (torchrun or the deepspeed launcher; gloo CPU ranks or NCCL GPUs), fitted into a calibration
file (``moesim.calibration`` v1, schema in :mod:`sim.inputs.calibration`) that a scenario's
``calibration:`` names. Prints the nccl-tests-style table of the collectives and every fitted
number; ``--json`` adds the fit report to the calibration document.

The work is in :mod:`hw_validate.calibrate` (it imports torch); it is imported only when the
command runs, so ``sim`` stays free of torch. Exit status: 0 ok; 2 bad input (the message names
the flag or file); 1 the job failed or hung (one line saying why, then the job's last lines).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from sim.cli.common import add_json_argument
from sim.errors import InputError
from sim.reports.progress import reporting, write

BACKENDS = ("gloo", "nccl")
LAUNCHERS = ("torchrun", "deepspeed")
STATS = ("median", "p25")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run collective (all_to_all_single, all_reduce), GEMM, attention, memory, kernel-launch, "
        "optimizer (DeepSpeed's ZeRO step and backward when DeepSpeed is installed), token-dispatcher "
        "(DeepSpeed's gate, sparse encode/decode) and rank-to-rank compute-noise microbenchmarks as a "
        "real job on N local ranks, fit the simulator's link alpha/bandwidth and kernel-cost models "
        "to them, and write a calibration JSON."
    )
    parser.epilog = (
        "example: moesim calibrate --nproc 2 --scenario scenarios/cpu-2rank.yaml --out calib.json; "
        "then set 'calibration: calib.json' in the scenario. From your own job's trace: moesim calibrate "
        "--from-profile traces/ --scenario my.yaml --out calib.json. Exit status: 0 ok, 2 bad input, 1 the "
        "job failed or timed out."
    )
    parser.add_argument("--out", required=True, metavar="CALIB.json", help="calibration file to write (atomically)")
    parser.add_argument("--nproc", type=int, default=2, metavar="N", help="ranks on this machine (default 2)")
    parser.add_argument("--backend", choices=BACKENDS, default="gloo",
                        help="gloo: CPU ranks (default); nccl: one GPU per rank")  # fmt: skip
    parser.add_argument("--launcher", choices=LAUNCHERS, default="torchrun",
                        help="how the ranks are started (default torchrun)")  # fmt: skip
    parser.add_argument("--scenario", action="append", default=[], metavar="S",
                        help="scenario YAML whose layer shapes (expert, router, attention GEMMs; activation "
                        "and optimizer sizes) are measured too (repeatable); the first one's topology "
                        "is the cluster the link fit uses")  # fmt: skip
    parser.add_argument("--topology", metavar="T",
                        help="topology (shipped name or YAML) of the link fit (default: the first "
                        "scenario's, else cpu-host for gloo and hgx-h200 for nccl)")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes, shapes and repetitions (seconds instead of a minute on CPU ranks)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900.0, metavar="S",
                        help="stop the job and fail after S seconds (default 900)")  # fmt: skip
    parser.add_argument("--stat", choices=STATS, default="median",
                        help="statistic of the timed repetitions the fits use: median (what a call in a "
                        "job typically pays; default) or p25 (lower quartile: the machine with the least "
                        "interference from other processes)")  # fmt: skip
    parser.add_argument("--desync-scenario", metavar="S", default=None,
                        help="reference scenario whose real job (per-call spans) measures how far the ranks "
                        "drift apart between blocking calls: late wake-ups and compute noise (default on "
                        "gloo with >= 2 ranks: scenarios/calibration/cpu-desync.yaml, ~30 s; not with "
                        "--quick)")  # fmt: skip
    parser.add_argument("--no-desync-job", action="store_true",
                        help="skip the desync job: take late wake-ups and compute noise from the microbenchmark loops")  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress on stderr")
    prof = parser.add_argument_group("from a profiler trace of your own job (no microbenchmarks run)")
    prof.add_argument("--from-profile", action="append", default=[], metavar="TRACE.json",
                      help="a PyTorch profiler (Kineto) trace of a training job, recorded with record_shapes=True: "
                      "one rank's file, every rank's (repeat the flag), or a folder of them; fits the calibration "
                      "fields the trace informs, each with its fit error (docs/validation.md)")  # fmt: skip
    prof.add_argument("--set", dest="overrides", action="append", default=[], metavar="PATH=VALUE",
                      help="with --from-profile --scenario: override a field of the scenario the trace is of")  # fmt: skip
    prof.add_argument("--router-trace", metavar="R",
                      help="with --from-profile --scenario: the job's routing decisions (router_trace.json of "
                      "an hw_validate job), replayed when the in-job factors are fitted")  # fmt: skip
    add_json_argument(parser)


def _need(module: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise _Missing(f"{module} is not installed ({why}); install it with pip install 'moesim[hw]'")


class _Missing(RuntimeError):
    pass


def run(args: argparse.Namespace) -> int:
    from sim.ioutil import write_json

    if args.from_profile:
        return _from_profile(args)
    for flag, given in (("--set", args.overrides), ("--router-trace", args.router_trace)):
        if given:
            raise InputError("only with --from-profile", field=flag)
    if args.nproc < 1:
        raise InputError(f"must be >= 1, got {args.nproc}", field="--nproc")
    try:
        _need("torch", "the microbenchmarks run on it")
        if args.launcher == "deepspeed":
            _need("deepspeed", "the deepspeed launcher")
    except _Missing as exc:
        print(f"moesim: error: {exc}", file=sys.stderr)
        return 1
    from hw_validate.calibrate import calibrate, check_writable
    from hw_validate.calibration_report import format_report
    from hw_validate.launch import JobError

    if args.json and args.json != "-":
        check_writable(args.json, "--json")

    def say(line: str) -> None:
        if not args.no_progress:
            write(f"[calibrate] {line}", sys.stderr)  # above the progress bar when one shows

    try:
        with reporting("calibrate", enabled=not args.no_progress):
            res = calibrate(
                args.out, nproc=args.nproc, backend=args.backend, launcher=args.launcher, topology=args.topology,
                scenarios=args.scenario, quick=args.quick, timeout_s=args.timeout, echo=not args.no_progress,
                stat=args.stat, progress=say,
                desync=None if args.no_desync_job else (args.desync_scenario or "auto"),
            )  # fmt: skip
    except JobError as exc:
        print(f"moesim: error: {exc}", file=sys.stderr)
        return 1
    doc = res.calibration.model_dump(mode="json")
    if args.json:
        write_json(args.json, {**doc, "out": str(args.out), "report": res.report})
    if args.json != "-":
        print(format_report(res.calibration))
        print(f"calibration written to {args.out}")
    return 0


def _from_profile(args: argparse.Namespace) -> int:
    """``--from-profile``: read the traces, fit, write (:mod:`hw_validate.fits.from_profile`)."""
    from pathlib import Path

    from sim.ioutil import write_json

    if len(args.scenario) > 1:
        raise InputError("with --from-profile, give the one scenario the trace is of", field="--scenario")
    scenario = args.scenario[0] if args.scenario else None
    if scenario is not None and not Path(scenario).is_file():
        raise InputError("scenario file not found", file=scenario, field="--scenario")
    if scenario is None and (args.overrides or args.router_trace):
        raise InputError("--set and --router-trace describe the scenario: add --scenario", field="--scenario")
    if args.router_trace and not Path(args.router_trace).is_file():
        raise InputError("router trace not found", file=args.router_trace, field="--router-trace")
    from hw_validate.calibrate import check_writable
    from hw_validate.calibration_report import format_profile_report
    from hw_validate.fits.from_profile import fit_traces
    from hw_validate.profile_trace import read_traces
    from sim.inputs.calibration import save_calibration

    check_writable(args.out)
    if args.json and args.json != "-":
        check_writable(args.json, "--json")

    def say(line: str) -> None:
        if not args.no_progress:
            write(f"[calibrate] {line}", sys.stderr)

    with reporting("calibrate", enabled=not args.no_progress):
        say(f"reading {len(args.from_profile)} trace path(s)")
        traces = read_traces(args.from_profile)
        cal, report = fit_traces(traces, scenario, args.overrides, args.topology, args.router_trace, progress=say)
    try:
        save_calibration(args.out, cal)
    except OSError as exc:
        raise InputError(f"cannot write '{args.out}': {exc.strerror or exc}", field="--out") from None
    if args.json:
        write_json(args.json, {**cal.model_dump(mode="json"), "out": str(args.out), "report": report})
    if args.json != "-":
        print(format_profile_report(cal, report))
        print(f"calibration written to {args.out}")
    return 0
