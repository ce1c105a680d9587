"""``moesim topo T --nodes N``: summary of a topology's cluster graph and a drawing of it.

The summary counts devices, switches and directed links, gives per-GPU bandwidths, hop counts of
typical paths, and the bisection bandwidth both from the graph (max flow between the halves) and
from the closed form. The drawing shows every node when there are at most four, otherwise the
first two and the last with the rest elided, and always the switches those nodes reach.
"""

from __future__ import annotations

import argparse
import io
from collections import Counter

from sim.cli.common import add_json_argument
from sim.errors import InputError
from sim.ioutil import atomic_write_bytes, write_json

_COLORS = {
    "intra": "#2a9d8f",
    "pcie_host": "#8d99ae",
    "pcie_nic": "#e9c46a",
    "nic_tx": "#e76f51",
    "leaf_up": "#264653",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("topology", metavar="T", help="shipped topology name or YAML path")
    parser.add_argument("--nodes", required=True, type=int, metavar="N", help="number of nodes")
    parser.add_argument(
        "--gpus-per-node", type=int, metavar="G", help="override the topology's GPUs per node"
    )
    parser.add_argument(
        "--cross-rail",
        choices=("pxn", "spine"),
        default="pxn",
        help="how traffic between different local ranks crosses: NCCL PXN (default) or via the spine",
    )
    parser.add_argument("--plot", metavar="P", help="write a PNG drawing of the cluster graph")
    add_json_argument(parser)


def summarize(cluster) -> dict:
    """The figures printed by ``moesim topo`` (also its JSON)."""
    from sim.hardware.cluster import bisection_closed_form_GBps, bisection_GBps

    topo, g = cluster.topology, cluster.gpus_per_node
    devices = Counter(d["kind"] for _, d in cluster.graph.nodes(data=True))
    links = Counter(str(k) for k in cluster.link_kind)
    nics = cluster.nics_per_node
    nic_GBps = topo.scaleout.nic_bw_GBps * nics / g if nics else 0.0
    hops = {"same_node": len(cluster.path(0, 1)) if g > 1 else None}
    if cluster.nodes > 1:
        hops["same_rail"] = len(cluster.path(0, g))
        hops["cross_rail"] = len(cluster.path(0, g + g - 1)) if g > 1 else None
        far = (cluster.nodes - 1) * g
        hops["farthest_node_same_rail"] = len(cluster.path(0, far))
    return {
        "topology": topo.name,
        "gpu": topo.gpu.kind,
        "nodes": cluster.nodes,
        "gpus_per_node": g,
        "num_gpus": cluster.world_size,
        "cross_rail": cluster.cross_rail,
        "devices": dict(sorted(devices.items())),
        "links_directed": dict(sorted(links.items())),
        "num_links": cluster.num_links,
        "per_gpu": {
            "intra_GBps": topo.node.intra.bw_GBps,
            "intra_alltoall_GBps": topo.node.intra.alltoall_bw_GBps,  # what EP all-to-alls see (sim.hardware.alltoall_links)
            "intra_line_GBps": topo.node.intra.line_bw_GBps,
            "nic_GBps": nic_GBps,
            "nic_line_GBps": topo.scaleout.nic_line_Gbps / 8 * nics / g if nics else 0.0,
            "pcie_host_GBps": topo.node.pcie_host.bw_GBps,
        },
        "hops": hops,
        "bisection_GBps": bisection_GBps(cluster),
        "bisection_closed_form_GBps": bisection_closed_form_GBps(topo, cluster.nodes, g),
    }


def _shown_nodes(n: int) -> list[int | None]:
    return list(range(n)) if n <= 4 else [0, 1, None, n - 1]


def draw(cluster) -> bytes:
    """PNG of the cluster graph (reduced to a few nodes when there are many)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g, topo = cluster.gpus_per_node, cluster.topology
    shown = _shown_nodes(cluster.nodes)
    width = g + 1.5
    pos: dict[str, tuple[float, float]] = {}
    fig, ax = plt.subplots(figsize=(max(8.0, 0.55 * width * len(shown)), 6.5))
    for slot, n in enumerate(shown):
        x0 = slot * width
        if n is None:
            ax.text(
                x0 + width / 2 - 0.75,
                1.0,
                f"... {cluster.nodes - 3} more nodes ...",
                ha="center",
                fontsize=10,
            )
            continue
        ax.add_patch(plt.Rectangle((x0 - 0.6, -0.9), g + 0.2, 3.4, fill=False, ec="#999", lw=0.8))
        ax.text(x0 - 0.5, 2.3, f"node {n}", fontsize=8, color="#555")
        pos[f"n{n}/switch"] = (x0 + (g - 1) / 2, -0.3)
        pos[f"n{n}/host"] = (x0 + g - 0.7, -0.7)
        for loc in range(g):
            pos[f"n{n}/gpu{loc}"] = (x0 + loc, 0.8)
        for k in range(cluster.nics_per_node):
            pos[f"n{n}/nic{k}"] = (x0 + k * g / cluster.nics_per_node, 1.9)
    leaves = sorted(
        {v for u, v in cluster.link_names if u in pos and cluster.graph.nodes[v]["kind"] == "leaf"}
    )
    span = max(width * len(shown) - 1.5, 1.0)
    for i, leaf in enumerate(leaves):
        pos[leaf] = (span * (i + 0.5) / len(leaves), 4.2)
    for core in ("spine", "switch"):
        if core in cluster.graph:
            pos[core] = (span / 2, 5.8 if core == "spine" else 4.2)
    drawn = set()
    for (u, v), kind in zip(cluster.link_names, cluster.link_kind, strict=True):
        if u in pos and v in pos and (v, u) not in drawn and kind in _COLORS:
            drawn.add((u, v))
            (x1, y1), (x2, y2) = pos[u], pos[v]
            ax.plot([x1, x2], [y1, y2], color=_COLORS[kind], lw=0.9, alpha=0.8, zorder=1)
    style = {
        "gpu": ("s", "#1d3557", 60),
        "nic": ("o", "#e76f51", 25),
        "host": ("D", "#8d99ae", 35),
        "leaf": ("^", "#264653", 70),
        "spine": ("h", "#000000", 160),
        "switch": ("h", "#000000", 160),
    }
    kinds_shown: dict[str, tuple] = {}
    for name, (x, y) in pos.items():
        kind = cluster.graph.nodes[name]["kind"]
        marker, color, size = style.get(kind, ("p", "#2a9d8f", 90))
        ax.scatter([x], [y], marker=marker, c=color, s=size, zorder=2)
        kinds_shown[kind] = (marker, color)
    for kind, (marker, color) in kinds_shown.items():
        ax.scatter([], [], marker=marker, c=color, label=kind.replace("_", " "))
    for leaf in leaves:
        d = cluster.graph.nodes[leaf]
        ax.text(*pos[leaf], f"  rail {d['rail']} leaf {d['leaf']}", fontsize=6, va="bottom", rotation=30)
    so = topo.scaleout
    labels = {
        "intra": f"{topo.node.intra_kind} {topo.node.intra.bw_GBps:.0f} GB/s per GPU",
        "pcie_host": f"PCIe to host {topo.node.pcie_host.bw_GBps:.1f} GB/s",
        "pcie_nic": f"PCIe GPU-NIC {topo.node.pcie_host.bw_GBps:.1f} GB/s",
        "nic_tx": f"NIC {so.nic_bw_GBps:.1f} GB/s ({so.nic_line_Gbps:.0f} Gb/s line)",
        "leaf_up": f"leaf uplinks (oversubscription {so.oversubscription:g}:1)",
    }
    present = {str(k) for k in cluster.link_kind}
    for kind, color in _COLORS.items():
        if kind in present:
            ax.plot([], [], color=color, label=labels[kind])
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(
        f"{topo.name}: {cluster.nodes} node(s) x {g} {topo.gpu.kind} = {cluster.world_size} GPUs, "
        f"{cluster.num_links} directed links",
        fontsize=10,
    )
    ax.set_axis_off()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=130, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def run(args: argparse.Namespace) -> int:
    from sim.hardware.cluster import build_cluster
    from sim.inputs.topology import load_topology

    if args.nodes < 1:
        raise InputError(f"must be >= 1, got {args.nodes}", field="--nodes")
    try:
        topology = load_topology(args.topology)
    except InputError as exc:
        if exc.field != "cluster.topology":
            raise
        raise InputError(exc.message, field="topology") from None
    try:
        cluster = build_cluster(topology, args.nodes, args.gpus_per_node, args.cross_rail)
    except InputError as exc:
        raise InputError(
            exc.message, field="--nodes" if exc.field == "cluster.nodes" else "--gpus-per-node"
        ) from None
    summary = summarize(cluster)
    if args.plot:
        atomic_write_bytes(args.plot, draw(cluster))
    if args.json:
        write_json(args.json, summary)
    if args.json != "-":
        _print(summary, topology.description)
    return 0


def _print(s: dict, description: str) -> None:
    pg = s["per_gpu"]
    closed = s["bisection_closed_form_GBps"]
    print(f"{s['topology']}: {description}")
    print(f"  nodes x GPUs        {s['nodes']} x {s['gpus_per_node']} = {s['num_gpus']} {s['gpu']}")
    print(f"  devices             {', '.join(f'{k} {v}' for k, v in s['devices'].items())}")
    print(
        f"  directed links      {s['num_links']} ({', '.join(f'{k} {v}' for k, v in s['links_directed'].items())})"
    )
    print(
        f"  per GPU intra-node  {pg['intra_GBps']:.1f} GB/s per direction (line {pg['intra_line_GBps']:.0f})"
    )
    if pg["intra_alltoall_GBps"] != pg["intra_GBps"]:
        print(f"    in all-to-alls    {pg['intra_alltoall_GBps']:.1f} GB/s per direction (measured apart from the ring figure)")
    if pg["nic_GBps"]:
        print(
            f"  per GPU NIC         {pg['nic_GBps']:.2f} GB/s per direction (line {pg['nic_line_GBps']:.1f})"
        )
    else:
        print("  per GPU NIC         none (single node, no scale-out fabric)")
    print(f"  per GPU PCIe host   {pg['pcie_host_GBps']:.1f} GB/s per direction")
    print(f"  hops                {', '.join(f'{k} {v}' for k, v in s['hops'].items() if v is not None)}")
    closed_text = f"{closed:.1f}" if closed is not None else "n/a (halves split a leaf)"
    print(
        f"  bisection           {s['bisection_GBps']:.1f} GB/s from the graph (max flow), closed form {closed_text}"
    )
    print(f"  cross-rail          {s['cross_rail']}")
