"""The compared quantities of the layout jobs, reduced the same way from a job's spans
(:mod:`hw_validate.layout.record`) and from the simulator's spans (:class:`sim.engine.spans.Span`,
every rank traced). No torch here.

Pipeline, per step:

- each rank's **compute** (its forward and backward passes, the loss with the last stage's forward),
  its **optimizer** and the **pipeline bubble** = step time - compute - optimizer: the time the rank
  is not computing, as the simulator tiles a rank's step (its ``pipeline_bubble`` category); on the
  real side the bubble is also split into receive waits, send waits, posting the p2p ops and the
  rest (Python between the passes, the idle end), and ``late_post_wait_s`` is the part of the
  receive waits spent on data sent before the receive was posted (gloo moves it only then; the
  simulator delivers it at the sender's pass end + the transfer, so such a receive costs nothing there);
- the **p2p transfer** of every activation or gradient whose receiver did not compute between the
  moment both sides had posted (the later of the ``isend`` and the ``irecv``; gloo moves nothing
  before) and the end of its wait: from that moment to the receiver's wake-up, and ``after_pass``:
  from the end of the sender's pass to that wake-up (what the simulator's ``p2p_time`` stands for:
  it sends at the pass's end). gloo's ``is_completed()`` is not read: a receive that arrived can
  still report not completed until waited on;
- each pass's duration per (stage, F|B).

Tensor parallel, per step: every TP collective (kind, fwd|bwd, region, layer), as each rank saw it
(entry to exit, its wait for the peer included: the simulator's ``tp_comm``), and its own time from
the last rank's entry to the first rank's exit (the transport) and to the last rank's exit (one rank
woke up late); the compute of the attention and MLP regions of each layer (their windows less the
collectives inside).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

EPS = 1e-9
#: simulator spans that are not compute on a rank's compute stream
_NOT_COMPUTE = {"pipeline_bubble", "optimizer", "tp_overlap_wait", "imbalance_wait", "grad_sync_wait",
                "grad_norm_wait", "param_gather", "param_gather_wait", "capacity_sync_wait"}  # fmt: skip
TP_KINDS = ("tp_all_gather", "tp_reduce_scatter", "tp_all_reduce")


def _median(v) -> float | None:
    v = [x for x in v if x is not None]
    return float(np.median(v)) if v else None


# ---- pipeline ----------------------------------------------------------------------------------
def measured_pipeline(ranks: list[list[list]]) -> dict[str, Any]:
    """One step of a pipeline job: ``ranks[r]`` = that rank's ``[name, start, end, args]`` spans."""
    passes, rows = [], []
    issue: dict[tuple, float] = {}
    waits = []
    step_s = max(b for sp in ranks for n, a, b, x in sp if n == "step")
    for r, spans in enumerate(ranks):
        tot: dict[str, float] = defaultdict(float)
        for n, a, b, x in spans:
            tot[n] += b - a
            if n in ("forward", "backward"):
                passes.append({"rank": r, "kind": n[0].upper(), "stage": x["stage"], "micro": x["micro"],
                               "start": a, "end": b})  # fmt: skip
            elif n == "loss" and "micro" in x:
                passes.append({"rank": r, "kind": "L", "stage": None, "micro": x["micro"], "start": a, "end": b})
            elif n in ("send_issue", "recv_issue"):
                issue[(n[:4], x["dir"], x["micro"], x["stage"])] = a
            elif n == "recv_wait":
                waits.append((r, x, a, b))
        compute = tot["forward"] + tot["backward"] + tot["loss"]
        rows.append({
            "rank": r, "compute_s": compute, "optimizer_s": tot["optimizer"],
            "bubble_s": step_s - compute - tot["optimizer"], "recv_wait_s": tot["recv_wait"],
            "send_wait_s": tot["send_wait"], "post_s": tot["p2p_post"],
        })  # fmt: skip
        rows[-1]["other_s"] = rows[-1]["bubble_s"] - tot["recv_wait"] - tot["send_wait"] - tot["p2p_post"]
    busy = defaultdict(list)  # each rank's compute intervals
    for p in passes:
        busy[p["rank"]].append((p["start"], p["end"]))
    _fold_loss(passes)
    ends = {(p["kind"], p["stage"], p["micro"]): p["end"] for p in passes}
    messages = []
    for row in rows:
        row["late_post_wait_s"] = 0.0
    for r, x, a, b in waits:
        src = x["stage"] - 1 if x["dir"] == "F" else x["stage"] + 1
        sent = issue.get(("send", x["dir"], x["micro"], src))
        posted = issue.get(("recv", x["dir"], x["micro"], x["stage"]))
        if sent is None or posted is None:
            continue
        both = max(sent, posted)
        if any(s0 < b and e0 > both for s0, e0 in busy[r]):
            continue  # the receiver computed after both had posted: the data may have waited for it
        if posted > sent:  # the data was sent before the receive was posted: it still had to move
            rows[r]["late_post_wait_s"] += b - a
        sender_end = ends.get((x["dir"], src, x["micro"]))
        messages.append({"dir": x["dir"], "micro": x["micro"], "src": src, "dst": x["stage"],
                         "transfer_s": b - max(sent, posted),
                         "after_pass_s": b - sender_end if sender_end is not None else None})  # fmt: skip
    return _pipeline_step(step_s, rows, passes, messages)


def _fold_loss(passes: list[dict]) -> None:
    """The loss belongs to the last stage's forward of its micro-batch (the simulator's ``output``)."""
    fwd = {(p["rank"], p["micro"]): p for p in passes if p["kind"] == "F"}
    for p in [p for p in passes if p["kind"] == "L"]:
        f = fwd.get((p["rank"], p["micro"]))
        if f is not None:
            f["compute_s"] = f["end"] - f["start"] + p["end"] - p["start"]
        passes.remove(p)


def simulated_pipeline(spans: list, layer_stage: dict[int, int], world: int) -> dict[str, Any]:
    """One simulated step (every rank traced); ``layer_stage``: model stage of each layer (the
    embedding is layer -1, the head layer ``num_layers``)."""
    per_rank: list[list] = [[] for _ in range(world)]
    for sp in spans:
        if sp.stream == "compute":
            per_rank[sp.rank].append(sp)
    step_s = max(sp.end for sp in spans)
    windows: dict[tuple, list[float]] = {}
    rows, bubble_ends = [], defaultdict(list)
    for r, sps in enumerate(per_rank):
        compute = opt = 0.0
        for sp in sps:
            if sp.name == "pipeline_bubble":
                bubble_ends[r].append(sp.end)
            elif sp.name == "optimizer":
                opt += sp.end - sp.start
            elif sp.name not in _NOT_COMPUTE:
                compute += sp.end - sp.start
                phase = sp.args.get("phase")
                kind = "F" if phase == "fwd" else "B"
                key = (r, kind, layer_stage[sp.args["layer"]], sp.args["micro"])
                w = windows.setdefault(key, [sp.start, sp.end])
                w[0], w[1] = min(w[0], sp.start), max(w[1], sp.end)
        rows.append({"rank": r, "compute_s": compute, "optimizer_s": opt, "bubble_s": step_s - compute - opt})
    passes = [{"rank": r, "kind": k, "stage": v, "micro": m, "start": a, "end": b}
              for (r, k, v, m), (a, b) in windows.items()]  # fmt: skip
    ends = {(p["kind"], p["stage"], p["micro"]): p["end"] for p in passes}
    messages = []
    for p in passes:
        src = p["stage"] - 1 if p["kind"] == "F" else p["stage"] + 1
        sender_end = ends.get((p["kind"], src, p["micro"]))
        if sender_end is None or not any(abs(e - p["start"]) < EPS for e in bubble_ends[p["rank"]]):
            continue  # the first stage's forward, the last stage's backward, or data already there
        messages.append({"dir": p["kind"], "micro": p["micro"], "src": src, "dst": p["stage"],
                         "transfer_s": p["start"] - sender_end, "after_pass_s": p["start"] - sender_end})  # fmt: skip
    return _pipeline_step(step_s, rows, passes, messages)


def _pipeline_step(step_s: float, rows: list[dict], passes: list[dict], messages: list[dict]) -> dict[str, Any]:
    durations: dict[str, list[float]] = defaultdict(list)
    for p in passes:
        durations[f"{p['kind']}{p['stage']}"].append(p.get("compute_s", p["end"] - p["start"]))
    bubble = float(np.mean([r["bubble_s"] for r in rows]))
    return {
        "step_s": step_s, "bubble_s": bubble, "bubble_fraction": bubble / step_s if step_s > 0 else 0.0,
        "ranks": rows, "pass_s": {k: float(np.median(v)) for k, v in sorted(durations.items())},
        "messages": messages,
        "p2p_transfer_s": _median(m["transfer_s"] for m in messages),
        "p2p_after_pass_s": _median(m["after_pass_s"] for m in messages),
    }  # fmt: skip


def summarise_pipeline(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over steps (per rank for the rank rows; p2p over every message of every step)."""
    world = len(steps[0]["ranks"])
    out: dict[str, Any] = {k: _median(s[k] for s in steps) for k in ("step_s", "bubble_s", "bubble_fraction")}
    out["ranks"] = [{k: _median(s["ranks"][r][k] for s in steps) for k in steps[0]["ranks"][r]}
                    for r in range(world)]  # fmt: skip
    keys = sorted({k for s in steps for k in s["pass_s"]})
    out["pass_s"] = {k: _median(s["pass_s"].get(k) for s in steps) for k in keys}
    msgs = [m for s in steps for m in s["messages"]]
    out["p2p_transfer_s"] = _median(m["transfer_s"] for m in msgs)
    out["p2p_after_pass_s"] = _median(m["after_pass_s"] for m in msgs)
    out["p2p_messages"] = len(msgs)
    if msgs:
        t = np.asarray([m["transfer_s"] for m in msgs])
        out["p2p_transfer_p10_p90_s"] = [float(np.percentile(t, 10)), float(np.percentile(t, 90))]
    out["step_p10_p90_s"] = [float(np.percentile([s["step_s"] for s in steps], q)) for q in (10, 90)]
    out["bubble_p10_p90_s"] = [float(np.percentile([s["bubble_s"] for s in steps], q)) for q in (10, 90)]
    return out


# ---- tensor parallel -----------------------------------------------------------------------------
#: regions whose TP collectives the simulator models (each layer's attention and MLP)
LAYER_REGIONS = ("attention", "mlp")
#: the job's regions outside the layers under the simulator's unit names: its output unit holds the
#: LM head and the vocab-parallel loss
OUTER_REGION = {"head": "output", "loss": "output"}


def _collective_rows(per_rank: list[list[dict]]) -> list[dict]:
    """The i-th collective of every rank is one call (every rank runs the same sequence): its
    per-rank time (entry to exit, the rank's wait for its peers included) and its own time, from the
    last rank's entry to the last exit."""
    n = {len(c) for c in per_rank}
    if len(n) != 1:
        raise ValueError(f"ranks ran different numbers of TP collectives: {sorted(n)}")
    rows = []
    for calls in zip(*per_rank, strict=True):
        c0 = calls[0]
        rows.append({"kind": c0["kind"], "phase": c0["phase"], "region": c0["region"], "layer": c0["layer"],
                     "rank_s": float(np.mean([c["end"] - c["start"] for c in calls])),
                     "after_last_s": max(c["end"] for c in calls) - max(c["start"] for c in calls),
                     "first_exit_s": min(c["end"] for c in calls) - max(c["start"] for c in calls)})  # fmt: skip
    return rows


def _tp_step(step_s: float, calls: list[dict], windows: list[dict], world: int) -> dict[str, Any]:
    layer = [c for c in calls if c["region"] in LAYER_REGIONS]
    per_call: dict[str, list[float]] = defaultdict(list)
    own: dict[str, list[float]] = defaultdict(list)
    first: dict[str, list[float]] = defaultdict(list)
    for c in layer:
        per_call[f"{c['kind']}:{c['phase']}"].append(c["rank_s"])
        own[f"{c['kind']}:{c['phase']}"].append(c["after_last_s"])
        first[f"{c['kind']}:{c['phase']}"].append(c["first_exit_s"])
    outer: dict[str, float] = defaultdict(float)
    for c in calls:
        if c["region"] not in LAYER_REGIONS:
            region = OUTER_REGION.get(c["region"], c["region"])
            outer[f"{c['kind']}:{region}:{c['phase']}"] += c["rank_s"]
    compute: dict[str, list[float]] = defaultdict(list)
    for w in windows:
        compute[f"{w['region']}:{w['phase']}"].append(w["compute_s"])
    return {
        "step_s": step_s,
        "tp_comm_s": sum(c["rank_s"] for c in layer),
        "tp_comm_own_s": sum(c["after_last_s"] for c in layer),
        "calls": len(layer),
        "per_call_s": {k: float(np.median(v)) for k, v in sorted(per_call.items())},
        "per_call_own_s": {k: float(np.median(v)) for k, v in sorted(own.items())},
        "per_call_first_s": {k: float(np.median(v)) for k, v in sorted(first.items())},
        "compute_s": {k: float(np.median(v)) for k, v in sorted(compute.items())},
        "compute_total_s": {k: float(np.sum(v)) / world for k, v in sorted(compute.items())},
        "not_modelled_s": dict(sorted(outer.items())),
    }


def measured_tp(ranks: list[list[list]]) -> dict[str, Any]:
    """One step of a tensor-parallel job (every rank's spans)."""
    step_s = max(b for sp in ranks for n, a, b, x in sp if n == "step")
    per_rank, windows = [], []
    for spans in ranks:
        per_rank.append([{"kind": n, "phase": x["phase"], "region": x["region"], "layer": x["layer"],
                          "start": a, "end": b} for n, a, b, x in spans if n in TP_KINDS])  # fmt: skip
        windows += [{"region": n, "phase": x["phase"], "layer": x["layer"], "compute_s": b - a - x["comm_s"]}
                    for n, a, b, x in spans if n in LAYER_REGIONS]  # fmt: skip
    return _tp_step(step_s, _collective_rows(per_rank), windows, len(ranks))


def simulated_tp(spans: list, world: int) -> dict[str, Any]:
    """One simulated step: each TP span is attributed to the kernel it serves (an all-gather to the
    next kernel on its rank, a reduce-scatter or all-reduce to the previous one), as the job's
    hooks attribute them."""
    per_rank: list[list] = [[] for _ in range(world)]
    for sp in sorted(spans, key=lambda x: (x.rank, x.start, x.end)):
        if sp.stream == "compute":
            per_rank[sp.rank].append(sp)
    calls, windows = [], []
    for sps in per_rank:
        kernels = [i for i, sp in enumerate(sps) if "phase" in sp.args]
        rows = []
        for i, sp in enumerate(sps):
            if sp.name in LAYER_REGIONS and "phase" in sp.args:
                windows.append({"region": sp.name, "phase": sp.args["phase"], "layer": sp.args["layer"],
                                "compute_s": sp.end - sp.start})  # fmt: skip
            if sp.name not in TP_KINDS:
                continue
            if sp.name == "tp_all_gather":
                k = next((j for j in kernels if j > i), None)
            else:
                k = next((j for j in reversed(kernels) if j < i), None)
            ref = sps[k] if k is not None else None
            region = ref.name if ref is not None and ref.name in LAYER_REGIONS else (ref.name if ref else "?")
            rows.append({"kind": sp.name, "phase": ref.args["phase"] if ref else "fwd", "region": region,
                         "layer": ref.args.get("layer") if ref else None, "start": sp.start, "end": sp.end})  # fmt: skip
        calls.append(rows)
    step_s = max(sp.end for sp in spans)
    return _tp_step(step_s, _collective_rows(calls), windows, world)


def summarise_tp(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over steps of every figure of :func:`measured_tp`."""
    out: dict[str, Any] = {k: _median(s[k] for s in steps) for k in ("step_s", "tp_comm_s", "tp_comm_own_s", "calls")}
    for group in ("per_call_s", "per_call_own_s", "per_call_first_s", "compute_s", "compute_total_s", "not_modelled_s"):
        keys = sorted({k for s in steps for k in s[group]})
        out[group] = {k: _median(s[group].get(k) for s in steps) for k in keys}
    out["tp_comm_p10_p90_s"] = [float(np.percentile([s["tp_comm_s"] for s in steps], q)) for q in (10, 90)]
    return out


__all__ = ["LAYER_REGIONS", "TP_KINDS", "measured_pipeline", "measured_tp", "simulated_pipeline", "simulated_tp",
           "summarise_pipeline", "summarise_tp"]
