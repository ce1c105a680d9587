"""DeepSpeed's token dispatcher (0.19.x) as work: eager ops and bytes of its gate, its sparse-route
encode (permute) and decode (unpermute), counted from the code. ``moesim calibrate`` times the real
pieces and fits the op cost and bandwidth through :func:`dispatcher_work`."""

from __future__ import annotations

import numpy as np

#: Eager ops (forward, backward) of DeepSpeed's (0.19.x) sparse-route encode and decode
#: (``_route_slots`` + ``_sparse_encode``; ``_sparse_decode``), counted from the code.
PERMUTE_OPS = (10, 4)
UNPERMUTE_OPS = (6, 8)
#: Eager ops (forward, backward) of DeepSpeed's (0.19.8) ``TopKGate.forward`` with sparse routes,
#: less the router GEMM (priced as one) and view-only ops (view, permute, t, detach, unsqueeze, ...):
#: aten ops dispatched by the real gate (``top1gating`` / ``top2gating`` / ``topkgating``), counted with
#: a TorchDispatchMode at 256 tokens, 8 experts (the counts do not depend on the sizes). Keyed by
#: (k if k <= 2 else "k", drop_tokens): the dropless gate skips the capacity masks.
GATE_OPS = {(1, True): (48, 7), (1, False): (49, 7), (2, True): (91, 39), (2, False): (71, 39),
            ("k", True): (43, 22), ("k", False): (35, 22)}  # fmt: skip
DISPATCHER_PIECES = ("gate", "encode", "decode")


def dispatcher_work(piece: str, tokens: int, d: int, experts: int, k: int, slots: float | np.ndarray,
                    drop: bool, bpe: int) -> tuple[int, float | np.ndarray, int, float | np.ndarray]:  # fmt: skip
    """(forward ops, forward bytes, backward ops, backward bytes) of one piece of DeepSpeed's
    (0.19.x) token dispatcher for ``tokens`` tokens of width ``d`` into ``slots`` = E x C rows:

    ``gate``   ``TopKGate`` less its router GEMM: softmax, top-k, masks, cumsum, aux loss over
               [S, E] fp32 (:data:`GATE_OPS`);
    ``encode`` ``_route_slots`` + ``_sparse_encode``: slot map (scatter), cat of a zero pad row,
               index_select of E C rows; backward: index_add of E C rows into zeros, slice of the pad;
    ``decode`` ``_sparse_decode``: cat a pad row, index_select k S rows, multiply by the gates, sum
               over the k routes; backward: the mirror plus the gate gradient (mul + sum).

    The simulator prices them as ``ops x dispatcher_op_s + bytes / dispatcher_Bps``
    (:meth:`sim.hardware.costs.CostModel.dispatcher_time`); ``moesim calibrate`` times the real pieces and
    fits the two constants through this same function."""
    if piece == "gate":
        ops_f, ops_b = GATE_OPS[(k if k <= 2 else "k", drop)]
        nb = 3.0 * tokens * experts * 4
        return ops_f, nb, ops_b, nb
    if piece == "encode":
        return (PERMUTE_OPS[0], (2 * tokens + 2 * slots) * d * bpe,
                PERMUTE_OPS[1], (2 * tokens + 3 * slots) * d * bpe)  # fmt: skip
    if piece == "decode":
        return (UNPERMUTE_OPS[0], (2 * slots + 5 * k * tokens + tokens) * d * bpe,
                UNPERMUTE_OPS[1], (3 * slots + 7 * k * tokens) * d * bpe)  # fmt: skip
    raise ValueError(f"unknown dispatcher piece {piece!r}; one of {DISPATCHER_PIECES}")


__all__ = ["DISPATCHER_PIECES", "GATE_OPS", "PERMUTE_OPS", "UNPERMUTE_OPS", "dispatcher_work"]
