"""banded_attention: the one attention primitive behind SWA, SA and gated SA+SWA (docs: method.md).

Tokens are stored in some order (original for SWA, permuted by pi for SA). The query in storage slot i attends to
the key in slot j iff  i - left <= j <= i + right  and  pos[j] <= pos[i]  (pos = original position of a slot).
Inputs and output are always in ORIGINAL order; backends move rows through pi themselves.

Backends (``backend=``):
  auto   - triton on CUDA (torch for what the Triton kernel does not take: fp64, head dim > 256), torch on CPU
  torch  - O(n*w) blocked PyTorch (fused SDPA per query block); CPU default, any device
  triton - fused Triton forward/backward loading rows through pi (CUDA, or CPU under TRITON_INTERPRET=1)
  flex   - torch FlexAttention with a band block mask and a pi mask_mod (forward only on CPU)
  naive  - dense O(n^2) masked reference (tests only)
"""

from __future__ import annotations

import importlib.util
import operator
import os

import torch

from kernels.order import check_perm as check_perm_rows
from kernels.order import assert_permutation_async, check_qkv

BACKENDS = ("auto", "torch", "triton", "flex", "naive")


def default_band(window: int, permuted: bool) -> tuple[int, int]:
    """(left, right) band for `window` slots including self: causal (w-1, 0) in original order, symmetric under pi."""
    if isinstance(window, bool):
        raise TypeError(f"window must be an integer number of slots, got {window!r}")
    try:
        window = operator.index(window)
    except TypeError:
        raise TypeError(f"window must be an integer number of slots, got {window!r}") from None
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if not permuted:
        return window - 1, 0
    return (window - 1) // 2, window // 2


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_HEAD_DIM = 256


def resolve_backend(backend: str, device: torch.device, q: torch.Tensor | None = None) -> str:
    """The backend to run: `auto` picks one that can take `q`; an explicit one that cannot run here is an error."""
    if backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        fits = q is None or (q.dtype in TRITON_DTYPES and q.shape[-1] <= TRITON_MAX_HEAD_DIM)
        return "triton" if device.type == "cuda" and fits and _triton_available() else "torch"
    if backend == "triton" and not (device.type == "cuda" or triton_interpreting()):
        raise RuntimeError(
            "attention.backend=triton needs a CUDA device (or TRITON_INTERPRET=1 on CPU for testing); "
            "use backend=auto or backend=torch on this machine"
        )
    if backend == "triton" and not _triton_available():
        raise RuntimeError("attention.backend=triton but the triton package is not installed (pip install triton)")
    return backend


# Looked up once without importing triton (the core imports fast; a compiled graph reads a constant).
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def _triton_available() -> bool:
    return _HAS_TRITON


def _under_autocast(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Under autocast q, k, v go to its dtype first, as SDPA's do. Left to the backends, the torch one ran its dense
    path (SDPA, autocast) in bf16 and its blocked path (raw CPU kernels, no autocast) in fp32 for the same fp32
    inputs."""
    device = q.device.type
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):  # meta has no autocast
        return q, k, v
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (q, k, v))


def banded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int,
    perm: torch.Tensor | None = None,
    band: tuple[int, int] | None = None,
    scale: float | None = None,
    backend: str = "auto",
    check_perm: bool = True,
) -> torch.Tensor:
    """Banded attention. q [B,Hq,n,D], k/v [B,Hkv,n,D] in original order; perm None (SWA) or [n] / [B,n] (SA).

    ``check_perm``: verify that every row of perm is a permutation of 0..n-1 (a wrong one makes the Triton kernel
    read and write out of bounds). On a GPU that waits for the device; the model's own pi skips it.
    Under autocast q, k, v run in its dtype, as SDPA's do.
    """
    q, k, v = _under_autocast(q, k, v)
    check_qkv(q, k, v)
    if perm is not None:
        compiling = torch.compiler.is_compiling()
        check_perm_rows(perm, q.shape[2], q.shape[0], values=check_perm and not compiling)
        if check_perm and compiling:
            assert_permutation_async(perm, q.shape[2])
    left, right = band if band is not None else default_band(window, perm is not None)
    left, right = operator.index(left), operator.index(right)
    if left < 0 or right < 0:
        raise ValueError(f"band must be non-negative (every query sees itself), got left={left}, right={right}")
    name = resolve_backend(backend, q.device, q)
    if name == "torch":
        from kernels.torch_band import torch_banded_attention

        return torch_banded_attention(q, k, v, left, right, perm, scale)
    if name == "naive":
        from kernels.naive import naive_banded_attention

        return naive_banded_attention(q, k, v, left, right, perm, scale)
    if name == "triton":
        from kernels.triton_band import triton_banded_attention

        return triton_banded_attention(q, k, v, left, right, perm, scale)
    from kernels.flex import flex_banded_attention

    return flex_banded_attention(q, k, v, left, right, perm, scale)
