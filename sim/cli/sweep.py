"""``moesim sweep SCEN --vary k=v1,v2 [--vary k2=...]``: the cartesian product, locally or on Ray.

Each finished run is appended to a JSONL log (``--jsonl``; default next to ``--json``, else under
``runs/``): run the same command again after an interruption and it skips what is done.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from sim.cli.common import add_engine_arguments, add_force_argument, add_json_argument, add_scenario_arguments
from sim.errors import InputError
from sim.ioutil import write_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_scenario_arguments(parser)
    parser.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="PATH=V1,V2,...",
        help="values of one scenario field (repeatable; the runs are the cartesian product), "
        "e.g. --vary cluster.nodes=2,4,8,16 --vary routing.policy=topk,node_limited:M=2",
    )
    parser.add_argument("--backend", choices=("local", "ray"), default="local",
                        help="local: a process pool on this machine (default); ray: Ray tasks "
                        "(needs pip install 'moesim[cluster]')")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="parallel runs (default: the CPU count; 1 runs in this process)")  # fmt: skip
    parser.add_argument("--address", metavar="ADDR",
                        help="with --backend ray: join this Ray cluster (auto, ray://host:10001)")  # fmt: skip
    add_engine_arguments(parser)
    parser.add_argument("--jsonl", metavar="PATH",
                        help="run log to append to and resume from (default: --json's path with .jsonl, "
                        "else runs/sweep-<scenario>-<hash>.jsonl)")  # fmt: skip
    parser.add_argument("--fresh", action="store_true", help="start the run log over instead of resuming")
    parser.add_argument("--plot", metavar="PNG", help="scaling curves: step time and tokens/s per GPU")
    parser.add_argument("--x", dest="x_key", metavar="PATH",
                        help="the --vary key on the plot's x axis (default cluster.nodes if varied, "
                        "else the first numeric one)")  # fmt: skip
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_force_argument(parser, "points")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from sim.studies.sweep import default_jsonl, parse_varies, run_sweep, sweep_header

    if not args.vary:
        raise InputError("give at least one --vary PATH=V1,V2,..., e.g. --vary cluster.nodes=2,4,8", field="--vary")
    varies = parse_varies(args.vary)
    if args.jobs is not None and args.jobs < 1:
        raise InputError(f"must be at least 1, got {args.jobs}", field="--jobs")
    if args.address and args.backend != "ray":
        raise InputError("--address joins a Ray cluster; it needs --backend ray", field="--address")
    if args.backend == "ray":
        from sim.studies.sweep_ray import import_ray

        import_ray()  # exit 2 with the install hint before any work
    path = Path(args.scenario)
    if not path.is_file():
        raise InputError("no such scenario file", file=str(path))
    x_key = None
    if args.plot:
        from sim.reports.plots import sweep_x_key

        x_key = sweep_x_key(varies, args.x_key)
    header = sweep_header(path, args.overrides, args.engine, args.comm_model)
    jsonl = Path(args.jsonl) if args.jsonl else default_jsonl(args.json, header)
    jobs = args.jobs or os.cpu_count() or 1
    doc = run_sweep(path, args.overrides, varies, engine=args.engine, comm_model=args.comm_model,
                    backend=args.backend, jobs=jobs, address=args.address, jsonl=jsonl,
                    fresh=args.fresh, progress=not args.no_progress, force=args.force)  # fmt: skip
    resumed, log_path = doc.pop("_resumed"), doc.pop("_jsonl")
    if args.plot:
        from sim.reports.plots import plot_sweep

        plot_sweep(args.plot, doc, x_key)
    if args.json:
        write_json(args.json, doc)
    if args.json != "-":
        print(format_table(doc, resumed, log_path))
    return 0


def format_table(doc: dict[str, Any], resumed: int = 0, log_path: str | None = None) -> str:
    keys = list(doc["vary"])
    head = [*keys, "GPUs", "step s", "tokens/s/GPU", "MFU", "a2a %", "wait %", "mem GiB", "fits"]
    rows = []
    for r in doc["runs"]:
        b, step = r["breakdown_s"], r["step_time_s"]

        def pct(v: float, step: float = step) -> str:
            return f"{100 * v / step:.1f}" if step > 0 else "-"

        rows.append([
            *(str(r["overrides"][k]) for k in keys), str(r["num_gpus"]), f"{step:.4f}",
            f"{r['tokens_per_s_per_gpu']:,.0f}", f"{100 * r['mfu']:.1f}%", pct(b["a2a"]),
            pct(b["imbalance_wait"]), f"{r['memory']['peak_GiB_per_gpu']:.1f}",
            "yes" if r["memory"]["fits"] else "NO",
        ])  # fmt: skip
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = [
        f"{doc['scenario']}: {len(doc['runs'])} runs ({resumed} from the log), engine {doc['engine']}",
        "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True)),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    if log_path:
        lines.append(f"run log: {log_path}")
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(1)
