"""All-to-all kernel benchmarks (the ``a2a`` entries of ``validation/published``) in simulation.

- DeepEP normal kernels (``tests/test_intranode.py`` / ``test_internode.py``): 4096 tokens per rank, h
  7168, top-8 of ``(256 // ranks) x ranks`` experts on random scores (internode: top-``min(nodes, 4)``
  node groups first), FP8 dispatch (1 + 1/32 bytes per element with the scales), BF16 combine. The
  benchmark's bandwidth counts received bytes deduplicated per rank (intranode "NVL") or tokens sent
  per destination node, the own node included (internode "RDMA"), over the kernel's time.
- HybridEP (``README_Hybrid-EP.md``): the same workload in BF16, "algorithm bandwidth" as DeepEP's, over
  its Torch API's time: the kernel, then a device-to-device copy of the rank's tokens between its
  registered buffer and the output tensor (``dispatch = dispatch_kernel + d2d + misc``, as its test
  prints it; the "misc", a stream synchronisation and flag updates, is not modelled).
- DeepEP low-latency kernels (``tests/test_low_latency.py``; ``docs/legacy.md``'s table): 128 tokens per
  rank, FP8 dispatch (7,408 bytes a copy: values, scales, a 16-byte header), BF16 combine. Each (token,
  expert) selection goes straight to the destination rank, no deduplication and no forwarding: RDMA from
  the sender's own NIC (IBGDA: across rails through the spine, not NCCL's PXN) and, since DeepEP's
  2025-06-05 change, NVLink to same-node peers. That is the ``direct`` all-to-all's traffic; the
  benchmark's bandwidth counts every selection, local ones included, over the kernel time (kineto).
- nccl-tests ``alltoall_perf``: ``busbw = S / t x (n-1)/n`` (:mod:`sim.network.nccl_tests`).

The simulated kernel is the dispatcher of :mod:`sim.engine.a2a_timing` (``deepep``/``hybridep``:
RDMA to the same-index GPU of each node, NVLink forwarding, each token once per rank) timed by its
exact (processor-sharing) model, each point with its kernel and SMs (DeepEP's normal kernels inside
one NVLink domain capped at SMs x the GPU's ``deepep_GBps_per_sm``); the kernel's own launch is not
modelled.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sim.api import scenario_from_dict
from sim.engine.a2a_timing import A2ATiming
from sim.engine.simulate import _cluster, cost_model
from sim.frameworks.program import EPAllToAll
from sim.hardware.faults import cluster_for
from sim.routing.plan import route_scenario
from sim.studies.published_row import Row


def _scenario(sc: dict[str, Any], point: dict[str, Any], entry) -> Any:
    nodes = int(point.get("nodes", sc.get("nodes", 1)))
    ep = int(point.get("ep", point.get("ranks", nodes * 8)))
    if "num_experts_per_rank" in sc:
        experts = int(sc["num_experts_per_rank"]) * ep
    else:
        experts = int(sc.get("num_experts", 256))
        experts = (experts // ep) * ep if experts >= ep else ep
    kernel, sms = point.get("kernel", sc.get("kernel", "")), point.get("sms", sc.get("sms"))  # the point's, else the row's
    algo = "direct" if low_latency(kernel) else "hybridep" if "hybrid" in str(kernel).lower() else "deepep"
    routing = dict(sc.get("routing", {"generator": "uniform"}))
    if str(routing.get("policy", "topk")).startswith("node_limited"):
        routing["policy"] = "topk" if nodes == 1 else f"node_limited:M={min(nodes, 4)}"
    data = {
        "name": f"{entry['id']}-ep{ep}",
        "cluster": {"topology": sc["topology"], "nodes": nodes, "gpus_per_node": ep // nodes},
        "model": {"num_layers": 1, "hidden_size": int(sc["hidden_size"]), "num_attention_heads": 1,
                  "vocab_size": 8, "ffn_type": "plain", "moe_ffn_hidden_size": 8, "num_experts": experts,
                  "top_k": int(sc["top_k"])},
        "parallelism": {"ep": ep, "zero_stage": 0},
        "training": {"micro_batch_size": 1, "seq_len": int(sc["tokens_per_rank"]), "dtype": "bf16"},
        "routing": {**routing, "dispatch": "dropless", "capacity_factor": None, "seed": 0},
        "collectives": {"all_to_all": algo, **({"dispatcher_sms": int(sms)} if sms else {})},
    }  # fmt: skip
    return scenario_from_dict(data, source=str(entry["_path"]), base_dir=entry["_path"].parent)


def low_latency(kernel: str) -> bool:
    """DeepEP's low-latency kernels (``kernel: deepep-low-latency``)."""
    return "low-latency" in str(kernel).lower()


def dispatcher_bandwidth(sc: dict[str, Any], point: dict[str, Any], entry) -> dict[str, float]:
    """Simulated dispatch and combine times of one EP group and the benchmark's bandwidths."""
    s = _scenario(sc, point, entry)
    plan = route_scenario(s)
    ll = s.collectives.all_to_all == "direct"  # the low-latency kernels (_scenario maps only them to direct)
    cluster = cluster_for(s, cross_rail="spine") if ll else _cluster(s)  # IBGDA posts on the sender's own NIC
    import simpy

    timing = A2ATiming(s, plan, cluster, simpy.Environment(), exact=True)
    h = s.model.hidden_size
    timing.elem_bytes = {"dispatch": h * float(sc.get("dispatch_bytes_per_element", 2)),
                         "combine": h * float(sc.get("combine_bytes_per_element", 2))}  # fmt: skip
    q = np.arange(s.ep)
    out: dict[str, float] = {}
    nodes = s.cluster.nodes
    nvl = nodes == 1 or timing._relay_unit(q[None, :]) >= s.ep  # the whole group over NVLink (one NVL72 domain)
    rank_tokens = plan.arrays.rank_tokens[0, 0].astype(np.float64)  # (ep, ep) distinct tokens src -> dst
    received = rank_tokens.sum(axis=0)  # tokens each rank receives, its own included
    hbm_Bps = cost_model(s).hbm_Bps
    node_tokens = plan.arrays.node_tokens[0, 0][:, :nodes].astype(np.float64)
    selections = plan.pair_copies(0, 0).sum(axis=1).astype(np.float64)  # (token, expert) copies each rank sends
    for direction in ("dispatch", "combine"):
        op = EPAllToAll(direction, direction, 0, 0)
        fin, _, _ = timing.run(0, op, 0, q, q, np.zeros(s.ep))
        per_elem = timing.elem_bytes[direction]
        if s.collectives.all_to_all == "hybridep":  # its Torch API: kernel + a device-to-device copy of
            # the rank's tokens between its registered buffer and the torch tensor (after the dispatch
            # kernel, before the combine kernel; tests/test_hybrid_ep.py) + misc (not modelled)
            fin = fin + 2.0 * received * per_elem / hbm_Bps
        t = float(fin.mean())
        # intranode (or one NVLink domain): NVL bytes received, one copy per rank, own rank included;
        # internode: RDMA tokens sent per destination node, own node included
        # low-latency: every (token, expert) selection, local ones included
        moved = (selections if ll else received if nvl else node_tokens.sum(axis=1)) * per_elem
        out[f"{direction}_s"] = t
        out[f"{direction}_GBps"] = float(moved.mean()) / t / 1e9
    return out


def a2a_rows(entry) -> list:
    sc, m = entry["scenario"], entry["measured"]
    rows = []
    if sc.get("collective") == "all_to_all" or "nccl" in str(sc.get("kernel", "")):
        from sim.hardware.cluster import build_cluster
        from sim.inputs.topology import load_topology
        from sim.network.nccl_tests import measure

        cluster = build_cluster(
            load_topology(sc["topology"]), int(sc.get("nodes", 1)), sc.get("gpus_per_node")
        )
        for pt in m["points"]:
            got = measure(cluster, "all_to_all", "direct", [int(pt.get("bytes", sc.get("bytes")))])[0]
            rows.append(Row(entry["id"], "a2a", entry["title"], f"busbw_GBps@{got['bytes']}", float(pt["busbw_GBps"]),
                            got["busbw_GBps"], got["busbw_GBps"] / float(pt["busbw_GBps"]) - 1))  # fmt: skip
        return rows
    points = m.get("points") or [dict(m)]
    sc_points = sc.get("points") or [{}] * len(points)
    for i, pt in enumerate(points):  # the measured point's kernel and SMs over the scenario's
        spt = sc_points[i] if i < len(sc_points) else {}
        bw = dispatcher_bandwidth(
            sc, {**spt, **{k: pt[k] for k in ("ep", "nodes", "ranks", "kernel", "sms") if k in pt}}, entry
        )
        tag = f"@ep{pt.get('ep', pt.get('ranks', ''))}"
        if "kernel" in pt or "sms" in pt:
            tag += f" {pt.get('kernel', '')} {pt.get('sms', '')} SMs".rstrip()
        for direction in ("dispatch", "combine"):
            key = f"{direction}_GBps"
            for measured_key in (key, f"{direction}_bf16_GBps"):
                if measured_key in pt:
                    rows.append(Row(entry["id"], "a2a", entry["title"], measured_key + tag, float(pt[measured_key]),
                                    bw[key], bw[key] / float(pt[measured_key]) - 1))  # fmt: skip
    return rows


__all__ = ["a2a_rows", "dispatcher_bandwidth"]
