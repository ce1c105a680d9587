"""PNG plots of a simulated step (``simulate --plot DIR``) and of a sweep (``sweep --plot``).

Step plots: the breakdown (stacked bars: mean over ranks, the critical rank, the healthy cluster
when the scenario has faults), the compute-stream timeline of one MoE layer's forward on the traced
ranks (the layer where ranks waited longest at its all-to-alls), the whole step's timeline (compute
and comm streams), the per-rank breakdown with imbalance wait, and the router's traffic heatmap and
expert-load histogram. Matplotlib with the Agg backend; every file is written atomically.
"""

from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path
from typing import Any

from sim.errors import InputError
from sim.ioutil import atomic_write_bytes
from sim.reports.chrome_trace import category_of

#: breakdown categories in stacking order, with their colours
CATEGORIES = ("compute", "a2a", "imbalance_wait", "tp_comm", "pipeline_bubble", "exposed_comm", "optimizer")
#: the categories every engine reports; the layout ones are drawn only where a rank spent time in them
BASE_CATEGORIES = ("compute", "a2a", "imbalance_wait", "exposed_comm", "optimizer")
CAT_COLOR = {"compute": "tab:blue", "a2a": "tab:red", "imbalance_wait": "0.65", "exposed_comm": "tab:purple",
             "optimizer": "tab:green", "grad_sync": "tab:olive", "tp_comm": "tab:cyan", "pipeline_bubble": "0.85"}  # fmt: skip
CAT_LABEL = {"compute": "compute", "a2a": "all-to-all", "imbalance_wait": "imbalance wait (at all-to-all)",
             "exposed_comm": "exposed comm", "optimizer": "optimizer", "grad_sync": "grad sync (comm stream)",
             "tp_comm": "tensor-parallel comm", "pipeline_bubble": "pipeline bubble"}  # fmt: skip
NAME_COLOR = {
    "embedding": "#8c564b", "attention": "#1f77b4", "route": "#17becf", "permute": "#bcbd22",
    "dispatch": "#d62728", "experts": "#ff7f0e", "combine": "#e377c2", "unpermute": "#9edae5",
    "shared_experts": "#ffbb78", "mlp": "#aec7e8", "mamba": "#393b79", "output": "#7f7f7f", "imbalance_wait": "#d9d9d9",
    "grad_sync_wait": "#9467bd", "grad_norm_wait": "#9467bd", "capacity_sync_wait": "#9467bd",
    "param_gather_wait": "#c5b0d5", "param_gather": "#c5b0d5",
    "optimizer": "#2ca02c", "grad_sync": "#bcbd22",
}  # fmt: skip
MAX_GANTT_RANKS = 64


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: str | Path, dpi: int = 110) -> Path:
    plt = pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())
    return Path(path)


def _title(scenario, result: dict[str, Any]) -> str:
    lay = result["layout"]
    return (f"{result['scenario']} - {result['num_gpus']} GPUs ({lay['nodes']} x {lay['gpus_per_node']} "
            f"{scenario.topology.name}), EP {lay['ep']}, policy {result['policy']}, engine {result['engine']}")  # fmt: skip


# ---- step breakdown --------------------------------------------------------------------------------
def plot_breakdown(path: str | Path, result: dict[str, Any], scenario) -> Path:
    plt = pyplot()
    bars = [("mean over ranks", result["breakdown_s"])]
    if "critical_rank_breakdown_s" in result:
        bars.append((f"critical rank {result['critical_rank']}", result["critical_rank_breakdown_s"]))
    if "faults" in result:
        bars.append(("healthy cluster (mean)", result["faults"]["healthy_breakdown_s"]))
    fig, ax = plt.subplots(figsize=(11, 1.9 + 0.6 * (len(bars) + 1)))
    ys = list(range(len(bars) + 1))[::-1]
    for y, (_, b) in zip(ys, bars, strict=False):
        left = 0.0
        for cat in CATEGORIES:
            v = b.get(cat, 0.0)
            ax.barh(y, v, left=left, color=CAT_COLOR[cat], edgecolor="white", lw=0.5,
                    label=CAT_LABEL[cat] if y == ys[0] else None)  # fmt: skip
            if v > 0.06 * sum(b.get(c, 0.0) for c in CATEGORIES):
                ax.text(left + v / 2, y, f"{v:.3g}", ha="center", va="center", fontsize=8, color="white")
            left += v
        ax.text(left, y, f"  {left:.4g} s", va="center", fontsize=9)
    gs = result["breakdown_s"]["grad_sync"]
    ax.barh(ys[-1], gs, color=CAT_COLOR["grad_sync"], hatch="//", edgecolor="white", label=CAT_LABEL["grad_sync"])
    ax.text(gs, ys[-1], f"  {gs:.4g} s busy, overlapped with backward", va="center", fontsize=9)
    ax.set_yticks(ys, [name for name, _ in bars] + ["comm stream (mean)"])
    ax.set_xlabel("seconds per training step")
    ax.set_xlim(0, max(result["step_time_s"], gs) * 1.25)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=6, fontsize=8, frameon=False)
    ax.set_title(f"{_title(scenario, result)}\nstep {result['step_time_s']:.4g} s, MFU "
                 f"{100 * result['mfu']:.1f}%: where the step goes", fontsize=10)  # fmt: skip
    fig.tight_layout()
    return save_png(fig, path)


# ---- timelines -------------------------------------------------------------------------------------
def _layer_window(spans) -> tuple[int, float, float] | None:
    """The MoE layer (micro-batch 0, forward) with the most imbalance wait: (layer, t0, t1)."""
    win: dict[int, list[float]] = {}
    for sp in spans:
        a = sp.args
        if sp.stream == "compute" and a.get("phase") == "fwd" and a.get("micro") == 0 and a.get("layer", -1) >= 0:
            w = win.setdefault(a["layer"], [sp.start, sp.end, 0.0])
            w[0], w[1] = min(w[0], sp.start), max(w[1], sp.end)
    moe = {sp.args["layer"] for sp in spans if sp.name == "dispatch" and sp.args.get("micro") == 0}
    if not moe:
        return None
    for sp in spans:
        a = sp.args
        if sp.name == "imbalance_wait" and a.get("micro") == 0 and a.get("layer") in moe:
            w = win[a["layer"]]
            if sp.start >= w[0] and sp.end <= w[1]:
                w[2] += sp.end - sp.start
    best = max(sorted(moe), key=lambda layer: win[layer][2])
    return best, win[best][0], win[best][1]


def plot_layer_timeline(path: str | Path, result: dict[str, Any], spans, scenario) -> Path | None:
    """Gantt of the compute streams over one MoE layer's forward: who waits at the all-to-all."""
    found = _layer_window(spans)
    if found is None:
        return None
    layer, t0, t1 = found
    plt = pyplot()
    ranks = sorted({sp.rank for sp in spans})[:MAX_GANTT_RANKS]
    row = {r: i for i, r in enumerate(ranks)}
    fig, ax = plt.subplots(figsize=(12, 1.8 + 0.28 * len(ranks)))
    bars: dict[str, list] = defaultdict(list)
    for sp in spans:
        if sp.stream == "compute" and sp.rank in row and sp.end > t0 and sp.start < t1:
            bars[sp.name].append((row[sp.rank], max(sp.start, t0) - t0, min(sp.end, t1) - max(sp.start, t0)))
    scale = 1e3
    for name, items in bars.items():
        for y, x, w in items:
            ax.barh(y, w * scale, left=x * scale, height=0.8, color=NAME_COLOR.get(name, "k"),
                    hatch="///" if name == "imbalance_wait" else None, edgecolor="white", lw=0.3)  # fmt: skip
    names = sorted(bars, key=lambda n: list(NAME_COLOR).index(n) if n in NAME_COLOR else len(NAME_COLOR))
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=NAME_COLOR.get(n, "k"), edgecolor="white",
                             hatch="///" if n == "imbalance_wait" else None) for n in names]  # fmt: skip
    ax.legend(handles, names, ncol=min(len(bars), 6), fontsize=8, loc="upper center",
              bbox_to_anchor=(0.5, -0.12 if len(ranks) > 8 else -0.3), frameon=False)  # fmt: skip
    ax.set_yticks(range(len(ranks)), [f"rank {r} (node {r // scenario.gpus_per_node})" for r in ranks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"milliseconds since layer {layer}'s forward began (t = {t0 * 1e3:.3f} ms into the step)")
    ax.set_title(f"{_title(scenario, result)}\nlayer {layer} forward, micro-batch 0: the grey hatched bars are "
                 "ranks waiting at an all-to-all barrier for the slowest peer", fontsize=10)  # fmt: skip
    fig.tight_layout()
    return save_png(fig, path)


def _merged(spans, stream: str) -> dict[tuple[int, str], list[tuple[float, float]]]:
    """Spans of ``stream`` by (rank, category), touching ones merged (fewer rectangles)."""
    out: dict[tuple[int, str], list[list[float]]] = defaultdict(list)
    for sp in sorted((s for s in spans if s.stream == stream), key=lambda s: (s.rank, s.start)):
        cat = category_of(sp.name) if stream == "compute" else "grad_sync"
        cur = out[(sp.rank, cat)]
        if cur and sp.start - cur[-1][1] <= 1e-12:
            cur[-1][1] = sp.end
        else:
            cur.append([sp.start, sp.end])
    return {k: [(a, b - a) for a, b in v] for k, v in out.items()}


def plot_step_timeline(path: str | Path, result: dict[str, Any], spans, scenario) -> Path:
    plt = pyplot()
    ranks = sorted({sp.rank for sp in spans})[:MAX_GANTT_RANKS]
    row = {r: i for i, r in enumerate(ranks)}
    fig, ax = plt.subplots(figsize=(13, 1.8 + 0.3 * len(ranks)))
    seen = set()
    for stream, height, off in (("compute", 0.62, -0.12), ("comm", 0.22, 0.32)):
        for (rank, cat), items in _merged(spans, stream).items():
            if rank in row:
                ax.broken_barh(items, (row[rank] + off - height / 2, height), facecolors=CAT_COLOR[cat],
                               label=None if cat in seen else CAT_LABEL[cat])  # fmt: skip
                seen.add(cat)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks], fontsize=7)
    ax.set_ylim(len(ranks) - 0.4, -0.6)
    ax.set_xlim(0, result["step_time_s"])
    ax.set_xlabel("seconds into the step (thick: compute stream; thin below: comm stream)")
    ax.legend(ncol=6, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1 if len(ranks) > 8 else -0.3),
              frameon=False)  # fmt: skip
    ax.set_title(f"{_title(scenario, result)}\nthe whole step on the traced ranks", fontsize=10)
    fig.tight_layout()
    return save_png(fig, path)


def rank_totals(spans) -> dict[int, dict[str, float]]:
    """Compute-stream seconds per breakdown category for every traced rank."""
    out: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(BASE_CATEGORIES, 0.0))
    for sp in spans:
        if sp.stream == "compute":
            cat = category_of(sp.name)
            out[sp.rank][cat] = out[sp.rank].get(cat, 0.0) + sp.end - sp.start
    return dict(out)


def plot_rank_breakdown(path: str | Path, result: dict[str, Any], spans, scenario) -> Path:
    plt = pyplot()
    tot = rank_totals(spans)
    ranks = sorted(tot)
    fig, ax = plt.subplots(figsize=(max(9, 0.3 * len(ranks) + 5), 5))
    bottom = [0.0] * len(ranks)
    for cat in CATEGORIES:
        vals = [tot[r].get(cat, 0.0) for r in ranks]
        ax.bar(range(len(ranks)), vals, bottom=bottom, color=CAT_COLOR[cat], label=CAT_LABEL[cat],
               hatch="///" if cat == "imbalance_wait" else None, edgecolor="white", lw=0.3)  # fmt: skip
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(ranks)), [str(r) for r in ranks], fontsize=7, rotation=90 if len(ranks) > 32 else 0)
    ax.set_xlabel("rank (traced ranks only)")
    ax.set_ylabel("seconds of the step on the compute stream")
    worst = max(ranks, key=lambda r: tot[r]["imbalance_wait"])
    ax.set_title(f"{_title(scenario, result)}\nper-rank breakdown: rank {worst} waited longest at all-to-all "
                 f"barriers ({tot[worst]['imbalance_wait'] * 1e3:.2f} ms)", fontsize=10)  # fmt: skip
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return save_png(fig, path)


def step_plots(out_dir: str | Path, result: dict[str, Any], spans, scenario) -> list[Path]:
    """Every step plot into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create '{out}': {exc.strerror or exc}", field="--plot") from None
    paths = [plot_breakdown(out / "breakdown.png", result, scenario)]
    if spans:
        layer = plot_layer_timeline(out / "timeline_layer.png", result, spans, scenario)
        paths += [p for p in (layer,) if p is not None]
        paths.append(plot_step_timeline(out / "timeline_step.png", result, spans, scenario))
        paths.append(plot_rank_breakdown(out / "ranks.png", result, spans, scenario))
    if scenario.model.num_moe_layers:
        from sim.reports.routing_plot import plot_routing
        from sim.routing.plan import route_scenario

        plan = route_scenario(scenario, result["policy"])  # same seed: the plan the step ran on
        plot_routing(plan, out / "routing.png")
        paths.append(out / "routing.png")
    return paths


# ---- sweep -----------------------------------------------------------------------------------------
def _numeric(values) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def sweep_x_key(varies, wanted: str | None = None) -> str:
    """The x axis of a sweep plot: ``wanted``, else cluster.nodes, else the first numeric --vary key."""
    vals = {p: [v for _, v in vs] for p, vs in varies}
    if wanted is not None:
        if wanted not in vals or not _numeric(vals[wanted]):
            raise InputError(f"'{wanted}' must be one of the numeric --vary keys ({', '.join(vals)})", field="--x")
        return wanted
    if "cluster.nodes" in vals:
        return "cluster.nodes"
    for p, v in vals.items():
        if _numeric(v):
            return p
    raise InputError("the scaling plot needs a --vary key with numeric values for its x axis", field="--plot")


def plot_sweep(path: str | Path, doc: dict[str, Any], x_key: str) -> Path:
    """Step time and tokens/s per GPU against ``x_key``; one line per value of the other keys."""
    plt = pyplot()
    others = [k for k in doc["vary"] if k != x_key]
    series: dict[str, list[tuple[float, float, float]]] = defaultdict(list)
    for r in doc["runs"]:
        o = r["overrides"]
        label = ", ".join(f"{k.split('.')[-1]}={o[k]}" for k in others) or doc["scenario"]
        series[label].append((o[x_key], r["step_time_s"], r["tokens_per_s_per_gpu"]))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5.2))
    for label, pts in series.items():
        pts.sort()
        xs = [p[0] for p in pts]
        a1.plot(xs, [p[1] for p in pts], marker="o", label=label)
        a2.plot(xs, [p[2] for p in pts], marker="o", label=label)
    xs_all = sorted({v for vs in (s for s in series.values()) for v, _, _ in vs})
    unit = " (nodes; GPUs below)" if x_key == "cluster.nodes" else ""
    gpus = {r["overrides"][x_key]: r["num_gpus"] for r in doc["runs"]}
    ticks = [f"{v:g}\n({gpus[v]})" if x_key == "cluster.nodes" else f"{v:g}" for v in xs_all]
    for ax in (a1, a2):
        if xs_all and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 8:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all, ticks)
        ax.minorticks_off()
        ax.set_xlabel(f"{x_key}{unit}")
        ax.grid(alpha=0.3)
    a1.set_ylabel("step time (s)")
    a1.set_ylim(bottom=0)
    a1.set_title("step time", fontsize=10)
    a2.set_ylabel("tokens/s per GPU")
    a2.set_ylim(bottom=0)
    a2.set_title("throughput per GPU (flat = perfect weak scaling)", fontsize=10)
    if len(series) > 1:
        a1.legend(fontsize=8, loc="lower right")
        a2.legend(fontsize=8, loc="lower left")
    fig.suptitle(f"{doc['scenario']}: sweep over {', '.join(doc['vary'])} (engine {doc['engine']})", fontsize=11)
    fig.tight_layout()
    return save_png(fig, path)


__all__ = [
    "CATEGORIES",
    "plot_breakdown",
    "plot_layer_timeline",
    "plot_rank_breakdown",
    "plot_step_timeline",
    "plot_sweep",
    "rank_totals",
    "save_png",
    "step_plots",
    "sweep_x_key",
]
