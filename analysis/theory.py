"""Theoretical coverage curves to set beside the measured ones.

SWA (exact): after L layers a query at t reaches exactly the keys t - L(w-1) .. t, so the covered causal pairs are
sum_t min(t + 1, L(w-1) + 1) out of n(n+1)/2.

SA and gated SA+SWA (mean field): let p_l(d) be the probability that a query reaches the key d positions back after
l layers. In SA each of the w-1 other band slots of a query holds a uniformly random token, so every earlier token is
an in-neighbour with probability q ~ (w-1)/(n-1), independently per layer (exactly: the share of ordered slot pairs
whose offset lies in the band (left, right), which counts the band's cut-off at the ends of the permuted order and
makes layer 1 exact; it matters where w is a sizeable fraction of n). A key is reached iff the query reached it
already (the self edge) or some in-neighbour at distance e < d reached it; treating those events as independent,

    1 - p_l(d) = (1 - p_{l-1}(d)) * prod_{e=0}^{d-1} (1 - q p_{l-1}(e))                         (SA)
                 * prod_{j=1}^{min(w-1, d)} (1 - p_{l-1}(d - j))                                 (+ SWA in gated)

with p_0(d) = [d == 0]. Coverage = sum_d (n - d) p_l(d) / (n(n+1)/2). The SWA recursion alone gives the exact SWA
curve. Until saturation p_l grows like (w-1)^l / n, hence the ~ceil(log_w n) layers of the paper's O(log_w n) claim;
the tail (pairs of early tokens, whose in-neighbours are few) decays only like (1 - q)^l, which is why SA's coverage
approaches 1 slowly while gated SA+SWA, whose local band covers the near pairs, saturates in a few layers.
"""

from __future__ import annotations

import numpy as np


def log_w_layers(n: int, w: int) -> int:
    """ceil(log_w n): the paper's depth for a global receptive field. In integers: in floats, log 125 / log 5 is
    3.0000000000000004 and its ceiling 4."""
    if w <= 1:
        return n
    layers = 1
    while w**layers < n:
        layers += 1
    return layers


def swa_reach(layers: int, w: int) -> int:
    """How far back SWA reaches after `layers` layers: L (w - 1) positions."""
    return layers * (w - 1)


def swa_coverage(n: int, w: int, layers: int) -> list[float]:
    """Exact SWA coverage after 1..layers layers."""
    t = np.arange(n, dtype=np.float64)
    total = n * (n + 1) / 2
    return [float(np.minimum(t + 1, swa_reach(l, w) + 1).sum() / total) for l in range(1, layers + 1)]


def _window_log_sum(log1m: np.ndarray, ones: np.ndarray, w: int) -> tuple[np.ndarray, np.ndarray]:
    """For each d: sum of log(1 - p(e)) and count of p(e) == 1 over e in [d - (w-1), d - 1]."""
    c_log = np.concatenate([[0.0], np.cumsum(log1m)])
    c_one = np.concatenate([[0], np.cumsum(ones)])
    d = np.arange(len(log1m))
    lo = np.maximum(d - (w - 1), 0)
    return c_log[d] - c_log[lo], c_one[d] - c_one[lo]


def band_pair_probability(n: int, w: int) -> float:
    """Probability that a uniformly random permutation puts two given tokens within one SA band of each other: the
    query's slot s and the key's s + d with -left <= d <= right, d != 0, over the n (n - 1) ordered slot pairs, of
    which n - |d| have offset d."""
    from kernels import default_band

    if n <= 1:
        return 0.0
    left, right = default_band(w, permuted=True)

    def offsets(m):  # ordered slot pairs with an offset of 1..m
        m = min(m, n - 1)
        return m * n - m * (m + 1) / 2

    return (offsets(left) + offsets(right)) / (n * (n - 1))


def mean_field_distance(n: int, w: int, layers: int, kind: str) -> list[np.ndarray]:
    """p_l(d) for l = 1..layers (see the module docstring); kind in swa, sa, gated_sa_swa."""
    if kind not in ("swa", "sa", "gated_sa_swa"):
        raise ValueError(f"kind must be swa, sa or gated_sa_swa, got {kind!r}")
    q = band_pair_probability(n, w)
    p = np.zeros(n)
    p[0] = 1.0
    out = []
    for _ in range(layers):
        ones = p >= 1.0
        log_not = np.log1p(-np.where(ones, 0.0, p))  # log(1 - p) where p < 1
        log_not_new = log_not.copy()
        certain = ones.copy()
        if kind in ("sa", "gated_sa_swa"):
            # sum_{e < d} log(1 - q p(e)): an exclusive prefix sum
            log_sa = np.log1p(-q * p) if q < 1 else np.where(p > 0, -np.inf, 0.0)
            log_not_new += np.concatenate([[0.0], np.cumsum(log_sa)[:-1]])
        if kind in ("swa", "gated_sa_swa"):
            s_log, s_one = _window_log_sum(log_not, ones.astype(np.int64), w)
            log_not_new += s_log
            certain |= s_one > 0
        p = np.where(certain, 1.0, -np.expm1(log_not_new))
        out.append(p.copy())
    return out


def mean_field_coverage(n: int, w: int, layers: int, kind: str) -> list[float]:
    weights = n - np.arange(n, dtype=np.float64)
    total = n * (n + 1) / 2
    return [float((weights * p).sum() / total) for p in mean_field_distance(n, w, layers, kind)]


def theory_coverage(n: int, w: int, layers: int, kind: str) -> list[float]:
    """The curve drawn beside a measured one: exact for SWA, mean field for SA and gated SA+SWA."""
    return swa_coverage(n, w, layers) if kind == "swa" else mean_field_coverage(n, w, layers, kind)
