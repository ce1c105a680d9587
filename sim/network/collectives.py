"""Collectives over process groups (lists of global ranks) as DAGs of network transfers.

Algorithms (``algo=``; defaults in :data:`DEFAULT_ALGO`):

* all-to-all(v) ``direct``: every rank sends to every peer at once (NCCL grouped send/recv).
* all-to-all(v) ``hierarchical`` (DeepSeek-V3 section 3.2.2 / DeepEP): a token crosses the fabric
  once per destination *node*, to the group GPU there with the sender's local index (the same
  rail), which forwards it over NVLink to each destination rank of that node; ``combine``
  reverses it (NVLink gather to that GPU, then one fabric transfer back). ``node_bytes`` says what
  crosses per (rank, node) after deduplication; without it nothing is deduplicated.
* all-reduce / reduce-scatter / all-gather ``ring``: NCCL rings. When the group spans several
  nodes with ``k > 1`` ranks on each, ``k`` rings run side by side (NCCL channels), ring ``c``
  entering every node at its ``c``-th rank, so each rail carries one ring's inter-node hop.
  Sizes follow nccl-tests: all-reduce ``S`` per rank; reduce-scatter / all-gather ``S`` = the
  whole array (``n`` pieces of ``S/n``).
* all-reduce ``hierarchical`` (2D): reduce-scatter inside each node, all-reduce of the ``S/k``
  pieces across nodes between same-position ranks (k rings on k rails), all-gather inside nodes.

Every function returns a :class:`~sim.network.dag.CollectiveHandle` with per-rank events.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from sim.hardware.cluster import Cluster
from sim.inputs.sections import KINDS
from sim.network.dag import CollectiveHandle, DagBuilder, TransferDag, run_dag
from sim.network.flows import Network

ALGOS: dict[str, tuple[str, ...]] = {
    "all_to_all": ("direct", "hierarchical"),
    "all_reduce": ("ring", "hierarchical"),
    "reduce_scatter": ("ring",),
    "all_gather": ("ring",),
}
DEFAULT_ALGO: dict[str, str] = {k: v[0] for k, v in ALGOS.items()}


def group_nodes(cluster: Cluster, group: Sequence[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Distinct nodes of ``group`` (sorted) and, per node, the group positions on it (by local index)."""
    ranks = np.asarray(group, dtype=np.int64)
    if len(np.unique(ranks)) != len(ranks):
        raise ValueError("a process group lists a rank twice")
    node = ranks // cluster.gpus_per_node
    nodes = np.unique(node)
    members = [np.flatnonzero(node == n)[np.argsort(ranks[node == n], kind="stable")] for n in nodes]
    return nodes, members


# ---- all-to-all ---------------------------------------------------------------------------------
def all_to_all_dag(
    cluster: Cluster,
    group: Sequence[int],
    pair_bytes: np.ndarray,
    algo: str = "direct",
    node_bytes: np.ndarray | None = None,
    direction: Literal["dispatch", "combine"] = "dispatch",
) -> TransferDag:
    """Transfers of an all-to-all(v). ``pair_bytes[i, j]``: bytes group[i] sends group[j] (dispatch;
    combine sends the same amounts back). ``node_bytes[i, n]``: bytes group[i] puts on the fabric
    for the n-th node of :func:`group_nodes` (hierarchical only; default: the sum over its ranks)."""
    ranks = np.asarray(group, dtype=np.int64)
    g = len(ranks)
    pair = np.asarray(pair_bytes, dtype=np.float64)
    if pair.shape != (g, g) or (pair < 0).any():
        raise ValueError(f"pair_bytes must be a non-negative {g}x{g} matrix")
    _check_algo("all_to_all", algo)
    b = DagBuilder()
    if algo == "direct":
        i, j = np.nonzero((pair > 0) & ~np.eye(g, dtype=bool))
        s, d = (i, j) if direction == "dispatch" else (j, i)
        b.add(ranks[s], ranks[d], pair[i, j])
        b.steps = 1
        return b.build()
    nodes, members = group_nodes(cluster, group)
    node_pos = np.searchsorted(nodes, ranks // cluster.gpus_per_node)
    if node_bytes is None:
        node_bytes = np.stack([pair[:, m].sum(axis=1) for m in members], axis=1)
    node_bytes = np.asarray(node_bytes, dtype=np.float64)
    if node_bytes.shape != (g, len(nodes)):
        raise ValueError(f"node_bytes must be {g}x{len(nodes)} (group ranks x group nodes)")
    same = (node_pos[:, None] == node_pos[None, :]) & (pair > 0) & ~np.eye(g, dtype=bool)
    i, j = np.nonzero(same)
    b.add(*((ranks[i], ranks[j]) if direction == "dispatch" else (ranks[j], ranks[i])), pair[i, j])
    local = ranks % cluster.gpus_per_node
    for n, m in enumerate(members):
        senders = np.flatnonzero((node_pos != n) & (node_bytes[:, n] > 0))
        if not len(senders):
            continue
        # relay: the member of node n with the sender's local index, else one by position
        hit = local[m][None, :] == local[senders][:, None]
        relay_pos = np.where(hit.any(axis=1), m[np.argmax(hit, axis=1)], m[local[senders] % len(m)])
        # per sender, the node's members it has tokens for (but its relay), in member order
        fan_mask = (pair[np.ix_(senders, m)] > 0) & (m[None, :] != relay_pos[:, None])
        si, ti = np.nonzero(fan_mask)
        fan_src, fan_relay, fan_dst = senders[si], relay_pos[si], m[ti]
        fan_counts = fan_mask.sum(axis=1)
        if direction == "dispatch":
            b.phase = 0
            hop = b.add(ranks[senders], ranks[relay_pos], node_bytes[senders, n])
            which = si
            b.phase = 1
            b.add(ranks[fan_relay], ranks[fan_dst], pair[fan_src, fan_dst], np.ones(len(fan_dst)), hop[which])
        else:
            b.phase = 0
            gather = b.add(ranks[fan_dst], ranks[fan_relay], pair[fan_src, fan_dst])
            b.phase = 1
            b.add(ranks[relay_pos], ranks[senders], node_bytes[senders, n], fan_counts, gather)
    b.steps = 2
    return b.build()


def all_to_all(
    net: Network,
    group: Sequence[int],
    pair_bytes: np.ndarray,
    algo: str = "direct",
    node_bytes: np.ndarray | None = None,
    direction: Literal["dispatch", "combine"] = "dispatch",
) -> CollectiveHandle:
    """Start an all-to-all(v) on ``net`` now (see :func:`all_to_all_dag`)."""
    return run_dag(
        net, list(group), all_to_all_dag(net.cluster, group, pair_bytes, algo, node_bytes, direction)
    )


def a2a_traffic(
    cluster: Cluster, group: Sequence[int], token_src: np.ndarray, token_dst: np.ndarray, token_bytes: float
) -> tuple[np.ndarray, np.ndarray]:
    """``(pair_bytes, node_bytes)`` from tokens: ``token_src[t]`` is the sending group position,
    ``token_dst[t, :]`` the group positions of its experts' ranks. A token goes once to each
    distinct rank (pair bytes) and crosses the fabric once per distinct node (node bytes)."""
    ranks = np.asarray(group, dtype=np.int64)
    g = len(ranks)
    nodes, _ = group_nodes(cluster, group)
    src = np.asarray(token_src, dtype=np.int64)
    dst = np.sort(np.asarray(token_dst, dtype=np.int64).reshape(len(src), -1), axis=1)
    first = np.ones_like(dst, dtype=bool)
    first[:, 1:] = dst[:, 1:] != dst[:, :-1]
    rows = np.broadcast_to(src[:, None], dst.shape)
    pair = np.bincount((rows * g + dst)[first], minlength=g * g).reshape(g, g) * token_bytes
    dnode = np.sort(np.searchsorted(nodes, ranks[dst] // cluster.gpus_per_node), axis=1)
    first_n = np.ones_like(dnode, dtype=bool)
    first_n[:, 1:] = dnode[:, 1:] != dnode[:, :-1]
    node = np.bincount((rows * len(nodes) + dnode)[first_n], minlength=g * len(nodes))
    return pair.astype(np.float64), node.reshape(g, len(nodes)).astype(np.float64) * token_bytes


# ---- rings --------------------------------------------------------------------------------------
def _rings(cluster: Cluster, group: Sequence[int]) -> np.ndarray:
    """Ring orders (channels x n) of global ranks, see the module docstring."""
    ranks = np.asarray(group, dtype=np.int64)
    _, members = group_nodes(cluster, group)
    k = len(members[0])
    if len(members) > 1 and k > 1 and all(len(m) == k for m in members):
        return np.stack([np.concatenate([ranks[np.roll(m, -c)] for m in members]) for c in range(k)])
    return ranks[np.concatenate(members)][None, :]


def _add_ring(b: DagBuilder, rings: np.ndarray, chunk: float, steps: int, first_wait=None) -> tuple:
    """``steps`` ring steps on every ring (rows of ``rings``); returns, per ring position, the ids of
    its last send and last receive. Step k at a position waits only for the chunk it forwards (its
    step k-1 receive), so a rank's successive sends may overlap, as NCCL's pipelined slots do.
    ``first_wait``: (ids, ids) per ring position that step 0 waits for (an earlier phase's end)."""
    r, m = rings.shape
    pos = np.arange(m)
    src = np.broadcast_to(rings[None, :, :], (steps, r, m)).reshape(-1)
    dst = np.broadcast_to(np.roll(rings, -1, axis=1)[None, :, :], (steps, r, m)).reshape(-1)
    base = b.next_id
    k = np.arange(steps)[:, None, None]
    ring = np.arange(r)[None, :, None]
    ident = base + (k * r + ring) * m + pos[None, None, :]
    prev_recv = (base + ((k - 1) * r + ring) * m + np.roll(pos, 1)[None, None, :])[1:].reshape(-1)
    if first_wait is None:
        counts0, wait0 = np.zeros(r * m, np.int64), np.zeros(0, np.int64)
    else:
        counts0, wait0 = np.full(r * m, 2), np.stack(first_wait, axis=-1).reshape(-1)
    counts = np.concatenate([counts0, np.ones(len(prev_recv), np.int64)])
    b.add(src, dst, chunk, counts, np.concatenate([wait0, prev_recv]))
    b.phase += 1
    last = ident[-1]
    return last, np.roll(last, 1, axis=1)


def ring_dag(cluster: Cluster, kind: str, group: Sequence[int], nbytes: float) -> TransferDag:
    """A ring reduce-scatter, all-gather (n-1 steps) or all-reduce (2(n-1) steps) of ``nbytes``."""
    rings = _rings(cluster, group)
    n = rings.shape[1]
    b = DagBuilder()
    if n > 1:
        b.steps = 2 * (n - 1) if kind == "all_reduce" else n - 1
        _add_ring(b, rings, nbytes / (n * len(rings)), b.steps)
    return b.build()


def hierarchical_all_reduce_dag(cluster: Cluster, group: Sequence[int], nbytes: float) -> TransferDag:
    """2D all-reduce: intra-node reduce-scatter, inter-node all-reduce per position, intra all-gather."""
    ranks = np.asarray(group, dtype=np.int64)
    _, members = group_nodes(cluster, group)
    k = len(members[0])
    if any(len(m) != k for m in members):
        raise ValueError("hierarchical all-reduce needs the same number of group ranks on every node")
    intra = np.stack([ranks[m] for m in members])  # nodes x k
    b, wait = DagBuilder(), None  # wait: (last send, last receive) ids per rank, nodes x k
    steps = 0
    if k > 1:
        wait = _add_ring(b, intra, nbytes / k, k - 1)
        steps += k - 1
    m = len(members)
    if m > 1:
        across = _add_ring(b, intra.T.copy(), nbytes / k / m, 2 * (m - 1), wait and tuple(x.T for x in wait))
        wait = tuple(x.T for x in across)
        steps += 2 * (m - 1)
    if k > 1:
        _add_ring(b, intra, nbytes / k, k - 1, wait)
        steps += k - 1
    b.steps = steps
    return b.build()


def reduction_dag(cluster: Cluster, kind: str, group: Sequence[int], nbytes: float, algo: str) -> TransferDag:
    """DAG of an all-reduce, reduce-scatter or all-gather with the named algorithm. A calibrated
    ``cluster.collective_bytes_factor[kind]`` scales the bytes it moves (gloo's all-gather moves
    its output at ~0.4x the all-to-all's rate on the CPU host measured: see sim.inputs.calibration)."""
    _check_algo(kind, algo)
    nbytes = nbytes * cluster.collective_bytes_factor.get(kind, 1.0)
    if algo == "hierarchical":
        return hierarchical_all_reduce_dag(cluster, group, nbytes)
    return ring_dag(cluster, kind, group, nbytes)


def all_reduce(net: Network, group: Sequence[int], nbytes: float, algo: str = "ring") -> CollectiveHandle:
    """Start an all-reduce of ``nbytes`` per rank over ``group``."""
    return run_dag(net, list(group), reduction_dag(net.cluster, "all_reduce", group, nbytes, algo))


def reduce_scatter(net: Network, group: Sequence[int], nbytes: float, algo: str = "ring") -> CollectiveHandle:
    """Start a reduce-scatter of a ``nbytes`` array (each rank keeps ``nbytes / n``)."""
    return run_dag(net, list(group), reduction_dag(net.cluster, "reduce_scatter", group, nbytes, algo))


def all_gather(net: Network, group: Sequence[int], nbytes: float, algo: str = "ring") -> CollectiveHandle:
    """Start an all-gather into a ``nbytes`` array (each rank contributes ``nbytes / n``)."""
    return run_dag(net, list(group), reduction_dag(net.cluster, "all_gather", group, nbytes, algo))


def uniform_pairs(n: int, nbytes: float) -> np.ndarray:
    """nccl-tests all-to-all: each rank's ``nbytes`` buffer split evenly over the n ranks (itself too)."""
    return np.full((n, n), nbytes / n)


def collective_dag(
    cluster: Cluster, kind: str, group: Sequence[int], nbytes: float, algo: str | None = None
) -> TransferDag:
    """The DAG of one nccl-tests-style collective of size ``nbytes`` (uniform all-to-all)."""
    if kind not in ALGOS:
        raise ValueError(f"unknown collective '{kind}'; choose from {', '.join(KINDS)}")
    algo = algo or DEFAULT_ALGO[kind]
    if kind == "all_to_all":
        return all_to_all_dag(cluster, group, uniform_pairs(len(group), nbytes), algo)
    return reduction_dag(cluster, kind, group, nbytes, algo)


def _check_algo(kind: str, algo: str) -> None:
    if algo not in ALGOS[kind]:
        raise ValueError(f"{kind} has no algorithm '{algo}'; choose from {', '.join(ALGOS[kind])}")
