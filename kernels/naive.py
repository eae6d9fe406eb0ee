"""Dense masked reference for banded attention over a stored order (tests and benchmarks' oracle only).

O(n^2) time and memory on purpose: it is the literal transcription of the mask in docs/method.md, so every fast
backend is checked against it.
"""

from __future__ import annotations

import math

import torch

from kernels.order import gather_rows, scatter_rows, storage_positions


def band_mask(pos: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """Boolean mask [..., n, n] (query slot i, key slot j): j in [i-left, i+right] and pos[j] <= pos[i]."""
    n = pos.shape[-1]
    slot = torch.arange(n, device=pos.device)
    offset = slot[None, :] - slot[:, None]  # j - i
    in_band = (offset >= -left) & (offset <= right)
    causal = pos[..., None, :] <= pos[..., :, None]
    return in_band & causal


def naive_banded_attention(q, k, v, left: int, right: int, perm=None, scale=None):
    """q [B,Hq,n,D], k/v [B,Hkv,n,D] in original order; perm None, [n] or [B,n]. Output in original order."""
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if Hq != Hkv:
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    if perm is not None:
        q, k, v = (gather_rows(t, perm) for t in (q, k, v))
    pos = storage_positions(perm, n, q.device)
    mask = band_mask(pos, left, right)
    if mask.dim() == 3:  # per-sequence permutation: [B, n, n] -> broadcast over heads
        mask = mask[:, None]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
    return out if perm is None else scatter_rows(out, perm)
