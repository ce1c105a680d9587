"""A layout job against the simulator: run the real pipeline- or tensor-parallel job, simulate the same
scenario with a calibration (the lane engine, :func:`sim.engine.simulate.simulate` with every rank
traced), reduce both sides' spans to the same quantities (:mod:`hw_validate.layout.quantities`) and
write measured against predicted with the relative error ``(predicted - measured) / measured``.

Result (``format: moesim.layout_validation``, version 1; seconds)::

    {"job", "scenario", "scenario_file", "overrides", "calibration",
     "measured": {...summary of the measured steps..., "environment", "load", "measurement_file",
                  "sweep": the job's isolated p2p / collective timings},
     "predicted": {...the same quantities from the simulator..., "breakdown_s", "simulator"},
     "rows": [{"quantity", "measured_s", "predicted_s", "error_rel", "compared", "note"}],
     "error": {"compared": {quantity: error_rel}, "worst": quantity, "within_15pct": [...], "missed": [...]},
     "job_run": {"wall_s", "command"} | null}

``compared`` rows are the quantities the simulator is checked on (issue 27: the pipeline bubble and
the p2p sends; the TP collectives and the layers' GEMMs); the others are context (the step, each
pass, the optimizer, the collectives the simulator does not model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hw_validate.layout import quantities as Q
from hw_validate.layout.record import load, measured_spans
from sim.errors import InputError
from sim.ioutil import atomic_write_text, dumps_json

FORMAT = "moesim.layout_validation"
VERSION = 1
RESULT_FILE = "validation.json"
LOAD_FILE = "load.json"  # the machine's CPU shares during the job (hw_validate.layout.run)
TOLERANCE = 0.15


def simulation(scenario: str | Path, overrides: list[str], calibration: str | Path | None):
    """The scenario as simulated: with ``calibration`` (default: the scenario's own ``calibration:``)."""
    from sim.api import load_scenario
    from sim.inputs.calibration import load_calibration

    sets = list(overrides)
    if calibration is not None:
        sets.append(f"calibration={Path(calibration).resolve()}")
    s = load_scenario(scenario, sets)
    if s.calibration is None:
        raise InputError("no calibration: give --calibration (`moesim calibrate` writes one; calibrations/ has a "
                         "reference) or name one in the scenario", file=str(scenario), field="calibration")  # fmt: skip
    load_calibration(s.resolve_path(s.calibration))  # a bad file fails now, not after the job
    return s


def check_layout(job: str, s) -> None:
    """What each job runs (exit 2 otherwise): the pipeline job pp > 1 stages with tp = cp = dp = 1 and
    1f1b or interleaved; the tensor-parallel job tp = the world size; both dense layers, fp32, untied
    embeddings."""
    p, m = s.parallelism, s.model
    if job == "pipeline" and (p.pp < 2 or p.tp * p.cp * s.dp != 1 or p.schedule == "dualpipe"):
        raise InputError(f"the pipeline job runs pp > 1 with tp = cp = dp = 1 and the 1f1b or interleaved schedule; "
                         f"this layout is {s.layout.describe()}, {p.schedule}", file=s.source, field="parallelism")  # fmt: skip
    if job == "tensor_parallel" and (p.tp < 2 or p.tp != s.world_size):
        raise InputError(f"the tensor-parallel job runs tp = the world size ({s.world_size}) > 1; this layout is "
                         f"{s.layout.describe()}", file=s.source, field="parallelism.tp")  # fmt: skip
    if m.is_moe or m.tie_word_embeddings or s.training.dtype != "fp32" or m.attention != "mha":
        raise InputError("the layout jobs build dense layers (num_experts 1) with mha attention, untied embeddings "
                         "and fp32", file=s.source, field="model")  # fmt: skip


def layer_stages(s) -> dict[int, int]:
    """Model stage of every layer; the embedding is layer -1, the LM head layer ``num_layers``."""
    from sim.inputs.stages import stage_layers

    out = {}
    for vs in stage_layers(s):
        out.update(dict.fromkeys(vs.layers, vs.index))
        if vs.embedding:
            out[-1] = vs.index
        if vs.head:
            out[s.model.num_layers] = vs.index
    return out


def predict(job: str, s) -> dict[str, Any]:
    """The simulator's figures of ``job``'s quantities for scenario ``s`` (lane engine, one step)."""
    from sim.engine.simulate import simulate, uses_lane_engine

    res = simulate(s, trace_ranks=set(range(s.world_size)))
    spans = res.pop("_spans")
    if job == "pipeline":
        q = Q.simulated_pipeline(spans, layer_stages(s), s.world_size)
        q.pop("messages")
    else:
        q = Q.simulated_tp(spans, s.world_size)
    q["breakdown_s"] = res["breakdown_s"]
    q["simulator"] = {**res["simulator"], "lane_engine": uses_lane_engine(s, "folded"),
                      "host_effects": "not modelled (lane engine)"}  # fmt: skip
    return q


def measure_summary(job: str, data: dict[str, Any]) -> dict[str, Any]:
    steps = measured_spans(data)
    if not steps:
        raise InputError("the measurement has no measured steps (all warm-up)", field="measured_steps")
    if job == "pipeline":
        return Q.summarise_pipeline([Q.measured_pipeline(r) for r in steps])
    return Q.summarise_tp([Q.measured_tp(r) for r in steps])


def _row(quantity: str, m: float | None, p: float | None, compared: bool, note: str = "") -> dict[str, Any]:
    err = (p - m) / m if m not in (None, 0) and p is not None else None
    return {"quantity": quantity, "measured_s": m, "predicted_s": p, "error_rel": err, "compared": compared,
            "note": note}  # fmt: skip


def pipeline_rows(m: dict[str, Any], p: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [_row("pipeline_bubble", m["bubble_s"], p["bubble_s"], True, "mean over ranks, s per step"),
            _row("pipeline_bubble_fraction", m["bubble_fraction"], p["bubble_fraction"], True, "bubble / step")]
    for r, (mr, pr) in enumerate(zip(m["ranks"], p["ranks"], strict=True)):
        rows.append(_row(f"pipeline_bubble[rank {r}]", mr["bubble_s"], pr["bubble_s"], True))
    rows.append(_row("p2p_send", m["p2p_transfer_s"], p["p2p_transfer_s"], True,
                     "one activation/gradient: both sides posted -> receiver has it (median)"))  # fmt: skip
    rows.append(_row("p2p_send_after_pass", m["p2p_after_pass_s"], p["p2p_after_pass_s"], False,
                     "sender's pass end -> receiver has it, blocked receivers"))  # fmt: skip
    rows.append(_row("step", m["step_s"], p["step_s"], False))
    for k in sorted(set(m["pass_s"]) | set(p["pass_s"])):
        rows.append(_row(f"pass {k}", m["pass_s"].get(k), p["pass_s"].get(k), False, "F/B of stage, one micro-batch"))
    for r, (mr, pr) in enumerate(zip(m["ranks"], p["ranks"], strict=True)):
        rows.append(_row(f"compute[rank {r}]", mr["compute_s"], pr["compute_s"], False))
        rows.append(_row(f"optimizer[rank {r}]", mr["optimizer_s"], pr["optimizer_s"], False,
                         "job: torch AdamW; simulator: the calibration's DeepSpeed step"))  # fmt: skip
    for r, mr in enumerate(m["ranks"]):
        rows.append(_row(f"late-posted receives[rank {r}] (not simulated)", mr["late_post_wait_s"], 0.0, False,
                         "waits for data sent before the receive was posted"))  # fmt: skip
    return rows


def tp_rows(m: dict[str, Any], p: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [_row("tp_comm", m["tp_comm_s"], p["tp_comm_s"], True,
                 "the layers' TP collectives per step and rank (entry to exit)")]  # fmt: skip
    for k in sorted(p["per_call_first_s"]):
        rows.append(_row(f"{k} (one call)", m["per_call_first_s"].get(k), p["per_call_first_s"][k], True,
                         "last rank's entry -> first exit (the transport), median"))  # fmt: skip
    for k in sorted(p["per_call_own_s"]):
        rows.append(_row(f"{k} (one call, last exit)", m["per_call_own_s"].get(k), p["per_call_own_s"][k], False,
                         "last rank's entry -> last exit (a late wake-up included), median"))  # fmt: skip
    for k in sorted(p["per_call_s"]):
        rows.append(_row(f"{k} (one call, per rank)", m["per_call_s"].get(k), p["per_call_s"][k], False,
                         "entry to exit on each rank (waits for the peer included)"))  # fmt: skip
    for k in sorted(p["compute_s"]):
        rows.append(_row(f"{k} GEMMs (one call)", m["compute_s"].get(k), p["compute_s"][k], True,
                         "the layer's module window less its collectives, median"))  # fmt: skip
    rows.append(_row("step", m["step_s"], p["step_s"], False))
    for k in sorted(set(m["not_modelled_s"]) | set(p.get("not_modelled_s", {}))):
        rows.append(_row(f"{k} (outside the layers)", m["not_modelled_s"].get(k), p.get("not_modelled_s", {}).get(k, 0.0),
                         False, "embedding, LM head and vocab-parallel loss collectives, per step and rank"))  # fmt: skip
    return rows


def compare(job: str, m: dict[str, Any], p: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = pipeline_rows(m, p) if job == "pipeline" else tp_rows(m, p)
    cmp = {r["quantity"]: r["error_rel"] for r in rows if r["compared"] and r["error_rel"] is not None}
    worst = max(cmp, key=lambda k: abs(cmp[k])) if cmp else None
    return rows, {"compared": cmp, "worst": worst, "within_15pct": [k for k, e in cmp.items() if abs(e) <= TOLERANCE],
                  "missed": [k for k, e in cmp.items() if abs(e) > TOLERANCE]}  # fmt: skip


def validate_layout(job: str, scenario: str | Path, out_dir: str | Path, calibration: str | Path | None = None,
                    steps: int | None = None, warmup: int | None = None, overrides: list[str] | None = None,
                    timeout_s: float = 600.0, reuse: bool = False, echo: bool = False,
                    quiet: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """Run (or, with ``reuse``, read a finished) ``job`` of ``scenario`` into ``out_dir``, simulate it
    and write ``out_dir/validation.json``; returns the result."""
    from hw_validate.layout.run import MEASUREMENT_FILE, run_layout_job

    overrides = list(overrides or [])
    s = simulation(scenario, overrides, calibration)
    check_layout(job, s)
    out = Path(out_dir)
    meas_path = out / MEASUREMENT_FILE
    run = None
    if not (reuse and meas_path.is_file()):
        run = run_layout_job(job, scenario, out, steps, warmup, overrides, timeout_s, echo, quiet)
        atomic_write_text(out / LOAD_FILE, dumps_json(run.load))
    data = load(meas_path)
    if data["job"] != job:
        raise InputError(f"{meas_path} is a {data['job']} measurement, not {job}", file=str(meas_path))
    m = measure_summary(job, data)
    m.update(environment=data["environment"], measurement_file=str(meas_path), steps=data["steps"],
             measured_steps=len(data["measured_steps"]), config=data["config"], loss=data["loss"],
             sweep=data.get("sweep", []))  # fmt: skip
    if run is not None:
        m["load"] = run.load
    elif (out / LOAD_FILE).is_file():
        m["load"] = json.loads((out / LOAD_FILE).read_text())
    p = predict(job, s)
    rows, err = compare(job, m, p)
    result = {
        "format": FORMAT, "version": VERSION, "job": job, "scenario": s.name, "scenario_file": str(scenario),
        "overrides": overrides, "calibration": str(s.resolve_path(s.calibration)), "measured": m, "predicted": p,
        "rows": rows, "error": err,
        "job_run": None if run is None else {"wall_s": run.wall_s, "command": run.command},
    }  # fmt: skip
    atomic_write_text(out / RESULT_FILE, dumps_json(result))
    return result


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:9.3f}"


def format_table(result: dict[str, Any]) -> str:
    lines = [f"{result['job']} job {result['scenario']} vs simulator (calibration {result['calibration']})",
             f"{'quantity':44s} {'measured ms':>11s} {'predicted ms':>12s} {'error':>8s}"]  # fmt: skip
    for r in result["rows"]:
        mark = "*" if r["compared"] else " "
        err = "-" if r["error_rel"] is None else f"{r['error_rel'] * 100:+7.1f}%"
        if r["quantity"] == "pipeline_bubble_fraction":
            lines.append(f"{mark}{r['quantity']:43s} {r['measured_s']:11.3f} {r['predicted_s']:12.3f} {err:>8s}")
            continue
        lines.append(f"{mark}{r['quantity']:43s} {_ms(r['measured_s']):>11s} {_ms(r['predicted_s']):>12s} {err:>8s}")
    e = result["error"]
    lines.append(f"* compared: {len(e['within_15pct'])} within 15%, missed: {', '.join(e['missed']) or 'none'}")
    return "\n".join(lines)


def main(job: str, prog: str, doc: str, argv: list[str] | None = None) -> int:
    """The command line of ``python -m hw_validate.pipeline_job`` / ``tp_job``: exit 0 ok, 2 bad
    input, 1 the job failed."""
    import argparse
    import sys

    from hw_validate.launch import JobError
    from sim.ioutil import write_json

    ap = argparse.ArgumentParser(prog=prog, description=doc)
    ap.add_argument("scenario")
    ap.add_argument("--out", required=True, help="folder of measurement.json, validation.json and the logs")
    ap.add_argument("--calibration", default=None, help="calibration JSON (default: the scenario's calibration:)")
    ap.add_argument("--steps", type=int, default=None, help="default training.steps")
    ap.add_argument("--warmup", type=int, default=None, help="default training.warmup_steps")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--reuse", action="store_true", help="compare OUT/measurement.json again instead of running")
    ap.add_argument("--json", default=None, help="also write the result here (- for stdout)")
    ap.add_argument("--echo", action="store_true", help="show the job's output")
    ap.add_argument("--quiet", type=float, default=0.0, metavar="BUSY",
                    help="first wait (up to 5 min) until the machine's busy CPU share is below BUSY (0-1)")
    args = ap.parse_args(argv)
    try:
        res = validate_layout(job, args.scenario, args.out, args.calibration, args.steps, args.warmup,
                              args.overrides, args.timeout, args.reuse, args.echo, args.quiet)  # fmt: skip
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except JobError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        write_json(args.json, res)
    if args.json != "-":
        print(format_table(res))
    return 0


__all__ = ["FORMAT", "RESULT_FILE", "VERSION", "compare", "format_table", "main", "predict", "validate_layout"]
