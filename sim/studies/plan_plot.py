"""``moesim plan --plot``: tokens/s per GPU against memory per GPU, every estimated candidate and the
layouts the DES ranked, with the Pareto front (the fastest plan at or under each memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sim.reports.plots import pyplot, save_png


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (memory, throughput) points no other point beats on both: less memory and more throughput."""
    front: list[tuple[float, float]] = []
    for mem, tput in sorted(points, key=lambda p: (p[0], -p[1])):
        if not front or tput > front[-1][1]:
            front.append((mem, tput))
    return front


def plot_plan(path: str | Path, doc: dict[str, Any]) -> Path:
    from sim.studies.plan import constant_knobs, label_of

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(12.5, 6))
    est = [(e["memory"]["peak_GiB_per_gpu"], e["tokens_per_s_per_gpu"]) for e in doc["estimates"]]
    des = [(p["memory"]["peak_GiB_per_gpu"], p["tokens_per_s_per_gpu"]) for p in doc["plans"]]
    if est:
        ax.scatter(*zip(*est, strict=True), s=14, color="0.65", label="estimated (lane engine estimate)")
    if des:
        ax.scatter(*zip(*des, strict=True), s=36, color="tab:blue", label="simulated (DES, folded)", zorder=3)
    simulated = {p["label"] for p in doc["plans"]}
    front = pareto_front(des + [(m, t) for e, (m, t) in zip(doc["estimates"], est, strict=True) if e["label"] not in simulated])
    if front:
        ax.step(*zip(*front, strict=True), where="post", color="tab:red", lw=1.2, zorder=2,
                label="Pareto front (DES where simulated, else estimate)")
    if des:
        const = constant_knobs(doc)
        for p in doc["plans"]:
            ax.annotate(str(p["rank"]), (p["memory"]["peak_GiB_per_gpu"], p["tokens_per_s_per_gpu"]), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")  # fmt: skip
        names = "\n".join(f"{p['rank']:>2}: {label_of(p, const)}" for p in doc["plans"])
        ax.text(1.02, 1.0, "ranked by the DES\n" + names, transform=ax.transAxes, fontsize=7, va="top", ha="left",
                family="monospace")  # fmt: skip
    cap = next((p["memory"].get("capacity_GiB") for p in [*doc["plans"], *doc["estimates"]]), None)
    if cap:
        ax.axvline(cap, color="0.3", ls="--", lw=0.8, label=f"GPU memory ({cap:g} GiB)")
    ax.set_xlabel("memory per GPU (GiB, the worst pipeline stage)")
    ax.set_ylabel("tokens/s per GPU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"{doc['model']} on {doc['gpus']} x {doc['gpu']}: global batch {doc['global_batch']} x {doc['seq_len']}",
                 fontsize=10)  # fmt: skip
    fig.subplots_adjust(left=0.07, right=0.68, bottom=0.1, top=0.93)
    return save_png(fig, path)


__all__ = ["pareto_front", "plot_plan"]
