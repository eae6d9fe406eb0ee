"""The benchmark scripts run end to end at toy sizes (a GPU session runs them once, with no time to fix a crash)."""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys

import pytest
import torch

import bench.attention as ba
from bench.attention import peak_memory_mb
from kernels import default_band
from bench.kernel_schedule import cuobjdump_path
from conftest import ROOT


def run_module(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


def test_attention_benchmark_writes_table_csv_and_plot(tmp_path):
    out = tmp_path / "results"
    proc = run_module(["bench.attention", "--device", "cpu", "--n", "64", "96", "--window", "16", "--heads", "2",
                       "--head-dim", "16", "--reps", "1", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "correctness gate torch: ok" in proc.stdout
    tag = "cpu_fp32_h2_d16_w16_n64-96"  # the settings off the default table name the files
    rows = list(csv.DictReader(open(out / f"attention_{tag}.csv")))
    assert {(r["n"], r["variant"]) for r in rows} == {(n, v) for n in ("64", "96")
                                                      for v in ("full", "swa", "sa", "gated_sa_swa")}
    assert all(float(r["fwd_ms"]) > 0 and float(r["fwd_bwd_ms"]) > 0 and float(r["peak_mb"]) > 0 for r in rows)
    assert (out / f"attention_{tag}.png").stat().st_size > 0
    table = (out / f"attention_{tag}.md").read_text()
    # fwd, fwd+bwd, memory, then fwd and fwd+bwd TFLOP/s
    assert table.count("| 64 | torch |") == 5 and table.count("| 96 | torch |") == 5
    rates = table.split("Attention matmul work per second")[1]
    rate = next(line for line in rates.splitlines() if line.startswith("| 96 | torch | fwd+bwd |"))
    row = {r["variant"]: r for r in rows if r["n"] == "96"}
    expected = (ba.attention_flops("sa", 96, 16, 1, 2, 16, True) / float(row["sa"]["fwd_bwd_ms"])) / \
        (ba.attention_flops("full", 96, 16, 1, 2, 16, True) / float(row["full"]["fwd_bwd_ms"]))
    assert float(rate.split("|")[-2]) == pytest.approx(expected, abs=0.006)


def test_model_benchmark_times_each_variant_with_and_without_recompute_and_loss_chunks(tmp_path):
    # 2 x 200 targets: past 265, the log-probabilities the plain loss keeps (targets x 8192 x 4 bytes) outweigh the
    # head gradients the chunked one keeps ((targets + 8192) x 256 x 4 bytes)
    proc = run_module(["bench.model", "--variants", "sa", "gated_sa_swa", "--seq-len", "200", "--batch", "2",
                       "--steps", "1", "--window", "8", "--recompute", "--loss-chunk", "16", "--out", str(tmp_path)],
                      tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = list(csv.DictReader(open(tmp_path / "model_cpu_small_n200_b2_w8_sa-gated_sa_swa_recompute_chunk16.csv")))
    settings = [("False", "0"), ("True", "0"), ("False", "16"), ("True", "16")]
    assert [(r["variant"], r["recompute"], r["loss_chunk"]) for r in rows] == [
        (v, *s) for v in ("sa", "gated_sa_swa") for s in settings]
    saved = {(r["variant"], r["recompute"], r["loss_chunk"]): float(r["saved_mb"]) for r in rows}
    for v in ("sa", "gated_sa_swa"):  # each one keeps less; both together the least
        assert max(saved[(v, "True", "0")], saved[(v, "False", "16")]) < saved[(v, "False", "0")]
        assert saved[(v, "True", "16")] < min(saved[(v, "True", "0")], saved[(v, "False", "16")])
    assert "| sa (recompute) |" in proc.stdout and "| sa (recompute) (loss chunks of 16) |" in proc.stdout


def test_saved_activations_leave_out_autocasts_weight_copies():
    """Under autocast each Linear saves its weight's bf16 copy: weights, not activations (~0.7 GB on the 360M model,
    which the recompute rows credited to activation checkpointing)."""
    import torch

    from bench.model import _autocast_weight

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    flagged, kept = [], []

    def pack(t):
        (flagged if _autocast_weight(t, params) else kept).append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randn(3, 8, requires_grad=True)).sum().backward()
    assert sorted(flagged) == [(8, 16), (16, 4)]  # the two weights' copies, transposed for the matmul
    assert (3, 8) in kept and (3, 16) in kept  # the inputs of each layer stay activations (the first: a cast of a
    # leaf that is no parameter)


def test_optimizer_benchmark_compares_default_and_fused_adamw(tmp_path):
    proc = run_module(["bench.optimizer", "--steps", "2", "--rounds", "1"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| torch default |" in proc.stdout and "| fused (training) |" in proc.stdout
    assert "largest weight difference after 3 steps" in proc.stdout


def test_tokenize_benchmark_compares_threads_on_and_off(tmp_path):
    proc = run_module(["bench.tokenize", "--docs", "30", "--vocab", "300"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| off |" in proc.stdout and "| on |" in proc.stdout and "same result: True" in proc.stdout


def test_cpu_peak_memory_is_the_largest_live_total_during_the_call():
    def call():
        a = torch.empty(2**20)  # 4 MiB
        b = torch.empty(2**21)  # 8 MiB more: 12 MiB live
        del a
        c = torch.empty(2**19)  # 2 MiB more: 10 MiB live, under the peak
        return b, c

    assert peak_memory_mb(call, torch.device("cpu")) == pytest.approx(12, abs=0.05)


@pytest.mark.parametrize("n,w", [(1, 1), (17, 1), (17, 4), (100, 16), (33, 64), (64, 200)])
def test_band_pairs_count_the_scores_inside_the_band(n, w):
    """The work the TFLOP/s table divides by: every (query, key) pair of the band mask (the causal compare of SA
    masks about half of them, but the kernel scores them all), and n (n + 1) / 2 for full causal attention."""
    for permuted in (False, True):
        left, right = default_band(w, permuted)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        in_band = (j >= i - left) & (j <= i + right)
        assert ba.band_pairs(n, left, right) == int(in_band.sum())
    assert ba.attention_flops("full", n, w, 2, 3, 16, False) == 4 * 16 * (n * (n + 1) // 2) * 2 * 3
    swa_pairs = ba.band_pairs(n, *default_band(w, False))
    assert ba.attention_flops("swa", n, w, 1, 1, 8, True) == 4 * 8 * swa_pairs * 3.5
    assert ba.attention_flops("gated_sa_swa", n, w, 1, 1, 8, False) == \
        ba.attention_flops("sa", n, w, 1, 1, 8, False) + ba.attention_flops("swa", n, w, 1, 1, 8, False)


def test_the_benchmark_times_on_the_gpu_it_was_given(monkeypatch):
    """do_bench synchronizes the current GPU: `--device cuda:1` must make it current, and a plain `cuda` (no index,
    which set_device refuses) is the current one."""
    made_current = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    assert ba.timed_device("cuda") == torch.device("cuda", 0)
    assert ba.timed_device("cuda:1") == torch.device("cuda", 1)
    assert made_current == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert ba.timed_device("cpu") == torch.device("cpu") and len(made_current) == 2


def test_attention_benchmark_subset_of_variants(tmp_path):
    """--variants without SWA or full: the ratio columns are left empty instead of crashing the table."""
    out = tmp_path / "results"
    proc = run_module(["bench.attention", "--device", "cpu", "--n", "64", "--window", "16", "--heads", "2",
                       "--head-dim", "16", "--reps", "1", "--variants", "sa", "--out", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| 64 | torch | fwd | - | - |" in (out / "attention_cpu_fp32_h2_d16_w16_n64_sa.md").read_text()


def test_attention_benchmark_files_are_named_by_the_settings_off_the_default_table():
    from bench.attention import DEFAULT_N, shape_suffix

    default = argparse.Namespace(batch=1, heads=16, head_dim=64, window=256, n=list(DEFAULT_N), variants=None,
                                 backends=None, full_max_n=None)
    assert shape_suffix(default) == ""  # the table BENCHMARKS.md quotes keeps its plain name
    b8 = argparse.Namespace(**{**vars(default), "batch": 8, "n": [2048, 8192], "backends": ["triton"]})
    assert shape_suffix(b8) == "_b8_n2048-8192_triton"
    cpu = argparse.Namespace(**{**vars(default), "full_max_n": 16384})  # the CPU's default limit: the plain name
    assert shape_suffix(cpu, 16384) == ""
    assert shape_suffix(argparse.Namespace(**{**vars(default), "full_max_n": 8192}), None) == "_fullmax8192"
    assert shape_suffix(argparse.Namespace(**{**vars(default), "full_max_n": 65536}), None) == ""  # skips none
    assert shape_suffix(argparse.Namespace(**{**vars(default), "full_max_n": 0}), 16384) == "_fullmax0"  # all
    assert shape_suffix(argparse.Namespace(**{**vars(default), "full_max_n": 8192, "variants": ["sa"]}), None) \
        == "_sa"  # no full attention in the table: its limit changes nothing


def test_a_backend_that_fails_its_gate_is_not_timed(tmp_path, monkeypatch):
    import bench.attention as ba

    assert ba.correctness_ok("torch", torch.device("cpu"), torch.float32, heads=2, head_dim=16) == (True, "ok")
    assert ba.correctness_ok("torch", torch.device("cpu"), torch.float32, heads=2, head_dim=16, window=2048) == \
        (True, "ok")  # the timed window, here all of n=2048
    real = ba.banded_attention
    monkeypatch.setattr(ba, "banded_attention", lambda *a, **k: real(*a, **k) * 1.001)
    ok, why = ba.correctness_ok("torch", torch.device("cpu"), torch.float32, heads=2, head_dim=16)
    assert not ok and why.startswith("out relative error 1.00e-03 > 1e-04")
    out = tmp_path / "results"  # no backend passes: a clear exit, no table or CSV
    proc = run_module(["bench.attention", "--device", "cpu", "--n", "64", "--window", "16", "--heads", "2",
                       "--head-dim", "16", "--reps", "1", "--backends", "nope", "--out", str(out)], tmp_path)
    assert proc.returncode == 1 and "nothing was timed" in proc.stderr, proc.stderr[-2000:]
    assert "correctness gate nope: FAILED - not timed: ValueError" in proc.stdout
    assert not list(out.glob("attention_*"))


def test_profile_script_runs_on_the_cpu(tmp_path):
    """bench/gpu_session.sh's profile stage, as a CPU run of the same code (a GPU lease has no time for a crash)."""
    proc = run_module(["bench.profile_gpu", "--device", "cpu", "--backend", "torch", "--n", "64", "--window", "8"],
                      tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "n=64 step: host issue time" in proc.stdout and "n=64 fwd: host issue time" in proc.stdout
    assert "Self CPU" in proc.stdout and "cumulative" in proc.stdout


def test_host_overhead_benchmark(tmp_path):
    proc = run_module(["bench.host_overhead", "--n", "64", "--calls", "5"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line.split(":")[0].strip() for line in proc.stdout.splitlines()] == ["fwd_no_grad", "fwd", "fwd_bwd"]


@pytest.mark.skipif(cuobjdump_path() is None, reason="needs Triton's CUDA backend (ptxas, cuobjdump)")
def test_sa_loops_pipeline_as_deep_as_swa(tmp_path):
    """Compiled for sm_90 on this CPU: every SA tile loop keeps as many tiles in flight as SWA's, and none spills.
    Loading pi in the same step as the gather it addresses kept 0 tiles in flight (each step waited for its loads)."""
    proc = run_module(["bench.kernel_schedule", "--check"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| fwd") or
            line.startswith("| dq") or line.startswith("| dkdv")]
    assert len(rows) == 6
    assert all(float(depth) >= 1 for row in rows for depth in row[9].split("/"))


@pytest.mark.skipif(cuobjdump_path() is None, reason="needs Triton's CUDA backend (ptxas, cuobjdump)")
def test_kernels_compile_with_unit_row_strides(tmp_path):
    """On a GPU, Triton's JIT turns an integer argument equal to 1 into a constant: at head dim 1 every row stride
    is 1. The interpreter never does that, so only a compile for sm_90 shows that _rows_at takes a constant."""
    code = (
        "from bench.kernel_schedule import compile_kernel\n"
        "strides = dict.fromkeys(['sqn', 'skn', 'svn', 'son', 'sdn', 'sdqn', 'sdkn', 'sdvn'], 1)\n"
        "for kernel in ('fwd', 'dq', 'dkdv'):\n"
        "    c = compile_kernel(kernel, 16, 16, 4, 1, True, True, head_dim=1, specialized=strides)\n"
        "    print(kernel, c.registers, c.spill_bytes)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for the GPU target
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split()[0] for line in proc.stdout.splitlines()] == ["fwd", "dq", "dkdv"]


def test_plot_csv_redraws_the_tables_of_an_older_csv_given_its_shape(tmp_path):
    """CSVs from before the shape columns (the GPU references) get their TFLOP/s from --batch/--heads/--head-dim."""
    old = tmp_path / "attention_gpu_bf16.csv"
    fields = ["device", "dtype", "n", "w", "variant", "backend", "fwd_ms", "fwd_bwd_ms", "peak_mb"]
    with open(old, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(fields)
        for variant, backend, ms in (("full", "sdpa", 4.0), ("swa", "triton", 0.2), ("sa", "triton", 0.25)):
            writer.writerow(["gpu", "bf16", 4096, 256, variant, backend, ms, 3 * ms, 100])
    proc = run_module(["bench.plot_csv", str(old), "--batch", "8"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fwd = next(line for line in proc.stdout.split("Attention matmul work per second")[1].splitlines()
               if line.startswith("| 4096 | triton | fwd |"))
    full_tflops = ba.attention_flops("full", 4096, 256, 8, 16, 64, False) / 4e-3 / 1e12
    assert float(fwd.split("|")[4]) == pytest.approx(full_tflops, rel=1e-3)  # B=8 from the option, H, D defaults
    assert (tmp_path / "attention_gpu_bf16.md").read_text().strip() == proc.stdout.strip()
    assert (tmp_path / "attention_gpu_bf16.png").stat().st_size > 0
    assert next(csv.reader(open(old))) == fields  # the CSV is left as it was: no guessed shape written into it
    new = tmp_path / "attention_new.csv"  # a CSV with its own shape: an option that contradicts it is refused
    with open(old) as src, open(new, "w", newline="") as dst:
        writer = csv.writer(dst)
        for i, row in enumerate(csv.reader(src)):
            writer.writerow(row + (["batch"] if i == 0 else ["2"]))
    refused = run_module(["bench.plot_csv", str(new), "--batch", "8"], tmp_path)
    assert refused.returncode == 2 and "--batch 8 contradicts the CSV's own batch column ([2])" in refused.stderr
    agrees = run_module(["bench.plot_csv", str(new)], tmp_path)
    assert agrees.returncode == 0 and f"| 4096 | triton | fwd | {full_tflops / 4:.1f} |" in agrees.stdout
