"""Whole-model training throughput per attention variant: forward + backward of the decoder, side by side in one run.

    python -m bench.model                               # CPU: the small default model, n=256
    python -m bench.model --model 360m --seq-len 2048 --batch 8   # GPU: the paper's shape (bf16 autocast)
    python -m bench.model --compile                     # also each variant with compiled blocks (trainer.compile)
    python -m bench.model --compiled-only               # compiled blocks only
    python -m bench.model --recompute                   # also each variant with trainer.activation_checkpointing
    python -m bench.model --loss-chunk 2048             # also each variant with trainer.loss_chunk_tokens=2048
                                                        # (with --recompute: also both at once)

Times one training step without the optimizer (the part attention changes), median over steps after warm-up, and
prints tokens/s, the step time relative to full attention, and the activation memory a step keeps for its backward
(the bytes autograd saves, counted in one more step). Writes bench/results/model_<device>_<model>_n<n>_b<batch>_w<w>
[_<variants>][_<backend>][_<options>].csv. The kernels' correctness is gated by bench.attention and the tests, not
here (a gate at the timed shape would autotune the Triton kernels for shapes nothing else runs, out of a GPU
session's minutes).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

from kernels.cpu_malloc import keep_freed_memory
from model.config import AttentionConfig, ModelConfig
from model.decoder import Decoder
from model.loss import head_cross_entropy

MODEL_CONFIGS = Path(__file__).resolve().parents[1] / "conf" / "model"
SHAPES = ("small", "360m")  # conf/model/<name>.yaml without a Hydra defaults list, so plain YAML reads them


def model_config(name: str) -> ModelConfig:
    """The model preset as training uses it, read without Hydra (GPU machines may not have it installed)."""
    return ModelConfig(**yaml.safe_load((MODEL_CONFIGS / f"{name}.yaml").read_text()))


def loss_of(model, tokens, autocast: bool, chunk: int = 0) -> torch.Tensor:
    """The training loss of one batch (forward only), as train.py computes it under bf16 autocast on CUDA."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = model.hidden_states(tokens[:, :-1])
        return head_cross_entropy(hidden, model.lm_head.weight, tokens[:, 1:], chunk) / tokens[:, 1:].numel()


def step_ms(model, tokens, device, steps: int, autocast: bool, chunk: int) -> float:
    def step():
        loss_of(model, tokens, autocast, chunk).backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up: compilation, autotuning, allocator
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


_VIEWS = ("TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0", "UnsafeViewBackward0",
          "ExpandBackward0", "SliceBackward0", "AsStridedBackward0")


def _autocast_weight(t, params: set[int]) -> bool:
    """Autocast's bf16 copy of a parameter, or a view of one (matmuls save the transposed weight): weights, not
    activations (~0.7 GB of the 360M model's), and activation checkpointing does not save them either. `params`:
    the parameters' storage addresses."""
    fn = t.grad_fn
    while fn is not None and type(fn).__name__ in _VIEWS:
        fn = fn.next_functions[0][0]
    if fn is None or type(fn).__name__ != "ToCopyBackward0":
        return False
    leaves = [getattr(nxt, "variable", None) for nxt, _ in fn.next_functions if nxt is not None]
    return any(leaf is not None and leaf.untyped_storage().data_ptr() in params for leaf in leaves)


def saved_mb(model, tokens, autocast: bool, chunk: int) -> float:
    """MiB that autograd keeps for the backward in one training step (what activation checkpointing cuts): each
    storage once (log_softmax and nll_loss save the same log-probabilities), the model's parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and not _autocast_weight(t, params):
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of(model, tokens, autocast, chunk)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values()) / 2**20


DEFAULT_VARIANTS = ["full", "swa", "sa", "gated_sa_swa"]


def settings_suffix(args) -> str:
    """The CSV name's batch and window, and what else a run times (variants, backend, options): a --batch 8 run
    overwrote the default run's file."""
    parts = [f"b{args.batch}", f"w{args.window}"]
    if args.variants != DEFAULT_VARIANTS:
        parts.append("-".join(args.variants))
    if args.backend != "auto":
        parts.append(args.backend)
    if args.compiled_only or args.compile:
        parts.append("compiled" if args.compiled_only else "compile")
    if args.recompute:
        parts.append("recompute")
    if args.loss_chunk:
        parts.append(f"chunk{args.loss_chunk}")
    return "".join(f"_{p}" for p in parts)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=SHAPES, default="small")
    p.add_argument("--seq-len", type=int, default=None, help="default: the model's context")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--window", type=int, default=None,
                   help="default: n/8, the paper's ratio (256 at n=2048; 32 for the small model's n=256, its "
                        "training default)")
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    p.add_argument("--backend", default="auto")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--compile", action="store_true", help="time every variant eager and with compiled blocks")
    p.add_argument("--compiled-only", action="store_true", help="time every variant with compiled blocks only")
    p.add_argument("--recompute", action="store_true", help="also every variant with activation checkpointing")
    p.add_argument("--loss-chunk", type=int, default=0, metavar="TOKENS",
                   help="also every variant with the loss over chunks of this many tokens (trainer.loss_chunk_tokens)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = p.parse_args()
    keep_freed_memory()  # as train.py does

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = model_config(args.model)
    n = args.seq_len or cfg.max_seq_len
    cfg.max_seq_len = max(cfg.max_seq_len, n)
    args.window = args.window or max(1, n // 8)
    if args.window >= n:
        print(f"note: --window {args.window} >= n={n}: every variant attends to the whole sequence, so this times the "
              "variants' overheads, not what the band saves (give --window < n, e.g. --window 32)", file=sys.stderr)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, n + 1), device=device)
    autocast = device.type == "cuda"
    rows = []
    compiled_options = (True,) if args.compiled_only else (False, True) if args.compile else (False,)
    for kind in args.variants:
        settings = [(c, False, 0) for c in compiled_options] + ([(False, True, 0)] if args.recompute else []) \
            + ([(False, False, args.loss_chunk)] if args.loss_chunk else []) \
            + ([(False, True, args.loss_chunk)] if args.loss_chunk and args.recompute else [])
        for compiled, recompute, chunk in settings:
            torch.manual_seed(0)
            model = Decoder(cfg, AttentionConfig(kind=kind, window=args.window, backend=args.backend))
            model = model.to(device).train()
            model.checkpoint_activations = recompute
            if compiled:
                model.compile_blocks()  # as trainer.compile=true; the warm-up steps compile
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            ms = step_ms(model, tokens, device, args.steps, autocast, chunk)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            rows.append({"device": torch.cuda.get_device_name() if autocast else "cpu", "model": args.model,
                         "params_m": round(model.num_parameters() / 1e6, 1), "batch": args.batch, "n": n,
                         "w": args.window, "variant": kind, "backend": args.backend, "compiled": compiled,
                         "recompute": recompute, "loss_chunk": chunk, "step_ms": round(ms, 2),
                         "tokens_per_s": round(args.batch * n / ms * 1e3),
                         "saved_mb": round(saved_mb(model, tokens, autocast, chunk), 1),
                         "peak_gib": None if peak is None else round(peak, 2)})
            print(rows[-1], flush=True)
            del model
    base = next((r["step_ms"] for r in rows if r["variant"] == "full" and not r["compiled"] and not r["recompute"]
                 and not r["loss_chunk"]), None)
    peak = rows[0]["peak_gib"] is not None
    print("\n| variant | step ms (fwd+bwd) | tokens/s | vs full (eager) | saved for backward (MiB) |"
          + (" peak GiB |" if peak else "") + "\n|---|---|---|---|---|" + ("---|" if peak else ""))
    for r in rows:
        rel = f"{r['step_ms'] / base:.3f}" if base else "-"
        name = r["variant"] + (" (compiled)" if r["compiled"] else "") + (" (recompute)" if r["recompute"] else "") \
            + (f" (loss chunks of {r['loss_chunk']})" if r["loss_chunk"] else "")
        print(f"| {name} | {r['step_ms']:.1f} | {r['tokens_per_s']:,} | {rel} | {r['saved_mb']:,.0f} |"
              + (f" {r['peak_gib']:.2f} |" if peak else ""))
    path = args.out / f"model_{'gpu' if autocast else 'cpu'}_{args.model}_n{n}{settings_suffix(args)}.csv"
    from bench.attention import write_csv

    write_csv(rows, path)
    print(f"\n{args.model}: B={args.batch} n={n} w={args.window} device={rows[0]['device']} csv: {path}")


if __name__ == "__main__":
    main()
