"""O(n*w) banded attention in plain PyTorch: one fused SDPA call over all query blocks at once.

Slots are cut into query blocks of `block` rows; block b sees the key slots [b*block - left, b*block + block - 1 + right]
(its span). K/V spans are materialised with `unfold` (about (block+left+right)/block copies of K and V, never scores),
and SDPA's fused CPU/GPU kernel does softmax(QK^T)V per block with a boolean mask for the band and the original-order
causality. Scores never leave the fused kernel, which is what makes this fast on CPU (docs/performance.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.order import gather_rows, scatter_rows, storage_positions


def _block_size(n: int, left: int, right: int) -> int:
    # Work per query ~ block + left + right, calls ~ n / block: a block near the band width balances the two.
    span = left + right + 1
    return max(16, min(256, 1 << max(4, math.ceil(math.log2(max(span, 1)))), 1 << math.ceil(math.log2(n))))


def _spans(x: torch.Tensor, left: int, right: int, block: int, n_blocks: int) -> torch.Tensor:
    """x [B,H,n,D] -> [B*n_blocks, H, span, D]: the key/value slots each query block can reach."""
    B, H, n, D = x.shape
    span = block + left + right
    pad_right = n_blocks * block + right - n
    x = F.pad(x, (0, 0, left, pad_right))
    x = x.unfold(2, span, block)  # [B, H, n_blocks, D, span]
    return x.permute(0, 2, 1, 4, 3).reshape(B * n_blocks, H, span, D)


def _block_masks(pos: torch.Tensor, n: int, left: int, right: int, block: int, n_blocks: int) -> torch.Tensor:
    """Boolean [B' * n_blocks, 1, block, span] mask (B' = 1 for a shared order, B for per-sequence orders)."""
    pos = pos if pos.dim() == 2 else pos[None]
    Bp, padded, span = pos.shape[0], n_blocks * block, block + left + right
    never = 2 * (padded + span)  # padded key slots: later than every query, so never visible
    q_pos = F.pad(pos, (0, padded - n), value=n).view(Bp, n_blocks, block)
    k_pos = F.pad(pos, (left, padded - n + right), value=never).unfold(1, span, block)  # [Bp, n_blocks, span]
    rows = torch.arange(block, device=pos.device)[:, None]
    cols = torch.arange(span, device=pos.device)[None, :]
    in_band = (cols >= rows) & (cols <= rows + left + right)
    mask = in_band & (k_pos[:, :, None, :] <= q_pos[:, :, :, None])
    # A padded query (discarded later) must not have an empty softmax row: let it see its own slot.
    mask |= (cols == rows + left) & (q_pos[:, :, :, None] >= n)
    return mask.reshape(Bp * n_blocks, 1, block, span)


def torch_banded_attention(q, k, v, left: int, right: int, perm=None, scale=None, block: int | None = None):
    B, Hq, n, D = q.shape
    Hkv = k.shape[1]
    left, right = min(left, n - 1), min(right, n - 1)  # a band wider than the sequence is the whole sequence
    if Hq != Hkv:  # SDPA's CPU flash path has no GQA: expand here (the fused Triton kernel never does)
        k = k.repeat_interleave(Hq // Hkv, dim=1)
        v = v.repeat_interleave(Hq // Hkv, dim=1)
    if perm is not None:
        q, k, v = (gather_rows(t, perm) for t in (q, k, v))
    block = block or _block_size(n, left, right)
    n_blocks = math.ceil(n / block)
    pos = storage_positions(perm, n, q.device)
    mask = _block_masks(pos, n, left, right, block, n_blocks)
    if mask.shape[0] != B * n_blocks:  # one order shared by the batch
        mask = mask.repeat(B, 1, 1, 1)
    qb = F.pad(q, (0, 0, 0, n_blocks * block - n)).view(B, Hq, n_blocks, block, D)
    qb = qb.transpose(1, 2).reshape(B * n_blocks, Hq, block, D)
    out = F.scaled_dot_product_attention(qb, _spans(k, left, right, block, n_blocks),
                                         _spans(v, left, right, block, n_blocks), attn_mask=mask, scale=scale)
    out = out.view(B, n_blocks, Hq, block, D).transpose(1, 2).reshape(B, Hq, n_blocks * block, D)[:, :, :n]
    return out if perm is None else scatter_rows(out, perm)
