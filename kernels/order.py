"""Moving rows between original order and a permuted storage order (slot s holds original token perm[s])."""

from __future__ import annotations

import torch


def storage_positions(perm: torch.Tensor | None, n: int, device) -> torch.Tensor:
    """Original position of the token stored in each slot: [n] (or [B, n] for per-sequence permutations)."""
    if perm is None:
        return torch.arange(n, device=device)
    return perm.to(device=device, dtype=torch.long)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    perm = perm.long()
    inv = torch.empty_like(perm)
    src = torch.arange(perm.shape[-1], device=perm.device).expand_as(perm)
    return inv.scatter_(-1, perm, src)


def gather_rows(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """x [B, H, n, D] in original order -> storage order: out[..., s, :] = x[..., perm[s], :]."""
    perm = perm.long()
    if perm.dim() == 1:
        return x.index_select(2, perm)
    B, H, n, D = x.shape
    return torch.gather(x, 2, perm[:, None, :, None].expand(B, H, n, D))


def scatter_rows(x: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Inverse of gather_rows: storage order -> original order (a gather with the inverse permutation)."""
    return gather_rows(x, inverse_permutation(perm))


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """The layout every attention op here takes: q [B, Hq, n, D], k / v [B, Hkv, n, D] with Hq a multiple of Hkv."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"expected q [B,Hq,n,D] and k, v [B,Hkv,n,D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
