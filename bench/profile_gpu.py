"""Where the time of one banded-attention call goes on a GPU: kernel time vs host (Python/launch) time.

    python -m bench.profile_gpu [--n 2048 32768] [--backend triton]
    python -m bench.profile_gpu --device cpu --backend torch --n 256     # the script itself, on any machine

For each n: GPU time of each kernel (torch.profiler), host time of one call with no synchronisation (what the
CPU spends issuing it), and the top Python functions by cumulative host time (cProfile). On the CPU (a check that
the script runs before a GPU session spends its minutes on it) the "kernels" are the CPU ops.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from kernels import banded_attention


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, nargs="+", default=[2048, 32768])
    p.add_argument("--backend", default="triton")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32

    def synchronize():
        if cuda:
            torch.cuda.synchronize(dev)

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    for n in args.n:
        q, k, v = (torch.randn(1, 16, n, 64, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
        perm = torch.randperm(n, device=dev, dtype=torch.int32)
        do = torch.randn_like(q)

        def step():
            out = banded_attention(q, k, v, args.window, perm=perm, backend=args.backend, check_perm=False)
            torch.autograd.grad(out, (q, k, v), do)  # no .grad accumulation: three more kernels per call

        def fwd():
            with torch.no_grad():
                banded_attention(q, k, v, args.window, perm=perm, backend=args.backend, check_perm=False)

        for fn in (step, fwd):
            for _ in range(3):
                fn()
            synchronize()
            start = time.perf_counter()
            for _ in range(20):
                fn()
            host = (time.perf_counter() - start) / 20 * 1e6
            synchronize()
            total = (time.perf_counter() - start) / 20 * 1e6
            print(f"n={n} {fn.__name__}: host issue time {host:.0f} us/call, with the GPU drained {total:.0f} us/call")
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(5):
                step()
            synchronize()
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                                        row_limit=12, max_name_column_width=60))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            step()
        synchronize()
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(22)


if __name__ == "__main__":
    main()
