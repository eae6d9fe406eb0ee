"""Reachability through stacked attention layers, as packed bitsets (no n x n float matrix, ever).

R is a [n, W] uint64 array in ORIGINAL token order: bit j of row q says "key keys[j] is reachable from query q".
Before any layer R = identity (every token reaches itself). One layer maps R to
    R'[q] = OR over the layer's in-edges (q <- k) of R[k]
(every query sees itself, so R' contains R: residual streams keep what they had). A layer's edges are band paths
(analysis.attention_graph): in a path's storage order the in-edges of slot i come from slots i + d, d in the band, so
the OR is a sum of shifted copies, masked where causality fails. Offsets whose mask is all-true (SWA's whole band,
the inner band of the undirected SA graph) are OR-ed as one window by doubling: O(log w) array passes instead of w.

Cost per layer: w passes over n * W words. With all keys (W = n / 64) that is exact for every (query, key) pair
(n = 32768: 128 MB per array); with a random sample of keys the coverage is an unbiased ratio estimate over every
query and the sampled keys.
"""

from __future__ import annotations

import numpy as np

from analysis.attention_graph import BandPath

def sample_keys(n: int, count: int | None, seed: int = 0) -> np.ndarray:
    """Sorted key positions: all of them when count is None or >= n, else a uniform sample without replacement."""
    if count is None or count >= n:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=count, replace=False)).astype(np.int64)


def identity_bits(n: int, keys: np.ndarray) -> np.ndarray:
    """[n, W] uint64 with bit j set in row keys[j]."""
    words = (len(keys) + 63) // 64
    bits = np.zeros((n, words), dtype=np.uint64)
    j = np.arange(len(keys))
    np.bitwise_or.at(bits, (keys, j // 64), np.left_shift(np.uint64(1), (j % 64).astype(np.uint64)))
    return bits


def window_or(x: np.ndarray, a: int, b: int) -> np.ndarray:
    """out[i] = OR of x[i + d] for d in [a, b] (rows outside the array count as zero), by doubling."""
    n = x.shape[0]
    m = b - a + 1
    pad_lo, pad_hi = max(0, -a), max(0, b)
    p = np.zeros((pad_lo + n + pad_hi,) + x.shape[1:], dtype=x.dtype)
    p[pad_lo : pad_lo + n] = x
    # p[j] = OR of the padded rows j .. j + k - 1, doubled while 2k <= m.
    k = 1
    while 2 * k <= m:
        p[: p.shape[0] - k] |= p[k:].copy()
        k *= 2
    start = a + pad_lo  # >= 0; two windows of k rows cover [a, b]
    out = p[start : start + n].copy()
    out |= p[start + m - k : start + m - k + n]
    return out


Plan = tuple[list[tuple[int, int]], list[tuple[int, "np.ndarray | None"]]]


def band_plan(path: BandPath, direction: str = "in") -> Plan:
    """How to OR one path's edges: (windows, shifts). windows: (a, b) runs of all-true offsets done by doubling;
    shifts: (d, mask) single offsets (mask None: all true). Depends only on the path: reuse it across calls."""
    n = path.n
    full, partial = [], []
    for d in path.offsets(direction):
        mask = path.mask(d, direction)
        valid = slice(max(0, -d), min(n, n - d))
        if mask[valid].all():
            full.append(d)
        elif mask.any():
            partial.append((d, mask))
    runs: list[list[int]] = []
    for d in full:
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    windows = []
    for run in runs:
        if len(run) >= 4:
            windows.append((run[0], run[-1]))
        else:
            partial += [(d, None) for d in run]
    return windows, partial


def propagate_path(bits: np.ndarray, path: BandPath, direction: str = "in", plan=None) -> np.ndarray:
    """OR of `bits` rows over one path's edges (direction as in BandPath.mask), result in original order, self
    included. `plan` = band_plan(path, direction), when the caller reuses it."""
    n = path.n
    windows, shifts = plan if plan is not None else band_plan(path, direction)
    store = bits[path.pos]  # storage order
    acc = np.zeros_like(store)
    for a, b in windows:
        acc |= window_or(store, a, b)
    for d, mask in shifts:
        lo, hi = max(0, -d), min(n, n - d)
        if lo >= hi:
            continue
        if mask is None:
            acc[lo:hi] |= store[lo + d : hi + d]
        else:
            np.bitwise_or(acc[lo:hi], store[lo + d : hi + d], out=acc[lo:hi], where=mask[lo:hi, None])
    out = np.empty_like(acc)
    out[path.pos] = acc
    return out


def propagate_layer(bits: np.ndarray, paths: list[BandPath], direction: str = "in") -> np.ndarray:
    """One layer: the union of its paths (gated SA+SWA = SA edges OR SWA edges), applied to the same input."""
    out = propagate_path(bits, paths[0], direction)
    for path in paths[1:]:
        out |= propagate_path(bits, path, direction)
    return out


def popcount(bits: np.ndarray) -> int:
    return int(np.bitwise_count(bits).sum(dtype=np.int64))


def causal_pairs(n: int, keys: np.ndarray) -> int:
    """Number of (query, key) pairs with key position <= query position, over every query and the given keys."""
    return int((n - keys).sum())


def coverage_by_layer(stack: list[list[BandPath]], keys: np.ndarray) -> list[float]:
    """Fraction of causal (query, key in keys) pairs reachable after layers 1..L (chains of edges through layers)."""
    n = stack[0][0].n
    bits = identity_bits(n, keys)
    total = causal_pairs(n, keys)
    out = []
    for paths in stack:
        bits = propagate_layer(bits, paths, "in")
        out.append(popcount(bits) / total)
    return out


def reachable_matrix(stack: list[list[BandPath]], keys: np.ndarray | None = None) -> np.ndarray:
    """[n, len(keys)] bool reachability after the whole stack (small n: tests and plots)."""
    n = stack[0][0].n
    keys = np.arange(n) if keys is None else keys
    bits = identity_bits(n, keys)
    for paths in stack:
        bits = propagate_layer(bits, paths, "in")
    return unpack(bits, len(keys))


def unpack(bits: np.ndarray, count: int) -> np.ndarray:
    return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :count].astype(bool)
