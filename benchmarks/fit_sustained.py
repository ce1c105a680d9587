"""Fit each GPU kind's sustained_compute_fraction to the dense training rows (validation/published/dense).

    python benchmarks/fit_sustained.py [--only DENSE-H100-8B,...] [--out benchmarks/results/sustained_fit]

For every GPU kind with dense rows: the fraction of the microbenchmark GEMM / attention rates that
zeroes the median log error of its rows (sim/studies/sustained_fit.py), and each row's error at 1 and
at the fitted fraction. The fractions are copied by hand into topologies/gpus/<kind>.yaml
(tests/test_sustained_fit.py checks the files agree with the record). Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_published import machine  # noqa: E402
from sim.ioutil import atomic_write_text, dumps_json  # noqa: E402
from sim.studies.sustained_fit import fit_all  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated dense entry ids")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sustained_fit"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    fits = fit_all(set(args.only.split(",")) if args.only else None)
    wall = time.perf_counter() - t0
    lines = [
        f"# sustained_compute_fraction fitted to dense training rows ({time.strftime('%Y-%m-%d')})",
        "",
        f"Machine: {machine()}. Command: `python benchmarks/fit_sustained.py` ({wall:.0f} s).",
        "",
        "| GPU kind | fitted fraction | row | measured step (s) | predicted at 1 | error at 1 | predicted | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in fits:
        for r in f.rows:
            lines.append(f"| {f.kind} | {f.fraction} | {r['id']} | {r['measured_step_s']:.3f} | {r['predicted_step_s_at_1']:.3f} "
                         f"| {r['error_at_1']:+.1%} | {r['predicted_step_s']:.3f} | {r['error']:+.1%} |")  # fmt: skip
            print(
                f"{f.kind:10s} {f.fraction:6.3f} {r['id']:18s} error at 1 {r['error_at_1']:+7.1%} -> {r['error']:+7.1%}"
            )
    out = Path(args.out)
    data = {"machine": machine(), "wall_s": wall,
            "fits": [{"kind": f.kind, "fraction": f.fraction, "iterations": f.iterations, "rows": f.rows} for f in fits]}  # fmt: skip
    atomic_write_text(out.with_suffix(".json"), dumps_json(data))
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
