"""Max-min fair rates of flows sharing links: progressive filling (water-filling), vectorised.

Bertsekas & Gallager, *Data Networks*, section 6.5.2: raise every unfrozen flow's rate together
until some link saturates; freeze the flows crossing it at that level; repeat on what is left.
Each round is a few passes over the flow x link incidence (given as parallel ``entry_flow`` /
``entry_link`` arrays), so the cost is O(rounds x nnz); rounds = distinct bottleneck levels.
"""

from __future__ import annotations

import numpy as np

#: Links whose fair share is within this relative distance of the round's minimum saturate in
#: the same round, so that symmetric flows get bitwise-identical rates despite rounding.
LEVEL_RTOL = 1e-9


def max_min_rates(
    entry_flow: np.ndarray,
    entry_link: np.ndarray,
    weight: np.ndarray,
    capacity: np.ndarray,
) -> np.ndarray:
    """Rate of every flow (same unit as ``capacity``) under max-min fair sharing.

    ``entry_flow[i]`` crosses ``entry_link[i]``; ``weight[f]`` is how many identical flows row
    ``f`` stands for (merged flows: each gets the returned rate, the link carries weight x rate).
    Every flow must cross at least one link of positive capacity.
    """
    n_flows, n_links = len(weight), len(capacity)
    rate = np.zeros(n_flows)
    e_flow, e_link = entry_flow, entry_link
    e_w = weight[e_flow].astype(np.float64)
    cap_left = capacity.astype(np.float64).copy()
    load = np.bincount(e_link, weights=e_w, minlength=n_links)
    frozen = np.zeros(n_flows, dtype=bool)
    while len(e_flow):
        used = np.flatnonzero(load > 0)
        share = cap_left[used] / load[used]
        level = share.min()
        saturated = np.zeros(n_links, dtype=bool)
        saturated[used[share <= level * (1 + LEVEL_RTOL)]] = True
        newly = np.zeros(n_flows, dtype=bool)
        newly[e_flow[saturated[e_link]]] = True
        newly &= ~frozen
        rate[newly] = level
        frozen |= newly
        gone = newly[e_flow]
        cap_left -= np.bincount(e_link[gone], weights=e_w[gone] * level, minlength=n_links)
        np.maximum(cap_left, 0.0, out=cap_left)
        load -= np.bincount(e_link[gone], weights=e_w[gone], minlength=n_links)
        keep = ~gone
        e_flow, e_link, e_w = e_flow[keep], e_link[keep], e_w[keep]
    return rate
