"""The DeepEP / HybridEP token dispatchers (``collectives.all_to_all: deepep | hybridep``), the
all-to-all overlap (``collectives.a2a_overlap``) and the kernel benchmark rows of
``validation/published/C*.yaml`` (:mod:`sim.studies.a2a_bench`), checked against closed forms and
against an independent re-implementation written here from the documented mechanism:

- a token is sent once per destination *rank* (``rank_tokens``), not once per expert;
- across nodes it is sent once per destination *node* (``node_tokens``) over RDMA to the GPU with the
  sender's local index (same rail: GPU -> PCIe -> NIC -> leaf -> NIC -> PCIe -> GPU), which forwards it
  over NVLink to the node's other destinations; every transfer is in flight at once;
- each link shares its bandwidth equally among its flows (processor sharing): a flow of ``b`` bytes on
  a link carrying flows ``b_g`` ends at ``sum_g min(b_g, b) / bw``; a flow ends at the latest of its
  links plus its path's latency; a rank's part ends with the last flow it sends or receives.

The link figures are those of ``topologies/h800-cluster.yaml``, written out here as line rate x
efficiency, so that a changed path or bandwidth in the cluster model shows up as a failure.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import simpy

from sim.api import scenario_from_dict
from sim.engine.a2a_timing import A2ATiming
from sim.engine.simulate import _cluster, simulate
from sim.frameworks.program import EPAllToAll
from sim.routing.plan import route_scenario
from sim.studies.a2a_bench import _scenario, a2a_rows, dispatcher_bandwidth
from sim.studies.published import entries

# topologies/h800-cluster.yaml: line rate x efficiency, latencies
NVL_BPS = 200e9 * 0.80  # NVLink per direction
NIC_BPS = 400e9 / 8 * 0.97  # CX7 400 Gb/s
PCIE_BPS = 64e9 * 0.85  # GPU <-> NIC
NVL_LAT = 2 * 2.5e-6  # GPU -> NVSwitch -> GPU
RDMA_LAT = 5e-6 + 2e-6 + 2e-6 + 5e-6  # PCIe, NIC -> leaf, leaf -> NIC, PCIe (same rail, same leaf)
GPN = 8
FP8 = 1 + 4 / 128  # bytes per element of DeepEP's FP8 dispatch (e4m3 + an fp32 scale per 128)
BF16 = 2.0
SMS = 132  # topologies/gpus/h800-sxm.yaml sm_count


@pytest.fixture(scope="module")
def published():
    return {e["id"]: e for e in entries()}


# ---- an independent model of the forwarded all-to-all -------------------------------------------------
def _link_path(s: int, d: int) -> list[tuple]:
    """Links (named here, not by the cluster model) of a transfer s -> d on h800-cluster with one
    NIC per GPU: NVLink inside a node; across nodes only same-rail transfers are ever made."""
    if s // GPN == d // GPN:
        return [("nvl_up", s), ("nvl_down", d)]
    assert s % GPN == d % GPN, "DeepEP's RDMA goes to the same-index GPU"
    rail = s % GPN
    return [("pcie_up", s), ("nic_tx", s // GPN, rail), ("nic_rx", d // GPN, rail), ("pcie_down", d)]


BW = {"nvl_up": NVL_BPS, "nvl_down": NVL_BPS, "pcie_up": PCIE_BPS, "pcie_down": PCIE_BPS,
      "nic_tx": NIC_BPS, "nic_rx": NIC_BPS}  # fmt: skip


def deepep_flows(rank_tokens: np.ndarray, node_tokens: np.ndarray, elem: float, direction: str):
    """(src, dst, bytes) of DeepEP's normal kernels for one EP group of ``ep`` consecutive ranks."""
    ep = rank_tokens.shape[0]
    nodes = ep // GPN
    flows = []
    for s in range(ep):
        for d in range(ep):
            if s != d and s // GPN == d // GPN:  # inside the node: straight over NVLink
                flows.append((s, d, rank_tokens[s, d] * elem))
        for n in range(nodes):
            if n == s // GPN:
                continue
            relay = n * GPN + s % GPN  # RDMA once per node, to the same-index GPU
            flows.append((s, relay, node_tokens[s, n] * elem))
            for d in range(n * GPN, (n + 1) * GPN):
                if d != relay:  # forwarded over the destination node's NVLink
                    flows.append((relay, d, rank_tokens[s, d] * elem))
    if direction == "combine":
        flows = [(d, s, b) for s, d, b in flows]
    return [f for f in flows if f[2] > 0]


def ps_rank_times(flows, ep: int) -> np.ndarray:
    """Per rank, the end of its last flow under per-link processor sharing (see the module doc)."""
    on_link = defaultdict(list)
    for f, (s, d, _) in enumerate(flows):
        for link in _link_path(s, d):
            on_link[link].append(f)
    size = np.array([b for _, _, b in flows], dtype=np.float64)
    end = np.zeros(len(flows))
    for link, fs in on_link.items():
        b = size[fs]
        t = np.minimum(b[:, None], b[None, :]).sum(axis=0) / BW[link[0]]
        end[fs] = np.maximum(end[fs], t)
    out = np.zeros(ep)
    for f, (s, d, _) in enumerate(flows):
        t = end[f] + (NVL_LAT if s // GPN == d // GPN else RDMA_LAT)
        out[s], out[d] = max(out[s], t), max(out[d], t)
    return out


def link_loads(flows) -> dict[tuple, float]:
    load: dict[tuple, float] = defaultdict(float)
    for s, d, b in flows:
        for link in _link_path(s, d):
            load[link] += b
    return load


# ---- the simulator's timing of one EP group ------------------------------------------------------------
def _bench(entry, ep: int, nodes: int):
    s = _scenario(entry["scenario"], {"ep": ep, "nodes": nodes}, entry)
    plan = route_scenario(s)
    return s, plan


def _run(s, plan, algo: str | None = None, elem_bytes: dict | None = None, exact: bool = True):
    timing = A2ATiming(s, plan, _cluster(s), simpy.Environment(), exact=exact)
    if algo is not None:
        timing.algo = algo
    if elem_bytes is not None:
        timing.elem_bytes = elem_bytes
    q = np.arange(s.ep)
    out = {}
    for direction in ("dispatch", "combine"):
        out[direction] = timing.run(0, EPAllToAll(direction, direction, 0, 0), 0, q, q, np.zeros(s.ep))
    return out, timing


def _plan_counts(plan, nodes: int):
    a = plan.arrays
    return (a.rank_tokens[0, 0].astype(np.float64), a.node_tokens[0, 0][:, :nodes].astype(np.float64),
            plan.pair_copies(0, 0).astype(np.float64))  # fmt: skip


# ---- the routing counts the dispatchers rest on ---------------------------------------------------------
def test_distinct_token_counts_are_consistent_with_the_copies(published):
    """A token reaches a rank at most once, at most top_k of its experts' copies go to one rank, a
    node's distinct tokens lie between its busiest rank's and the sum of its ranks', and node-limited
    routing M=4 reaches at most 4 of the 8 nodes: sum over nodes <= 4 x tokens."""
    s, plan = _bench(published["C2"], 64, 8)
    rt, nt, pc = _plan_counts(plan, 8)
    tokens, k = 4096, 8
    assert pc.sum() == 64 * tokens * k  # dropless: every copy kept
    assert np.all(rt <= np.minimum(pc, tokens)) and np.all(pc <= rt * min(k, s.experts_per_rank))
    per_node = rt.reshape(64, 8, GPN)
    assert np.all(nt >= per_node.max(axis=2)) and np.all(nt <= per_node.sum(axis=2))
    assert np.all(nt.sum(axis=1) <= 4 * tokens) and np.all(nt.sum(axis=1) >= tokens)


# ---- intranode DeepEP (C1) ------------------------------------------------------------------------------
def test_intranode_deepep_is_bounded_by_the_busiest_nvlink_port(published):
    """EP8 on one node: the last rank ends when the busiest NVLink port (a rank's distinct tokens
    out, or in, self excluded) has moved its bytes at 160 GB/s, plus the 5 us path; every rank ends
    no sooner than its own port's bytes allow; and the per-rank ends equal the independent model."""
    entry = published["C1"]
    s, plan = _bench(entry, 8, 1)
    rt, _, _ = _plan_counts(plan, 1)
    elem = 7168 * FP8
    out, _ = _run(s, plan, elem_bytes={"dispatch": elem, "combine": 7168 * BF16})
    fin, sent, inter = out["dispatch"]
    off = rt * (1 - np.eye(8))
    port = np.maximum(off.sum(axis=1), off.sum(axis=0)) * elem
    assert fin.max() == pytest.approx(port.max() / NVL_BPS + NVL_LAT, rel=1e-9)
    assert np.all(fin >= port / NVL_BPS + NVL_LAT - 1e-12)
    assert fin == pytest.approx(ps_rank_times(deepep_flows(rt, rt[:, :1], elem, "dispatch"), 8), rel=1e-9)
    assert sent == pytest.approx(off.sum(axis=1) * elem, rel=1e-12)  # one copy per rank, never per expert
    assert np.all(inter == 0.0)
    # ~0.88 ms at 160 GB/s: 4096 tokens x ~5.3/8 ranks x 7 peers x 7392 B
    assert 0.8e-3 < fin.max() < 1.0e-3


def test_intranode_combine_is_the_dispatch_reversed_at_bf16(published):
    """Combine sends every dispatch flow back (dst -> src): NVLink up and down ports swap roles, so
    each rank's time less the latency scales exactly by the element sizes, 2 / 1.03125."""
    s, plan = _bench(published["C1"], 8, 1)
    out, _ = _run(s, plan, elem_bytes={"dispatch": 7168 * FP8, "combine": 7168 * BF16})
    rt, _, _ = _plan_counts(plan, 1)
    d, c = out["dispatch"][0], out["combine"][0]
    assert (c - NVL_LAT) / (d - NVL_LAT) == pytest.approx(np.full(8, BF16 / FP8), rel=1e-9)
    off = rt * (1 - np.eye(8))  # a rank sends back in combine what it received in dispatch
    assert out["combine"][1] == pytest.approx(off.sum(axis=0) * 7168 * BF16, rel=1e-12)


def test_c1_benchmark_rows_recomputed(published):
    """``a2a_rows`` on C1: the predicted 'NVL' bandwidth is the bytes a rank receives (distinct tokens
    per rank, own rank included) over the mean kernel time of the independent model."""
    entry = published["C1"]
    rows = a2a_rows(entry)
    assert [r.metric for r in rows] == ["dispatch_GBps@ep8", "combine_GBps@ep8"]
    s, plan = _bench(entry, 8, 1)
    rt, _, _ = _plan_counts(plan, 1)
    for row, direction, per_elem, measured in zip(rows, ("dispatch", "combine"), (FP8, BF16), (153, 158),
                                                  strict=True):  # fmt: skip
        elem = 7168 * per_elem
        t = ps_rank_times(deepep_flows(rt, rt[:, :1], elem, direction), 8).mean()
        want = rt.sum(axis=0).mean() * elem / t / 1e9
        assert row.measured == measured
        assert row.predicted == pytest.approx(want, rel=1e-9)
        assert row.error == pytest.approx(want / measured - 1, rel=1e-9)
        # the count includes the ~1/8 a rank keeps: above the 160 GB/s wire, below 160 x 8/7
        assert NVL_BPS / 1e9 < row.predicted < NVL_BPS / 1e9 * 8 / 7


# ---- internode DeepEP (C2) ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ep64(published):
    s, plan = _bench(published["C2"], 64, 8)
    rt, nt, pc = _plan_counts(plan, 8)
    return s, plan, rt, nt, pc


def test_internode_deepep_ep64_equals_the_forwarding_model_and_is_rdma_bound(ep64):
    """EP64 on 8 nodes, node-limited M=4: per-rank ends equal the independent RDMA + NVLink forwarding
    model; the NIC is the bottleneck, so the last rank ends when the busiest NIC (a GPU's distinct
    (token, remote node) pairs, or what a NIC receives from its rail) has moved its bytes at
    48.5 GB/s, plus the 14 us RDMA path; every GPU needs at least its own RDMA bytes / 48.5 GB/s."""
    s, plan, rt, nt, _ = ep64
    elem = 7168 * FP8
    out, _ = _run(s, plan, elem_bytes={"dispatch": elem, "combine": 7168 * BF16})
    fin, _, inter = out["dispatch"]
    flows = deepep_flows(rt, nt, elem, "dispatch")
    assert fin == pytest.approx(ps_rank_times(flows, 64), rel=1e-9)
    own = np.arange(64) // GPN
    remote = nt.sum(axis=1) - nt[np.arange(64), own]
    assert inter == pytest.approx(remote * elem, rel=1e-12)  # one copy per (token, remote node)
    load = link_loads(flows)
    nic = max(v for k, v in load.items() if k[0] in ("nic_tx", "nic_rx"))
    nvl = max(v for k, v in load.items() if k[0].startswith("nvl"))
    assert nvl / NVL_BPS + NVL_LAT < nic / NIC_BPS + RDMA_LAT  # RDMA-bound, as the C2 entry says
    assert fin.max() == pytest.approx(nic / NIC_BPS + RDMA_LAT, rel=1e-9)
    assert np.all(fin >= remote * elem / NIC_BPS + RDMA_LAT - 1e-12)
    # nic_tx of a node's rail k carries exactly GPU k's remote node bytes
    tx = {k[1] * GPN + k[2]: v for k, v in load.items() if k[0] == "nic_tx"}
    assert np.array([tx[r] for r in range(64)]) == pytest.approx(remote * elem, rel=1e-12)


def test_deepep_sends_fewer_bytes_across_nodes_than_direct(ep64):
    """Direct (NCCL) sends one row per (token, expert) to every remote rank; DeepEP one per (token,
    remote node): the inter-node bytes shrink by sum(node_tokens remote) / sum(pair_copies remote),
    and the bytes leaving a GPU by the distinct-token ratio; both read off the routing plan."""
    s, plan, rt, nt, pc = ep64
    elem = 7168 * BF16
    deep, _ = _run(s, plan, elem_bytes={"dispatch": elem, "combine": elem})
    direct, _ = _run(s, plan, algo="direct", elem_bytes={"dispatch": elem, "combine": elem})
    node = np.arange(64) // GPN
    cross = node[:, None] != node[None, :]
    remote_nodes = nt.sum() - nt[np.arange(64), node].sum()
    remote_copies = (pc * cross).sum()
    _, sent_deep, inter_deep = deep["dispatch"]
    _, sent_direct, inter_direct = direct["dispatch"]
    assert inter_direct.sum() == pytest.approx(remote_copies * elem, rel=1e-12)
    assert inter_deep.sum() / inter_direct.sum() == pytest.approx(remote_nodes / remote_copies, rel=1e-12)
    off = 1 - np.eye(64)
    assert sent_deep.sum() / sent_direct.sum() == pytest.approx(
        (rt * off).sum() / (pc * off).sum(), rel=1e-12
    )
    # top-8 over ~4 nodes: ~2 copies per (token, node), so about half the wire bytes
    assert 0.35 < remote_nodes / remote_copies < 0.65
    # and the exchange is faster for it
    assert deep["dispatch"][0].max() < direct["dispatch"][0].max()


def test_internode_ep16_is_nvlink_bound_through_forwarding(published):
    """EP16 on 2 nodes (M=2: no node limit): nearly every token needs the other node, but the NVLink
    port also carries what it forwards for its same-index partner, so NVLink is the bottleneck:
    the last rank ends at the busiest NVLink port's bytes / 160 GB/s + 5 us, where rank i's up port
    carries its own same-node tokens plus its partner's tokens for i's node-mates."""
    s, plan = _bench(published["C2"], 16, 2)
    rt, nt, _ = _plan_counts(plan, 2)
    elem = 7168 * FP8
    out, _ = _run(s, plan, elem_bytes={"dispatch": elem, "combine": 7168 * BF16})
    fin = out["dispatch"][0]
    up, down = np.zeros(16), np.zeros(16)
    for i in range(16):
        mates = [j for j in range(16) if j // GPN == i // GPN and j != i]
        partner = (i + GPN) % 16
        up[i] = rt[i, mates].sum() + rt[partner, mates].sum()
        senders = [s_ for s_ in range(16) if s_ // GPN != i // GPN and (s_ % GPN) != (i % GPN)]
        down[i] = rt[mates, i].sum() + rt[senders, i].sum()
    nvl = max(up.max(), down.max()) * elem
    remote = nt[np.arange(16), 1 - np.arange(16) // GPN] * elem
    assert nvl / NVL_BPS + NVL_LAT > remote.max() / NIC_BPS + RDMA_LAT  # NVLink-bound
    assert fin.max() == pytest.approx(nvl / NVL_BPS + NVL_LAT, rel=1e-9)
    assert fin == pytest.approx(ps_rank_times(deepep_flows(rt, nt, elem, "dispatch"), 16), rel=1e-9)
    # rank i's NVLink up port: the closed form above, and the same in the forwarding model
    load = link_loads(deepep_flows(rt, nt, elem, "dispatch"))
    assert [load[("nvl_up", i)] for i in range(16)] == pytest.approx(up * elem, rel=1e-12)
    assert [load[("nvl_down", i)] for i in range(16)] == pytest.approx(down * elem, rel=1e-12)


def _cluster_link(cluster, link: tuple) -> int:
    """Index in the cluster model of a link named as in :func:`_link_path`."""
    kind = link[0]
    if kind in ("nic_tx", "nic_rx"):
        n, k = link[1], link[2]
        ends = (f"n{n}/nic{k}", f"leaf/r{k}/0")
        return cluster.link_names.index(ends if kind == "nic_tx" else ends[::-1])
    r = link[1]
    gpu = f"n{r // GPN}/gpu{r % GPN}"
    other = f"n{r // GPN}/switch" if kind.startswith("nvl") else f"n{r // GPN}/nic{r % GPN}"
    return cluster.link_names.index((gpu, other) if kind.endswith("up") else (other, gpu))


@pytest.mark.parametrize(("ep", "nodes"), [(16, 2), (32, 4)])
def test_forwarded_bytes_on_every_link(published, ep, nodes):
    """Every link's bytes in the simulated dispatch + combine equal the forwarding model's: NVLink
    ports carry same-node tokens and forwarded ones, each NIC one copy per (token, remote node)."""
    s, plan = _bench(published["C2"], ep, nodes)
    rt, nt, _ = _plan_counts(plan, nodes)
    elem = {"dispatch": 7168 * FP8, "combine": 7168 * BF16}
    _, timing = _run(s, plan, elem_bytes=elem)
    cluster = timing.cluster
    got = np.zeros(cluster.num_links)
    for paths in timing.comm._path_cache.values():  # the cached flow sets of the forwarded phases
        got += paths.link_bytes()
    want = np.zeros(cluster.num_links)
    for direction in ("dispatch", "combine"):
        for link, b in link_loads(deepep_flows(rt, nt, elem[direction], direction)).items():
            want[_cluster_link(cluster, link)] += b
    assert got == pytest.approx(want, rel=1e-12)
    kinds = cluster.link_kind
    own = np.arange(ep) // GPN
    remote = (nt.sum(axis=1) - nt[np.arange(ep), own]).sum()
    assert got[kinds == "nic_tx"].sum() == pytest.approx(
        remote * (elem["dispatch"] + elem["combine"]), rel=1e-12
    )


@pytest.mark.parametrize(
    "algo",
    ["direct", "deepep", "hybridep"],
)  # fmt: skip
def test_simulated_link_bytes_include_the_all_to_all(published, algo):
    """Whatever the dispatcher, the bytes the simulator reports on its NICs (what ``link_bytes`` and
    the result's ``link_bytes_by_kind`` are made of) are the inter-node bytes the all-to-all sent."""
    s, plan = _bench(published["C2"], 16, 2)
    out, timing = _run(s, plan, algo=algo)
    inter = out["dispatch"][2].sum() + out["combine"][2].sum()
    nic_tx = timing.comm.total_link_bytes()[timing.cluster.link_kind == "nic_tx"].sum()
    assert inter > 0
    assert nic_tx == pytest.approx(inter, rel=1e-9)


def test_c2_benchmark_rows_recomputed(published):
    """``a2a_rows`` on C2: the 'RDMA' bandwidth counts (token, node) pairs over the selected nodes,
    own node included, x bytes per element, over the mean kernel time; recomputed for EP16/32/64
    with the independent model, FP8 dispatch and BF16 combine."""
    entry = published["C2"]
    rows = a2a_rows(entry)
    got = {r.metric: r for r in rows}
    assert sorted(got) == sorted(f"{d}_GBps@ep{ep}" for d in ("dispatch", "combine") for ep in (16, 32, 64))
    for ep, nodes in ((16, 2), (32, 4), (64, 8)):
        s, plan = _bench(entry, ep, nodes)
        rt, nt, _ = _plan_counts(plan, nodes)
        for direction, per_elem in (("dispatch", FP8), ("combine", BF16)):
            elem = 7168 * per_elem
            t = ps_rank_times(deepep_flows(rt, nt, elem, direction), ep).mean()
            want = nt.sum(axis=1).mean() * elem / t / 1e9
            assert got[f"{direction}_GBps@ep{ep}"].predicted == pytest.approx(want, rel=1e-9), (ep, direction)


def test_bf16_dispatch_and_combine_bandwidths_are_equal(published):
    """With the same element size both ways (HybridEP's BF16 benchmark, C4), the combine is the
    dispatch with every flow reversed over mirror links of equal bandwidth and latency: the same
    times, the same bandwidth."""
    entry = published["C2"]
    sc = {**entry["scenario"], "dispatch_bytes_per_element": 2, "combine_bytes_per_element": 2}
    bw = dispatcher_bandwidth(sc, {"ep": 16, "nodes": 2}, entry)
    assert bw["combine_s"] == pytest.approx(bw["dispatch_s"], rel=1e-12)
    assert bw["combine_GBps"] == pytest.approx(bw["dispatch_GBps"], rel=1e-12)
    fp8 = dispatcher_bandwidth(entry["scenario"], {"ep": 16, "nodes": 2}, entry)
    assert fp8["combine_s"] == pytest.approx(bw["combine_s"], rel=1e-12)  # combine is BF16 in both
    assert fp8["dispatch_s"] < bw["dispatch_s"]


# ---- deepep vs hybridep ---------------------------------------------------------------------------------
def test_hybridep_moves_and_times_exactly_as_deepep(published):
    """The two normal-kernel dispatchers share the transfer model (same flows, same times, same
    bytes); what differs is the SMs they hold, which only matters with a2a_overlap (below)."""
    s, plan = _bench(published["C2"], 16, 2)
    deep, _ = _run(s, plan, algo="deepep")
    hyb, _ = _run(s, plan, algo="hybridep")
    hier, _ = _run(s, plan, algo="hierarchical")
    for direction in ("dispatch", "combine"):
        for a, b in zip(deep[direction], hyb[direction], strict=True):
            np.testing.assert_array_equal(a, b)
    # the plain hierarchical dispatcher sends a row per (token, expert) inside the node instead
    assert hier["dispatch"][1].sum() > deep["dispatch"][1].sum()


# ---- a2a_overlap and the SMs the kernels hold ----------------------------------------------------------
def _train(a2a: str, overlap: bool, sms: int | None = None, micro: int = 2):
    """16 H800 (2 nodes), EP16, a small MoE; balanced contiguous routing so that every rank and every
    micro-batch does the same work (each overlapped pair is the same)."""
    coll = {"all_to_all": a2a, "a2a_overlap": overlap, **({"dispatcher_sms": sms} if sms else {})}
    data = {
        "name": "overlap",
        "cluster": {"topology": "h800-cluster", "nodes": 2},
        "model": {"num_layers": 2, "hidden_size": 1024, "num_attention_heads": 8, "vocab_size": 1024,
                  "ffn_type": "gated", "moe_ffn_hidden_size": 512, "ffn_hidden_size": 2048, "num_experts": 32,
                  "top_k": 4},
        "parallelism": {"ep": 16, "zero_stage": 0},
        "training": {"micro_batch_size": 1, "seq_len": 2048, "grad_accum_steps": micro, "dtype": "bf16"},
        "routing": {"generator": "balanced", "balanced_pattern": "contiguous", "dispatch": "dropless",
                    "capacity_factor": None, "seed": 0},
        "collectives": coll,
    }  # fmt: skip
    return simulate(scenario_from_dict(data))


def _tiles(r) -> float:
    return sum(v for k, v in r["breakdown_s"].items() if k != "grad_sync")


@pytest.mark.parametrize(
    ("a2a", "sms", "slowdown"),
    [("direct", None, 1.0), ("deepep", None, SMS / (SMS - 20)), ("hybridep", None, SMS / (SMS - 24)),
     ("deepep", 28, SMS / (SMS - 28))],
)  # fmt: skip
def test_a2a_overlap_hides_the_closed_form(a2a, sms, slowdown):
    """The forward of micro-batch i + 1 and the backward of i take max(C, K + C (1 - 1/s)) instead of
    K + C (K their kernels, C their all-to-alls; compute runs at 1/s of its speed only while an
    all-to-all holds its SMs; Megatron's combined_1f1b_schedule_for_no_pipelining runs the first
    forward and the last backward alone): the a2a share drops by (m - 1) min(K, C / s) over the m - 1
    pairs, with s = sm_count / (sm_count - SMs) for DeepEP (20) and HybridEP (24), 1 for NCCL; compute
    is unchanged (the SM slowdown stays in the all-to-all's share); the step is no slower and gains at
    most the all-to-all time; the breakdown still tiles the step."""
    m = 3
    off, on = _train(a2a, False, sms, m), _train(a2a, True, sms, m)
    b0, b1 = off["breakdown_s"], on["breakdown_s"]
    k, c = b0["compute"] / m, b0["a2a"] / m
    saved = min(k, c / slowdown)
    pair = max(c, k + c * (1 - 1 / slowdown))  # the same, as the pair's length
    assert k + c - pair == pytest.approx(saved, rel=1e-12)
    assert 0 < saved <= c
    assert b1["a2a"] == pytest.approx(b0["a2a"] - (m - 1) * saved, rel=1e-9)
    assert b1["compute"] == pytest.approx(b0["compute"], rel=1e-12)
    assert off["step_time_s"] - b0["a2a"] <= on["step_time_s"] < off["step_time_s"]
    assert _tiles(on) == pytest.approx(on["step_time_s"], rel=1e-9)
    assert _tiles(off) == pytest.approx(off["step_time_s"], rel=1e-9)


def test_dispatcher_sms_matter_only_with_overlap():
    """Without overlap the SMs a kernel holds change nothing (deepep with 20 or 100 SMs, hybridep);
    with it, more SMs hide less: hybridep's 24 SMs leave more all-to-all exposed than deepep's 20."""
    base = _train("deepep", False)
    for other in (_train("deepep", False, 100), _train("hybridep", False)):
        assert other["step_time_s"] == base["step_time_s"]
        assert other["breakdown_s"] == base["breakdown_s"]
    deep, hyb = _train("deepep", True), _train("hybridep", True)
    assert hyb["breakdown_s"]["a2a"] > deep["breakdown_s"]["a2a"]
    assert hyb["step_time_s"] > deep["step_time_s"]


def test_overlap_with_most_sms_taken_hides_little_and_tiles_the_step():
    """With 100 of 132 SMs taken (s = 4.125) compute crawls only while the all-to-all runs: a pair
    saves C / s (or K when that is less), never goes slower than the two in series, and compute + a2a
    + ... still add up to the step."""
    m = 2
    off, on = _train("deepep", False, 100, micro=m), _train("deepep", True, 100, micro=m)
    k, c = off["breakdown_s"]["compute"] / m, off["breakdown_s"]["a2a"] / m
    assert off["step_time_s"] - on["step_time_s"] == pytest.approx(min(k, c / (132 / 32)), rel=1e-9)
    assert _tiles(on) == pytest.approx(on["step_time_s"], rel=1e-9)


def test_overlap_schedule_pairs_another_micro_batch():
    """pp 1 with a2a overlap runs Megatron's combined 1F1B: F0, then F(i + 1) before B(i), then the
    last B alone; no forward is followed by its own micro-batch's backward. The pair runs layer i's
    forward beside layer L - 1 - i's backward and frees each backward layer: one micro-batch's layers
    plus one (here L = 2) are alive at once."""
    from sim.frameworks import pipeline
    from sim.model.stage_memory import in_flight

    seq = pipeline.build("1f1b", 1, 1, 4, overlap=True)[0]
    assert [repr(x) for x in seq] == ["F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "F0.3", "B0.2", "B0.3"]
    pipeline.check("1f1b", 1, 1, 4, [seq])
    assert [repr(x) for x in pipeline.build("1f1b", 1, 1, 2)[0]] == ["F0.0", "B0.0", "F0.1", "B0.1"]
    s_on, s_off = (load_scenario_for_overlap(True), load_scenario_for_overlap(False))
    assert in_flight(s_on, 0) == 1.5 and in_flight(s_off, 0) == 1.0


def load_scenario_for_overlap(overlap: bool):
    data = {"name": "o", "cluster": {"topology": "h800-cluster", "nodes": 2},
            "model": {"num_layers": 2, "hidden_size": 1024, "num_attention_heads": 8, "vocab_size": 1024,
                      "ffn_type": "gated", "moe_ffn_hidden_size": 512, "ffn_hidden_size": 2048, "num_experts": 32,
                      "top_k": 4},
            "parallelism": {"ep": 16, "zero_stage": 0},
            "training": {"micro_batch_size": 1, "seq_len": 2048, "grad_accum_steps": 4},
            "collectives": {"a2a_overlap": overlap}}  # fmt: skip
    return scenario_from_dict(data)


def test_overlap_with_plain_1f1b_pipeline_is_refused():
    from sim.errors import InputError

    data = {"name": "o", "cluster": {"topology": "h800-cluster", "nodes": 2},
            "model": {"num_layers": 4, "hidden_size": 1024, "num_attention_heads": 8, "vocab_size": 1024,
                      "ffn_type": "gated", "moe_ffn_hidden_size": 512, "ffn_hidden_size": 2048, "num_experts": 32,
                      "top_k": 4},
            "parallelism": {"ep": 8, "pp": 2, "zero_stage": 1},
            "training": {"micro_batch_size": 1, "seq_len": 2048, "grad_accum_steps": 4, "framework": "megatron"},
            "collectives": {"a2a_overlap": True}}  # fmt: skip
    with pytest.raises(InputError, match="collectives.a2a_overlap"):
        scenario_from_dict(data)
    data["parallelism"]["vpp"] = 2
    scenario_from_dict(data)  # interleaved: allowed


@pytest.mark.parametrize("ep,nodes", [(16, 2), (32, 4), (64, 8)])
@pytest.mark.parametrize("algo", ["deepep", "hybridep"])
def test_estimate_counts_the_forwarding_legs(published, ep, nodes, algo):
    """The estimate mode (``fidelity: estimate``, the plan's ranking and the folded engine's choice of
    lanes) prices each member by its busiest link class; the relay's NVLink legs (tokens taken off the
    network and passed on to the node's other destinations) are counted, so it lands within 2% of the
    exact forwarded model. Without them EP16 on 2 nodes, NVLink-bound, came out 42% short."""
    s, plan = _bench(published["C2"], ep, nodes)
    elem = {"dispatch": 7168 * FP8, "combine": 7168 * BF16}
    exact, _ = _run(s, plan, algo=algo, elem_bytes=elem)
    est, _ = _run(s, plan, algo=algo, elem_bytes=elem, exact=False)
    for direction in ("dispatch", "combine"):
        assert est[direction][0].max() == pytest.approx(exact[direction][0].max(), rel=0.02)
        assert est[direction][1] == pytest.approx(exact[direction][1])  # the same bytes sent


@pytest.mark.parametrize("ep,nodes", [(16, 2), (64, 8)])
def test_hierarchical_estimate_is_a_lower_bound(published, ep, nodes):
    """NCCL-style hierarchical all-to-all runs its in-node and inter-node phases one after the
    other (the exact DAG); the estimate's busiest link class, forwarding legs included, bounds it
    from below, up to how the two add path latencies (1%)."""
    s, plan = _bench(published["C2"], ep, nodes)
    exact, _ = _run(s, plan, algo="hierarchical")
    est, _ = _run(s, plan, algo="hierarchical", exact=False)
    for direction in ("dispatch", "combine"):
        assert 0.5 * exact[direction][0].max() < est[direction][0].max() <= exact[direction][0].max() * 1.01


@pytest.mark.parametrize("a2a", ["hybridep", "deepep"])
def test_an_ep_group_inside_one_nvlink_domain_has_no_relay(a2a):
    """HybridEP's multi-node NVLink mode: on a GB200 NVL72 rack an EP group that spans two trays of 4
    still reaches every member over NVLink directly, no relay through the same-index GPU of the other
    tray. So its all-to-all takes what the same group takes as one node of 8 GPUs on the same NVLink
    (cluster.gpus_per_node 8), and nothing counts as inter-node traffic."""

    def run(extra: dict) -> dict:
        data = {
            "name": "nvl72", "cluster": {"topology": "gb200-nvl72", "nodes": 2, **extra},
            "model": {"num_layers": 2, "hidden_size": 1024, "num_attention_heads": 8, "vocab_size": 1024,
                      "ffn_type": "gated", "moe_ffn_hidden_size": 512, "ffn_hidden_size": 2048, "num_experts": 32,
                      "top_k": 4},
            "parallelism": {"ep": 8, "zero_stage": 0},
            "training": {"micro_batch_size": 1, "seq_len": 2048, "grad_accum_steps": 2, "dtype": "bf16",
                         "framework": "megatron"},
            "routing": {"generator": "uniform", "dispatch": "dropless", "capacity_factor": None, "seed": 0},
            "collectives": {"all_to_all": a2a},
        }  # fmt: skip
        return simulate(scenario_from_dict(data))

    trays = run({})  # 2 trays x 4 GPUs, one NVLink domain
    node = run({"nodes": 1, "gpus_per_node": 8})  # the same 8 GPUs as one node
    assert trays["traffic"]["inter_node_bytes"] == 0
    assert trays["breakdown_s"]["a2a"] == pytest.approx(node["breakdown_s"]["a2a"], rel=1e-9)


# ---- DeepEP low-latency kernels (C3) --------------------------------------------------------------------
def test_low_latency_rows_are_the_direct_all_to_all_of_every_selection(published):
    """C3 (DeepEP's low-latency kernels): every (token, expert) selection goes straight to its rank, RDMA
    across nodes from the sender's own NIC, NVLink inside one. The benchmark's bytes are exactly 128 tokens
    x 8 selections x 7,408 B per rank (FP8 dispatch); at EP256 a rank's kernel ends between its NIC
    bytes (the larger of out and in) over the NIC's 48.5 GB/s and the busiest NIC's plus the spine path's
    latency (PCIe 5 + 4 switch hops x 2 + PCIe 5 = 18 us)."""
    entry = published["C3"]
    rows = a2a_rows(entry)
    assert len(rows) == 12 and all(r.predicted is not None and r.predicted > 0 for r in rows)
    sc = entry["scenario"]
    point = {"ep": 256, "nodes": 32}
    got = dispatcher_bandwidth(sc, point, entry)
    per_sel = 7168 * float(sc["dispatch_bytes_per_element"])
    assert per_sel == pytest.approx(7408, abs=0.2)  # 1.0335 B per element, as the entry rounds 7408 / 7168
    assert got["dispatch_GBps"] * 1e9 * got["dispatch_s"] == pytest.approx(128 * 8 * per_sel, rel=1e-9)
    s = _scenario(sc, point, entry)
    copies = route_scenario(s).pair_copies(0, 0).astype(np.float64) * per_sel  # (256, 256) src -> dst
    node = np.arange(256) // GPN
    cross = node[:, None] != node[None, :]
    nic = np.maximum((copies * cross).sum(axis=1), (copies * cross).sum(axis=0))
    assert nic.mean() / NIC_BPS < got["dispatch_s"] < nic.max() / NIC_BPS + 18e-6
