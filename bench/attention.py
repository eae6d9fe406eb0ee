"""Attention latency and memory: full (SDPA) vs SWA vs SA vs gated SA+SWA, per backend, side by side in one run.

    python -m bench.attention                      # CPU defaults (fp32, n up to 32768, full up to 16384; ~6 min)
    python -m bench.attention                      # on a CUDA GPU: bf16, n up to 32768, backends triton and flex
    python -m bench.attention --graphs             # GPU time alone: calls replayed from a CUDA graph

Prints a markdown table with the ratios full/SA (SA's speed-up) and SA/SWA (SA's cost), the peak memory and the
attention matmuls' TFLOP/s (SA's per-FLOP efficiency against full attention's), writes CSV and a PNG plot to
bench/results/.
A backend whose output or gradients disagree with the dense reference on a small problem is not timed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import inspect
import itertools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from data.shards import atomic_write, atomic_write_text
from kernels import banded_attention, default_band
from kernels.cpu_malloc import keep_freed_memory
from kernels.naive import naive_banded_attention

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# relative error of output and gradients against the fp32 dense reference (the kernel tests' thresholds; bf16 keeps
# 8 bits of mantissa to fp16's 11)
GATE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def time_call(fn, device, reps: int, grads=(), graphs: bool = False) -> float:
    """Median milliseconds. CUDA: triton's do_bench (CUDA events, L2 flushed between runs), or with `graphs` its
    do_bench_cudagraph (calls replayed from a CUDA graph: GPU time without the host's launch cost); CPU: wall clock."""
    if device.type == "cuda":
        from triton.testing import do_bench, do_bench_cudagraph

        if graphs:
            return do_bench_cudagraph(fn, rep=max(100, 10 * reps), return_mode="median")
        return do_bench(fn, warmup=25, rep=max(100, 10 * reps), grad_to_none=list(grads), return_mode="median")
    for _ in range(3):  # warm-up: compilation, and the heap, which takes a few calls of a new shape to stop growing
        fn()  # (with one warm-up call and 3 timed ones, page faults of fresh memory put SA's median 30% high)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def peak_memory_mb(fn, device) -> float:
    """MiB allocated at the call's peak above what was allocated before it. CUDA: the caching allocator's statistics;
    CPU (PyTorch keeps no CPU allocator statistics): the running sum of the profiler's allocation records, in time
    order, over every thread."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated(device) - base) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    return max(itertools.accumulate((nbytes for _, nbytes in records), initial=0)) / 2**20


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2: the profiler's C++ side logs two lines per use. The call was timed before, so
    any warning of its own has been shown; an exception still propagates after stderr is back."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def correctness_ok(backend: str, device, dtype, heads: int = 16, head_dim: int = 64, window: int = 256,
                   batch: int = 1) -> tuple[bool, str]:
    """SA and SWA problems against the dense reference, forward and gradients, at the timed batch, heads, head dim
    and window: n=2048, and n=1999 (a ragged last tile) with one pi per sequence. Both share the Triton tuning key
    (n, w, batch x heads, D, GQA group) of a timed n=2048, so the configs picked there for timing are the ones
    checked, and the gate tunes nothing that no timed case uses (a GPU session's minutes go to compiling them;
    GQA and other shapes are the tests' job)."""
    torch.manual_seed(0)
    tol = GATE_TOLERANCE[dtype]
    cases = []
    for n in (2048, 1999):  # 2048 first: the autotuner compiles its configs for the timed lengths' specialisation
        # (n % 16 == 0); 1999 then launches the chosen ones
        # SWA, SA with one pi per sequence, and SA with one pi for the batch (the timed calls' kind)
        perms = [None, torch.stack([torch.randperm(n, dtype=torch.int32) for _ in range(batch)]).to(device),
                 torch.randperm(n, dtype=torch.int32).to(device)]
        # each case twice: the first call may autotune, the second takes the cached-config launch path
        cases += [(n, window, batch, heads, heads, head_dim, perm) for perm in perms + perms]
    for n, w, B, hq, hkv, d, perm in cases:
        q = torch.randn(B, hq, n, d, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(B, hkv, n, d, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(B, hkv, n, d, device=device, dtype=dtype, requires_grad=True)
        left, right = default_band(w, perm is not None)
        ref = naive_banded_attention(q.float(), k.float(), v.float(), left, right, perm)
        g = torch.randn_like(ref)
        ref_grads = torch.autograd.grad(ref, (q, k, v), g)
        try:
            if backend == "flex" and device.type == "cpu":  # forward only there (no flex backward on CPU)
                with torch.no_grad():
                    got, want = [banded_attention(q, k, v, w, perm=perm, backend=backend)], [ref]
            else:
                out = banded_attention(q, k, v, w, perm=perm, backend=backend)
                got, want = [out, *torch.autograd.grad(out, (q, k, v), g.to(dtype))], [ref, *ref_grads]
        except Exception as err:  # noqa: BLE001 - report any failure as "not timed"
            return False, f"{type(err).__name__}: {err}"[:120]
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            if not err <= tol:
                return False, f"{name} relative error {err:.2e} > {tol:.0e}"
    return True, "ok"


# The GPU session's A/B stage times older kernels/ folders with this script; theirs may predate check_perm.
_TRUSTED_PERM = {"check_perm": False} if "check_perm" in inspect.signature(banded_attention).parameters else {}


def variants(backend: str, w: int, n: int, device):
    perm = torch.randperm(n, device=device, dtype=torch.int32)

    def full(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def swa(q, k, v):
        return banded_attention(q, k, v, w, backend=backend)

    def sa(q, k, v):  # timed as the model calls it: its sampler's pi needs no check
        return banded_attention(q, k, v, w, perm=perm, backend=backend, **_TRUSTED_PERM)

    def gated(q, k, v):  # both paths on the same q, k, v, as in the model (gates are an elementwise mix)
        return 0.5 * sa(q, k, v) + 0.5 * swa(q, k, v)

    return {"full": full, "swa": swa, "sa": sa, "gated_sa_swa": gated}


def timed_device(name: str | None) -> torch.device:
    """The device to time on (default: the GPU, else the CPU). A GPU is made the current one, index and all: Triton's
    do_bench records its events and synchronizes on the current GPU, which would otherwise stay cuda:0."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        torch.cuda.set_device(device)
    return device


def run(args, csv_path: Path | None = None) -> list[dict]:
    device = timed_device(args.device)
    dtype = DTYPES[args.dtype]
    backends = args.backends or (["triton", "flex"] if device.type == "cuda" else ["torch"])
    rows = []
    gates = {b: correctness_ok(b, device, dtype, args.heads, args.head_dim, args.window, args.batch) for b in backends}
    for b, (ok, why) in gates.items():
        print(f"correctness gate {b}: {'ok' if ok else 'FAILED - not timed: ' + why}", flush=True)
    if device.type == "cuda":  # clocks idle low (345 MHz seen at the start of a session): spin them up first
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        start = time.perf_counter()
        while time.perf_counter() - start < 2.0:
            a @ a
            torch.cuda.synchronize()
        del a
    inputs = {}
    # backend-major: one backend's compilation (Triton autotuning, torch.compile of flex) is done before the next
    # starts, and a run stopped half-way still holds complete tables for the backends it finished
    for backend in [b for b in backends if gates[b][0]]:
        for n in args.n:
            if n not in inputs:
                shape = (args.batch, args.heads, n, args.head_dim)
                inputs[n] = [torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3)]
                inputs[n].append(torch.randn(shape, device=device, dtype=dtype))
            q, k, v, grad_out = inputs[n]
            for name, fn in variants(backend, args.window, n, device).items():
                if args.variants and name not in args.variants:
                    continue
                if name == "full" and (any(r["n"] == n and r["variant"] == "full" for r in rows)
                                       or (args.full_max_n and n > args.full_max_n)):
                    continue
                with_grad = not (backend == "flex" and device.type == "cpu")

                def fwd():
                    with torch.no_grad():
                        fn(q, k, v)

                def fwd_bwd():  # no .grad accumulation: it would add the same three in-place adds to every variant
                    torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)

                row = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                       "dtype": args.dtype, "n": n, "w": args.window, "batch": args.batch, "heads": args.heads,
                       "head_dim": args.head_dim, "variant": name, "backend": "sdpa" if name == "full" else backend}
                try:
                    row["fwd_ms"] = time_call(fwd, device, args.reps, graphs=args.graphs)
                    row["fwd_bwd_ms"] = (time_call(fwd_bwd, device, args.reps, (q, k, v), args.graphs)
                                         if with_grad else None)
                    row["peak_mb"] = peak_memory_mb(fwd_bwd if with_grad else fwd, device)
                except Exception as err:  # noqa: BLE001 - one failing size must not lose the rest of the table
                    print(f"n={n} {name} {backend}: FAILED {type(err).__name__}: {str(err)[:300]}", flush=True)
                    continue
                rows.append(row)
                print(_fmt_row(row), flush=True)
                if csv_path is not None:  # rewritten after every row: an interrupted run keeps what it measured
                    write_csv(rows, csv_path)
    return rows


def _fmt(x, spec=None):
    if x is None:
        return "-"
    return format(x, spec or (".3f" if abs(x) < 10 else ".1f"))  # GPU latencies are fractions of a millisecond


def _fmt_row(r):
    return (f"n={r['n']:>6} {r['variant']:>13} {r['backend']:>7}: fwd {_fmt(r['fwd_ms'])} ms, "
            f"fwd+bwd {_fmt(r['fwd_bwd_ms'])} ms, peak {_fmt(r['peak_mb'])} MiB")


def ratios_table(rows) -> str:
    """Markdown: per (n, backend) the latencies and the full/SA (SA's speed-up) and SA/SWA (SA's cost) ratios
    (fwd+bwd when measured, else fwd)."""
    by = {(r["n"], r["backend"], r["variant"]): r for r in rows}
    lines = ["| n | backend | metric | full (SDPA) ms | SWA ms | SA ms | gated ms | full / SA | SA / SWA |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in sorted({r["n"] for r in rows}):
        full = by.get((n, "sdpa", "full"))
        for backend in sorted({r["backend"] for r in rows if r["backend"] != "sdpa"}):
            for metric in ("fwd_ms", "fwd_bwd_ms"):
                sa, swa, gated = (by.get((n, backend, v)) for v in ("sa", "swa", "gated_sa_swa"))
                if not sa or sa[metric] is None:
                    continue
                f = full[metric] if full else None
                lines.append(
                    f"| {n} | {backend} | {'fwd' if metric == 'fwd_ms' else 'fwd+bwd'} | {_fmt(f)} | "
                    f"{_fmt(swa[metric] if swa else None)} | {_fmt(sa[metric])} | "
                    f"{_fmt(gated[metric] if gated else None)} | {_times(f / sa[metric] if f else None)} | "
                    f"{_fmt(sa[metric] / swa[metric] if swa else None, '.3f')} |")
    return "\n".join(lines)


def _times(ratio) -> str:
    return _fmt(ratio, ".2f") + ("x" if ratio is not None else "")


def memory_table(rows) -> str:
    """Markdown: peak MiB of one call per (n, backend) and variant (forward + backward where timed, else forward;
    SA / full only where both peaks are of the same call: flex on the CPU has no backward)."""
    peak = {(r["n"], r["variant"], r["backend"]): r["peak_mb"] for r in rows}
    backward = {(r["n"], r["variant"], r["backend"]): r.get("fwd_bwd_ms") is not None for r in rows}
    lines = ["| n | backend | full (SDPA) MiB | SWA MiB | SA MiB | gated MiB | SA / full |",
             "|---|---|---|---|---|---|---|"]
    for n in sorted({r["n"] for r in rows}):
        for backend in sorted({r["backend"] for r in rows if r["backend"] != "sdpa"}):
            full = peak.get((n, "full", "sdpa"))
            swa, sa, gated = (peak.get((n, v, backend)) for v in ("swa", "sa", "gated_sa_swa"))
            if sa is None and swa is None and gated is None:
                continue
            cells = " | ".join(_fmt(x, ".0f") for x in (full, swa, sa, gated))
            same_call = backward.get((n, "sa", backend)) == backward.get((n, "full", "sdpa"))
            ratio = _fmt(sa / full if full and sa is not None and same_call else None, ".2f")
            lines.append(f"| {n} | {backend} | {cells} | {ratio} |")
    return "\n".join(lines)


def band_pairs(n: int, left: int, right: int) -> int:
    """(query, key) slot pairs with the key in the query's band [i - left, i + right] (within the sequence): the
    scores a banded kernel computes. For SA about half of them fail the causal compare in original order; they are
    masked, not skipped, so they count as work, as full attention's diagonal tiles do."""
    i = torch.arange(n, dtype=torch.int64)
    return int(((i + right).clamp(max=n - 1) - (i - left).clamp(min=0) + 1).sum())


def attention_flops(variant: str, n: int, w: int, batch: int, heads: int, head_dim: int, backward: bool) -> float:
    """Matmul FLOPs of one call, counted as FlashAttention's papers do: 4 D per scored pair forward (QK^T, PV), 3.5x
    that forward + backward (five matmuls in the backward; this repo's kernels run seven, recomputing QK^T for dq
    and dk/dv apart). Full attention scores the causal pairs n (n + 1) / 2."""
    pairs = {"full": n * (n + 1) // 2,
             "swa": band_pairs(n, *default_band(w, permuted=False)),
             "sa": band_pairs(n, *default_band(w, permuted=True))}
    pairs["gated_sa_swa"] = pairs["sa"] + pairs["swa"]
    return 4.0 * head_dim * pairs[variant] * batch * heads * (3.5 if backward else 1.0)


def rate_table(rows) -> str:
    """Markdown: TFLOP/s of attention_flops per variant, and SA's rate as a fraction of full attention's (SDPA /
    FlashAttention: how far SA is from the per-FLOP efficiency that full/SA = its FLOP ratio would need). Empty for
    rows without their shape (CSVs written before 2026-12-05: bench.plot_csv takes it as options)."""
    if not rows or any(r.get("batch") in (None, "") for r in rows):
        return ""
    rate = {}
    for r in rows:
        for metric, backward in (("fwd_ms", False), ("fwd_bwd_ms", True)):
            if r.get(metric):
                flops = attention_flops(r["variant"], int(r["n"]), int(r["w"]), int(r["batch"]), int(r["heads"]),
                                        int(r["head_dim"]), backward)
                rate[(r["n"], r["backend"], r["variant"], metric)] = flops / (r[metric] * 1e-3) / 1e12
    lines = ["| n | backend | metric | full (SDPA) TFLOP/s | SWA | SA | gated | SA / full |",
             "|---|---|---|---|---|---|---|---|"]
    for n in sorted({r["n"] for r in rows}):
        for backend in sorted({r["backend"] for r in rows if r["backend"] != "sdpa"}):
            for metric in ("fwd_ms", "fwd_bwd_ms"):
                full, swa, sa, gated = (rate.get((n, b, v, metric)) for b, v in (
                    ("sdpa", "full"), (backend, "swa"), (backend, "sa"), (backend, "gated_sa_swa")))
                if sa is None:
                    continue
                cells = " | ".join(_fmt(x) for x in (full, swa, sa, gated))
                lines.append(f"| {n} | {backend} | {'fwd' if metric == 'fwd_ms' else 'fwd+bwd'} | {cells} | "
                             f"{_fmt(sa / full if full else None, '.2f')} |")
    return "\n".join(lines)


def report(rows) -> str:
    """The markdown the benchmark prints and writes: the latency ratios, the peak memory, then the work rates."""
    text = f"{ratios_table(rows)}\n\nPeak memory of one call:\n\n{memory_table(rows)}"
    rates = rate_table(rows)
    if rates:
        text += f"\n\nAttention matmul work per second (bench.attention.attention_flops):\n\n{rates}"
    return text


def write_csv(rows, path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)


def save(rows, out_dir: Path, tag: str, csv_too: bool = True):
    """attention_<tag>.png (and the CSV unless `csv_too` is False: bench.plot_csv redraws from one it must keep)."""
    if csv_too:
        write_csv(rows, out_dir / f"attention_{tag}.csv")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    titles = {"fwd_ms": ("forward", "ms"), "fwd_bwd_ms": ("forward + backward", "ms"),
              "peak_mb": ("peak memory of one call", "MiB")}
    for ax, (metric, (title, unit)) in zip(axes, titles.items()):
        for key in sorted({(r["variant"], r["backend"]) for r in rows}):
            pts = [(r["n"], r[metric]) for r in rows if (r["variant"], r["backend"]) == key and r[metric] is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{key[0]} ({key[1]})")
        ax.set(xscale="log", yscale="log", xlabel="sequence length n", ylabel=unit, title=f"{title} [{tag}]")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    atomic_write(out_dir / f"attention_{tag}.png", lambda f: fig.savefig(f, format="png", dpi=120))


DEFAULT_N = [2048, 4096, 8192, 16384, 32768]
DEFAULT_SHAPE = {"batch": 1, "heads": 16, "head_dim": 64, "window": 256}
SHAPE_LETTERS = {"batch": "b", "heads": "h", "head_dim": "d", "window": "w"}


def shape_suffix(args, default_full_max_n: int | None = None) -> str:
    """The file name's part for settings off the default table (B=1, H=16, D=64, w=256; the default n, every
    variant and backend, full attention timed up to the device's default --full-max-n), so that a run at another
    shape or subset does not overwrite the default table's files."""
    parts = [f"{SHAPE_LETTERS[k]}{getattr(args, k)}" for k, v in DEFAULT_SHAPE.items() if getattr(args, k) != v]
    if args.n != DEFAULT_N:
        parts.append("n" + "-".join(map(str, args.n)))
    for subset in (args.variants, args.backends):
        if subset:
            parts.append("-".join(subset))

    def untimed(limit):  # the lengths at which full attention is skipped (0 or None: none)
        return {n for n in args.n if limit and n > limit}

    if (not args.variants or "full" in args.variants) and untimed(args.full_max_n) != untimed(default_full_max_n):
        parts.append(f"fullmax{args.full_max_n or 0}")
    return "".join(f"_{p}" for p in parts)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=None)
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None)
    p.add_argument("--backends", nargs="+", default=None)
    p.add_argument("--variants", nargs="+", choices=["full", "swa", "sa", "gated_sa_swa"], default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--reps", type=int, default=5, help="timed calls per case (CPU: the median of these)")
    p.add_argument("--full-max-n", type=int, default=None,
                   help="skip full attention above this n (CPU default 16384: at 32768 it alone takes ~8 min)")
    p.add_argument("--graphs", action="store_true",
                   help="CUDA only: time calls replayed from a CUDA graph (GPU time, no Python/launch overhead)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    keep_freed_memory()  # as train.py does; SA_CPU_MALLOC=0 measures glibc's default behaviour
    cuda = torch.cuda.is_available() and args.device != "cpu"
    args.n = args.n or list(DEFAULT_N)
    default_full_max_n = None if cuda else 16384
    if args.full_max_n is None:
        args.full_max_n = default_full_max_n
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    if args.graphs and not cuda:
        p.error("--graphs needs a CUDA device")
    tag = f"{'gpu' if cuda else 'cpu'}_{args.dtype}{'_graphs' if args.graphs else ''}" \
        f"{shape_suffix(args, default_full_max_n)}"
    rows = run(args, args.out / f"attention_{tag}.csv")
    if not rows:
        sys.exit("nothing was timed: no backend passed its correctness gate, or every case failed (see above)")
    save(rows, args.out, tag)
    table = report(rows)
    print(f"\n{table}\n\nthreads={torch.get_num_threads()} torch={torch.__version__} "
          f"csv/png/md: {args.out}/attention_{tag}.*")
    atomic_write_text(args.out / f"attention_{tag}.md", table + "\n")
    print_chosen_configs()


def print_chosen_configs():
    """The block sizes the Triton autotuner picked per kernel and tuning key (to explain the timings)."""
    module = sys.modules.get("kernels.triton_band")
    for (kernel, *tune, flags, dtype, _), cfg in sorted(getattr(module, "_chosen", {}).items(), key=str):
        name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
        perm = dict(flags).get("HAS_PERM")
        keys = " ".join(f"{k}={v}" for k, v in zip(("n_key", "band_key", "bh_key"), tune))  # older kernels: no bh_key
        print(f"config {name} {keys} perm={perm} {dtype}: "
              + " ".join(f"{k}={v}" for k, v in cfg.items() if k.isupper() or k.startswith("num_")))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
