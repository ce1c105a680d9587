"""The accuracy record: ``moesim validate`` over the accuracy scenarios, calibrated once.

Writes ``benchmarks/accuracy/<name>.json`` (every validation result, the calibration report, the
machine and the commands) and ``<name>.md`` (per scenario: measured and predicted step, error,
worst phase; then every phase's error per scenario). Run it alone on the machine, under the
measurement lock other jobs use::

    flock /tmp/moesim-measure.lock python benchmarks/bench_accuracy.py            # ~4 min per round on 2 cores
    flock /tmp/moesim-measure.lock python benchmarks/bench_accuracy.py --calibration C.json

Without ``--calibration`` it runs one full ``moesim calibrate`` over the shapes of all the scenarios
first (saved beside the record). ``--collect DIR`` only renders the record from the
``validation.json`` files under DIR (what ``hw_validate/gpu_check.sh`` leaves on a GPU machine).
Targets (issue 8): median |step-time error| <= 10% and max <= 20% on CPU ranks; <= 5% on GPUs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sim.ioutil import atomic_write_text, dumps_json  # noqa: E402

SCENARIOS = sorted((ROOT / "scenarios" / "accuracy").glob("*.yaml"))
TARGETS = {"cpu": (0.10, 0.20), "gpu": (0.05, 0.05)}  # (median, max) |step-time error|
PHASES = ("forward", "backward", "optimizer", "attention", "route", "permute", "dispatch", "experts", "combine",
          "unpermute", "output", "attention_bwd", "experts_bwd", "combine_bwd", "dispatch_bwd", "grad_sync",
          "optimizer_comm", "forward_comm")  # fmt: skip


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    import os

    return f"{os.cpu_count()}-core {model} VM ({platform.system()} {platform.release()}), Python {platform.python_version()}"


def shown(p: Path) -> str:
    """``p`` relative to the repository when it lies inside it, else as given."""
    p = Path(p)
    return str(p.relative_to(ROOT)) if p.is_absolute() and p.is_relative_to(ROOT) else str(p)


def summary_row(r: dict) -> dict:
    e = r["error"]
    worst = e["worst_phase"]
    return {
        "scenario": r["scenario"],
        "measured_step_s": r["measured"]["step_time_s"],
        "measured_p10_s": r["measured"]["p10_s"]["step"],
        "measured_p90_s": r["measured"]["p90_s"]["step"],
        "predicted_step_s": r["predicted"]["step_time_s"],
        "step_time_rel": e["step_time_rel"],
        "worst_phase": worst,
        "worst_phase_rel": e["phases_rel"].get(worst) if worst else None,
        "worst_phase_abs_s": e["worst_phase_abs_s"],
        "repeats": r.get("repeats"),
    }


def median_job(runs: list[dict]) -> dict:
    """The job with the median step-time error of a scenario's repeated jobs (the lower middle one for
    an even count), with every job's figures under ``repeats``: the record's row and phases come
    from that one real job, and the spread of the others is shown beside it."""
    order = sorted(range(len(runs)), key=lambda i: (runs[i]["error"]["step_time_rel"], i))
    pick = dict(runs[order[(len(runs) - 1) // 2]])
    if len(runs) > 1:
        pick["repeats"] = [{"job": i + 1, "measured_step_s": r["measured"]["step_time_s"],
                            "predicted_step_s": r["predicted"]["step_time_s"],
                            "step_time_rel": r["error"]["step_time_rel"]} for i, r in enumerate(runs)]  # fmt: skip
    return pick


def render(name: str, results: list[dict], meta: dict) -> tuple[dict, str]:
    rows = [summary_row(r) for r in results]
    errs = [abs(r["step_time_rel"]) for r in rows if r["step_time_rel"] is not None]
    kind = meta.get("kind", "cpu")
    tmed, tmax = TARGETS[kind]
    med = statistics.median(errs) if errs else None
    mx = max(errs) if errs else None
    record = {"name": name, **meta, "summary": {"median_abs_step_error": med, "max_abs_step_error": mx,
              "target_median": tmed, "target_max": tmax,
              "met": bool(errs) and med <= tmed and mx <= tmax}, "rows": rows, "results": results}  # fmt: skip
    md = [f"# Accuracy record: {name}", "", f"Machine: {meta.get('machine')}", ""]
    md += [f"Calibration: `{meta.get('calibration')}` ({meta.get('calibration_note', '')})", ""]
    if meta.get("calibration_report"):
        md += ["```", meta["calibration_report"], "```", ""]
    md += ["Commands:", "", "```", *meta.get("commands", []), "```", ""]
    rep = any(r.get("repeats") for r in rows)
    if rep:
        md += [f"Each scenario ran {max(len(r['repeats'] or [1]) for r in rows)} times, in rounds over all the scenarios; a row "
               "is the job with the median step-time error, and the last column lists every job's error "
               "(measured / predicted ms).", ""]  # fmt: skip
    md += ["| scenario | measured step ms (p10..p90) | predicted ms | error | worst phase (error, ms off) |"
           + (" every job |" if rep else ""), "|---|---|---|---|---|" + ("---|" if rep else "")]  # fmt: skip
    for r in rows:
        wr = r["worst_phase_rel"]
        each = ", ".join(f"{100 * j['step_time_rel']:+.0f}% ({1e3 * j['measured_step_s']:.0f}/{1e3 * j['predicted_step_s']:.0f})"
                         for j in r.get("repeats") or [])  # fmt: skip
        md.append(
            f"| {r['scenario']} | {1e3 * r['measured_step_s']:.1f} ({1e3 * r['measured_p10_s']:.1f}..{1e3 * r['measured_p90_s']:.1f}) "
            f"| {1e3 * r['predicted_step_s']:.1f} | {100 * r['step_time_rel']:+.1f}% | {r['worst_phase']} "
            f"({'n/a' if wr is None else f'{100 * wr:+.0f}%'}, {1e3 * (r['worst_phase_abs_s'] or 0):.1f}) |"
            + (f" {each} |" if rep else "")
        )
    if errs:
        md += ["", f"Median |step-time error| {100 * med:.1f}% (target {100 * tmed:.0f}%), max {100 * mx:.1f}% "
               f"(target {100 * tmax:.0f}%): {'met' if record['summary']['met'] else 'NOT met'}."]  # fmt: skip
    present = [p for p in PHASES if any(p in r["error"]["phases_rel"] for r in results)]
    md += ["", "Per-phase error (predicted - measured) / measured; measured ms in brackets:", "",
           "| phase | " + " | ".join(r["scenario"] for r in results) + " |",
           "|---|" + "---|" * len(results)]  # fmt: skip
    for p in present:
        cells = []
        for r in results:
            e = r["error"]["phases_rel"].get(p, "absent")
            m = r["measured"]["phases_s"].get(p, 0.0)
            cells.append("-" if e == "absent" else ("n/a" if e is None else f"{100 * e:+.0f}% ({1e3 * m:.1f})"))
        md.append(f"| {p} | " + " | ".join(cells) + " |")
    if meta.get("notes"):
        md += ["", *meta["notes"]]
    return record, "\n".join(md) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", help="calibration JSON (default: calibrate once now over all the scenarios)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3, metavar="N",
                    help="jobs per scenario, run in N rounds over all the scenarios; the record keeps the "
                         "median-error job and lists them all (default 3: this VM's step time moves up to 2x "
                         "between minutes)")  # fmt: skip
    ap.add_argument("--name", default="cpu-2rank-gloo", help="record name (file stem under --out)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "accuracy"))
    ap.add_argument("--runs", default=str(ROOT / "runs" / "accuracy"), help="--keep folders of the jobs")
    ap.add_argument("--only", action="append", default=[], help="scenario stem (repeatable)")
    ap.add_argument("--collect", metavar="DIR", help="render from DIR/**/validation.json instead of running")
    ap.add_argument("--kind", choices=("cpu", "gpu"), default="cpu", help="which targets apply")
    ap.add_argument("--rerender", action="store_true", help="render <name>.md again from <name>.json (and the notes)")
    args = ap.parse_args(argv)
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    out = Path(args.out)
    notes_file = out / f"{args.name}.notes.md"
    if args.rerender:
        rec = json.loads((out / f"{args.name}.json").read_text())
        meta = {k: v for k, v in rec.items() if k not in ("name", "summary", "rows", "results", "notes")}
        if notes_file.is_file():
            meta["notes"] = [notes_file.read_text()]
        record, md = render(args.name, rec["results"], meta)
        atomic_write_text(out / f"{args.name}.json", dumps_json(record))
        atomic_write_text(out / f"{args.name}.md", md)
        print(md)
        return 0
    if args.collect:
        results = [json.loads(p.read_text()) for p in sorted(Path(args.collect).rglob("validation.json"))]
        if not results:
            print(f"no validation.json under {args.collect}", file=sys.stderr)
            return 2
        env = results[0]["measured"]["environment"]
        cal = results[0]["calibration"]["file"]
        meta = {"kind": args.kind, "machine": f"{env.get('world_size')} x {(env.get('devices') or ['?'])[0]} "
                f"({env.get('backend')} {env.get('backend_version')}, torch {env.get('torch')}, host {env.get('hostname')})",
                "calibration": cal, "calibration_note": "from the collected run",
                "commands": sorted({" ".join(r["job"]["command"] or []) or "(reused)" for r in results})}  # fmt: skip
        record, md = render(args.name, results, meta)
        atomic_write_text(out / f"{args.name}.json", dumps_json(record))
        atomic_write_text(out / f"{args.name}.md", md)
        print(md)
        return 0
    from hw_validate.calibrate import calibrate
    from hw_validate.calibration_report import format_report
    from hw_validate.validate import format_table, validate
    from sim.inputs.calibration import load_calibration

    scens = [p for p in SCENARIOS if not args.only or p.stem in args.only]
    commands = []
    t0 = time.time()
    if args.calibration:
        cal_path = Path(args.calibration)
        note = "given"
    else:
        cal_path = out / f"{args.name}.calibration.json"
        rel = [str(p.relative_to(ROOT)) for p in scens]
        print(f"calibrating once over {len(scens)} scenarios -> {cal_path}", flush=True)
        calibrate(cal_path, nproc=2, backend="gloo", scenarios=rel, quick=False, echo=False)
        commands.append(f"python -c \"from hw_validate.calibrate import calibrate; calibrate('{shown(cal_path)}', "
                        f"nproc=2, scenarios={rel})\"  # = moesim calibrate over the scenarios' shapes")  # fmt: skip
        note = f"one full calibration over all {len(scens)} scenarios, made right before the jobs"
    report = format_report(load_calibration(cal_path))
    jobs: dict[str, list[dict]] = {p.stem: [] for p in scens}
    # rounds over all the scenarios, so that a slow spell of the VM hits every scenario alike
    for rnd in range(args.repeat):
        for p in scens:
            rel = p.relative_to(ROOT)
            keep = Path(args.runs) / p.stem / (f"job{rnd + 1}" if args.repeat > 1 else "")
            cmd = f"moesim validate {rel} --calibration {shown(cal_path)} --steps {args.steps} --keep {shown(keep)}"
            commands.append(cmd)
            print(f"== [{rnd + 1}/{args.repeat}] {cmd}", flush=True)
            r = validate(rel, cal_path, args.steps, keep=keep, echo=False, log=lambda m: print(m, flush=True))
            print(format_table(r), flush=True)
            jobs[p.stem].append(r)
    results = [median_job(jobs[p.stem]) for p in scens]
    meta = {"kind": args.kind, "machine": machine(), "calibration": shown(cal_path),
            "calibration_note": note, "calibration_report": report, "commands": commands,
            "wall_s": time.time() - t0, "steps": args.steps, "repeat": args.repeat,
            "run": f"flock /tmp/moesim-measure.lock python benchmarks/bench_accuracy.py --repeat {args.repeat}" + (f" --calibration {args.calibration}" if args.calibration else "")}  # fmt: skip
    if notes_file.is_file():
        meta["notes"] = [notes_file.read_text()]
    record, md = render(args.name, results, meta)
    atomic_write_text(out / f"{args.name}.json", dumps_json(record))
    atomic_write_text(out / f"{args.name}.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
