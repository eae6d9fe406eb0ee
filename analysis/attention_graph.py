"""The attention graph of a stack of layers, drawn through the model's own code (docs/method.md).

A layer of a variant is one or more *band paths*: a storage order `pos` (storage slot s holds original token pos[s]) and
a band (left, right). The query in slot i sees the key in slot j iff i - left <= j <= i + right and pos[j] <= pos[i].
SWA is one path (pos = arange, band (w-1, 0)); SA is one path (pos = pi from model.permutation.PermutationSampler, the
band from kernels.default_band(w, permuted=True)); gated SA+SWA is both paths (the union of their edges). Nothing here
re-implements the permutation draw or the band choice: both come from the modules the model calls.

The edge rule is applied as shifts in storage order: for each slot offset d, the array `pos[i + d] <= pos[i]` says
which slots i get an edge from slot i + d. That keeps every computation O(n * w) and lets the analysis reach
n = 32768 without an n x n matrix; `directed_edges` lists the edges explicitly for small n (tests check it against
kernels.naive.band_mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VARIANTS = ("swa", "sa", "gated_sa_swa")
DIRECTIONS = ("in", "out", "both")  # in: the attention edges of method.md; out: reversed; both: undirected


@dataclass(frozen=True)
class BandPath:
    """One banded-attention call: storage order `pos` (original position of each slot) and the band."""

    pos: np.ndarray  # [n] int64, a permutation of 0..n-1
    left: int
    right: int

    @property
    def n(self) -> int:
        return int(self.pos.shape[0])

    @property
    def is_identity(self) -> bool:
        return bool(np.array_equal(self.pos, np.arange(self.n)))

    def slots(self) -> np.ndarray:
        """inverse order: slot of each original token."""
        inv = np.empty_like(self.pos)
        inv[self.pos] = np.arange(self.n)
        return inv

    def mask(self, d: int, direction: str = "in") -> np.ndarray:
        """[n] bool: slot i is linked to slot i + d. in: i attends to i + d (the mask rule of method.md);
        out: i + d attends to i; both: either (the undirected graph)."""
        n = self.n
        mask = np.zeros(n, dtype=bool)
        if d == 0:
            mask[:] = True
            return mask
        lo, hi = max(0, -d), min(n, n - d)  # slots i with i + d inside the sequence
        if lo >= hi:
            return mask
        here, there = self.pos[lo:hi], self.pos[lo + d : hi + d]
        if direction in ("in", "both") and -self.left <= d <= self.right:
            mask[lo:hi] |= there <= here
        if direction in ("out", "both") and -self.right <= d <= self.left:
            mask[lo:hi] |= here <= there
        return mask

    def offsets(self, direction: str = "in") -> range:
        """slot offsets d that can carry a link in `direction`."""
        if direction not in DIRECTIONS:  # mask() would link nothing but self, in silence
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        if direction == "in":
            return range(-self.left, self.right + 1)
        if direction == "out":
            return range(-self.right, self.left + 1)
        reach = max(self.left, self.right)
        return range(-reach, reach + 1)


def permutation(layer: int, n: int, seed: int = 0, training: bool = False, step: int = 0) -> np.ndarray:
    """pi for `layer` exactly as the model draws it: eval from (eval seed, layer), train from (seed, step, layer, 0)."""
    from model.permutation import PermutationSampler

    sampler = PermutationSampler(seed=seed, eval_seed=seed, rank=0, step=step, per_sequence=True)
    perm = sampler.sample(layer, n, 1, training=training)
    return perm.reshape(-1, n)[0].cpu().numpy().astype(np.int64)


def layer_paths(kind: str, layer: int, n: int, w: int, seed: int = 0, training: bool = False,
                step: int = 0) -> list[BandPath]:
    """The band paths of one layer of `kind` (swa, sa, gated_sa_swa), bands from kernels.default_band."""
    from kernels import default_band

    if kind not in VARIANTS:
        raise ValueError(f"kind must be one of {VARIANTS}, got {kind!r}")
    paths = []
    if kind in ("sa", "gated_sa_swa"):
        left, right = default_band(w, permuted=True)
        paths.append(BandPath(permutation(layer, n, seed, training, step), left, right))
    if kind in ("swa", "gated_sa_swa"):
        left, right = default_band(w, permuted=False)
        paths.append(BandPath(np.arange(n, dtype=np.int64), left, right))
    return paths


def stack_paths(kind: str, layers: int, n: int, w: int, seed: int = 0, training: bool = False,
                step: int = 0) -> list[list[BandPath]]:
    return [layer_paths(kind, layer, n, w, seed, training, step) for layer in range(layers)]


def directed_edges(path: BandPath) -> tuple[np.ndarray, np.ndarray]:
    """(query token, key token) arrays of one path's edges in ORIGINAL positions, self edges included. O(n * w)."""
    queries, keys = [], []
    for d in path.offsets("in"):
        ok = path.mask(d, "in")
        slots = np.nonzero(ok)[0]
        queries.append(path.pos[slots])
        keys.append(path.pos[slots + d])
    return np.concatenate(queries), np.concatenate(keys)


def layer_edges(paths: list[BandPath]) -> tuple[np.ndarray, np.ndarray]:
    """Union of the paths' edges (deduplicated), (query, key) in original positions."""
    n = paths[0].n
    q, k = zip(*(directed_edges(p) for p in paths))
    codes = np.unique(np.concatenate(q) * n + np.concatenate(k))
    return codes // n, codes % n
