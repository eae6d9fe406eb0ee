"""Receptive-field coverage and small-world metrics of attention graphs drawn through the model's own code."""

import json

import numpy as np
import pytest
import torch

from analysis.attention_graph import VARIANTS, directed_edges, layer_edges, layer_paths, stack_paths
from analysis.reachability import coverage_by_layer, reachable_matrix, sample_keys
from analysis.smallworld import BandGraph, CsrGraph, measure, random_reference, watts_strogatz_csr
from analysis.theory import log_w_layers, mean_field_coverage, swa_coverage
from kernels.naive import band_mask


@pytest.mark.parametrize("kind", VARIANTS)
@pytest.mark.parametrize("n,w", [(37, 5), (64, 8), (20, 64), (33, 2)])
def test_edges_are_the_kernel_mask(kind, n, w):
    """Every path's edges are exactly kernels.naive.band_mask under the model's permutation and band."""
    for path in layer_paths(kind, 2, n, w, seed=3):
        q_slot, k_slot = np.nonzero(band_mask(torch.from_numpy(path.pos), path.left, path.right).numpy())
        dense = np.zeros((n, n), dtype=bool)
        dense[path.pos[q_slot], path.pos[k_slot]] = True
        q, k = directed_edges(path)
        ours = np.zeros((n, n), dtype=bool)
        ours[q, k] = True
        assert (ours == dense).all()
        assert (reachable_matrix([[path]]) == dense).all()
    with pytest.raises(ValueError, match="direction must be one of"):  # a typo linked nothing but self, in silence
        path.offsets("In")


def test_permutations_are_the_models():
    from model.permutation import PermutationSampler

    path = layer_paths("sa", 3, 50, 8, seed=7)[0]
    assert torch.equal(torch.from_numpy(path.pos), PermutationSampler(eval_seed=7).sample(3, 50, 1, training=False))
    path = layer_paths("sa", 3, 50, 8, seed=7, training=True, step=11)[0]
    expected = PermutationSampler(seed=7, step=11).sample(3, 50, 1, training=True)[0]
    assert torch.equal(torch.from_numpy(path.pos), expected)


@pytest.mark.parametrize("kind", VARIANTS)
def test_reachability_equals_dense_boolean_products(kind):
    n, w, layers = 150, 6, 4
    stack = stack_paths(kind, layers, n, w, seed=1)
    dense = np.eye(n, dtype=bool)
    for paths in stack:
        adj = np.zeros((n, n), dtype=np.int32)
        q, k = layer_edges(paths)
        adj[q, k] = 1
        dense = (adj @ dense.astype(np.int32)) > 0
    assert (reachable_matrix(stack) == dense).all()
    keys = sample_keys(n, 40, seed=2)
    assert (reachable_matrix(stack, keys) == dense[:, keys]).all()
    causal = np.tril(np.ones((n, n), dtype=bool))
    assert coverage_by_layer(stack, np.arange(n))[-1] == pytest.approx(dense.sum() / causal.sum(), abs=1e-12)


@pytest.mark.parametrize("n,w", [(97, 4), (256, 8), (300, 33)])
def test_swa_reach_is_exactly_layers_times_w_minus_1(n, w):
    for layers in range(1, 6):
        reach = reachable_matrix(stack_paths("swa", layers, n, w))
        q, k = np.indices((n, n))
        assert (reach == ((q - k >= 0) & (q - k <= layers * (w - 1)))).all(), layers
    measured = coverage_by_layer(stack_paths("swa", 5, n, w), np.arange(n))
    assert measured == pytest.approx(swa_coverage(n, w, 5), abs=1e-12)
    assert mean_field_coverage(n, w, 5, "swa") == pytest.approx(swa_coverage(n, w, 5), abs=1e-12)


def test_sa_coverage_after_log_w_layers():
    """Near 1 after ceil(log_w n) + 2 layers when w is large; for small w causality thins the edges of early queries
    (a query at t has only (w-1) t / n causal neighbours per layer) and coverage stays well below 1. Either way the
    measurement follows the mean-field curve of analysis.theory."""
    for n, w, floor in [(2048, 32, 0.85), (4096, 64, 0.87), (512, 8, 0.45), (1024, 16, 0.70)]:
        layers = log_w_layers(n, w) + 2
        for training in (False, True):
            measured = coverage_by_layer(stack_paths("sa", layers, n, w, seed=0, training=training, step=3),
                                         np.arange(n))
            assert measured[-1] >= floor, (n, w, measured)
            assert measured[-1] == pytest.approx(mean_field_coverage(n, w, layers, "sa")[-1], abs=0.03)
    # the paper's setting: n = 32768, w = 256 -> ceil(log_w n) = 2; four layers reach > 95% of the pairs
    n, w = 32768, 256
    measured = coverage_by_layer(stack_paths("sa", log_w_layers(n, w) + 2, n, w), sample_keys(n, 256, seed=0))
    assert measured[-1] > 0.95


@pytest.mark.parametrize("n,w", [(256, 8), (1024, 16)])
def test_gated_covers_everything_in_a_few_layers(n, w):
    layers = log_w_layers(n, w) + 2
    keys = np.arange(n)
    gated = coverage_by_layer(stack_paths("gated_sa_swa", layers, n, w), keys)
    sa = coverage_by_layer(stack_paths("sa", layers, n, w), keys)
    swa = coverage_by_layer(stack_paths("swa", layers, n, w), keys)
    assert all(g >= max(a, b) for g, a, b in zip(gated, sa, swa))
    assert gated[-1] > 0.999


@pytest.mark.parametrize("kind,n,w,layers", [("swa", 90, 6, 1), ("sa", 120, 8, 1), ("sa", 100, 6, 3),
                                             ("gated_sa_swa", 80, 4, 2)])
def test_small_world_metrics_agree_with_networkx(kind, n, w, layers):
    nx = pytest.importorskip("networkx")
    stack = stack_paths(kind, layers, n, w, seed=4)
    graph = BandGraph([p for paths in stack for p in paths])
    g = graph.to_networkx()
    ours = measure(graph)
    assert ours.method == "exact"
    assert ours.mean_degree == pytest.approx(2 * g.number_of_edges() / n)
    assert ours.clustering == pytest.approx(nx.average_clustering(g), abs=1e-12)
    assert ours.path_length == pytest.approx(nx.average_shortest_path_length(g), abs=1e-12)
    csr = measure(CsrGraph(nx.to_scipy_sparse_array(g)))
    assert (csr.clustering, csr.path_length) == pytest.approx((ours.clustering, ours.path_length), abs=1e-12)
    ws = watts_strogatz_csr(200, 10, 0.2, seed=1)
    ws_nx = nx.from_scipy_sparse_array(ws.m)
    m = measure(ws)
    assert m.clustering == pytest.approx(nx.average_clustering(ws_nx), abs=1e-12)
    if nx.is_connected(ws_nx):
        assert m.path_length == pytest.approx(nx.average_shortest_path_length(ws_nx), abs=1e-12)


@pytest.mark.parametrize("n,k", [(600, 12), (600, 150)])  # sparse, and dense (K > sqrt n) where ln n / ln K fails
def test_random_reference_path_length_matches_a_measured_random_graph(n, k):
    nx = pytest.importorskip("networkx")
    g = nx.gnp_random_graph(n, k / (n - 1), seed=3)
    measured = nx.average_shortest_path_length(g.subgraph(max(nx.connected_components(g), key=len)))
    c_rand, l_rand = random_reference(n, k)
    assert l_rand == pytest.approx(measured, rel=0.02) and c_rand == pytest.approx(k / (n - 1))
    assert l_rand >= 2 - k / (n - 1) - 1e-9  # no graph of this mean degree has shorter paths


def test_log_w_layers_is_an_integer_ceiling():
    assert [log_w_layers(n, w) for n, w in ((125, 5), (126, 5), (2048, 256), (65536, 256), (65537, 256), (3, 4))] \
        == [3, 4, 2, 2, 3, 1]


def test_coverage_cli_writes_table_and_plot(tmp_path, capsys):
    from analysis.coverage import main

    assert main(["--n", "256", "--w", "8", "--layers", "4", "--out", str(tmp_path), "--sw-exact-nodes", "300"]) == 0
    text = (tmp_path / "coverage.md").read_text()
    assert "| 4 | 28 |" in text  # layer 4: SWA reach 4 x 7
    assert "identical to the measured column" in text and "Small-world" in text
    assert (tmp_path / "coverage.png").stat().st_size > 10_000
    assert (tmp_path / "coverage.json").is_file()
    with pytest.raises(SystemExit):  # it divided by zero deep in the estimate
        main(["--n", "256", "--w", "8", "--layers", "2", "--keys", "0", "--out", str(tmp_path)])
    assert "--keys 0: a number of sampled keys >= 1" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- loss by position
def test_windows_stay_inside_documents():
    from analysis.position_loss import cut_windows

    docs = [np.arange(100, 110), np.arange(200, 203), np.arange(300, 325)]
    windows = cut_windows(docs, 5, limit=100)
    assert len(windows) == 2 + 5  # 10 // 5 from the first document, none from the second, 25 // 5 from the third
    assert all(np.array_equal(w, np.arange(w[0], w[0] + 5)) for w in windows)  # consecutive tokens of one document
    assert len(cut_windows(docs, 5, limit=3)) == 3
    with pytest.raises(ValueError, match="no document holds 30 tokens"):
        cut_windows(docs, 30, limit=4)


def test_position_losses_equal_the_direct_per_position_loss():
    from analysis.position_loss import position_losses
    from model.config import AttentionConfig, ModelConfig
    from model.decoder import Decoder

    model = Decoder(ModelConfig(vocab_size=50, n_layers=2, d_model=32, n_heads=2, max_seq_len=600),
                    AttentionConfig(kind="sa", window=16, backend="torch"), seed=1).eval()
    windows = np.random.default_rng(0).integers(0, 50, size=(3, 601))  # 600 positions: two slices of the head
    got = position_losses(model, windows, batch_size=2, device="cpu")
    tokens = torch.from_numpy(windows)
    with torch.no_grad():
        logits = model(tokens[:, :-1])
    direct = torch.nn.functional.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    assert got.shape == (600,) and np.allclose(got, direct.mean(0).numpy(), atol=1e-5)
    each = position_losses(model, windows, batch_size=2, device="cpu", per_window=True)
    assert each.shape == (3, 600) and np.allclose(each, direct.numpy(), atol=1e-5)


def test_position_loss_cli_past_the_trained_context(tiny_ckpt, corpus_file, tmp_path, capsys):
    from analysis.position_loss import main
    from tools.runs import read_evals

    run_dir = tiny_ckpt.parent.parent
    with pytest.raises(SystemExit, match="error: /no/such/run: "):  # a mistyped run stops before any run is scored
        main([f"ckpt={run_dir},/no/such/run"])
    assert not (run_dir / "eval" / "position_loss_64").exists()
    assert main([f"ckpt={run_dir}"]) == 0  # the defaults: the run's own validation shard, at the trained context
    saved = json.loads((run_dir / "eval" / "position_loss_64" / "results.json").read_text())
    assert saved["max_length"] == saved["trained_context"] == 64 and len(saved["loss"]) == 64
    assert saved["text"].endswith("val.bin") and saved["setting"] == {}
    each = [b["stderr"] for b in saved["buckets"]]  # over windows: how far apart neighbouring buckets may fall
    assert all(e is not None and e >= 0 for e in each) and max(each) > 0
    assert main([f"ckpt={run_dir}", "windows=4"]) == 0  # another measurement: a folder of its own, not the default's
    [other] = (run_dir / "eval").glob("position_loss_64_*")
    assert json.loads((other / "results.json").read_text())["windows"] == 4
    assert json.loads((run_dir / "eval" / "position_loss_64" / "results.json").read_text()) == saved
    books = tmp_path / "books.jsonl"  # documents long enough for 128-token windows
    text = [json.loads(line)["text"] for line in corpus_file.read_text().splitlines()]
    books.write_text("".join(json.dumps({"text": " ".join(text[i: i + 20])}) + "\n" for i in range(0, 200, 20)))
    assert main([f"ckpt={run_dir}", "context=128", f"text={books}", "windows=6", "seeds=2",
                 f"out={tmp_path / 'out'}"]) == 0
    combined = json.loads((tmp_path / "out" / "position_loss.json").read_text())
    assert combined[0]["attention"]["eval_seeds"] == [0, 1] and len(combined[0]["loss"]) == 128
    assert (tmp_path / "out" / "position_loss.png").stat().st_size > 0
    assert "| positions | sa w=8" in capsys.readouterr().out
    evals = read_evals(run_dir)
    assert {"position_loss/loss", "position_loss/loss [windows=4]",
            f"position_loss/loss [seeds=2, context=128, text={books}, windows=6]"} <= set(evals)
    with pytest.raises(SystemExit, match="no document holds 100001 tokens"):
        main([f"ckpt={run_dir}", "context=100000", f"text={books}"])


@pytest.mark.parametrize("n,w", [(64, 100), (256, 128), (300, 7)])
def test_sa_mean_field_is_exact_after_one_layer(n, w):
    """Layer 1 reaches exactly the band's direct edges; q = (w-1)/(n-1) ignored the band's cut-off at the ends of
    the permuted order and claimed full coverage after one layer at n=64, w=100 (0.953 measured)."""
    exact = np.mean([coverage_by_layer(stack_paths("sa", 1, n, w, seed=s), np.arange(n))[0] for s in range(8)])
    assert mean_field_coverage(n, w, 1, "sa")[0] == pytest.approx(exact, abs=0.01)


def test_position_loss_bucket_edges_span_every_position():
    """Buckets start at position 0 and end at the context: shifting the log-spaced edges by one lost position 0."""
    from analysis.position_loss import bucket_edges

    for context, buckets in ((64, 12), (4096, 12), (10, 40)):
        edges = bucket_edges(context, buckets)
        assert edges[0] == 0 and edges[-1] == context, edges
        assert all(a < b for a, b in zip(edges, edges[1:]))
    assert bucket_edges(64, 12)[:3] == [0, 1, 2]


def test_position_loss_stderr_is_over_windows(tiny_ckpt, monkeypatch):
    """Each bucket's stderr = std(ddof=1) over the windows of their mean loss in the bucket / sqrt(windows)."""
    from analysis import position_loss

    def fake_curve(model, seed, windows, given):  # known per-window losses, different in every window
        k, context = len(windows), windows.shape[1] - 1
        return np.random.default_rng(5).random((k, context)) + np.arange(k)[:, None]

    monkeypatch.setattr(position_loss, "_seed_curve", fake_curve)
    given = {**position_loss.DEFAULTS, "ckpt": str(tiny_ckpt.parent.parent), "windows": 4, "buckets": 5}
    run = position_loss.score_run(given["ckpt"], given, {}, log=lambda msg: None)
    per_window = np.random.default_rng(5).random((4, 64)) + np.arange(4)[:, None]
    assert run["windows"] == 4 and run["loss"] == pytest.approx(per_window.mean(0), abs=1e-5)
    for bucket in run["buckets"]:
        means = per_window[:, bucket["lo"]: bucket["hi"] + 1].mean(1)
        assert bucket["loss"] == pytest.approx(means.mean(), abs=1e-12)
        assert bucket["stderr"] == pytest.approx(means.std(ddof=1) / 2, abs=1e-12)  # sqrt(4 windows)


def test_sa_mean_field_follows_its_documented_recursion():
    """mean_field_distance is the module docstring's recursion (SA: a product over e < d, exclusive of d itself;
    gated adds the SWA window's product), checked against a plain loop."""
    from analysis.theory import band_pair_probability, mean_field_distance

    n, w, layers = 20, 4, 3
    q = band_pair_probability(n, w)
    for kind in ("sa", "gated_sa_swa", "swa"):
        p = [1.0] + [0.0] * (n - 1)
        expected = []
        for _ in range(layers):
            new = []
            for d in range(n):
                miss = 1 - p[d]
                if kind != "swa":
                    for e in range(d):
                        miss *= 1 - q * p[e]
                if kind != "sa":
                    for j in range(1, min(w - 1, d) + 1):
                        miss *= 1 - p[d - j]
                new.append(1 - miss)
            p = new
            expected.append(p)
        got = mean_field_distance(n, w, layers, kind)
        assert len(got) == layers
        for ours, loop in zip(got, expected):
            assert ours == pytest.approx(loop, abs=1e-12), kind


def test_ws_clustering_approx_is_barrat_weigt():
    """C(p) = C(0) (1-p)^3 with C(0) = 3(K-2)/(4(K-1)), the ring lattice's clustering (measured here at p = 0)."""
    from analysis.smallworld import ws_clustering_approx

    for k in (4, 10, 20):
        c0 = 3 * (k - 2) / (4 * (k - 1))
        assert measure(watts_strogatz_csr(200, k, 0.0)).clustering == pytest.approx(c0, abs=1e-12)
        assert ws_clustering_approx(k, 0.0) == pytest.approx(c0, abs=1e-12)
        for p in (0.1, 0.3, 0.5):
            assert ws_clustering_approx(k, p) == pytest.approx(c0 * (1 - p) ** 3, abs=1e-12)
    assert ws_clustering_approx(2, 0.1) == 0.0


def test_connected_fraction_counts_ordered_pairs_of_distinct_nodes():
    """connected_fraction = reachable pairs / (sources x (n - 1)): 1 on a connected graph, (m-1)/(2m-1) on two
    components of m nodes each."""
    nx = pytest.importorskip("networkx")
    assert measure(CsrGraph(nx.to_scipy_sparse_array(nx.cycle_graph(30)))).connected_fraction == 1.0
    assert measure(BandGraph(stack_paths("swa", 1, 40, 4)[0])).connected_fraction == 1.0
    assert measure(CsrGraph(nx.to_scipy_sparse_array(nx.path_graph(30))), path_sources=7).connected_fraction == 1.0
    m = 15
    two = nx.disjoint_union(nx.cycle_graph(m), nx.cycle_graph(m))
    assert measure(CsrGraph(nx.to_scipy_sparse_array(two))).connected_fraction == pytest.approx((m - 1) / (2 * m - 1))


def test_first_full_needs_exactly_full_coverage():
    """first_full is 1-based and accepts only coverage 1, not a value that rounds to it."""
    from analysis.coverage import first_full

    assert first_full([0.9995, 1.0]) == 2
    assert first_full([0.5, 0.99999999, 1.0, 1.0]) == 3
    assert first_full([1.0]) == 1
    assert first_full([0.2, 0.9999]) is None


def test_small_world_sigma_divides_the_path_length_ratio():
    """run_smallworld's sigma = (C / C_rand) / (L / L_rand), from the row's own C, L, C_rand and L_rand."""
    from analysis.coverage import run_smallworld

    rows = run_smallworld(120, 6, 2, seed=1, variants=("sa",), log=lambda msg: None)
    assert len(rows) == 2
    for r in rows:
        assert r["path_length"] / r["l_rand"] != pytest.approx(1.0, abs=0.01)  # the ratio matters
        expected = (r["clustering"] / r["c_rand"]) / (r["path_length"] / r["l_rand"])
        assert r["sigma"] == pytest.approx(expected, rel=1e-12)
