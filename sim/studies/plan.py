"""``moesim plan``: the best layouts of a model on N GPUs, searched with the simulator.

1. **Enumerate** the space of :mod:`sim.studies.plan_space` (degrees, micro-batch size, recompute and
   the dispatchers, frameworks and policies asked for), counting what its rules drop.
2. **Prune** each candidate as a scenario (``check_layout``: invalid, with the field it breaks) and by
   the memory model (:func:`~sim.studies.plan_base.memory_record`: does not fit; a layout whose
   parameters and optimizer states alone overflow a stage is out for every micro-batch and recompute).
3. **Screen** what fits with the closed form of :mod:`sim.studies.plan_screen`; the best layouts
   (degrees, dispatcher, framework, policy), each with its :data:`VARIANTS_PER_LAYOUT` best micro-batch
   / recompute choices, make the shortlist.
4. **Estimate**: the lane engine's estimate pass (``fidelity="estimate"``: every lane, all-to-alls by
   their link-load bound) ranks the shortlist. A step is linear in its micro-batches once the pipeline
   is full, so each candidate runs with ``pp`` and ``pp + 2`` (interleaved: ``2 pp``) micro-batches and
   the step, its breakdown and MFU are extrapolated to the real count (0.03% from the full estimate on
   Qwen3-235B's published layout).
5. **Simulate** the best ``top`` layouts with the DES (``fidelity="folded"``, every micro-batch), on local
   processes or Ray (:mod:`sim.studies.sweep`, :mod:`sim.studies.sweep_ray`); they are ranked by it.
   Each layout goes in once: its fastest variant by the estimate, or among those within
   :data:`TIE_FRACTION` of it the one that needs the least memory.

Stages 4 and 5 append every run to a JSONL log in ``moesim sweep``'s format (:class:`~sim.studies.sweep.RunLog`:
its header names the plan; each line a candidate's overrides, plus ``plan.fidelity``): the same command
again resumes, running nothing that is in the log.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sim.errors import InputError
from sim.inputs.scenario import Scenario
from sim.reports.progress import part, report, reporting
from sim.studies.plan_base import PlanBase, candidate_scenario, fits, memory_record, states_exceed
from sim.studies.plan_screen import Screen
from sim.studies.plan_space import Candidate, enumerate_space, short_label
from sim.studies.sweep import RunLog, map_local, point_key, read_log

#: micro-batch / recompute variants of one layout that the screen may send to the estimate
VARIANTS_PER_LAYOUT = 2
#: variants of a layout whose estimates are this close count as tied: the one needing less memory wins
TIE_FRACTION = 0.005
#: breakdown categories -> what ``bound_by`` calls them
BOUNDS = {"compute": "compute", "a2a": "all-to-all", "pipeline_bubble": "pipeline bubble",
          "exposed_comm": "gradient sync", "imbalance_wait": "imbalance", "tp_comm": "tp comm",
          "optimizer": "optimizer"}  # fmt: skip
MEMORY_KEYS = ("peak_GiB_per_gpu", "capacity_GiB", "fits", "weights_GiB", "gradients_GiB", "optimizer_GiB",
               "activations_GiB")  # fmt: skip


@dataclass
class Fit:
    """A candidate that fits: its scenario, memory record and closed-form step."""

    candidate: Candidate
    scenario: Scenario
    memory: dict[str, Any]
    screen_s: float = 0.0


def layout_key(c: Candidate) -> tuple:
    """What makes a layout: the degrees, the split and the searched dispatcher, framework, policy."""
    return (c.tp, c.cp, c.pp, c.vpp, c.ep, c.etp, c.dp, c.split, c.dispatcher, c.framework, c.policy)


# ---- prune ---------------------------------------------------------------------------------------
def prune(base: PlanBase, candidates: list[Candidate]) -> tuple[list[Fit], Counter, Counter]:
    """(fitting candidates, invalid ones by field, what does not fit by why). Memory is computed once
    per layout, micro-batch size and recompute (dispatcher and policy change none of it), and a larger
    micro-batch only where the smaller one fit (activations grow with the tokens)."""
    invalid: Counter = Counter()
    no_fit: Counter = Counter()
    kept: list[Fit] = []
    groups: dict[tuple, list[Candidate]] = defaultdict(list)
    for c in candidates:
        groups[(c.tp, c.cp, c.pp, c.vpp, c.ep, c.etp, c.dp, c.split, c.framework)].append(c)
    for n, group in enumerate(groups.values()):
        report(n / len(groups), "checking layouts")
        states_over: bool | None = None
        mem: dict[tuple[int, str], dict[str, Any] | None] = {}
        for c in sorted(group, key=lambda c: c.micro_batch_size):
            try:
                s = candidate_scenario(base, c)
            except InputError as exc:
                invalid[exc.field or exc.message.split(":")[0]] += 1
                continue
            if states_over is None:
                states_over = states_exceed(s, base.headroom_GiB)
            if states_over:
                no_fit["parameters and optimizer states alone"] += 1
                continue
            key = (c.micro_batch_size, c.recompute)
            if key not in mem:
                smaller = mem.get((c.micro_batch_size // 2, c.recompute), {}) if c.micro_batch_size > 1 else {}
                mem[key] = None if smaller is None else memory_record(s)
            rec = mem[key]
            if rec is None or not fits(rec, base.headroom_GiB):
                mem[key] = None
                no_fit["with activations"] += 1
                continue
            kept.append(Fit(c, s, rec))
    return kept, invalid, no_fit


def shortlist(fitting: list[Fit], n: int) -> list[Fit]:
    """The best layouts by the closed form, each with up to :data:`VARIANTS_PER_LAYOUT` of its best
    variants, until ``n`` candidates."""
    by_layout: dict[tuple, list[Fit]] = defaultdict(list)
    for f in sorted(fitting, key=lambda f: (f.screen_s, f.candidate.key())):
        by_layout[layout_key(f.candidate)].append(f)
    out: list[Fit] = []
    for variants in by_layout.values():  # in order of each layout's best variant
        for f in variants[:VARIANTS_PER_LAYOUT]:
            if len(out) < n:
                out.append(f)
    return out


def best_variants(short: list[Fit], estimates: dict[int, dict[str, Any]], order: list[int]) -> list[int]:
    """One variant per layout, layouts in order of their fastest estimate: the fastest, or among the
    variants within :data:`TIE_FRACTION` of it the one that needs the least memory."""
    by_layout: dict[tuple, list[int]] = {}
    for i in order:
        by_layout.setdefault(layout_key(short[i].candidate), []).append(i)
    out = []
    for variants in by_layout.values():
        limit = estimates[variants[0]]["step_time_s"] * (1 + TIE_FRACTION)
        close = [i for i in variants if estimates[i]["step_time_s"] <= limit]
        out.append(min(close, key=lambda i: (short[i].memory["peak_GiB_per_gpu"], estimates[i]["step_time_s"])))
    return out


# ---- the runs (workers: picklable in, JSON-ready out) ---------------------------------------------
def extrapolation_points(s: Scenario) -> tuple[int, ...]:
    """Micro-batch counts the estimate runs with: ``(m,)`` when that is few, else ``(pp, pp + 2)``
    (interleaved: ``(pp, 2 pp)``, its micro-batches come in groups of pp)."""
    p, m = s.parallelism, s.training.grad_accum_steps
    lo = max(p.pp, 2)
    hi = 2 * p.pp if p.schedule == "interleaved" else lo + 2
    return (m,) if m <= hi else (lo, hi)


def _with_micro(s: Scenario, m: int) -> Scenario:
    t = s.training.model_copy(update={"grad_accum_steps": m, "global_batch_size": m * s.training.micro_batch_size * s.dp})
    return s.model_copy(update={"training": t})


def estimate_point(s: Scenario, engine: str = "des", comm_model: str = "auto") -> dict[str, Any]:
    """The lane engine's estimate of ``s``, extrapolated linearly in the micro-batches (see the module
    docstring); ``engine`` and ``comm_model`` are there for the sweep runners' signature."""
    from sim.engine.simulate import simulate

    m = s.training.grad_accum_steps
    points = extrapolation_points(s)
    runs = [simulate(_with_micro(s, k), engine=engine, comm_model=comm_model, fidelity="estimate") for k in points]
    first, last = runs[0], runs[-1]

    def at_m(a: float, b: float) -> float:
        return a if len(points) == 1 else a + (b - a) * (m - points[0]) / (points[1] - points[0])

    step = at_m(first["step_time_s"], last["step_time_s"])
    tokens = s.global_batch_size * s.training.seq_len
    return {
        "fidelity": "estimate",
        "step_time_s": step,
        "tokens_per_s_per_gpu": tokens / step / s.world_size,
        "mfu": last["mfu"] * (m / points[-1]) * (last["step_time_s"] / step),  # FLOPs grow with m, time as step
        "breakdown_s": {k: at_m(first["breakdown_s"][k], v) for k, v in last["breakdown_s"].items()},
        "micro_batches_run": list(points),
        "steps_run_s": [r["step_time_s"] for r in runs],
    }


def compact(result: dict[str, Any]) -> dict[str, Any]:
    """What the log keeps of a DES run."""
    keep = ("step_time_s", "tokens_per_s_per_gpu", "mfu", "breakdown_s", "num_gpus", "traffic")
    out = {k: result[k] for k in keep if k in result}
    out["fidelity"] = "folded"
    out["memory"] = {k: result["memory"][k] for k in MEMORY_KEYS if k in result["memory"]}
    folded = result.get("simulator", {}).get("folded")
    if folded:
        out["folded"] = {k: folded[k] for k in ("lanes_total", "lanes_simulated") if k in folded}
    return out


# ---- results -------------------------------------------------------------------------------------
def bound_by(breakdown: dict[str, float], step: float) -> tuple[str, dict[str, float]]:
    """The category that holds most of the step, and every category's share of it."""
    shares = {BOUNDS[k]: breakdown.get(k, 0.0) / step for k in BOUNDS if step > 0}
    return max(shares, key=lambda k: shares[k]) if shares else "compute", shares


def plan_entry(f: Fit, run: dict[str, Any], estimate: dict[str, Any] | None) -> dict[str, Any]:
    step = run["step_time_s"]
    bound, shares = bound_by(run["breakdown_s"], step)
    mem = {k: f.memory[k] for k in MEMORY_KEYS if k in f.memory}
    mem["per_stage_GiB"] = [round(x["peak_GiB_per_gpu"], 3) for x in f.memory.get("per_stage", [])]
    return {
        "label": f.candidate.label,
        "layout": f.candidate.layout(),
        "fidelity": run["fidelity"],
        "step_time_s": step,
        "tokens_per_s_per_gpu": run["tokens_per_s_per_gpu"],
        "mfu": run["mfu"],
        "memory": mem,
        "bound_by": bound,
        "shares": shares,
        "breakdown_s": run["breakdown_s"],
        "estimate_step_time_s": estimate["step_time_s"] if estimate else None,
        "screen_step_time_s": f.screen_s,
    }


def plan_header(base: PlanBase) -> dict[str, Any]:
    """The log's first line: ``moesim sweep``'s header, naming the model file and the plan's inputs."""
    return {"moesim_sweep": 1, "scenario": base.model_file, "scenario_sha256": base.model_sha256,
            "set": list(base.options), "engine": "des", "comm_model": "auto", "moesim_plan": 1}  # fmt: skip


def default_log(json_path: str | None, base: PlanBase) -> Path:
    """Next to ``--json P`` (``P`` with suffix ``.jsonl``); else ``runs/plan-<model>-<hash>.jsonl``."""
    if json_path and json_path != "-":
        return Path(json_path).with_suffix(".jsonl")
    digest = hashlib.sha256(json.dumps(plan_header(base), sort_keys=True).encode()).hexdigest()[:10]
    return Path("runs") / f"plan-{Path(base.model_file).stem}-{digest}.jsonl"


def _run(fn: Callable | None, todo: list[tuple[int, Scenario]], backend: str, jobs: int,
         address: str | None, on_result: Callable) -> None:  # fmt: skip
    if backend == "ray":
        from sim.studies.sweep import run_point
        from sim.studies.sweep_ray import run_ray

        run_ray(todo, "des", "auto", jobs, address, on_result, fn or run_point)
    elif fn is None:
        from sim.studies.sweep import run_local

        run_local(todo, "des", "auto", jobs, on_result)
    else:
        map_local(fn, todo, jobs, on_result)


def run_plan(base: PlanBase, *, top: int = 10, shortlist_size: int | None = None, backend: str = "local",
             jobs: int = 1, address: str | None = None, log_path: Path, fresh: bool = False,
             progress: bool = True, force: bool = False) -> dict[str, Any]:  # fmt: skip
    """Plan ``base`` (see the module docstring); returns the JSON document, plus ``_resumed`` (runs
    found in the log), ``_log`` and ``_timing_s`` (seconds per stage) for the caller."""
    if backend not in ("local", "ray"):
        raise InputError(f"backend must be local or ray, not {backend!r}", field="--backend")
    m = base.scenario.model  # the analytic screen prices attention + FFN layers at hidden_size only
    if m.hybrid_pattern is not None or m.moe_latent_size is not None:
        raise InputError("plan does not screen hybrid (Mamba-2) or LatentMoE models yet; simulate their layouts "
                         "with moesim simulate or sweep", field="model.hybrid_pattern")  # fmt: skip
    n_short = shortlist_size or max(4 * top, 20)
    timing: dict[str, float] = {}
    clock = time.perf_counter()
    header = plan_header(base)
    done = {} if fresh else read_log(log_path, header)
    log = RunLog(log_path, header, fresh=fresh)
    resumed = 0
    with reporting("plan", enabled=progress), contextlib.closing(log):
        candidates, dropped = enumerate_space(base.shape, base.space)
        with part(0, 3, "prune"):
            fitting, invalid, no_fit = prune(base, candidates)
        timing["prune"] = time.perf_counter() - clock
        screen = Screen(base.scenario)
        for f in fitting:
            f.screen_s = screen.step(f.scenario).step_time_s
        short = shortlist(fitting, n_short)
        timing["screen"] = time.perf_counter() - clock - timing["prune"]

        def stage(index: int, kind: str, chosen: list[Fit], fn: Callable | None) -> dict[int, dict[str, Any]]:
            nonlocal resumed
            out: dict[int, dict[str, Any]] = {}
            keys = [point_key({**f.candidate.overrides(), "plan.fidelity": kind}) for f in chosen]
            todo = []
            for i, (f, key) in enumerate(zip(chosen, keys, strict=True)):
                if key in done:
                    out[i] = done[key]
                    resumed += 1
                else:
                    todo.append((i, f.scenario))

            def on_result(i: int, result: dict[str, Any]) -> None:
                rec = result if kind == "estimate" else compact(result)
                log.append({"overrides": {**chosen[i].candidate.overrides(), "plan.fidelity": kind}, **rec})
                out[i] = rec
                report(len(out), chosen[i].candidate.label)

            with part(index, 3, f"{kind} runs", total=len(chosen)):
                _run(fn, todo, backend, jobs, address, on_result)
            return out

        t0 = time.perf_counter()
        estimates = stage(1, "estimate", short, estimate_point)
        timing["estimate"] = time.perf_counter() - t0
        order = sorted(range(len(short)), key=lambda i: (estimates[i]["step_time_s"], short[i].candidate.key()))
        ranked = best_variants(short, estimates, order)
        chosen_idx = _guarded(short, ranked[:top], force, jobs, backend, address)
        t0 = time.perf_counter()
        des = stage(2, "folded", [short[i] for i in chosen_idx], None)
        timing["simulate"] = time.perf_counter() - t0
    des_by = {chosen_idx[j]: r for j, r in des.items()}
    plans = [plan_entry(short[i], des_by[i], estimates[i]) for i in chosen_idx]
    plans.sort(key=lambda p: (p["step_time_s"], p["label"]))
    for r, p in enumerate(plans, start=1):
        p["rank"] = r
    est_rows = [{"estimate_rank": r, **plan_entry(short[i], estimates[i], None)} for r, i in enumerate(order, 1)]
    counts = {
        "combinations": sum(dropped.values()) + len(candidates),
        "dropped_by_rules": dict(sorted(dropped.items())),
        "candidates": len(candidates),
        "invalid": dict(sorted(invalid.items())),
        "do_not_fit": dict(sorted(no_fit.items())),
        "fit": len(fitting),
        "not_shortlisted": len(fitting) - len(short),
        "estimated": len(short),
        "simulated": len(chosen_idx),
        "refused_by_resource_guard": min(top, len(ranked)) - len(chosen_idx),
    }
    timing["total"] = time.perf_counter() - clock
    s = base.scenario
    return {
        "model": s.model.name,
        "model_file": base.model_file,
        "topology": s.topology.name,
        "gpu": s.topology.gpu.kind,
        "gpus": base.space.gpus,
        "nodes": s.cluster.nodes,
        "global_batch": base.space.global_batch,
        "seq_len": base.space.seq_len,
        "dtype": s.training.dtype,
        "headroom_GiB": base.headroom_GiB,
        "space": _space_doc(base, candidates),
        "counts": counts,
        "plans": plans,
        "estimates": est_rows,
        "_resumed": resumed,
        "_log": str(log_path),
        "_timing_s": timing,
    }


def _guarded(short: list[Fit], idx: list[int], force: bool, jobs: int, backend: str, address: str | None) -> list[int]:
    """The DES runs the resource guard lets this machine take (all of them with ``--force`` or a remote
    Ray cluster); a refused one keeps its estimate and is left out of the ranking."""
    if force or (backend == "ray" and address):
        return idx
    from sim.studies.guard import available_memory_bytes, check_resources

    avail = available_memory_bytes()
    share = None if avail is None else avail / max(1, min(jobs, len(idx)))
    out = []
    for i in idx:
        try:
            check_resources(short[i].scenario, fidelity="folded", available_bytes=share)
            out.append(i)
        except InputError:
            continue
    return out


def _space_doc(base: PlanBase, candidates: list[Candidate]) -> dict[str, Any]:
    sp = base.space
    out: dict[str, Any] = {k: sorted({getattr(c, k) for c in candidates}) for k in
                           ("tp", "cp", "pp", "vpp", "ep", "etp", "dp", "micro_batch_size")}  # fmt: skip
    out.update({"recompute": list(sp.recomputes), "dispatcher": list(sp.dispatchers),
                "framework": list(sp.frameworks), "policy": list(sp.policies)})  # fmt: skip
    return out


def constant_knobs(doc: dict[str, Any]) -> set[str]:
    """The knobs a plan did not search (left out of its labels)."""
    return {k for k in ("dispatcher", "framework", "policy") if len(doc["space"][k]) == 1}


def label_of(entry: dict[str, Any], constant: set[str]) -> str:
    lay = entry["layout"]
    from sim.studies.plan_space import Split

    c = Candidate(lay["tp"], lay["cp"], lay["pp"], lay["vpp"], lay["ep"], lay["etp"], lay["dp"],
                  lay["micro_batch_size"], lay["grad_accum_steps"], lay["recompute"], lay["dispatcher"],
                  lay["framework"], lay["policy"], Split(**lay["layer_split"]))  # fmt: skip
    return short_label(c, constant)


__all__ = ["BOUNDS", "Fit", "best_variants", "bound_by", "constant_knobs", "default_log", "estimate_point", "extrapolation_points",
           "label_of", "layout_key", "plan_header", "prune", "run_plan", "shortlist"]
