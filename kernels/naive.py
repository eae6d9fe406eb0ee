"""Dense masked reference for banded attention over a stored order (tests and benchmarks' oracle only).

O(n^2) time and memory on purpose: it is the literal transcription of the mask in docs/method.md, so every fast
backend is checked against it. It works in original order and shares no index code with the backends (neither
kernels.order's gathers nor band_mask below, the storage-order mask of the torch backend's dense path): a bug there
cannot hide in the reference too.
"""

from __future__ import annotations

import contextlib
import math

import torch


def band_mask(pos: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """Boolean mask [..., n, n] (query slot i, key slot j): j in [i-left, i+right] and pos[j] <= pos[i]."""
    n = pos.shape[-1]
    slot = torch.arange(n, device=pos.device)
    offset = slot[None, :] - slot[:, None]  # j - i
    in_band = (offset >= -left) & (offset <= right)
    causal = pos[..., None, :] <= pos[..., :, None]
    return in_band & causal


def naive_banded_attention(q, k, v, left: int, right: int, perm=None, scale=None):
    """q [B,Hq,n,D], k/v [B,Hkv,n,D] in original order; perm None, [n] or [B,n]. Output in original order.

    The token at original position a is stored in slot s[a] (s = pi^-1: the argsort of a permutation is its
    inverse). Query a sees key b iff s[b] - s[a] lies in [-left, right] (the band in storage order) and b <= a (the
    original order)."""
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    position = torch.arange(n, device=q.device)
    slot = position if perm is None else torch.argsort(perm.to(q.device).long(), dim=-1)
    slot = slot.expand(B, n)
    apart = slot[:, None, :] - slot[:, :, None]  # [B, query a, key b]: s[b] - s[a]
    mask = (apart >= -left) & (apart <= right) & (position[None, :] <= position[:, None])
    exact = torch.promote_types(q.dtype, torch.float32)  # fp32 for half inputs; fp64 stays fp64, to check fp64
    exact_here = torch.autocast(q.device.type, enabled=False) if torch.amp.is_autocast_available(q.device.type) \
        else contextlib.nullcontext()
    with exact_here:  # an oracle: exact under autocast too
        scores = torch.matmul(q.to(exact), k.to(exact).transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), v.to(exact)).to(q.dtype)
