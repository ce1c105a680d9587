"""How long each rank's part of an EP all-to-all takes, exactly or by an estimate.

The bytes come from the routing plan, per EP group (never a world x world matrix): copies from each
member to each member (``dropless``) or the padded ``E x C`` chunks (``capacity_padded``); the
hierarchical dispatchers (``hierarchical``, ``deepep``, ``hybridep``) send each token once per
destination node over RDMA, to the member with the sender's local index, which forwards it over
NVLink (DeepEP's normal kernels, DeepSeek-V3 section 3.2.2).

- ``exact`` (the DES): the processor-sharing model of :class:`sim.network.comm.Comm` on the group's
  routed flows (direct: every pair; hierarchical: both phases of the DAG).
- DeepEP / HybridEP send each token once per destination rank (the receiver copies it to its experts),
  where NCCL's all-to-all dispatcher sends one row per (token, expert) pair.
- estimate (ranking lanes and the data-parallel arrivals of lanes the DES does not follow): per rank
  the slowest of its NVLink and NIC links, ``max(bytes out, bytes in) / bandwidth`` per link class,
  plus the path latency; vectorised over every group at once.
"""

from __future__ import annotations

import numpy as np
import simpy

from sim.engine.rank_groups import group_ids
from sim.frameworks.program import EPAllToAll
from sim.hardware.alltoall_links import for_all_to_all
from sim.hardware.cluster import Cluster
from sim.inputs.scenario import Scenario
from sim.model.dtypes import BYTES_PER_ELEMENT, storage_dtype
from sim.network.collectives import all_to_all_dag
from sim.network.comm import Comm
from sim.network.group_times import GroupTimes
from sim.routing.plan import RoutingPlan

HIERARCHICAL = ("hierarchical", "deepep", "hybridep")
#: dispatchers that send a token once per destination rank (and expand it there), not once per expert
DEDUP = ("deepep", "hybridep")
#: SMs the normal dispatch/combine kernels hold by default: DeepEP's 20 (DeepSeek-V3 report sec. 3.2.2,
#: "only 20 SMs"), HybridEP's 24 inside an NVLink domain (docs/README_Hybrid-EP.md default)
DISPATCHER_SMS = {"deepep": 20, "hybridep": 24}


def sm_slowdown(s: Scenario) -> float:
    """How much slower compute runs while a DeepEP / HybridEP kernel holds its SMs:
    ``sm_count / (sm_count - SMs)`` (``collectives.dispatcher_sms``, else :data:`DISPATCHER_SMS`); 1 for
    NCCL's all-to-all (its SMs are not modelled) and for a GPU without an SM count."""
    c, sms = s.collectives, s.topology.gpu.sm_count
    if c.all_to_all not in DISPATCHER_SMS or not sms:
        return 1.0
    taken = c.dispatcher_sms or DISPATCHER_SMS[c.all_to_all]
    return sms / max(sms - taken, 1)


def overlap_saved_s(kernels, comm, slowdown: float):
    """Seconds an overlapped forward-backward pair saves over running its kernels (``kernels`` s alone)
    and its all-to-alls (``comm`` s) one after the other. While an all-to-all runs, compute keeps
    ``1 / slowdown`` of its speed (the SMs the kernel holds) and is at full speed the rest of the pair,
    so the pair takes ``max(comm, kernels + comm (1 - 1 / slowdown))`` and saves
    ``min(kernels, comm / slowdown)``: never negative, all of ``comm`` with NCCL (slowdown 1) when the
    kernels are the longer."""
    return np.minimum(kernels, np.asarray(comm) / slowdown)


def routing_rank(s: Scenario, q: np.ndarray) -> np.ndarray:
    """Row of the routing plan for stage position ``q``: EP groups are contiguous there (``ep`` ranks
    with the same etp and edp coordinates)."""
    p = s.parallelism
    etp, ep = p.etp, p.ep
    etp_i, rest = q % etp, q // etp
    ep_i, edp_i = rest % ep, rest // ep
    return ep_i + ep * (etp_i + etp * edp_i)


class A2ATiming:
    def __init__(self, s: Scenario, plan: RoutingPlan | None, cluster: Cluster, env: simpy.Environment, exact: bool):
        self.s, self.plan, self.exact = s, plan, exact
        self.cluster = for_all_to_all(cluster)  # NVLink at the GPU's all-to-all figure, where it has one
        self.comm = Comm(env, self.cluster, "ps")
        self.times = GroupTimes(cluster)  # the capacity all-reduce: ring figures
        self.algo = s.collectives.all_to_all
        self.elem = s.model.moe_token_width * BYTES_PER_ELEMENT[storage_dtype(s.training.dtype)]  # latent under LatentMoE
        self.ep = s.ep
        #: bytes per element moved by dispatch and by combine (FP8 dispatch: 1 + scales)
        self.elem_bytes = {"dispatch": self.elem, "combine": self.elem}
        self._links: dict[int, np.ndarray] | None = None
        self._bound: dict[tuple, tuple] = {}
        self._flows: dict[tuple, tuple] = {}
        #: DeepEP's bandwidth cap per direction, B/s (SMs x deepep_GBps_per_sm); None: only the links limit it
        fig = s.topology.gpu.deepep_GBps_per_sm
        sms = s.collectives.dispatcher_sms or DISPATCHER_SMS["deepep"]
        self._per_sm_Bps = None if self.algo != "deepep" or fig is None else {
            "dispatch": sms * fig.dispatch_GBps * 1e9, "combine": sms * fig.combine_GBps * 1e9}  # fmt: skip

    def _rank_links(self) -> np.ndarray:
        """(4, world): per rank the bottleneck bandwidth and latency of its path to a peer in its node
        and to the same-index GPU of the next node (degraded and rerouted links included)."""
        if self._links is None:
            c = self.cluster
            w, gpn = c.world_size, c.gpus_per_node
            r = np.arange(w)
            out = np.zeros((4, w))
            pairs = [(r, (r // gpn) * gpn + (r % gpn + 1) % gpn)]
            pairs.append((r, (r + gpn) % w) if c.nodes > 1 else (r, r))
            for i, (a, b) in enumerate(pairs):
                ok = a != b
                bw, lat = np.full(w, np.inf), np.zeros(w)
                if ok.any():
                    indptr, links = c.paths(a[ok], b[ok])
                    bw[ok] = np.minimum.reduceat(c.link_bw_Bps[links], indptr[:-1])
                    lat[ok] = np.add.reduceat(c.link_latency_s[links], indptr[:-1])
                out[2 * i], out[2 * i + 1] = bw, lat
            self._links = out
        return self._links

    # ---- bytes ------------------------------------------------------------------------------------
    def _pairs(self, moe: int, micro: int, rho: np.ndarray) -> np.ndarray:
        """(groups, ep, ep) bytes member i -> member j of each EP group whose routing rows are ``rho``
        (groups x ep, in EP order); the diagonal is the member's own share (never on a wire)."""
        plan, ep = self.plan, self.ep
        assert plan is not None
        epr = self.s.experts_per_rank
        if plan.padded is not None:
            chunk = plan.padded[moe, micro][rho[:, 0] // ep].astype(np.float64) * epr
            return np.broadcast_to(chunk[:, None, None], (len(rho), ep, ep)) * self.elem
        copies = plan.pair_copies(moe, micro, rho.reshape(-1)).reshape(len(rho), ep, ep)
        return copies.astype(np.float64) * self.elem

    def _rank_pairs(self, moe: int, micro: int, rho: np.ndarray) -> np.ndarray:
        """(groups, ep, ep) bytes of the distinct tokens member i sends member j (DeepEP, HybridEP)."""
        rt = self.plan.arrays.rank_tokens[moe, micro][rho.reshape(-1)]  # (groups*ep, ep)
        return rt.reshape(len(rho), self.ep, self.ep).astype(np.float64) * self.elem

    def _node_bytes(self, moe: int, micro: int, rho_g: np.ndarray, nodes: int, direction: str = "dispatch") -> np.ndarray:
        """(ep, nodes) distinct-token bytes each member sends to each node of its group."""
        nt = self.plan.arrays.node_tokens[moe, micro][rho_g, :nodes]
        return nt.astype(np.float64) * self.elem_bytes[direction]

    # ---- timing -----------------------------------------------------------------------------------
    def run(self, r: int, op: EPAllToAll, micro: int, q: np.ndarray, ranks: np.ndarray, launch: np.ndarray):
        """(seconds of each rank's part, bytes it sent off the GPU, of which across nodes) for every
        EP group among the ranks ``ranks`` (stage positions ``q``), launched at ``launch``."""
        ids = group_ids(self.s, q, "ep")
        order = np.lexsort((routing_rank(self.s, q), ids))  # members of each group in EP order
        n_groups = len(q) // self.ep
        sel = order.reshape(n_groups, self.ep)
        rho = routing_rank(self.s, q)[sel]
        if self.algo in DEDUP and self.plan.padded is None:  # a token goes once to each rank it needs
            pairs = self._rank_pairs(op.moe, micro, rho)
        else:
            pairs = self._pairs(op.moe, micro, rho)
        scale = self.elem_bytes[op.direction] / self.elem
        if scale != 1.0:
            pairs = pairs * scale
        # (groups, ep): bytes each member receives in dispatch, its own included (the SM bound's bytes)
        recv = pairs.sum(axis=1) if self._per_sm_Bps is not None else None
        if op.direction == "combine":
            pairs = pairs.transpose(0, 2, 1)
        grank = ranks[sel]
        gpn = self._relay_unit(grank)
        same = (grank[:, :, None] // gpn) == (grank[:, None, :] // gpn)
        off = pairs * (1.0 - np.eye(self.ep))[None]
        sent = off.sum(axis=2)
        inter = (off * ~same).sum(axis=2)
        fin = np.zeros((n_groups, self.ep))
        hier = self.algo in HIERARCHICAL and self.plan.padded is None
        if not self.exact and not hier:
            fin = self._link_bound(r, grank, off)
        for g in range(n_groups if (self.exact or hier) else 0):
            group = grank[g].tolist()
            nb = None
            if hier:
                nodes = len(np.unique(grank[g] // gpn))
                nb = self._node_bytes(op.moe, micro, rho[g], nodes, op.direction)
                if op.direction == "combine":
                    pass  # the combine's DAG returns the same node bytes back
                own = (grank[g] // gpn)[:, None] == np.unique(grank[g] // gpn)[None, :]
                inter[g] = (nb * ~own).sum(axis=1)
            if self.exact:
                fin[g] = self._exact(r, g, group, pairs[g] if op.direction == "dispatch" else pairs[g].T, nb,
                                     op.direction, gpn)  # fmt: skip
            else:
                fwd = self._fan_bytes(grank[g].tolist(), off[g], op.direction, gpn) if hier else None
                fin[g] = self._estimate(off[g], same[g], inter[g] if hier else None, grank[g], fwd)
        if recv is not None:
            fin = self._sm_bound(fin, recv, inter, op.direction)
        out = np.zeros(len(q))
        out_sent, out_inter = np.zeros(len(q)), np.zeros(len(q))
        out[sel.reshape(-1)] = fin.reshape(-1)
        out_sent[sel.reshape(-1)] = sent.reshape(-1)
        out_inter[sel.reshape(-1)] = inter.reshape(-1)
        return out, out_sent, out_inter

    def _sm_bound(self, fin: np.ndarray, recv: np.ndarray, inter: np.ndarray, direction: str) -> np.ndarray:
        """DeepEP's normal kernels inside one NVLink domain move at most their SMs x the GPU's
        ``deepep_GBps_per_sm`` (its benchmark's bytes: what a rank receives in dispatch, its own copy
        included, and the same bytes back in combine): a member ends no sooner than those bytes at that
        rate. Groups with RDMA traffic are unchanged."""
        inside = ~(inter > 0).any(axis=1, keepdims=True)
        return np.where(inside, np.maximum(fin, recv / self._per_sm_Bps[direction]), fin)

    def _relay_unit(self, grank: np.ndarray) -> int:
        """GPUs of the unit DeepEP / HybridEP relay between: a node, or the whole NVLink domain when every
        EP group lies inside one (HybridEP's multi-node NVLink mode on NVL72 racks: every member reached
        over NVLink directly, no RDMA hop and no relay; groups across domains keep the node relay)."""
        c = self.cluster
        dom = c.gpus_per_domain
        if self.algo in DEDUP and dom > c.gpus_per_node and bool((grank // dom == grank[:, :1] // dom).all()):
            return dom
        return c.gpus_per_node

    def _exact(self, r: int, g: int, group: list[int], pair: np.ndarray, node_bytes, direction: str,
               unit: int) -> np.ndarray:  # fmt: skip
        if node_bytes is None:
            done = self.comm.direct_a2a((("lane", r, group[0]),), [group], [pair], direction)
            return np.array([done[x] for x in group])
        if self.algo in DEDUP:
            return self._forwarded(group, pair, node_bytes, direction, unit)
        dag = all_to_all_dag(self.cluster, group, pair, "hierarchical", node_bytes, direction)
        fin = self.comm.ps_rank_finish(dag)
        out = fin[np.asarray(group)]
        return np.where(np.isnan(out), 0.0, out)

    def _forwarded(self, group: list[int], pair: np.ndarray, node_bytes: np.ndarray, direction: str,
                   unit: int) -> np.ndarray:  # fmt: skip
        """DeepEP / HybridEP normal kernels: the hierarchical DAG's transfers all in flight at once
        (RDMA chunks forwarded over NVLink as they arrive), on a flow structure cached per group:
        same-node pairs, one RDMA hop per (sender, node) to the member with the sender's local index,
        then NVLink from that relay to the node's other destinations. The same transfers, bytes and
        paths as :func:`sim.network.collectives.all_to_all_dag`, timed as one processor-sharing phase."""
        key = ("fwd", tuple(group), unit)
        hit = self._flows.get(key)
        if hit is None:
            hit = self._flows[key] = self._flow_structure(group, unit)
        same_i, same_j, hop_s, hop_n, hop_r, fan_s, fan_d, fan_r = hit
        nb = np.concatenate([pair[same_i, same_j], node_bytes[hop_s, hop_n], pair[fan_s, fan_d]])
        src = np.concatenate([same_i, hop_s, fan_r])
        dst = np.concatenate([same_j, hop_r, fan_d])
        if direction == "combine":
            src, dst = dst, src
        ranks = np.asarray(group)
        paths = self.comm._paths(ranks[src], ranks[dst])
        t = paths.ps_times(nb)
        np.add.at(self.comm.link_bytes, paths.links, nb[paths.owner])  # the traffic the result reports
        out = np.zeros(len(group))
        np.maximum.at(out, src, t)
        np.maximum.at(out, dst, t)
        return out

    def _flow_structure(self, group: list[int], gpn: int):
        ranks = np.asarray(group)
        node = ranks // gpn
        nodes = np.unique(node)
        node_pos = np.searchsorted(nodes, node)
        local = ranks % gpn
        g = len(ranks)
        ii, jj = np.nonzero((node_pos[:, None] == node_pos[None, :]) & ~np.eye(g, dtype=bool))
        relay = np.zeros((g, len(nodes)), dtype=np.int64)
        for n in range(len(nodes)):
            m = np.flatnonzero(node_pos == n)
            hit = local[m][None, :] == local[:, None]
            relay[:, n] = np.where(hit.any(axis=1), m[np.argmax(hit, axis=1)], m[local % len(m)])
        hs, hn = np.nonzero(node_pos[:, None] != np.arange(len(nodes))[None, :])
        fs, fd = np.nonzero(node_pos[:, None] != node_pos[None, :])
        fr = relay[fs, node_pos[fd]]
        keep = fr != fd
        return ii, jj, hs, hn, relay[hs, hn], fs[keep], fd[keep], fr[keep]

    def _link_bound(self, r: int, grank: np.ndarray, off: np.ndarray) -> np.ndarray:
        """Direct all-to-alls of every group at once: each link's bytes over its bandwidth is when
        its last (largest) flow ends under processor sharing; a member ends with the slowest link
        any of its flows crosses (sending or receiving), plus that flow's path latency."""
        g, ep = off.shape[:2]
        key = ("bound", r, grank.shape, int(grank[0, 0]))
        hit = self._bound.get(key)
        if hit is None:
            i, j = np.nonzero(~np.eye(ep, dtype=bool))
            src = grank[:, i].reshape(-1)
            dst = grank[:, j].reshape(-1)
            indptr, links = self.cluster.paths(src, dst)
            owner = np.repeat(np.arange(len(src)), np.diff(indptr))
            lat = np.bincount(owner, weights=self.cluster.link_latency_s[links], minlength=len(src))
            nonempty = np.diff(indptr) > 0
            hit = self._bound[key] = (i, j, indptr, links, owner, lat, 1.0 / self.cluster.link_bw_Bps[links],
                                      indptr[:-1][nonempty], nonempty)  # fmt: skip
        i, j, indptr, links, owner, lat, inv_bw, starts, nonempty = hit
        nb = off[:, i, j].reshape(-1)
        load = np.bincount(links, weights=nb[owner], minlength=self.cluster.num_links)
        per_link = load[links] * inv_bw
        flow = np.zeros(len(nb))
        flow[nonempty] = np.maximum.reduceat(per_link, starts)
        flow = np.where(nb > 0, flow + lat, 0.0)
        dense = np.zeros((g, ep, ep))
        dense[:, i, j] = flow.reshape(g, -1)
        return np.maximum(dense.max(axis=2), dense.max(axis=1))  # a member's sends and receives

    def _fan_bytes(self, group: list[int], off: np.ndarray, direction: str, unit: int) -> tuple[np.ndarray, np.ndarray]:
        """(out, in) bytes per member on the in-node legs of a forwarded all-to-all: the relay that took
        a sender's tokens off the network passes them on to the node's other destinations (combine:
        the reverse), the flows of :meth:`_forwarded`."""
        *_, fan_s, fan_d, fan_r = self._flows.get(("fwd", tuple(group), unit)) or self._flows.setdefault(
            ("fwd", tuple(group), unit), self._flow_structure(group, unit))
        x = off if direction == "dispatch" else off.T  # the dispatch orientation: x[sender, destination]
        w = x[fan_s, fan_d]
        n = len(group)
        relay, dest = np.bincount(fan_r, weights=w, minlength=n), np.bincount(fan_d, weights=w, minlength=n)
        return (relay, dest) if direction == "dispatch" else (dest, relay)

    def _estimate(self, off: np.ndarray, same: np.ndarray, node_inter: np.ndarray | None, ranks: np.ndarray,
                  fwd: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:  # fmt: skip
        """Per member, ``max(out, in)`` bytes per link class over its path's bandwidth, plus latency;
        ``fwd``: the (out, in) bytes a forwarded all-to-all adds on the in-node links."""
        bw_in, lat_in, bw_out, lat_out = self._rank_links()[:, ranks]
        intra = off * same
        out_intra, in_intra = intra.sum(axis=1), intra.sum(axis=0)
        if fwd is not None:
            out_intra, in_intra = out_intra + fwd[0], in_intra + fwd[1]
        if node_inter is None:
            cross = off * ~same
            out_inter, in_inter = cross.sum(axis=1), cross.sum(axis=0)
        else:
            out_inter = in_inter = node_inter
        t = np.maximum(np.maximum(out_intra, in_intra) / bw_in, np.maximum(out_inter, in_inter) / bw_out)
        lat = np.where(np.maximum(out_inter, in_inter) > 0, lat_out, np.where(t > 0, lat_in, 0.0))
        return t + lat

    def small_all_reduce_s(self, r: int, nbytes: float) -> float:
        """DeepSpeed's capacity all-reduce over an EP group (its first group stands for all)."""
        group = list(range(r * self.s.layout.stage_size, r * self.s.layout.stage_size + self.ep))
        return self.times.time_s("all_reduce", group, nbytes)


__all__ = ["A2ATiming", "HIERARCHICAL", "routing_rank"]
