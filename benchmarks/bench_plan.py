"""``moesim plan`` on the published runs the issue names; writes benchmarks/results/plan.{json,md,png}.

Issue 30's targets: for D5 (GPT-OSS-120B on 64 H100) and D9 (Qwen3-235B-A22B on 256 H100) of
validation/published/, the published layout is in the plan's top 10 and the best layout found is, in
simulation, at least as fast as the published one; planning D9 takes 10 minutes or less on this machine.

Each case runs ``moesim plan --model validation/published/<ID>.yaml --topology dgx-h100 --gpus N`` in a
fresh process (fresh log, the default jobs = CPU count), timed by wall clock, and simulates the
published scenario as it stands (``moesim simulate``, folded DES). Where the published layout is not
among the simulated plans, its place is bounded from below by the distinct layouts the plan estimated
faster than the published layout's own estimate, and the closed form's layout rank is given.

    python benchmarks/bench_plan.py                 # D5, D9 and D9 with 8 GiB kept free (~11 min on 2 cores)
    python benchmarks/bench_plan.py --only D5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sim.ioutil import atomic_write_text, dumps_json  # noqa: E402

#: case -> (published entry, GPUs, extra plan options)
CASES = {"D5": ("D5", 64, []), "D9": ("D9", 256, []), "D9-headroom8": ("D9", 256, ["--headroom", "8"])}
TARGET_S = 600.0
DEGREES = ("tp", "cp", "pp", "vpp", "ep", "etp", "dp")
CATEGORIES = ("compute", "a2a", "pipeline_bubble", "tp_comm", "exposed_comm", "imbalance_wait", "optimizer")


def lscpu_head() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "lscpu not available"
    return "\n".join(out.splitlines()[:15])


def _cli(args: list[str]) -> tuple[float, float]:
    """Run ``python -m sim ARGS``; (wall seconds, CPU seconds of it and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sim", *args], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"moesim {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measured_step(entry: Path) -> float | None:
    """The entry's measured step (or the one derived from its tokens/s)."""
    import yaml

    m = yaml.safe_load(entry.read_text())["measured"]
    return m.get("step_time_s") or m.get("step_time_s_derived")


def published_layout(entry: Path) -> dict:
    from sim.api import load_scenario

    s = load_scenario(entry)
    return {**{k: v for k, v in s.layout.describe().items() if k in DEGREES},
            "micro_batch_size": s.training.micro_batch_size, "recompute": s.training.activation_checkpointing}  # fmt: skip


def published_estimate_and_screen(entry: Path, gpus: int, pub: dict, extra: list[str]) -> dict:
    """The published configuration as the plan sees it: its estimate and the closed form's layout rank."""
    from sim.studies.plan import estimate_point, layout_key, prune
    from sim.studies.plan_base import build_base, candidate_scenario
    from sim.studies.plan_screen import Screen
    from sim.studies.plan_space import enumerate_space

    headroom = float(extra[extra.index("--headroom") + 1]) if "--headroom" in extra else 0.0
    base = build_base(entry, "dgx-h100", gpus, headroom_GiB=headroom)
    cands, _ = enumerate_space(base.shape, base.space)
    fits, _, _ = prune(base, cands)
    screen = Screen(base.scenario)
    best: dict[tuple, float] = {}
    mine = None
    for f in fits:
        t = screen.step(f.scenario).step_time_s
        key = layout_key(f.candidate)
        best[key] = min(best.get(key, t), t)
        c = f.candidate
        if {k: getattr(c, k) for k in DEGREES} == {k: pub[k] for k in DEGREES} and (
                c.micro_batch_size, c.recompute) == (pub["micro_batch_size"], pub["recompute"]):  # fmt: skip
            mine = f
    if mine is None:
        return {"fits": False}
    key = layout_key(mine.candidate)
    rank = 1 + sum(t < best[key] for k, t in best.items() if k != key)
    est = estimate_point(candidate_scenario(base, mine.candidate))
    return {"fits": True, "estimate_step_time_s": est["step_time_s"], "screen_layout_rank": rank,
            "screen_layouts": len(best), "memory_GiB": mine.memory["peak_GiB_per_gpu"]}  # fmt: skip


def run_case(case: str, tmp: Path, plot: Path | None) -> dict:
    from sim.studies.plan import constant_knobs, label_of

    entry_id, gpus, extra = CASES[case]
    entry = ROOT / "validation" / "published" / f"{entry_id}.yaml"
    out = tmp / f"{case}.json"
    cmd = ["plan", "--model", str(entry.relative_to(ROOT)), "--topology", "dgx-h100", "--gpus", str(gpus), *extra,
           "--json", str(out), "--log", str(tmp / f"{case}.jsonl"), "--fresh", "--no-progress"]  # fmt: skip
    if plot:
        cmd += ["--plot", str(plot)]
    load_before = os.getloadavg()[0]
    wall, cpu = _cli(cmd)
    load_after = os.getloadavg()[0]
    doc = json.loads(out.read_text())
    const = constant_knobs(doc)
    sim_out = tmp / f"{case}-published.json"
    _cli(["simulate", str(entry.relative_to(ROOT)), "--json", str(sim_out)])
    published = json.loads(sim_out.read_text())
    pub = published_layout(entry)
    same = [p for p in doc["plans"] if all(p["layout"][k] == pub[k] for k in DEGREES)]
    seen = published_estimate_and_screen(entry, gpus, pub, extra)
    faster = {json.dumps({k: e["layout"][k] for k in (*DEGREES, "dispatcher", "framework", "policy")})
              for e in doc["estimates"] if e["step_time_s"] < seen.get("estimate_step_time_s", 0)}  # fmt: skip
    best = doc["plans"][0]
    diff = {k: best["breakdown_s"].get(k, 0.0) - published["breakdown_s"].get(k, 0.0) for k in CATEGORIES}
    return {
        "case": case,
        "command": "moesim " + " ".join(cmd[: 7 + len(extra)]),
        "headroom_GiB": doc["headroom_GiB"],
        "wall_s": wall,
        "cpu_s": cpu,
        "load_average_1min": [load_before, load_after],
        "counts": doc["counts"],
        "plans": [{k: p[k] for k in ("rank", "step_time_s", "tokens_per_s_per_gpu", "mfu", "bound_by", "shares",
                                     "estimate_step_time_s")}
                  | {"label": label_of(p, const), "memory_GiB": p["memory"]["peak_GiB_per_gpu"]} for p in doc["plans"]],  # fmt: skip
        "published": {
            "layout": pub,
            "measured_step_time_s": measured_step(entry),
            "step_time_s": published["step_time_s"],
            "tokens_per_s_per_gpu": published["tokens_per_s_per_gpu"],
            "memory_GiB": published["memory"]["peak_GiB_per_gpu"],
            "breakdown_s": published["breakdown_s"],
            "layout_rank_in_plans": same[0]["rank"] if same else None,
            "same_knobs_in_plans": bool(same) and all(same[0]["layout"][k] == pub[k] for k in ("micro_batch_size", "recompute")),
            "estimated_layouts_faster": len(faster),
            **seen,
        },
        "best": {"label": label_of(best, const), "step_time_s": best["step_time_s"], "breakdown_s": best["breakdown_s"],
                 "memory_GiB": best["memory"]["peak_GiB_per_gpu"], "layout": best["layout"]},  # fmt: skip
        "speedup_over_published": published["step_time_s"] / best["step_time_s"],
        "breakdown_difference_s": diff,
    }


def _md(record: dict) -> str:
    lines = ["# `moesim plan` on the published runs (issue 30)", "",
             f"Recorded {record['date']} by `python benchmarks/bench_plan.py` on this machine (`lscpu | head -15`):",
             "", "```", record["lscpu"], "```", "",
             "Targets: the published layout in the plan's top 10; the best layout found at least as fast as the "
             "published one in simulation; planning D9 in 10 minutes or less. Each plan ran fresh (no run log) with "
             "the default jobs (the CPU count). Step times are the folded DES.", ""]  # fmt: skip
    for c in record["cases"]:
        pub, best = c["published"], c["best"]
        target = f" (target {TARGET_S:.0f} s)" if c["case"] == "D9" else ""
        load = c["load_average_1min"]
        lines += [f"## {c['case']}", "", f"`{c['command']}`: {c['wall_s']:.0f} s wall, {c['cpu_s']:.0f} s CPU{target}; "
                  f"1-minute load average {load[0]:.1f} before, {load[1]:.1f} after (2 CPUs).", ""]  # fmt: skip
        cnt = c["counts"]
        lines += [f"{cnt['combinations']:,} combinations, {sum(cnt['do_not_fit'].values()):,} do not fit "
                  f"({', '.join(f'{k} {v:,}' for k, v in cnt['do_not_fit'].items())}), "
                  f"{sum(cnt['invalid'].values())} invalid, {cnt['fit']:,} fit, {cnt['estimated']} estimated, "
                  f"{cnt['simulated']} simulated.", "",
                  "| rank | layout | step s | tokens/s/GPU | MFU | mem GiB | bound by | estimate s |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for p in c["plans"]:
            shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(p["shares"].items(), key=lambda kv: -kv[1])[:2])
            lines.append(f"| {p['rank']} | {p['label']} | {p['step_time_s']:.3f} | {p['tokens_per_s_per_gpu']:,.0f} | "
                         f"{100 * p['mfu']:.1f}% | {p['memory_GiB']:.1f} | {shares} | {p['estimate_step_time_s']:.3f} |")  # fmt: skip
        lay = " ".join(f"{k}{pub['layout'][k]}" for k in DEGREES) + (
            f", mbs {pub['layout']['micro_batch_size']}, recompute {pub['layout']['recompute']}")
        where = (f"rank {pub['layout_rank_in_plans']}" + ("" if pub["same_knobs_in_plans"] else " (with other micro-batch/recompute knobs)")
                 if pub["layout_rank_in_plans"] else
                 f"not in the top {len(c['plans'])}: {pub['estimated_layouts_faster']} distinct layouts estimated "
                 f"faster than its own estimate ({pub.get('estimate_step_time_s', float('nan')):.3f} s), so rank "
                 f"{pub['estimated_layouts_faster'] + 1} or below; the closed form puts it at layout "
                 f"{pub.get('screen_layout_rank')} of {pub.get('screen_layouts')}")  # fmt: skip
        diff = ", ".join(f"{k} {v:+.2f} s" for k, v in sorted(c["breakdown_difference_s"].items(), key=lambda kv: kv[1]) if abs(v) >= 0.05)
        lines += ["", f"Published layout ({lay}): simulated {pub['step_time_s']:.3f} s ({pub['tokens_per_s_per_gpu']:,.0f} "
                  f"tokens/s/GPU, {pub['memory_GiB']:.1f} GiB), measured {pub['measured_step_time_s']:.3f} s; in the plan: {where}.",
                  "", f"Best found: {best['label']}, {best['step_time_s']:.3f} s, {c['speedup_over_published']:.3f}x the "
                  f"published layout, {best['memory_GiB']:.1f} GiB. Breakdown, best minus published: {diff}.", ""]  # fmt: skip
        note = NOTES.get(c["case"])
        if note:
            lines += [note, ""]
    return "\n".join(lines)


#: What makes the difference, read off the record of 2026-12-07, after the sustained-fraction refit (rewrite when the record changes).
NOTES: dict[str, str] = {
    "D5": "What makes the difference: the published layout runs GPT-OSS-120B's 36 layers on 4 pipeline stages "
    "of 9 without interleaving, and the last stage also carries the LM head and loss over a 201,088-word "
    "vocabulary: in simulation the other stages wait for it, so the pipeline bubble is 2.2 s of the 9.5 s "
    "step where 1F1B's own (3/83 with 80 micro-batches) is 0.4 s. The best layouts halve the pipeline and "
    "interleave it: PP2 x VPP3 (6 layers a chunk) leaves 0.81 s of bubble (-1.37 s); with dp 32 the same "
    "global batch is 40 micro-batches a rank, and without recompute compute drops 0.21 s, for 0.15 s more "
    "exposed gradient reduce-scatter. It spends memory the published run leaves free (75.6 against 53.3 GiB "
    "in the model; Megatron's gradient buffer counted in the bf16 the recipe reduces in). The published "
    "degrees rank 21st or lower by the estimate (18th of 197 by the closed form). The ten layouts lie within "
    "8% of each other, and D5 itself is simulated 32% faster than measured: the order among them is the "
    "simulator's opinion, not a measurement.",
    "D9": "What makes the difference: the all-to-all. EP32 spreads a token's 8 experts over ~3.6 of the EP "
    "group's 4 nodes and DeepEP sends it once over InfiniBand to each remote node (~2.7 copies); EP16 spans 2 "
    "nodes (~1 copy). In simulation that is 6.10 s of all-to-all per step against 2.17 s (-3.94 s), for 0.26 s "
    "more compute (8 experts a GPU instead of 4). Every layout the plan estimated is faster than the published "
    "one, so the target is missed: the published layout ranks 21st or lower (the closed form puts it 81st of 429 "
    "layouts), 28% slower than the best. Two things the simulator does not see can make EP16 lose in practice: "
    "memory (the best layouts use 77-79 of the model's 79.6 GiB, with no room for the CUDA context, NCCL and "
    "DeepEP buffers or fragmentation) and the measurement itself (D9 is simulated 6% faster than its 19.7 s). "
    "The first is tested below: with 8 GiB kept free EP16 still wins by 23%. Nor is it the simulator's "
    "all-to-all bias: it over-predicts DeepEP's EP16 bandwidth more than EP32's (C2: +29% against +10%), but "
    "priced at C2's measured 43 and 58 GB/s the two take about 2.8 and 6.7 s, the same 3.9 s apart. The row comes from the "
    "ModelZoo's 'Cross-node EP strategy' table, a demonstration of EP across nodes rather than a claim of the "
    "fastest layout.",
    "D9-headroom8": "With 8 GiB per GPU kept free the EP16 layouts that filled memory drop out (tp2 pp4 vpp8 at "
    "79.2 GiB, tp2 pp8 vpp4 with no recompute at 79.4) and selective recompute comes back, but the all-to-all "
    "difference stands: the best is 1.23x the published layout at 68.6 GiB, and the published layout still "
    "ranks 21st or lower.",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help=f"comma-separated cases ({', '.join(CASES)})")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "plan"), help="results path without suffix")
    args = ap.parse_args()
    cases = args.only.split(",") if args.only else list(CASES)
    record = {"date": time.strftime("%Y-%m-%d"), "lscpu": lscpu_head(), "cpus": os.cpu_count(), "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            plot = Path(f"{args.out}.png") if case == "D9" else None
            record["cases"].append(run_case(case, Path(tmp), plot))
            print(f"{case}: {record['cases'][-1]['wall_s']:.0f} s", flush=True)
    d9 = next((c for c in record["cases"] if c["case"] == "D9"), None)
    record["targets"] = {
        "published_in_top_10": {c["case"]: c["published"]["layout_rank_in_plans"] is not None for c in record["cases"]},
        "best_at_least_as_fast": {c["case"]: c["speedup_over_published"] >= 1.0 for c in record["cases"]},
        "d9_within_600_s": None if d9 is None else d9["wall_s"] <= TARGET_S,
    }
    atomic_write_text(f"{args.out}.json", dumps_json(record))
    atomic_write_text(f"{args.out}.md", _md(record) + "\n")
    print(json.dumps(record["targets"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
