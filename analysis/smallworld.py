"""Small-world metrics of attention graphs: clustering coefficient and average shortest path length, beside a
Watts-Strogatz graph of the same size and mean degree.

Graphs are undirected (an edge wherever one token attends to the other), self loops dropped. An attention graph is a
union of band paths (analysis.attention_graph): one layer's graph, or the *composed* graph = the union of every
layer's edges, undirected (so its paths ignore causality and layer order: the receptive field, which respects both,
is analysis.reachability's coverage). Band graphs are never materialised: a node's
neighbours come from its slot offsets, BFS runs as bitsets through analysis.reachability (64 sources per word).

Exact for small n (every node a clustering sample, every node a BFS source: identical to networkx's
average_clustering / average_shortest_path_length, which the tests check); for large n both are averages over random
samples of nodes, stated in the output. The Watts-Strogatz reference is measured on a generated graph (networkx for
small n, a scipy CSR graph up to `ws_max_edges` edges) and otherwise given by its standard approximations:
C(p) = 3(K-2)/(4(K-1)) (1-p)^3 (Barrat-Weigt) and L ~ the random graph's (`random_path_length`, a lower bound).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from analysis.attention_graph import BandPath
from analysis.reachability import band_plan, identity_bits, popcount, propagate_path


def _ragged_pairs(sorted_vals: np.ndarray, reach: int) -> tuple[np.ndarray, np.ndarray]:
    """All index pairs (i < j) with sorted_vals[j] - sorted_vals[i] <= reach."""
    m = len(sorted_vals)
    ends = np.searchsorted(sorted_vals, sorted_vals + reach, side="right")
    counts = ends - np.arange(m) - 1
    i = np.repeat(np.arange(m), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    j = i + 1 + (np.arange(counts.sum()) - first)
    return i, j


class BandGraph:
    """Undirected union of band paths over n tokens."""

    def __init__(self, paths: list[BandPath]):
        self.paths = []
        for p in paths:  # identical paths (SWA in every layer) add no edges
            if not any(q.left == p.left and q.right == p.right and np.array_equal(q.pos, p.pos) for q in self.paths):
                self.paths.append(p)
        self.n = self.paths[0].n
        self._slots = [p.slots() for p in self.paths]
        self._plans = None  # undirected propagation plans, built at the first BFS

    def neighbors(self, v: int) -> np.ndarray:
        out = []
        for path, slots in zip(self.paths, self._slots):
            s = int(slots[v])
            reach = max(path.left, path.right)
            d = np.arange(max(-reach, -s), min(reach, self.n - 1 - s) + 1)
            d = d[d != 0]
            here, there = path.pos[s], path.pos[s + d]
            link = ((d >= -path.left) & (d <= path.right) & (there <= here)) | \
                   ((d >= -path.right) & (d <= path.left) & (here <= there))
            out.append(there[link])
        return np.unique(np.concatenate(out))

    def edges_among(self, nodes: np.ndarray) -> int:
        """Number of edges of the graph between members of `nodes` (sorted unique token ids)."""
        k = len(nodes)
        seen = np.zeros((k, k), dtype=bool) if k <= 8192 else None  # an edge found by several paths counts once
        codes = []
        for path, slots in zip(self.paths, self._slots):
            s = slots[nodes]
            order = np.argsort(s)
            ss, tokens = s[order], nodes[order]
            i, j = _ragged_pairs(ss, max(path.left, path.right))
            d = ss[j] - ss[i]  # > 0: slot j is d after slot i
            pa, pb = path.pos[ss[i]], path.pos[ss[j]]
            link = ((d <= path.right) & (pb <= pa)) | ((d <= path.left) & (pa <= pb))
            if seen is not None:  # local indices: position of each token in the sorted `nodes`
                a, b = order[i][link], order[j][link]
                seen[np.minimum(a, b), np.maximum(a, b)] = True
            else:
                a, b = tokens[i][link], tokens[j][link]
                codes.append(np.minimum(a, b) * self.n + np.maximum(a, b))
        if seen is not None:
            return int(seen.sum())
        return int(np.unique(np.concatenate(codes)).size) if codes else 0

    def bfs(self, sources: np.ndarray) -> tuple[int, int]:
        """(sum of shortest-path lengths, number of reachable ordered pairs) from `sources` to every other node."""
        total, pairs = 0, 0
        for chunk in range(0, len(sources), 512):
            src = sources[chunk : chunk + 512]
            seen = identity_bits(self.n, src)
            count, level = popcount(seen), 0
            if self._plans is None:
                self._plans = [band_plan(p, "both") for p in self.paths]
            while True:
                nxt = propagate_path(seen, self.paths[0], "both", self._plans[0])
                for path, plan in zip(self.paths[1:], self._plans[1:]):
                    nxt |= propagate_path(seen, path, "both", plan)
                new_count = popcount(nxt)
                if new_count == count:
                    break
                level += 1
                total += level * (new_count - count)
                pairs += new_count - count
                seen, count = nxt, new_count
        return total, pairs

    def to_networkx(self):
        import networkx as nx

        g = nx.Graph()
        g.add_nodes_from(range(self.n))
        for v in range(self.n):
            g.add_edges_from((v, int(u)) for u in self.neighbors(v) if u > v)
        return g


class CsrGraph:
    """An undirected graph as a symmetric scipy CSR matrix (the Watts-Strogatz reference at large n)."""

    def __init__(self, matrix):
        import scipy.sparse as sp

        m = sp.csr_matrix(matrix, dtype=bool)
        m = ((m + m.T) > 0).tocsr()
        m.setdiag(False)
        m.eliminate_zeros()
        self.m, self.n = m, m.shape[0]

    def neighbors(self, v: int) -> np.ndarray:
        return self.m.indices[self.m.indptr[v] : self.m.indptr[v + 1]]

    def edges_among(self, nodes: np.ndarray) -> int:
        return int(self.m[nodes][:, nodes].nnz // 2)

    def bfs(self, sources: np.ndarray) -> tuple[int, int]:
        from scipy.sparse.csgraph import shortest_path

        dist = shortest_path(self.m, unweighted=True, directed=False, indices=sources)
        ok = np.isfinite(dist) & (dist > 0)
        return int(dist[ok].sum()), int(ok.sum())


def watts_strogatz_csr(n: int, k: int, p: float, seed: int = 0) -> CsrGraph:
    """Ring lattice (each node linked to k/2 neighbours per side), each edge's far end rewired with probability p."""
    import scipy.sparse as sp

    rng = np.random.default_rng(seed)
    half = max(1, k // 2)
    src = np.repeat(np.arange(n), half)
    dst = (src + np.tile(np.arange(1, half + 1), n)) % n
    rewire = rng.random(src.size) < p
    dst[rewire] = rng.integers(0, n, int(rewire.sum()))
    keep = src != dst
    m = sp.coo_matrix((np.ones(int(keep.sum()), dtype=bool), (src[keep], dst[keep])), shape=(n, n))
    return CsrGraph(m)


@dataclass
class Metrics:
    nodes: int
    mean_degree: float
    clustering: float
    path_length: float
    clustering_sample: int  # nodes averaged for C (== nodes: exact)
    path_sources: int  # BFS sources for L (== nodes: exact)
    connected_fraction: float  # reachable ordered pairs / all ordered pairs from the sources
    method: str

    def as_dict(self) -> dict:
        return asdict(self)


def measure(graph, clustering_sample: int | None = None, path_sources: int | None = None, seed: int = 0,
            method: str = "sampled") -> Metrics:
    """Average clustering (networkx's convention: nodes of degree < 2 count as 0) and average shortest path length
    over the reachable pairs, on all nodes or on random samples."""
    n = graph.n
    rng = np.random.default_rng(seed)
    c_nodes = np.arange(n) if clustering_sample is None or clustering_sample >= n else \
        np.sort(rng.choice(n, clustering_sample, replace=False))
    degrees, local = [], []
    for v in c_nodes:
        nb = graph.neighbors(int(v))
        k = len(nb)
        degrees.append(k)
        local.append(2.0 * graph.edges_among(nb) / (k * (k - 1)) if k >= 2 else 0.0)
    sources = np.arange(n) if path_sources is None or path_sources >= n else \
        np.sort(rng.choice(n, path_sources, replace=False))
    dist_sum, pairs = graph.bfs(sources)
    exact = len(c_nodes) == n and len(sources) == n
    return Metrics(nodes=n, mean_degree=float(np.mean(degrees)), clustering=float(np.mean(local)),
                   path_length=dist_sum / pairs if pairs else float("inf"), clustering_sample=len(c_nodes),
                   path_sources=len(sources), connected_fraction=pairs / (len(sources) * (n - 1)),
                   method="exact" if exact else method)


def ws_clustering_approx(k: float, p: float) -> float:
    """Barrat-Weigt: C(p) = 3(K-2) / (4(K-1)) * (1-p)^3."""
    return 3 * (k - 2) / (4 * (k - 1)) * (1 - p) ** 3 if k > 2 else 0.0


def ws_path_length_approx(n: int, k: float) -> float:
    """Path length of a Watts-Strogatz graph whose rewired edges already dominate (n K p >> n): the random graph's,
    a lower bound for p < 1 (used only where the graph is too large to generate)."""
    return random_path_length(n, k)


def random_path_length(n: int, k: float) -> float:
    """Mean shortest path of an Erdos-Renyi graph G(n, p = K / (n - 1)): the sum over l of P(distance > l), with
    P(distance > l) = (1 - p)^(nodes within l - 1 hops), those growing as 1 + K + ... + K^(l-1). Exact at l = 1, so it
    holds for dense graphs too, where the sparse limit ln n / ln K falls below 2 - K / (n - 1), the least mean path
    any graph of that degree has (n = 1000, K = 100: 1.900 measured, 1.900 here, 1.50 by ln n / ln K)."""
    p = min(1.0, max(k, 0.0) / max(n - 1, 1))
    if p >= 1.0:
        return 1.0
    total, within, reach = 1.0, 1.0, 1.0  # P(distance > 0) = 1; nodes within 0 hops: the source itself
    while within < n:  # once every node is within reach, only unconnected pairs are left (not counted, as in measure)
        term = math.exp(within * math.log1p(-p))
        if term < 1e-12:
            break
        total += term
        reach *= max(k, 1.0 + 1e-9)
        within += reach
    return total


def watts_strogatz_reference(n: int, mean_degree: float, p: float = 0.1, seed: int = 0, exact_nodes: int = 2000,
                             clustering_sample: int = 256, path_sources: int = 32,
                             ws_max_edges: int = 10_000_000) -> Metrics:
    """Metrics of a Watts-Strogatz graph with the same n and (even-rounded) mean degree."""
    k = max(2, int(round(mean_degree / 2)) * 2)
    k = min(k, n - 1 - (n - 1) % 2)
    if n <= exact_nodes:
        import networkx as nx

        g = nx.watts_strogatz_graph(n, k, p, seed=seed)
        path = nx.average_shortest_path_length(g) if nx.is_connected(g) else float("nan")
        return Metrics(n, 2 * g.number_of_edges() / n, nx.average_clustering(g), path, n, n, 1.0, "networkx")
    if n * k // 2 <= ws_max_edges:
        return measure(watts_strogatz_csr(n, k, p, seed), clustering_sample, path_sources, seed, method="sampled")
    return Metrics(n, float(k), ws_clustering_approx(k, p), ws_path_length_approx(n, k), 0, 0, 1.0, "approx")


def random_reference(n: int, mean_degree: float) -> tuple[float, float]:
    """(C, L) of an Erdos-Renyi graph with the same n and mean degree: K / (n - 1) and `random_path_length`."""
    k = max(mean_degree, 1.0001)
    return k / max(n - 1, 1), random_path_length(n, k)
