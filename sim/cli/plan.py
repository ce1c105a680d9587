"""``moesim plan --model HF_CONFIG_OR_SCENARIO --topology T --gpus N``: the best layouts of a model on
N GPUs, searched with the simulator (:mod:`sim.studies.plan`), locally or on Ray, resumable from its
JSONL log (``--log``; default next to ``--json``, else under ``runs/``)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from sim.cli.common import add_force_argument, add_json_argument
from sim.errors import InputError
from sim.ioutil import write_json


def _list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="HF_CONFIG_OR_SCENARIO",
                        help="a HuggingFace config.json, or a scenario YAML (a validation/published entry too): "
                        "its precision, framework, routing and dispatcher are kept, its layout searched")  # fmt: skip
    parser.add_argument("--topology", required=True, metavar="T", help="a shipped topology name or a topology YAML")
    parser.add_argument("--gpus", required=True, type=int, metavar="N", help="GPUs, a multiple of a node's")
    parser.add_argument("--global-batch", type=int, metavar="B",
                        help="sequences per step (default: the scenario's, else 1024)")  # fmt: skip
    parser.add_argument("--seq", type=int, metavar="S", help="tokens per sequence (default: the scenario's, else 4096)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32", "fp8", "mxfp8", "nvfp4"),
                        help="training precision (default: the scenario's, else bf16)")  # fmt: skip
    parser.add_argument("--framework", type=_list, metavar="F[,F...]",
                        help="framework(s) to search: megatron, deepspeed, fsdp2 (default: the scenario's, else megatron)")  # fmt: skip
    parser.add_argument("--dispatcher", type=_list, metavar="D[,D...]",
                        help="all-to-all(s) to search: direct, hierarchical, deepep, hybridep (default: the scenario's, else direct)")  # fmt: skip
    parser.add_argument("--policy", type=_list, metavar="P[,P...]",
                        help="routing policies to search, e.g. topk,node_limited:M=2 (default: the scenario's, else topk)")  # fmt: skip
    parser.add_argument("--recompute", type=_list, metavar="R[,R...]",
                        help="recompute choices to search (default: none,selective,full)")  # fmt: skip
    parser.add_argument("--headroom", type=float, default=0.0, metavar="GiB",
                        help="memory per GPU to keep free beyond the memory model's peak (CUDA context, "
                        "communication libraries' buffers, fragmentation; default 0)")  # fmt: skip
    parser.add_argument("--top", type=int, default=10, metavar="K",
                        help="layouts simulated with the DES and listed (default 10)")  # fmt: skip
    parser.add_argument("--shortlist", type=int, metavar="N",
                        help="candidates the lane engine's estimate ranks (default 4 x --top, at least 20)")  # fmt: skip
    parser.add_argument("--backend", choices=("local", "ray"), default="local",
                        help="local: a process pool on this machine (default); ray: Ray tasks "
                        "(needs pip install 'moesim[cluster]')")  # fmt: skip
    parser.add_argument("--address", metavar="A", help="with --backend ray: join this Ray cluster (auto, ray://host:10001)")
    parser.add_argument("--jobs", type=int, default=None, metavar="J",
                        help="parallel runs (default: the CPU count; 1 runs in this process)")  # fmt: skip
    parser.add_argument("--log", metavar="JSONL",
                        help="run log to append to and resume from (default: --json's path with .jsonl, "
                        "else runs/plan-<model>-<hash>.jsonl)")  # fmt: skip
    parser.add_argument("--fresh", action="store_true", help="start the run log over instead of resuming")
    parser.add_argument("--plot", metavar="PNG", help="Pareto plot: tokens/s per GPU against memory per GPU")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_force_argument(parser, "DES runs")
    add_json_argument(parser)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sim.studies.plan import default_log, run_plan
    from sim.studies.plan_base import build_base

    for name, value in (("--top", args.top), ("--jobs", args.jobs), ("--shortlist", args.shortlist)):
        if value is not None and value < 1:
            raise InputError(f"must be at least 1, got {value}", field=name)
    if args.address and args.backend != "ray":
        raise InputError("--address joins a Ray cluster; it needs --backend ray", field="--address")
    if args.backend == "ray":
        from sim.studies.sweep_ray import import_ray

        import_ray()  # exit 2 with the install hint before any work
    base = build_base(args.model, args.topology, args.gpus, global_batch=args.global_batch, seq_len=args.seq,
                      dtype=args.dtype, frameworks=args.framework, dispatchers=args.dispatcher,
                      policies=args.policy, recomputes=args.recompute, headroom_GiB=args.headroom)  # fmt: skip
    log = Path(args.log) if args.log else default_log(args.json, base)
    jobs = args.jobs or os.cpu_count() or 1
    doc = run_plan(base, top=args.top, shortlist_size=args.shortlist, backend=args.backend, jobs=jobs,
                   address=args.address, log_path=log, fresh=args.fresh, progress=not args.no_progress,
                   force=args.force)  # fmt: skip
    resumed, log_path, timing = doc.pop("_resumed"), doc.pop("_log"), doc.pop("_timing_s")
    if args.plot:
        from sim.studies.plan_plot import plot_plan

        plot_plan(args.plot, doc)
    if args.json:
        write_json(args.json, doc)
    if args.json != "-":
        print(format_table(doc, resumed, log_path, timing))
    return 0


def _counts_line(doc: dict[str, Any]) -> list[str]:
    c = doc["counts"]
    rules = sum(c["dropped_by_rules"].values())
    lines = [f"searched {c['combinations']:,} combinations: {rules:,} dropped by the space's rules, "
             f"{sum(c['invalid'].values()):,} invalid layouts, {sum(c['do_not_fit'].values()):,} do not fit in memory, "
             f"{c['fit']:,} fit; {c['estimated']} estimated (lane engine, every lane), {c['simulated']} simulated (DES, folded)"]  # fmt: skip
    if c.get("refused_by_resource_guard"):
        lines[0] += f", {c['refused_by_resource_guard']} refused by the resource guard (--force runs them)"
    for what, by in (("dropped", c["dropped_by_rules"]), ("invalid", c["invalid"]), ("do not fit", c["do_not_fit"])):
        if by:
            lines.append(f"  {what}: " + "; ".join(f"{k} {v:,}" for k, v in by.items()))
    return lines


def format_table(doc: dict[str, Any], resumed: int = 0, log_path: str | None = None,
                 timing: dict[str, float] | None = None) -> str:  # fmt: skip
    from sim.studies.plan import constant_knobs, label_of

    const = constant_knobs(doc)
    sp = doc["space"]
    knobs = ", ".join(f"{sp[k][0]}" for k in ("framework", "dispatcher", "policy") if k in const)
    head = ["rank", "layout", "step s", "tokens/s/GPU", "MFU", "mem GiB", "bound by", "est s"]
    rows = []
    for p in doc["plans"]:
        shares = sorted(p["shares"].items(), key=lambda kv: -kv[1])[:2]
        rows.append([str(p["rank"]), label_of(p, const), f"{p['step_time_s']:.3f}", f"{p['tokens_per_s_per_gpu']:,.0f}",
                     f"{100 * p['mfu']:.1f}%", f"{p['memory']['peak_GiB_per_gpu']:.1f}",
                     ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares), f"{p['estimate_step_time_s']:.3f}"])  # fmt: skip
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    left = {1, 6}

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    out = [f"{doc['model']} on {doc['gpus']} x {doc['gpu']} ({doc['nodes']} x {doc['topology']}): global batch "
           f"{doc['global_batch']:,} x {doc['seq_len']:,} tokens, {doc['dtype']}" + (f", {knobs}" if knobs else "")
           + (f", {doc['headroom_GiB']:g} GiB kept free" if doc["headroom_GiB"] else ""),
           *_counts_line(doc), line(head), *(line(r) for r in rows)]  # fmt: skip
    if not rows:
        out.append("no layout fits: see the counts above")
    out.append("step s, tokens/s/GPU, MFU, bound by: the DES (folded); est s: the lane engine's estimate that ranked it")
    if log_path:
        out.append(f"run log: {log_path} ({resumed} runs from it)")
    if timing:
        out.append("took " + ", ".join(f"{k} {v:.1f} s" for k, v in timing.items()))
    return "\n".join(out)
