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
    """The layout every attention op here takes: q [B, Hq, n, D], k / v [B, Hkv, n, D] with Hq a multiple of Hkv,
    one dtype and one device."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"expected q [B,Hq,n,D] and k, v [B,Hkv,n,D]; got {tuple(q.shape)}, {tuple(k.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")


def check_perm(perm: torch.Tensor, n: int, batch: int, values: bool = True) -> None:
    """perm must be [n] or [batch, n] integers, each row (with `values`) a permutation of 0..n-1. Kernels move rows
    through it: an entry out of range reads (in Triton, writes) outside the tensors, a repeated one leaves rows
    unwritten. On a GPU the values check waits for the device, so callers whose pi comes from PermutationSampler
    skip it."""
    if perm.dim() not in (1, 2) or perm.shape[-1] != n or (perm.dim() == 2 and perm.shape[0] != batch):
        raise ValueError(f"perm must have shape [n] or [B, n] with B={batch}, n={n}, got {tuple(perm.shape)}")
    if perm.dtype.is_floating_point or perm.dtype.is_complex or perm.dtype == torch.bool:
        raise TypeError(f"perm must be an integer tensor (original position of each slot), got {perm.dtype}")
    if not values or perm.numel() == 0 or (perm.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    rows = perm.reshape(-1, n).long()
    lo, hi = rows.aminmax()
    # slots no entry names (an entry out of range is clamped here and reported first); one wait for the device
    missing = ~torch.zeros_like(rows, dtype=torch.bool).scatter_(1, rows.clamp(0, n - 1), True)
    lo, hi, any_missing = torch.stack([lo, hi, missing.any().long()]).tolist()
    if lo < 0 or hi >= n:
        raise ValueError(f"perm entries must lie in [0, {n}), got entries from {lo} to {hi}")
    if any_missing:
        row = int(missing.any(1).nonzero()[0])
        where = f"perm[{row}]" if perm.dim() == 2 else "perm"
        raise ValueError(f"{where} is not a permutation of 0..{n - 1}: it repeats entries and misses "
                         f"{int(missing[row].sum())} (e.g. {int(missing[row].nonzero()[0])})")


def assert_permutation_async(perm: torch.Tensor, n: int) -> None:
    """check_perm's values check in a form torch.compile traces (no wait for the device): the graph raises where it
    runs. Compiled callers skipped the check, and a bad pi made the torch backend read unwritten memory."""
    rows = perm.reshape(-1, n).long()
    ok = (rows.sort(-1).values == torch.arange(n, device=rows.device)).all()
    torch._assert_async(ok, f"perm is not a permutation of 0..{n - 1} (each row)")
