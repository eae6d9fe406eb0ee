"""The optimizer step of a model preset: torch's default AdamW (foreach on CUDA, a per-tensor loop on the CPU) against
the fused AdamW that training uses, side by side in one run, alternating, over two parameter groups (matrices with
weight decay, vectors without; training also leaves the embedding undecayed, which changes no kernel's work).

    python -m bench.optimizer                 # the small preset on this machine's device
    python -m bench.optimizer --model 360m

Also checks that both end with the same weights (the fused kernel only reorders the arithmetic).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.model import SHAPES, model_config
from kernels.cpu_malloc import keep_freed_memory
from model.config import AttentionConfig
from model.decoder import Decoder
from model.lightning_module import adamw


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=SHAPES, default="small")
    p.add_argument("--steps", type=int, default=20, help="timed steps per optimizer and round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    keep_freed_memory()  # as train.py does
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    models, optimizers = {}, {}
    for name in ("default", "fused"):
        torch.manual_seed(0)
        model = Decoder(model_config(args.model), AttentionConfig()).to(device)
        gen = torch.Generator(device=device).manual_seed(1)
        for param in model.parameters():  # the same fixed gradients for both
            param.grad = torch.randn(param.shape, generator=gen, device=device) * 1e-2
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        models[name] = model
        optimizers[name] = adamw(groups, lr=1e-3) if name == "fused" else torch.optim.AdamW(groups, lr=1e-3)
    times = {name: [] for name in optimizers}
    for _ in range(args.rounds):
        for name, opt in optimizers.items():
            opt.step()  # warm-up
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                opt.step()
            sync()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    assert optimizers["fused"].param_groups[0]["fused"], "the fused AdamW was not fused on this device"
    diff = max((a - b).abs().max().item() for a, b in zip(models["default"].parameters(),
                                                           models["fused"].parameters()))
    steps = args.rounds * (args.steps + 1)
    if not diff <= 1e-5:  # no table of an optimizer that computes something else
        raise SystemExit(f"the fused AdamW's weights differ from the default's by {diff:.2e} after {steps} steps")
    default, fused = statistics.median(times["default"]), statistics.median(times["fused"])
    n_params = sum(p.numel() for p in models["fused"].parameters())
    print(f"{args.model} ({n_params / 1e6:.1f}M parameters) on {device}, median of {args.rounds} rounds of "
          f"{args.steps} steps:")
    print("| AdamW | step ms |\n|---|---|")
    print(f"| torch default | {default:.2f} |\n| fused (training) | {fused:.2f} ({default / fused:.2f}x faster) |")
    print(f"largest weight difference after {steps} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
