"""Max-min fair rates of flows sharing links: progressive filling, vectorised, many links per round.

Progressive filling (Bertsekas & Gallager, *Data Networks*, section 6.5.2) raises all unfrozen
flows together and freezes those crossing the first link to saturate. Any link whose fair share
``remaining capacity / unfrozen flows`` is no larger than the share of every link its flows cross
saturates at exactly that share (shares only grow as flows elsewhere freeze below them), so each
round freezes all such local minima at once: independent groups of links are solved in the same
rounds. A round is a few passes over the flow x link incidence (``entry_flow`` / ``entry_link``).
"""

from __future__ import annotations

import numpy as np

#: Shares within this relative distance count as equal, so that symmetric flows get
#: bitwise-identical rates despite rounding and saturate in the same round.
LEVEL_RTOL = 1e-9


def max_min_rates(
    entry_flow: np.ndarray,
    entry_link: np.ndarray,
    weight: np.ndarray,
    capacity: np.ndarray,
) -> np.ndarray:
    """Rate of every flow (same unit as ``capacity``) under max-min fair sharing.

    ``entry_flow[i]`` crosses ``entry_link[i]``, entries sorted by flow; ``weight[f]`` is how many
    identical flows row ``f`` stands for (each gets the returned rate; links carry weight x rate).
    Every flow must cross at least one link of positive capacity.
    """
    n_flows, n_links = len(weight), len(capacity)
    rate = np.zeros(n_flows)
    e_flow, e_link = entry_flow, entry_link
    e_w = weight[e_flow].astype(np.float64)
    cap_left = capacity.astype(np.float64).copy()
    load = np.bincount(e_link, weights=e_w, minlength=n_links)
    share = np.full(n_links, np.inf)
    while len(e_flow):
        used = load > 0
        share[:] = np.inf
        share[used] = cap_left[used] / load[used]
        e_share = share[e_link]
        # smallest share on each flow's path (entries are grouped by flow)
        first = np.empty(len(e_flow), dtype=bool)
        first[0] = True
        np.not_equal(e_flow[1:], e_flow[:-1], out=first[1:])
        starts = np.flatnonzero(first)
        path_min = np.minimum.reduceat(e_share, starts)
        e_path_min = path_min[np.cumsum(first) - 1]
        # a link is a local minimum when no flow crossing it sees a smaller share elsewhere
        nbr_min = np.full(n_links, np.inf)
        np.minimum.at(nbr_min, e_link, e_path_min)
        bottleneck = used & (share <= nbr_min * (1 + LEVEL_RTOL))
        frozen_entry = bottleneck[e_link]
        newly = np.zeros(n_flows, dtype=bool)
        newly[e_flow[frozen_entry]] = True
        rate[newly] = path_min[newly[e_flow[starts]]]
        gone = newly[e_flow]
        cap_left -= np.bincount(e_link[gone], weights=e_w[gone] * rate[e_flow[gone]], minlength=n_links)
        np.maximum(cap_left, 0.0, out=cap_left)
        load -= np.bincount(e_link[gone], weights=e_w[gone], minlength=n_links)
        keep = ~gone
        e_flow, e_link, e_w = e_flow[keep], e_link[keep], e_w[keep]
    return rate
