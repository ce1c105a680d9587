"""Predicted against measured for every published GPU run in validation/published (issue 26).

    python benchmarks/bench_published.py [--only D6,L-mixtral-a2a-bf16] [--out benchmarks/results/published]

Prints one row per measured figure (training step, layer forward/backward, all-to-all bandwidth) with
its error, and per kind the median and max |error| against the targets (training and layer rows
10%, all-to-all rows 15%); writes ``OUT.json`` and ``OUT.md`` atomically, with the machine named.
Rows the simulator cannot run yet say why instead of a number.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hw_validate.calibration_cache import cpu_model  # noqa: E402
from sim.ioutil import atomic_write_text, dumps_json  # noqa: E402
from sim.studies.published import as_json, entries, predict, summary  # noqa: E402


def machine() -> str:
    return f"{cpu_model()}, {platform.python_implementation()} {platform.python_version()}"


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated entry ids")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "published"))
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    rows, walls = [], {}
    for e in entries():
        if only and e["id"] not in only:
            continue
        t0 = time.perf_counter()
        got = predict(e)
        walls[e["id"]] = time.perf_counter() - t0
        rows += got
        for r in got:
            print(f"{r.id:26s} {r.metric:34s} measured {fmt(r.measured, '10.3f')} predicted {fmt(r.predicted, '10.3f')} "
                  f"error {fmt(r.error, '+7.1%')} {r.note}", flush=True)
    summ = summary(rows)
    for kind, s in summ.items():
        print(f"{kind}: {s['predicted']}/{s['rows']} predicted, median |error| {fmt(s['median_abs_error'], '.1%')}, "
              f"max {fmt(s['max_abs_error'], '.1%')}, within {s['target']:.0%}: {s['within_target']}")
    doc = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "rows": as_json(rows), "summary": summ,
           "wall_s": walls}  # fmt: skip
    out = Path(args.out)
    atomic_write_text(out.with_suffix(".json"), dumps_json(doc))
    lines = [f"# Published GPU runs: predicted vs measured ({doc['date']})", "",
             f"Machine: {doc['machine']}. Command: `python benchmarks/bench_published.py`.", "",
             "| id | metric | measured | predicted | error | within target | note |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.id} | {r.metric} | {fmt(r.measured, '.4g')} | {fmt(r.predicted, '.4g')} | {fmt(r.error, '+.1%')} | "
                     f"{'-' if r.within is None else 'yes' if r.within else 'no'} | {r.note} |")  # fmt: skip
    lines += ["", "| kind | predicted / rows | median abs error | max abs error | within target |", "|---|---|---|---|---|"]
    for kind, s in summ.items():
        lines.append(f"| {kind} | {s['predicted']}/{s['rows']} | {fmt(s['median_abs_error'], '.1%')} | "
                     f"{fmt(s['max_abs_error'], '.1%')} | {s['within_target']} (target {s['target']:.0%}) |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
