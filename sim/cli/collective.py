"""``moesim collective KIND --topology T --nodes N --bytes B[,B...]``: one collective, nccl-tests style.

Every size runs in a fresh simulation over all ranks of the cluster. Rows follow nccl-tests'
doc/PERFORMANCE.md: ``algbw = S / t``; ``busbw = algbw x 2(n-1)/n`` (all-reduce) or
``x (n-1)/n`` (reduce-scatter, all-gather, all-to-all), with ``S`` the per-rank buffer for
all-reduce and all-to-all, and the whole array for reduce-scatter and all-gather.
"""

from __future__ import annotations

import argparse
import re

from sim.cli.common import add_json_argument
from sim.errors import InputError
from sim.ioutil import write_json

_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_sizes(text: str) -> list[int]:
    """``1K,1M,64M,1G`` -> bytes; K/M/G/T are powers of two (2^10, 2^20, ...) as in nccl-tests."""
    sizes = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", item, flags=re.IGNORECASE)
        if not m:
            raise InputError(
                f"cannot read size '{item}': give numbers with an optional K, M, G or T suffix "
                "(powers of two), comma-separated, e.g. 1K,1M,64M,1G",
                field="--bytes",
            )
        value = float(m.group(1)) * _UNITS[m.group(2).upper()]
        if value < 1 or value != int(value):
            raise InputError(f"size '{item}' must be a whole number of bytes >= 1", field="--bytes")
        sizes.append(int(value))
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sim.network.collectives import ALGOS, KINDS

    parser.add_argument("kind", metavar="KIND", choices=KINDS, help="one of: " + ", ".join(KINDS))
    parser.add_argument("--topology", required=True, metavar="T", help="shipped topology name or YAML path")
    parser.add_argument("--nodes", required=True, type=int, metavar="N", help="number of nodes")
    parser.add_argument(
        "--bytes",
        required=True,
        metavar="B[,B...]",
        help="sizes, comma-separated; K/M/G/T suffixes are powers of two (1K = 1024 B), as in "
        "nccl-tests. S is the per-rank buffer (all_reduce, all_to_all) or the whole array "
        "(reduce_scatter, all_gather)",
    )
    choices = "; ".join(f"{k}: {', '.join(v)} (default {v[0]})" for k, v in ALGOS.items())
    parser.add_argument("--algo", metavar="A", help=f"algorithm ({choices})")
    parser.add_argument(
        "--gpus-per-node", type=int, metavar="G", help="override the topology's GPUs per node"
    )
    add_json_argument(parser)


def _cluster(args: argparse.Namespace):
    from sim.hardware.cluster import build_cluster
    from sim.inputs.topology import load_topology

    if args.nodes < 1:
        raise InputError(f"must be >= 1, got {args.nodes}", field="--nodes")
    if args.gpus_per_node is not None and args.gpus_per_node < 1:
        raise InputError(f"must be >= 1, got {args.gpus_per_node}", field="--gpus-per-node")
    try:
        topology = load_topology(args.topology)
    except InputError as exc:
        if exc.field != "cluster.topology":
            raise  # a bad field inside the topology file: the message names file and field
        raise InputError(exc.message, field="--topology") from None
    try:
        return build_cluster(topology, args.nodes, args.gpus_per_node)
    except InputError as exc:
        raise InputError(exc.message, field="--nodes") from None


def run(args: argparse.Namespace) -> int:
    from sim.network.collectives import ALGOS, DEFAULT_ALGO
    from sim.network.nccl_tests import measure

    sizes = parse_sizes(args.bytes)
    algo = args.algo or DEFAULT_ALGO[args.kind]
    if algo not in ALGOS[args.kind]:
        raise InputError(
            f"{args.kind} has no algorithm '{algo}'; choose from {', '.join(ALGOS[args.kind])}",
            field="--algo",
        )
    cluster = _cluster(args)
    if cluster.world_size < 2:
        raise InputError("a collective needs at least 2 ranks", field="--gpus-per-node")
    rows = measure(cluster, args.kind, algo, sizes)
    result = {
        "kind": args.kind,
        "algo": algo,
        "topology": cluster.topology.name,
        "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "ranks": cluster.world_size,
        "size_convention": "per-rank buffer" if args.kind in ("all_reduce", "all_to_all") else "whole array",
        # NVLink per GPU and direction as this collective sees it (all-to-alls: node.intra.alltoall_efficiency)
        "intra_GBps": (cluster.topology.node.intra.alltoall_bw_GBps if args.kind == "all_to_all"
                       else cluster.topology.node.intra.bw_GBps),
        "rows": rows,
    }  # fmt: skip
    if args.json:
        write_json(args.json, result)
    if args.json != "-":
        print(
            f"# moesim collective {args.kind} ({algo}): {cluster.topology.name}, {cluster.nodes} node(s) x "
            f"{cluster.gpus_per_node} GPUs = {cluster.world_size} ranks (simulated; GB/s = 1e9 B/s)"
        )
        if result["intra_GBps"] != cluster.topology.node.intra.bw_GBps:
            print(f"# NVLink at the GPU's all-to-all figure: {result['intra_GBps']:.1f} GB/s per direction "
                  f"(ring collectives: {cluster.topology.node.intra.bw_GBps:.1f})")  # fmt: skip
        print(
            f"# {'size (B)':>14} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13} {'analytic (us)':>14}"
        )
        for r in rows:
            print(
                f"  {r['bytes']:>14d} {r['time_s'] * 1e6:>12.1f} {r['algbw_GBps']:>13.2f} "
                f"{r['busbw_GBps']:>13.2f} {r['estimate_time_s'] * 1e6:>14.1f}"
            )
    return 0
