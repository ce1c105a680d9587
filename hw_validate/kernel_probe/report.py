"""The probe's record: the summary per case, the factors that tell the suspects apart, the tables."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from hw_validate.kernel_probe.plan import ExpertCase

#: the ratio of expert GEMM time the published layer rows need over moesim's (docs/research/gemm-fit.md)
NEEDED_RATIO = (1.30, 1.45)


# ---- the record ---------------------------------------------------------------------------------
def summarize(rows: list[dict], cases: list[ExpertCase]) -> list[dict]:
    """Per case and (impl, mode, data): the experts' forward GEMMs (both ``fwd``) and backward ones
    (``dgrad`` + ``wgrad``), measured over moesim's -- the figure the published rows need at 1.30-1.45
    over the microbenchmark (burst) curve. Casts: what moesim adds per pass (forward: ``x`` + ``w`` of
    each GEMM; backward: ``dy`` + ``w``). TransformerEngine: both GroupedLinear modules, backward =
    (fwd+bwd) - fwd. ``*_ratio`` is over moesim's step pricing, ``*_ratio_burst`` over its burst curve."""
    out = []
    casts = ("cast_plain", "cast_tensor", "cast_block")
    for c in cases:
        mine = [r for r in rows if r["case"] == c.name]
        combos = list(dict.fromkeys((r["impl"], r["mode"], r["data"], r["dtype"]) for r in mine))
        for impl, mode, data, dtype in combos:
            sel = [
                r for r in mine if (r["impl"], r["mode"], r["data"], r["dtype"]) == (impl, mode, data, dtype)
            ]
            by = {r["role"]: r for r in sel}
            entry: dict[str, Any] = {"case": c.name, "impl": impl, "mode": mode, "data": data, "dtype": dtype,
                                     "kernel": sel[0]["kernel"]}  # fmt: skip
            if impl in casts:
                parts = {"fwd": [f"{g.name}.{w}" for g in c.gemms for w in ("x", "w")],
                         "bwd": [f"{g.name}.{w}" for g in c.gemms for w in ("dy", "w")]}  # fmt: skip
            elif impl.startswith("te_"):
                parts = {
                    "fwd": [f"{g.name}.fwd" for g in c.gemms],
                    "fwd+bwd": [f"{g.name}.fwd+bwd" for g in c.gemms],
                }
            else:
                parts = {"fwd": [f"{g.name}.fwd" for g in c.gemms],
                         "bwd": [f"{g.name}.{r}" for g in c.gemms for r in ("dgrad", "wgrad")]}  # fmt: skip
            got: dict[str, np.ndarray] = {}  # name -> (ms, predicted ms, predicted burst ms (nan: none))
            for name, roles in parts.items():
                sel_p = [by.get(role) for role in roles]
                if all(r is not None and r["ms"] is not None for r in sel_p):
                    got[name] = np.array([[r["ms"], r["predicted_ms"], r.get("predicted_burst_ms") or np.nan]
                                          for r in sel_p]).sum(axis=0)  # fmt: skip
            if "fwd+bwd" in got and "fwd" in got:
                got["bwd"] = got["fwd+bwd"] - got["fwd"]
            if "fwd" in got and "bwd" in got:
                got["total"] = got["fwd"] + got["bwd"]
            for name in ("fwd", "bwd", "total"):
                v = got.get(name)
                entry[f"{name}_ratio"] = entry[f"{name}_ratio_burst"] = None
                if v is not None:
                    entry.update({f"{name}_ms": float(v[0]), f"{name}_predicted_ms": float(v[1]),
                                  f"{name}_ratio": float(v[0] / v[1])})  # fmt: skip
                    if np.isfinite(v[2]):
                        entry.update(
                            {
                                f"{name}_predicted_burst_ms": float(v[2]),
                                f"{name}_ratio_burst": float(v[0] / v[2]),
                            }
                        )
            s = sel[0].get("samples")
            if mode == "sustained" and isinstance(s, dict):
                entry.update(sm_MHz_median=s.get("sm_MHz_median"), power_W_mean=s.get("power_W_mean"),
                             reasons=s.get("reasons"))  # fmt: skip
            out.append(entry)
    return out


#: (name, numerator (impl, mode, data), denominator (impl, mode, data) or None = moesim, what it tells)
FACTORS = (
    ("dense burst / moesim", ("dense", "burst", "randn"), None,
     "moesim's curve against a short cuBLAS run at this shape (about 1 on the burst curve: the curve holds)"),
    ("dense sustained / dense burst", ("dense", "sustained", "randn"), ("dense", "burst", "randn"),
     "clocks under continuous load (suspect 1)"),
    ("dense sustained randn / zeros", ("dense", "sustained", "randn"), ("dense", "sustained", "zeros"),
     "zeros draw less power: a gap means power-capped clocks (suspect 1)"),
    ("grouped burst / dense burst, per unit of work", ("grouped", "burst", "randn"), ("dense", "burst", "randn"),
     "the grouped kernel against cuBLAS on the same work (suspect 2)"),
    ("loop burst / dense burst, per unit of work", ("loop", "burst", "randn"), ("dense", "burst", "randn"),
     "per-expert cuBLAS calls one after another"),
    ("grouped sustained / moesim", ("grouped", "sustained", "randn"), None,
     "the nearest plain torch gets to the published rows' BF16 experts: compare with the needed ratio"),
    ("TE bf16 / moesim", ("te_bf16", "burst", "randn"), None, "the published rows' own module, BF16"),
    ("TE fp8 / moesim", ("te_fp8", "burst", "randn"), None,
     "the published rows' own module, FP8 blockwise, casts included (suspect 3)"),
    ("fp8 per-tensor / moesim", ("fp8_tensor", "burst", "randn"), None, "moesim's FP8 curve (GEMM only)"),
    ("fp8 blocks / fp8 per-tensor", ("fp8_block", "burst", "randn"), ("fp8_tensor", "burst", "randn"),
     "what 1x128 / 128x128 block scales cost inside the GEMM (suspect 3)"),
    ("casts per-tensor / moesim", ("cast_tensor", "burst", "randn"), None,
     "moesim's cast model: one bf16 read and one fp8 write per GEMM input (suspect 3)"),
)  # fmt: skip


def factors(summary: list[dict]) -> list[dict]:
    """The ratios that tell the suspects apart, per case, on the experts' forward + backward time:
    ``value`` over moesim's step pricing, ``value_burst`` over its microbenchmark curve (where it has
    one). A factor of two rows divides their ratios to moesim: per unit of work (a grouped row does every
    local expert's, a dense row one expert's)."""
    out = []
    for case in dict.fromkeys(e["case"] for e in summary):
        by = {(e["impl"], e["mode"], e["data"]): e for e in summary if e["case"] == case}
        for name, num, den, meaning in FACTORS:
            a, b = by.get(num), by.get(den) if den is not None else None
            if (
                a is None
                or a.get("total_ratio") is None
                or (den is not None and (b is None or b.get("total_ratio") is None))
            ):
                continue
            vals = []
            for key in ("total_ratio", "total_ratio_burst"):
                x, y = a.get(key), (b.get(key) if b is not None else 1.0)
                vals.append(x / y if x is not None and y is not None else None)
            out.append(
                {"case": case, "factor": name, "value": vals[0], "value_burst": vals[1], "meaning": meaning}
            )
    return out


def _f(x, fmt="{:.3f}") -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return "-"
    return fmt.format(x)


def _shape(s: dict) -> str:
    if "M" in s:
        return f"{s['M']}x{s['N']}x{s['K']}" + (f" (x{s['groups']})" if s.get("groups", 1) > 1 else "")
    if "rows" in s:
        return f"{s['rows']}x{s['cols']}"
    if "in" in s:
        return f"{s['groups']}x[{s['rows_per_group']}, {s['in']}->{s['out']}]"
    return f"b{s['batch']} h{s['heads']} s{s['seq']} d{s['head_dim']}"


def table(rows: list[dict], measured: bool = True) -> list[str]:
    head = ["part", "kernel", "case", "role", "M x N x K / shape", "dtype", "mode", "data"]
    if measured:
        head += [
            "ms",
            "TFLOP/s",
            "pred ms",
            "pred TFLOP/s",
            "meas/pred",
            "meas/burst pred",
            "SM MHz",
            "W",
            "note",
        ]
    else:
        head += ["pred ms", "pred TFLOP/s", "burst pred ms", "burst pred TFLOP/s"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["part"],
            r["kernel"],
            r["case"],
            r["role"],
            _shape(r["shape"]),
            r["dtype"],
            r["mode"],
            r["data"],
        ]
        if measured:
            s = r.get("samples")
            sm = (
                _f(s.get("sm_MHz_median"), "{:.0f}")
                if isinstance(s, dict)
                else ("n/a" if s == "unavailable" else "-")
            )
            pw = _f(s.get("power_W_mean"), "{:.0f}") if isinstance(s, dict) else "-"
            note = r["error"] or r.get("note") or ""
            if r["mode"] == "sustained" and r.get("ms_last_quarter"):
                note = (
                    note + "; " if note else ""
                ) + f"first 10% {r['ms_first_tenth']:.3f} / last 25% {r['ms_last_quarter']:.3f} ms"
            if r.get("fp8_formats"):
                note = (note + "; " if note else "") + r["fp8_formats"]
            cells += [_f(r["ms"]), _f(r["TFLOPs"], "{:.0f}"), _f(r["predicted_ms"]), _f(r["predicted_TFLOPs"], "{:.0f}"),
                      _f(r["ratio"], "{:.2f}"), _f(r.get("ratio_burst"), "{:.2f}"), sm, pw, note.replace("|", "/")]  # fmt: skip
        else:
            cells += [_f(r["predicted_ms"]), _f(r["predicted_TFLOPs"], "{:.0f}"), _f(r.get("predicted_burst_ms")),
                      _f(r.get("predicted_burst_TFLOPs"), "{:.0f}")]  # fmt: skip
        out.append("| " + " | ".join(str(x) for x in cells) + " |")
    return out


def markdown(doc: dict) -> str:
    dev, dry = doc["device"], doc.get("dry_run")
    lines = [f"# GPU kernels at the published rows' shapes{' (dry run: the plan)' if dry else ''}", ""]
    unmatched = "" if doc["moesim"]["matched"] else ", no description matched the name: H100's used"
    lines.append(f"Device: {dev.get('name', '-')} (moesim GPU description `{doc['moesim']['gpu']}`"
                 f"{unmatched}); torch {dev.get('torch', '-')}, "
                 f"CUDA {dev.get('cuda', '-')}; sampler: {doc['sampler'].get('source')} {doc['sampler'].get('static', '')}; "
                 f"wall {_f(doc.get('wall_s'), '{:.0f}')} s.")  # fmt: skip
    lines += ["", "Cases (from the published rows):", ""]
    for c in doc["cases"]:
        lines.append(f"- `{c['name']}` ({', '.join(c['rows'])}): {c['local_experts']} local expert(s) x "
                     f"{c['rows_per_expert']} rows, h {c['hidden']}, expert FFN {c['width']} ({c['ffn_type']})")  # fmt: skip
    for a in doc["attention_cases"]:
        lines.append(f"- attention `{a['name']}` ({a['row']}): batch {a['batch']}, {a['heads']} heads, seq {a['seq']}, "
                     f"head dim {a['head_dim']}{'; ' + a['note'] if a['note'] else ''}")  # fmt: skip
    if not dry:
        lines += [
            "",
            "## Summary: experts' GEMMs, measured over moesim",
            "",
            f"The published layer rows need about {NEEDED_RATIO[0]:.2f}-{NEEDED_RATIO[1]:.2f} (measured / moesim's "
            "microbenchmark curve, the `burst` column) on the experts' GEMMs; the `step` column is over what moesim "
            f"prices in a training step (the GPU's sustained-compute fraction, {doc['moesim'].get('sustained_compute_fraction', 1)}, "
            "applied). Read: dense burst near 1 on the burst curve = the curve is right for short cuBLAS runs; sustained randn "
            "above burst (and above zeros) with the SM clock below its maximum and `sw_power_cap` among the "
            "reasons = power-limited clocks (suspect 1); grouped above dense at the same data = the grouped kernel "
            "(suspect 2); FP8 GEMMs or casts well above moesim's = the FP8 recipe (suspect 3).",
            "",
            "| case | factor (experts' forward + backward time; A / B = their ratios to moesim divided) | step | burst | what it tells |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {f['case']} | {f['factor']} | {_f(f['value'])} | {_f(f.get('value_burst'))} | {f['meaning']} |"
            for f in doc.get("factors", [])
        ]
        lines += ["",
                  "| case | kernel | impl | mode | data | dtype | fwd ms | fwd pred | fwd ratio | bwd ms | bwd pred | bwd ratio | total ratio (burst) | SM MHz | W | reasons |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for s in doc["summary"]:
            reasons = s.get("reasons")
            lines.append("| " + " | ".join([s["case"], s["kernel"], s["impl"], s["mode"], s["data"], s["dtype"],
                         _f(s.get("fwd_ms")), _f(s.get("fwd_predicted_ms")), _f(s.get("fwd_ratio"), "{:.2f}"),
                         _f(s.get("bwd_ms")), _f(s.get("bwd_predicted_ms")), _f(s.get("bwd_ratio"), "{:.2f}"),
                         _f(s.get("total_ratio_burst"), "{:.2f}"), _f(s.get("sm_MHz_median"), "{:.0f}"), _f(s.get("power_W_mean"), "{:.0f}"),
                         ",".join(reasons) if isinstance(reasons, list) else str(reasons or "-")]) + " |")  # fmt: skip
    parts = {"a": "a. dense BF16 (torch.matmul), one expert", "b": "b. grouped BF16, every local expert",
             "c": "c. FP8 GEMMs and casts", "d": "d. attention (SDPA)", "f": "f. TransformerEngine GroupedLinear"}  # fmt: skip
    for p, title in parts.items():
        sel = [r for r in doc["rows"] if r["part"] == p]
        if sel:
            lines += ["", f"## {title}", ""] + table(sel, measured=not dry)
    if doc.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {e}" for e in doc["errors"]]
    return "\n".join(lines) + "\n"


def write(out: Path, doc: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("gpu_kernels.json", json.dumps(doc, indent=1, default=str)),
        ("gpu_kernels.md", markdown(doc)),
    ):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)
