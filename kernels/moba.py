"""MoBA (Mixture of Block Attention; Lu et al., arXiv 2502.13189): the block-sparse baseline of the paper's section 6.

Keys are cut into blocks of `block_size` consecutive positions (block c = positions [c*bs, (c+1)*bs)). The query at
position t, in block c_t = t // bs, scores every block that starts at or before it by  q_t . mean(K_c)  (fp32), and
attends to the keys of its `top_k` best blocks, where

  * the query's own block c_t is always selected (it counts towards top_k) and is causal inside (keys <= t),
  * blocks after c_t are never selected (causal),
  * a query with fewer than top_k candidate blocks attends to all of them.

This is the selection rule of MoonshotAI/MoBA's moba_naive.py (mean-pooled keys as the gate, current chunk forced
on, future chunks off, top-k). The paper's training-free comparison uses top_k = 2 and block_size = w_eff / 2, so a
query attends to about w_eff keys. With top_k >= the number of blocks MoBA is exactly full causal attention.

Layout like kernels.banded_attention: q [B, Hq, n, D], k / v [B, Hkv, n, D] (GQA: Hq % Hkv == 0; every query head
selects its own blocks, using the keys of its KV head). Plain PyTorch, differentiable, any device; the selected blocks
are gathered per query in query chunks sized to a memory budget (O(n * top_k * bs) work, no n x n scores).
`moba_attention_reference` is the dense O(n^2) masked version, for tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.order import check_qkv

# Elements of the gathered K (and V) per query chunk: 2^27 = 256 MiB in bf16.
_GATHER_BUDGET = 1 << 27


def _check(q, k, v, block_size: int, top_k: int):
    check_qkv(q, k, v)
    if block_size < 1 or top_k < 1:
        raise ValueError(f"block_size and top_k must be >= 1, got block_size={block_size}, top_k={top_k}")


def block_means(k: torch.Tensor, block_size: int) -> torch.Tensor:
    """k [B, H, n, D] -> mean key of every block [B, H, n_blocks, D] (a last, partial block: mean of its keys), fp32."""
    B, H, n, D = k.shape
    n_blocks = math.ceil(n / block_size)
    sums = F.pad(k.float(), (0, 0, 0, n_blocks * block_size - n)).view(B, H, n_blocks, block_size, D).sum(3)
    counts = torch.full((n_blocks,), float(block_size), device=k.device)
    counts[-1] = n - (n_blocks - 1) * block_size
    return sums / counts[:, None]


def select_blocks(q: torch.Tensor, k: torch.Tensor, block_size: int, top_k: int):
    """The MoBA gate: (idx, valid), both [B, Hq, n, k'] with k' = min(top_k, n_blocks).

    idx[..., t, j] is a selected block of the query at position t; valid is False where the query has fewer than
    top_k candidate blocks (those entries point at a future block and must be ignored).
    """
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    means = block_means(k, block_size)  # [B, Hkv, nb, D]
    n_blocks = means.shape[2]
    scores = torch.matmul(q.float().reshape(B, Hkv, g * n, D), means.transpose(-1, -2)).view(B, Hq, n, n_blocks)
    own = torch.arange(n, device=q.device) // block_size  # the block of each query
    block = torch.arange(n_blocks, device=q.device)
    scores = scores.masked_fill(block[None, :] > own[:, None], float("-inf"))  # future blocks: never
    scores = scores.masked_fill(block[None, :] == own[:, None], float("inf"))  # own block: always
    top, idx = scores.topk(min(top_k, n_blocks), dim=-1)
    return idx, top > float("-inf")


def moba_attention(q, k, v, block_size: int, top_k: int = 2, scale: float | None = None) -> torch.Tensor:
    """MoBA attention, output [B, Hq, n, D] in q's dtype. See the module docstring for the rule."""
    _check(q, k, v, block_size, top_k)
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    g = Hq // Hkv
    idx, valid = select_blocks(q, k, block_size, top_k)  # [B, Hq, n, kk]
    kk = idx.shape[-1]
    n_blocks = math.ceil(n / block_size)
    pad = n_blocks * block_size - n
    kb = F.pad(k, (0, 0, 0, pad)).view(B, Hkv, n_blocks, block_size, D)
    vb = F.pad(v, (0, 0, 0, pad)).view(B, Hkv, n_blocks, block_size, D)
    # Group query heads by their KV head: [B, Hkv, g, n, ...]
    qg = q.reshape(B, Hkv, g, n, D)
    idx, valid = idx.view(B, Hkv, g, n, kk), valid.view(B, Hkv, g, n, kk)
    bi = torch.arange(B, device=q.device).view(B, 1, 1, 1, 1)
    hi = torch.arange(Hkv, device=q.device).view(1, Hkv, 1, 1, 1)
    offs = torch.arange(block_size, device=q.device)
    chunk = max(1, min(n, _GATHER_BUDGET // max(1, B * Hq * kk * block_size * D)))
    outs = []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        ic = idx[:, :, :, s:e]  # [B, Hkv, g, C, kk]
        keys = kb[bi, hi, ic].flatten(-3, -2)  # [B, Hkv, g, C, kk * bs, D]
        vals = vb[bi, hi, ic].flatten(-3, -2)
        pos = (ic[..., None] * block_size + offs).flatten(-2)  # original position of every gathered key
        t = torch.arange(s, e, device=q.device)[:, None]
        mask = (valid[:, :, :, s:e, :, None].expand(-1, -1, -1, -1, -1, block_size).flatten(-2)) & (pos <= t)
        C = e - s
        out = F.scaled_dot_product_attention(
            qg[:, :, :, s:e].reshape(B * Hq, C, 1, D), keys.reshape(B * Hq, C, kk * block_size, D),
            vals.reshape(B * Hq, C, kk * block_size, D), attn_mask=mask.reshape(B * Hq, C, 1, kk * block_size),
            scale=scale)
        outs.append(out.view(B, Hq, C, D))
    return torch.cat(outs, dim=2)


def moba_mask(q, k, block_size: int, top_k: int = 2) -> torch.Tensor:
    """Dense boolean mask [B, Hq, n, n] (query t, key j) of MoBA, computed the straightforward O(n^2) way."""
    _check(q, k, k, block_size, top_k)
    B, Hq, n, D = q.shape
    kr = k.repeat_interleave(Hq // k.shape[1], dim=1)
    means = block_means(kr, block_size)  # [B, Hq, nb, D]
    n_blocks = means.shape[2]
    gate = torch.matmul(q.float(), means.transpose(-1, -2))  # [B, Hq, n, nb]
    t = torch.arange(n, device=q.device)
    own, block = t // block_size, torch.arange(n_blocks, device=q.device)
    gate = gate.masked_fill(block[None, :] > own[:, None], float("-inf"))
    gate = gate.masked_fill(block[None, :] == own[:, None], float("inf"))
    top, idx = gate.topk(min(top_k, n_blocks), dim=-1)
    chosen = torch.zeros_like(gate, dtype=torch.bool).scatter_(-1, idx, top > float("-inf"))
    return chosen[..., own] & (t[None, :] <= t[:, None])  # key j is in a chosen block of query t, and j <= t


def moba_attention_reference(q, k, v, block_size: int, top_k: int = 2, scale: float | None = None) -> torch.Tensor:
    """Dense masked reference of moba_attention (O(n^2), fp32 softmax): tests only."""
    B, Hq, n, D = q.shape
    mask = moba_mask(q, k, block_size, top_k)
    g = Hq // k.shape[1]
    kr, vr = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    scores = torch.matmul(q.float(), kr.float().transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.matmul(probs, vr.float()).to(q.dtype)
