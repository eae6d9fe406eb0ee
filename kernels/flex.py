"""FlexAttention backend for banded attention over a stored order (docs/method.md).

q/k/v are gathered into storage order (kernels/order.py), attended with ``flex_attention`` under a BlockMask
for the band, and the output is scattered back to original order. The query in slot i sees the key in slot j iff
``i - left <= j <= i + right`` and ``pos[j] <= pos[i]``.

BlockMask: the set of (query block, key block) pairs that the band touches depends only on (n, left, right), never
on pos, so it is computed directly from the band (O(n/bs * w/bs), no dense n x n evaluation) and cached; the
per-call mask_mod adds the element-level band and causality tests. Without a permutation (SWA) blocks that lie
entirely inside the band and below the diagonal are marked *full* (mask_mod skipped there) and the whole BlockMask
is cached. With a permutation (SA) causality depends on pos, so every touched block is partial and a new BlockMask
is wrapped around the cached block tensors with a mask_mod that closes over pos (torch lifts closure tensors into
graph inputs, so a new pos does not recompile).

CPU: torch 2.13 has no FlexAttention backward on CPU; asking for gradients raises a RuntimeError that points to
backend=torch. One module-level ``torch.compile(flex_attention)`` per device type is built on first use and reused
(static shapes on CPU, see _flex_fn, with lengths padded to a power of two so that few compile); on CPU a failed
compile falls back to eager flex with a warning (eager flex materialises the full score matrix: tests and small
inputs only).
"""

from __future__ import annotations

import functools
import math
import os
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kernels.order import check_perm, check_qkv, gather_rows, scatter_rows

BLOCK_SIZE = 128  # FlexAttention's default sparse block size

_compiled_flex: dict[str, object] = {}  # device type -> the one compiled flex_attention for it
_compile_failed = False


def _flex_fn(compiled: bool, device_type: str):
    if not compiled or (_compile_failed and device_type == "cpu"):
        return flex_attention
    if device_type not in _compiled_flex:
        # CPU: static shapes. torch 2.13's CPU flex template emits C++ that does not compile once a length turns
        # into a symbolic size (measured), so each new n compiles afresh there; CUDA keeps automatic dynamic shapes.
        dynamic = False if device_type == "cpu" else None
        _compiled_flex[device_type] = torch.compile(flex_attention, dynamic=dynamic)
    return _compiled_flex[device_type]


def _default_compiled() -> bool:
    return os.environ.get("SA_FLEX_COMPILE", "1") != "0"


@functools.lru_cache(maxsize=64)
def _band_blocks(n: int, left: int, right: int, device: str, causal_full: bool, bs: int = BLOCK_SIZE):
    """Block structure of the band: (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), [1, 1, nb, nb].

    A (query block, key block) pair is listed iff some slot pair in it lies in the band. With causal_full
    (pos = slot order) pairs whose every element is in the band and causal go to the full lists instead.
    """
    nb = (n + bs - 1) // bs
    qb = torch.arange(nb, device=device)
    q_start, q_end = qb * bs, torch.clamp(qb * bs + bs - 1, max=n - 1)
    first = torch.clamp(q_start - left, min=0) // bs
    last = torch.clamp(q_end + right, max=n - 1) // bs
    kb = torch.arange(nb, device=device)
    touched = (kb[None, :] >= first[:, None]) & (kb[None, :] <= last[:, None])
    if causal_full:
        k_start, k_end = kb * bs, kb * bs + bs - 1
        full = (
            touched
            & (k_start[None, :] >= (q_start + bs - 1)[:, None] - left)  # j >= i - left for the block's last query
            & (k_end[None, :] <= q_start[:, None])  # j <= i (and so j <= i + right) for its first query
            & (k_end <= n - 1)[None, :]  # no padding inside full blocks
            & (q_start + bs - 1 <= n - 1)[:, None]
        )
        partial = touched & ~full
    else:
        full = None
        partial = touched

    def ordered(m: torch.Tensor):
        num = m.sum(-1).to(torch.int32)
        # listed blocks first, in increasing order (stable sort on "not listed"), then the unused tail
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num[None, None].contiguous(), idx[None, None].contiguous()

    kv_num, kv_idx = ordered(partial)
    full_num, full_idx = ordered(full) if full is not None else (None, None)
    return kv_num, kv_idx, full_num, full_idx


@functools.lru_cache(maxsize=256)
def _band_scalar(x: int, device: str) -> torch.Tensor:
    # the band edges enter mask_mods as 0-dim tensors: torch.compile lifts closure tensors into graph inputs, so a
    # new window neither recompiles nor becomes a symbolic int (which the CPU flex template fails to compile)
    return torch.tensor(x, device=device, dtype=torch.int64)


@functools.lru_cache(maxsize=64)
def _swa_block_mask(n: int, left: int, right: int, device: str) -> BlockMask:
    """Cached BlockMask for the unpermuted band (pos = slot index)."""
    left_t = _band_scalar(left, device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= q_idx - left_t) & (kv_idx <= q_idx)  # right >= 0, so causality is the upper bound

    kv_num, kv_idx, full_num, full_idx = _band_blocks(n, left, right, device, True)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK_SIZE, mask_mod=mask_mod, seq_lengths=(n, n)
    )


@functools.lru_cache(maxsize=64)
def _sa_block_template(n: int, left: int, right: int, device: str) -> BlockMask:
    kv_num, kv_idx, _, _ = _band_blocks(n, left, right, device, False)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=BLOCK_SIZE, seq_lengths=(n, n))


def _pad_positions(pos: torch.Tensor, n_pad: int) -> torch.Tensor:
    """pos ([n] or [B, n]) extended to n_pad slots with positions n, n+1, ...: after every real token in original
    order, so no real query sees a pad slot."""
    n = pos.shape[-1]
    if n_pad <= n:
        return pos
    tail = torch.arange(n, n_pad, device=pos.device, dtype=pos.dtype)
    return torch.cat([pos, tail.expand(*pos.shape[:-1], n_pad - n)], dim=-1)


def _sa_block_mask(n: int, left: int, right: int, pos: torch.Tensor) -> BlockMask:
    """BlockMask for a permuted band: cached block lists plus a mask_mod reading pos ([n] or [B, n])."""
    device = str(pos.device)
    t = _sa_block_template(n, left, right, device)
    # pad pos so that any index a kernel evaluates in a padded tail block stays in bounds; pads come last in
    # original order, so no real query can see them
    pos = _pad_positions(pos, t.kv_indices.shape[-1] * BLOCK_SIZE)
    left_t, right_t = _band_scalar(left, device), _band_scalar(right, device)
    if pos.dim() == 2:

        def mask_mod(b, h, q_idx, kv_idx):
            band = (kv_idx >= q_idx - left_t) & (kv_idx <= q_idx + right_t)
            return band & (pos[b, kv_idx] <= pos[b, q_idx])

    else:

        def mask_mod(b, h, q_idx, kv_idx):
            band = (kv_idx >= q_idx - left_t) & (kv_idx <= q_idx + right_t)
            return band & (pos[kv_idx] <= pos[q_idx])

    return BlockMask(
        seq_lengths=t.seq_lengths, kv_num_blocks=t.kv_num_blocks, kv_indices=t.kv_indices,
        full_kv_num_blocks=None, full_kv_indices=None, q_num_blocks=t.q_num_blocks, q_indices=t.q_indices,
        full_q_num_blocks=None, full_q_indices=None, BLOCK_SIZE=t.BLOCK_SIZE, mask_mod=mask_mod,
    )


def _block_mask(n: int, left: int, right: int, pos: torch.Tensor | None, device: str) -> BlockMask:
    if pos is None:
        return _swa_block_mask(n, left, 0, device)  # pos = slot: causality caps the band at j <= i
    return _sa_block_mask(n, left, right, pos)


def _bucket(n: int) -> int:
    """CPU compiles one kernel per length (static shapes): lengths run padded to a power of two >= one block."""
    return max(BLOCK_SIZE, 1 << (n - 1).bit_length())


# Distinct lengths (CPU), head counts, dtypes, mask kinds and grad modes each compile once. Past dynamo's default of
# 8 per function later calls ran eager flex silently, with the full n x n scores (a 64 GiB allocation at n=32768 in
# the GPU benchmark of 2026-12-04): allow more, and past that fail loudly (_recompile_budget).
RECOMPILE_LIMIT = 64


# torch < 2.7 spells these "cache" instead of "recompile"
_LIMIT_KEY, _FAIL_KEY = (("recompile_limit", "fail_on_recompile_limit_hit")
                         if hasattr(torch._dynamo.config, "recompile_limit")
                         else ("cache_size_limit", "fail_on_cache_limit_hit"))
_LimitHit = (getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None)
             or getattr(torch._dynamo.exc, "FailOnCacheLimitHit", None)
             or type("_NeverRaised", (Exception,), {}))  # a torch without the flag runs eager past the limit


def _recompile_limit() -> int:
    return max(getattr(torch._dynamo.config, _LIMIT_KEY), RECOMPILE_LIMIT)  # a user's higher limit stands


def _recompile_budget():
    fail = {_FAIL_KEY: True} if hasattr(torch._dynamo.config, _FAIL_KEY) else {}
    return torch._dynamo.config.patch(**{_LIMIT_KEY: _recompile_limit()}, **fail)


def _cpu_compiled(fn, q, k, v, left: int, right: int, pos, scale: float, enable_gqa: bool) -> torch.Tensor:
    """The compiled CPU kernel on storage-order q/k/v, padded to _bucket(n) slots. Pad slots come after every token
    in original order (pos n, n+1, ...; for SWA their slots are right of every real query), so no real query sees
    one; their own rows are dropped."""
    n = q.shape[2]
    n_run = _bucket(n)
    if n_run > n:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, n_run - n)) for t in (q, k, v))
        pos = None if pos is None else _pad_positions(pos, n_run)
    block_mask = _block_mask(n_run, left, right, pos, str(q.device))
    out = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    return out[:, :, :n]


def flex_banded_attention(q, k, v, left: int, right: int, perm=None, scale=None, *, compiled: bool | None = None):
    """FlexAttention banded attention. q [B,Hq,n,D], k/v [B,Hkv,n,D] in original order; perm None, [n] or [B,n].

    ``compiled``: use the shared torch.compile'd flex_attention (default; env SA_FLEX_COMPILE=0 turns it off).
    Eager flex is exact but materialises the n x n scores: only for tests at small sizes.
    """
    global _compile_failed
    check_qkv(q, k, v)
    if left < 0 or right < 0:
        raise ValueError(f"band must be non-negative (every query sees itself), got left={left}, right={right}")
    if q.device.type == "cpu" and any(t.requires_grad for t in (q, k, v)):
        if torch.is_grad_enabled():
            raise RuntimeError(
                "attention backend 'flex' has no backward on CPU (torch FlexAttention is forward-only there); "
                "use backend='torch' (or 'auto') for CPU training, or call under torch.no_grad() for inference"
            )
        q, k, v = q.detach(), k.detach(), v.detach()  # no graph is being built: forward-only flex is exact
    B, Hq, n, D = q.shape
    if n == 0 or B * Hq == 0:
        return q.new_empty(q.shape)
    left, right = min(int(left), n), min(int(right), n)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    compiled = _default_compiled() if compiled is None else compiled
    device = str(q.device)

    if perm is not None:
        check_perm(perm, n, B, values=False)
        perm = perm.to(device=q.device, dtype=torch.long)
        q, k, v = (gather_rows(t, perm) for t in (q, k, v))

    enable_gqa = Hq != k.shape[1]
    fn = _flex_fn(compiled, q.device.type)
    try:
        if fn is flex_attention:
            out = fn(q, k, v, block_mask=_block_mask(n, left, right, perm, device), scale=scale, enable_gqa=enable_gqa)
        else:
            with _recompile_budget():
                if q.device.type != "cpu":
                    out = fn(q, k, v, block_mask=_block_mask(n, left, right, perm, device), scale=scale,
                             enable_gqa=enable_gqa)
                else:
                    out = _cpu_compiled(fn, q, k, v, left, right, perm, scale, enable_gqa)
    except _LimitHit as err:
        raise RuntimeError(
            f"attention backend 'flex': torch.compile(flex_attention) reached its limit of {_recompile_limit()} "
            "compiled variants (one per length on CPU, head count, dtype, mask kind and grad mode); beyond it flex "
            f"would run eager and materialise the n x n scores. Raise torch._dynamo.config.{_LIMIT_KEY}, or use "
            "backend='triton' (CUDA) / 'torch' (CPU)"
        ) from err
    except Exception as err:  # noqa: BLE001 - only a failed CPU compile is recovered, everything else re-raises
        if fn is flex_attention or q.device.type != "cpu":
            raise
        first_line = (str(err).strip().splitlines() or [""])[0][:300]  # inductor errors carry whole compiler logs
        warnings.warn(
            f"torch.compile(flex_attention) failed on CPU ({type(err).__name__}: {first_line}); "
            "falling back to eager flex for the rest of this process"
        )
        _compile_failed = True
        out = flex_attention(q, k, v, block_mask=_block_mask(n, left, right, perm, device), scale=scale,
                             enable_gqa=enable_gqa)
    return out if perm is None else scatter_rows(out, perm)
