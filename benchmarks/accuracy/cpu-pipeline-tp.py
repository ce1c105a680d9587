"""Issue 27 item 5's record: real pipeline- and tensor-parallel jobs on 2 gloo CPU ranks against the
simulator (the lane engine) with one calibration. Run alone, under the measurement lock::

    flock /tmp/moesim-measure.lock python benchmarks/accuracy/cpu-pipeline-tp.py run [ROUNDS]
    python benchmarks/accuracy/cpu-pipeline-tp.py render

``run`` runs every scenario of ``scenarios/accuracy/layout/`` (or ``ONLY``'s) ROUNDS times (default 3), in rounds,
with ``python -m hw_validate.pipeline_job`` / ``tp_job`` (each job first waits, up to 5 min, until
the machine was busy less than ``QUIET_BUSY`` of its CPU over 5 s; default 0.3), into
``runs/layout/<scenario>/job<N>``. ``render`` writes ``cpu-pipeline-tp.md`` and ``.json`` beside this
file: per scenario and quantity the median over the quiet jobs (other processes took less than 5%
of the CPU during them) of each job's figure (itself the median over its measured steps), the
prediction, the error, every quiet job's error and, apart, the loaded jobs' errors.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: ``TAG`` keeps a later set of jobs apart (runs/layout<TAG>/, record cpu-pipeline-tp<TAG>.json); ``ONLY``
#: (comma-separated scenario names) runs and renders those; ``CALIBRATION`` names the calibration file
TAG = os.environ.get("TAG", "")
OUT = ROOT / "runs" / f"layout{TAG}"
RECORD = Path(__file__).with_name(Path(__file__).stem + TAG)
ONLY = {x for x in os.environ.get("ONLY", "").split(",") if x}
SCENARIOS = [p for p in sorted((ROOT / "scenarios" / "accuracy" / "layout").glob("*.yaml")) if not ONLY or p.stem in ONLY]
CALIBRATION = os.environ.get("CALIBRATION", "calibrations/cpu-host-2rank.json")
QUIET = os.environ.get("QUIET_BUSY", "0.3")
#: a job counts as quiet when other processes took less than this share of the machine's CPU during it
QUIET_OTHERS = 0.05


def job_of(path: Path) -> str:
    return "tensor_parallel" if path.name.startswith("tp") else "pipeline"


def command(path: Path, out: Path) -> list[str]:
    module = "hw_validate.tp_job" if job_of(path) == "tensor_parallel" else "hw_validate.pipeline_job"
    return [sys.executable, "-m", module, str(path.relative_to(ROOT)), "--out", str(out.relative_to(ROOT)),
            "--calibration", CALIBRATION, "--quiet", QUIET]  # fmt: skip


def run(rounds: int) -> None:
    for r in range(1, rounds + 1):
        for path in SCENARIOS:
            out = OUT / path.stem / f"job{r}"
            if (out / "validation.json").is_file():
                continue
            cmd = command(path, out)
            t0 = time.time()
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            out.mkdir(parents=True, exist_ok=True)
            (out / "command.log").write_text(f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stdout}\n{p.stderr}")
            print(f"round {r} {path.stem}: exit {p.returncode} in {time.time() - t0:.0f} s", flush=True)
            print(p.stdout if p.returncode == 0 else p.stdout[-3000:] + p.stderr[-3000:], flush=True)


def machine() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} vCPUs"
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()


def _median(v: list[float]) -> float | None:
    v = sorted(x for x in v if x is not None)
    if not v:
        return None
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def replay_bubble_fraction(schedule: str, pp: int, vpp: int, micro: int, fwd: list[float], bwd: list[float],
                           p2p_s: float) -> float:  # fmt: skip
    """The bubble fraction (mean over ranks) of the simulator's instruction lists
    (:func:`sim.frameworks.pipeline.build`) run with the given pass times per model stage, every
    send taking ``p2p_s`` and nothing else: what the pipeline model gives when its compute and p2p
    are the job's own."""
    from sim.frameworks import pipeline

    seqs = pipeline.build(schedule, pp, vpp, micro)
    done: dict[tuple, float] = {}
    clock, heads, busy = [0.0] * pp, [0] * pp, [0.0] * pp
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            while heads[r] < len(seqs[r]):
                ins = seqs[r][heads[r]]
                path = pipeline.path(schedule, pp, vpp, micro, ins.micro)
                v = path.index((r, ins.chunk))
                if ins.kind == "F":
                    dep = ("F", v - 1, ins.micro) if v > 0 else None
                else:
                    dep = ("F", v, ins.micro) if v == len(path) - 1 else ("B", v + 1, ins.micro)
                if dep is not None and dep not in done:
                    break
                ready = done[dep] + (p2p_s if dep[1] != v else 0.0) if dep is not None else 0.0
                secs = fwd[v] if ins.kind == "F" else bwd[v]
                clock[r] = max(clock[r], ready) + secs
                busy[r] += secs
                done[(ins.kind, v, ins.micro)] = clock[r]
                heads[r] += 1
                moved = True
    step = max(clock)
    return sum(step - b for b in busy) / pp / step


def _replay(res: dict) -> float:
    m, cfg = res["measured"], res["measured"]["config"]
    n = cfg["pp"] * cfg["vpp"]
    return replay_bubble_fraction(cfg["schedule"], cfg["pp"], cfg["vpp"], cfg["micro_batches"],
                                  [m["pass_s"][f"F{v}"] for v in range(n)], [m["pass_s"][f"B{v}"] for v in range(n)],
                                  m["p2p_transfer_s"] or 0.0)  # fmt: skip


def render() -> None:
    scen = []
    for path in SCENARIOS:
        jobs = sorted((OUT / path.stem).glob("job*/validation.json"))
        if not jobs:
            continue
        res = [json.loads(j.read_text()) for j in jobs]
        quiet = [r for r in res if (r["measured"].get("load") or {}).get("others", 1.0) < QUIET_OTHERS]
        loaded = [r for r in res if r not in quiet]
        rows = []
        for i, row in enumerate(res[0]["rows"]):
            q = row["quantity"]
            meas = [r["rows"][i]["measured_s"] for r in quiet]
            m, p = _median(meas), row["predicted_s"]
            err = (p - m) / m if m not in (None, 0) and p is not None else None
            rows.append({"quantity": q, "compared": row["compared"], "measured_s": m, "predicted_s": p,
                         "error_rel": err, "note": row["note"], "every_job_measured_s": meas,
                         "every_job_error_rel": [r["rows"][i]["error_rel"] for r in quiet],
                         "loaded_jobs_error_rel": [r["rows"][i]["error_rel"] for r in loaded]})  # fmt: skip
        scen.append({
            "scenario": path.stem, "scenario_file": str(path.relative_to(ROOT)), "job": job_of(path),
            "jobs": [str(j.parent.relative_to(ROOT)) for j in jobs],
            "quiet_jobs": [r["measured"]["measurement_file"].split("/")[-2] for r in quiet],
            "loaded_jobs": [r["measured"]["measurement_file"].split("/")[-2] for r in loaded],
            "commands": [" ".join(r["job_run"]["command"][-9:]) if r.get("job_run") else None for r in res],
            "load": [r["measured"].get("load") for r in res], "rows": rows,
            "predicted": {k: res[0]["predicted"][k] for k in ("breakdown_s", "simulator")},
            "sweep": [r["measured"].get("sweep") for r in res],
            "config": res[0]["measured"]["config"], "environment": res[0]["measured"]["environment"],
            "replayed_bubble_fraction": [_replay(r) for r in quiet] if job_of(path) == "pipeline" else None,
            "measured_bubble_fraction": [r["measured"]["bubble_fraction"] for r in quiet] if job_of(path) == "pipeline" else None,
        })  # fmt: skip
    data = {"record": "cpu-pipeline-tp", "machine": machine(), "python": platform.python_version(),
            "torch": version("torch"), "calibration": CALIBRATION, "scenarios": scen,
            "created": time.strftime("%Y-%m-%d %H:%M")}  # fmt: skip
    from sim.ioutil import atomic_write_text, dumps_json

    atomic_write_text(RECORD.with_suffix(".json"), dumps_json(data))
    print(f"wrote {RECORD.with_suffix('.json')}; tables for {RECORD.with_suffix('.md')}:\n")
    for sc in scen:
        print(f"### {sc['scenario']}\n\n| quantity | measured ms | predicted ms | error | every quiet job's error | "
              "loaded jobs' error |\n|---|---|---|---|---|---|")
        for r in sc["rows"]:
            scale, digits = (1, 3) if r["quantity"].endswith("fraction") else (1e3, 3)
            err = "-" if r["error_rel"] is None else f"{r['error_rel'] * 100:+.1f}%"
            every, loaded = (", ".join("-" if e is None else f"{e * 100:+.0f}%" for e in r[k])
                             for k in ("every_job_error_rel", "loaded_jobs_error_rel"))
            name = f"**{r['quantity']}**" if r["compared"] else r["quantity"]
            m, p = (("-" if v is None else f"{v * scale:.{digits}f}") for v in (r["measured_s"], r["predicted_s"]))
            print(f"| {name} | {m} | {p} | {err} | {every} | {loaded} |")
        if sc["replayed_bubble_fraction"]:
            print("\nbubble fraction of the simulator's schedule replayed with each quiet job's own pass times and p2p: "
                  + ", ".join(f"{v:.3f}" for v in sc["replayed_bubble_fraction"]) + " (measured: "
                  + ", ".join(f"{v:.3f}" for v in sc["measured_bubble_fraction"]) + ")")
        print()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    if sys.argv[1:2] == ["run"]:
        run(int(sys.argv[2]) if len(sys.argv) > 2 else 3)
    elif sys.argv[1:2] == ["render"]:
        render()
    else:
        raise SystemExit(__doc__)
