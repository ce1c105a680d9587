"""``moesim route --plot``: the rank x rank dispatch heatmap and the expert-load histogram.

Imports matplotlib (Agg backend) when called; the PNG is written atomically.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import numpy as np

from sim.ioutil import atomic_write_bytes
from sim.routing.plan import RoutingPlan
from sim.routing.traffic import group_matrix

#: The heatmap shows at most this many ranks (the first EP groups): 8,192 x 8,192 pixels say nothing more.
HEATMAP_RANKS = 512


def mean_dispatch_MB(plan: RoutingPlan, ranks: int | None = None) -> np.ndarray:
    """(n, n) dispatch MB (1e6 bytes) src -> dst per MoE layer and micro-batch, averaged, over the
    first n ranks (whole EP groups; all ranks when ``ranks`` is None). Built from the per-group
    blocks, never a world x world matrix beyond those n ranks."""
    lay = plan.layout
    n = lay.world if ranks is None else max(lay.ep, min(ranks, lay.world) // lay.ep * lay.ep)
    cells = plan.num_moe_layers * plan.micro_batches
    elem = plan.hidden_size * plan.bytes_per_elem
    if plan.padded is not None:  # every member gets the group's E/ep x C chunk
        chunk = plan.padded[:, :, : n // lay.ep].sum(axis=(0, 1)) * lay.experts_per_rank
        per_dst = np.repeat(np.repeat(chunk.astype(np.float64), lay.ep)[:, None], lay.ep, axis=1)
    else:
        per_dst = plan.counts.pair_copies[:, :, :n].sum(axis=(0, 1), dtype=np.int64).astype(np.float64)
    return group_matrix(per_dst, dataclasses.replace(lay, world=n)) * elem / cells / 1e6


def plot_routing(plan: RoutingPlan, path: str | Path) -> None:
    """Two panels: dispatch heatmap with node boundaries, and received tokens per expert over mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lay = plan.layout
    fig, (ax_map, ax_hist) = plt.subplots(1, 2, figsize=(13, 5.6), gridspec_kw={"width_ratios": [1.1, 1]})
    heat = mean_dispatch_MB(plan, HEATMAP_RANKS)
    shown_ranks = "" if len(heat) == lay.world else f", first {len(heat)} of {lay.world} ranks"
    shown = np.ma.masked_where(heat <= 0, heat)
    im = ax_map.imshow(shown, cmap="viridis", interpolation="nearest", origin="upper")
    fig.colorbar(im, ax=ax_map, label="dispatch MB per MoE layer per micro-batch")
    for b in range(lay.gpus_per_node, len(heat), lay.gpus_per_node):
        ax_map.axhline(b - 0.5, color="white", lw=0.4, alpha=0.5)
        ax_map.axvline(b - 0.5, color="white", lw=0.4, alpha=0.5)
    ax_map.set_xlabel("destination rank (thin lines: node boundaries)")
    ax_map.set_ylabel("source rank")
    ax_map.set_title(f"dispatch traffic ({plan.dispatch}{shown_ranks}; blank = no traffic)", fontsize=10)

    load = plan.counts.expert_rows.astype(np.float64)  # (layers, micro, world, experts_per_rank)
    mean = load.reshape(*load.shape[:2], -1).mean(axis=-1)[:, :, None, None]
    ratio = (load / np.where(mean > 0, mean, 1)).ravel()
    ax_hist.hist(ratio, bins=60, color="tab:blue", alpha=0.85)
    ax_hist.axvline(1.0, color="black", lw=1, ls=":", label="mean")
    if plan.padded is not None:
        pad = float((plan.padded.mean(axis=2) * lay.ep / mean[:, :, 0, 0]).mean())
        ax_hist.axvline(pad, color="tab:red", lw=1.2, ls="--", label=f"padded buffer ({pad:.2f} x mean)")
    ax_hist.set_xlabel("tokens received by an expert replica / mean over replicas (per layer, micro-batch)")
    ax_hist.set_ylabel("count of (layer, micro-batch, expert replica)")
    s = plan.summary()["summary"]
    ax_hist.set_title(
        f"expert load: max/mean {s['max_over_mean_expert_load']:.2f} (experts), "
        f"{s['max_over_mean_load']:.2f} (ranks); dropped {100 * s['dropped_fraction']:.1f}%",
        fontsize=10,
    )
    ax_hist.legend(fontsize=9)
    fig.suptitle(
        f"{plan.scenario} - policy {plan.policy} - {lay.world} ranks, EP {lay.ep}, "
        f"{lay.num_experts} experts top-{plan.top_k} ({plan.method} routing)",
        fontsize=12,
    )
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buf.getvalue())


__all__ = ["mean_dispatch_MB", "plot_routing"]
