"""Host cost of the Triton wrapper: the Python time of one banded_attention call with the kernel launches stubbed out.

    python -m bench.host_overhead [--n 2048] [--calls 2000]

At batch 1 and short sequences a GPU call is host-bound (BENCHMARKS.md: SA forward at n=2048 took 0.054 ms on an
H200 for a few microseconds of kernel work), so this is the part of a call that the wrapper's code decides. It runs
on any machine (TRITON_INTERPRET=1 only lets the dispatcher pick the Triton backend on CPU; nothing is launched) and
prints microseconds per call: forward without grad (evaluation), forward with grad (training), forward + backward.
Triton's own launch cost on a GPU comes on top; bench/profile_gpu.py measures the whole call there.
"""

from __future__ import annotations

import argparse
import os
import time

import torch


def per_call_us(fn, calls: int) -> float:
    for _ in range(50):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    os.environ["TRITON_INTERPRET"] = "1"
    import kernels.triton_band as tb
    from kernels import banded_attention

    tb._launch = lambda *a, **k: None  # measure the wrapper, not the kernels
    q, k, v = (torch.randn(1, 16, args.n, 64, requires_grad=True) for _ in range(3))
    perm = torch.randperm(args.n, dtype=torch.int32)
    grad_out = torch.randn_like(q)

    def sa():  # as the model calls it (its sampler's pi needs no check)
        return banded_attention(q, k, v, 256, perm=perm, backend="triton", check_perm=False)

    def fwd_no_grad():
        with torch.no_grad():
            sa()

    def fwd():
        sa()

    def fwd_bwd():
        torch.autograd.grad(sa(), (q, k, v), grad_out)

    for fn in (fwd_no_grad, fwd, fwd_bwd):
        print(f"{fn.__name__:>12}: {per_call_us(fn, args.calls):7.1f} us per call (host only, SA, n={args.n})")


if __name__ == "__main__":
    main()
