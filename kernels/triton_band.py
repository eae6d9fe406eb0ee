"""Fused Triton banded attention (forward + backward) that moves rows through pi itself (docs/method.md).

Query in storage slot i attends to key in slot j iff  i - left <= j <= i + right  and  pos[j] <= pos[i],
with pos[s] = perm[s] (or s when perm is None). q/k/v, the output and dq/dk/dv all stay in ORIGINAL order in
memory: every kernel computes on storage slots but loads and stores row perm[slot], so no permuted copy is made.

Kernels (all fp32 accumulation, flash-attention online softmax, base-2 exponentials):
  _fwd_kernel     grid (cdiv(n, BLOCK_M), B*Hq): one query tile of storage slots; loops over the key tiles that
                  intersect the tile's band [start_m - left, end_m + right] only (O(n*w) work); writes O and the
                  log-sum-exp (base 2, indexed by original position) for the backward.
  _dkdv_kernel    grid (cdiv(n, BLOCK_N), B*Hkv): one key tile; loops over the Hq/Hkv query heads of its group and
                  the query tiles whose band reaches it ([start_n - right, end_n + left]); dk/dv summed over the
                  group in registers (GQA without expanding K/V and without atomics: deterministic).
  _dq_kernel      grid (cdiv(n, BLOCK_M), B*Hq): one query tile, same key-tile range as the forward; runs first
                  and also writes delta = rowsum(dO * O) per query row for the dk/dv kernel (no separate launch).

Block sizes are autotuned on CUDA (key: n and left+right+1 rounded up to powers of two, head dim; env
SA_TRITON_AUTOTUNE=0 pins one config); under TRITON_INTERPRET=1 (CPU tests) one large-block config is used, since
the interpreter's cost grows with programs x ops, not FLOPs.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import triton
import triton.language as tl

from kernels import TRITON_DTYPES, TRITON_MAX_HEAD_DIM
from kernels.order import check_qkv

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------------------------
# kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _mm(a, b, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation; UPCAST (interpreter + bf16) works around the interpreter's broken bf16 dot."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _load_pos(PERM, perm_off, offs, valid, HAS_PERM: tl.constexpr):
    """Original position (row index in memory) of each storage slot in `offs` (int64)."""
    if HAS_PERM:
        pos = tl.load(PERM + perm_off + offs, mask=valid, other=0).to(tl.int64)
    else:
        pos = offs.to(tl.int64)
    return pos


@triton.jit
def _band_mask(offs_m, offs_n, pos_m, pos_n, n, left, right):
    """[BLOCK_M, BLOCK_N] mask: key slot in the query's band, causal in original order, key slot < n."""
    return (
        (offs_n[None, :] >= offs_m[:, None] - left)
        & (offs_n[None, :] <= offs_m[:, None] + right)
        & (pos_n[None, :] <= pos_m[:, None])
        & (offs_n[None, :] < n)
    )


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, PERM,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, spb,
    n, left, right, Hq, qk_scale, n_key, band_key,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PERM: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # heads and batch on axes 1 and 2: B * H alone could pass CUDA's 65535 limit
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    m_valid = offs_m < n
    perm_off = b * spb
    pos_m = _load_pos(PERM, perm_off, offs_m, m_valid, HAS_PERM)

    q = tl.load(Q + b * sqb + h * sqh + pos_m[:, None] * sqn + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    lo = tl.maximum(start_m - left, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M + right, n)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < n
        pos_n = _load_pos(PERM, perm_off, offs_n, n_valid, HAS_PERM)
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_base + pos_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = _mm(q, tl.trans(k), UPCAST)
        mask = _band_mask(offs_m, offs_n, pos_m, pos_n, n, left, right)
        qk = tl.where(mask, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet: avoid inf - inf
        alpha = tl.math.exp2(m_i - m_safe)
        p = tl.math.exp2(qk - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + pos_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, UPCAST)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # only padding rows (slot >= n); real rows always see themselves
    acc = acc / l_safe[:, None]
    lse = m_i + tl.math.log2(l_safe)
    tl.store(O + b * sob + h * soh + pos_m[:, None] * son + offs_d[None, :], acc.to(O.dtype.element_ty),
             mask=m_valid[:, None] & d_valid[None, :])
    tl.store(LSE + (b * Hq + h) * n + pos_m, lse, mask=m_valid)


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, PERM,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdb, sdh, sdn,
    sdkb, sdkh, sdkn, sdvb, sdvh, sdvn, spb,
    n, left, right, Hq, Hkv, qk_scale, sm_scale, n_key, band_key,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PERM: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    n_valid = offs_n < n
    perm_off = b * spb
    pos_n = _load_pos(PERM, perm_off, offs_n, n_valid, HAS_PERM)
    kv_mask = n_valid[:, None] & d_valid[None, :]
    k = tl.load(K + b * skb + hk * skh + pos_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + b * svb + hk * svh + pos_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # queries i that can see key slot j satisfy j - right <= i <= j + left
    lo = tl.maximum(start_n - right, 0)
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = tl.minimum(start_n + BLOCK_N + left, n)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * Hq + h
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_valid = offs_m < n
            pos_m = _load_pos(PERM, perm_off, offs_m, m_valid, HAS_PERM)
            row_mask = m_valid[:, None] & d_valid[None, :]
            q = tl.load(q_base + pos_m[:, None] * sqn + offs_d[None, :], mask=row_mask, other=0.0)
            do = tl.load(do_base + pos_m[:, None] * sdn + offs_d[None, :], mask=row_mask, other=0.0)
            lse = tl.load(LSE + bh * n + pos_m, mask=m_valid, other=0.0)
            delta = tl.load(DELTA + bh * n + pos_m, mask=m_valid, other=0.0)
            qkT = _mm(k, tl.trans(q), UPCAST)  # [BLOCK_N, BLOCK_M]
            maskT = (
                (offs_n[:, None] >= offs_m[None, :] - left)
                & (offs_n[:, None] <= offs_m[None, :] + right)
                & (pos_n[:, None] <= pos_m[None, :])
                & m_valid[None, :]
                & n_valid[:, None]
            )
            pT = tl.where(maskT, tl.math.exp2(qkT * qk_scale - lse[None, :]), 0.0)
            dv += _mm(pT.to(do.dtype), do, UPCAST)
            dpT = _mm(v, tl.trans(do), UPCAST)
            dsT = pT * (dpT - delta[None, :])
            dk += _mm(dsT.to(q.dtype), q, UPCAST)

    dk = dk * sm_scale
    tl.store(DK + b * sdkb + hk * sdkh + pos_n[:, None] * sdkn + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + b * sdvb + hk * sdvh + pos_n[:, None] * sdvn + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_mask)


@triton.jit
def _dq_kernel(
    Q, K, V, O, DO, LSE, DELTA, DQ, PERM,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdb, sdh, sdn, sdqb, sdqh, sdqn, spb,
    n, left, right, Hq, qk_scale, sm_scale, n_key, band_key,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_PERM: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)  # heads and batch on axes 1 and 2: B * H alone could pass CUDA's 65535 limit
    b = tl.program_id(2).to(tl.int64)
    hk = h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    m_valid = offs_m < n
    perm_off = b * spb
    pos_m = _load_pos(PERM, perm_off, offs_m, m_valid, HAS_PERM)
    row_mask = m_valid[:, None] & d_valid[None, :]
    q = tl.load(Q + b * sqb + h * sqh + pos_m[:, None] * sqn + offs_d[None, :], mask=row_mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + pos_m[:, None] * sdn + offs_d[None, :], mask=row_mask, other=0.0)
    lse = tl.load(LSE + (b * Hq + h) * n + pos_m, mask=m_valid, other=0.0)
    # delta = rowsum(dO * O): computed here (each row's one visit) and stored for the dk/dv kernel, which runs next
    o = tl.load(O + b * sob + h * soh + pos_m[:, None] * son + offs_d[None, :], mask=row_mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + (b * Hq + h) * n + pos_m, delta, mask=m_valid)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo = tl.maximum(start_m - left, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M + right, n)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < n
        pos_n = _load_pos(PERM, perm_off, offs_n, n_valid, HAS_PERM)
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = tl.load(k_base + pos_n[:, None] * skn + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + pos_n[:, None] * svn + offs_d[None, :], mask=kv_mask, other=0.0)
        qk = _mm(q, tl.trans(k), UPCAST)
        mask = _band_mask(offs_m, offs_n, pos_m, pos_n, n, left, right) & m_valid[:, None]
        p = tl.where(mask, tl.math.exp2(qk * qk_scale - lse[:, None]), 0.0)
        dp = _mm(do, tl.trans(v), UPCAST)
        ds = p * (dp - delta[:, None])
        dq += _mm(ds.to(k.dtype), k, UPCAST)

    dq = dq * sm_scale
    tl.store(DQ + b * sdqb + h * sdqh + pos_m[:, None] * sdqn + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_mask)


# ----------------------------------------------------------------------------------------------------------------
# launch configuration: autotuned on CUDA, one big-block config under the interpreter
# ----------------------------------------------------------------------------------------------------------------

# Tuning key: sequence length and band width rounded up to powers of two (n_key, band_key: launch arguments the
# kernels ignore) and the head dim, so variable-length evaluation does not re-tune for every length.
_TUNE_KEY = ["n_key", "band_key", "HEAD_DIM"]


def _prune(configs, named_args, **kwargs):
    """Drop configs whose tiles are far larger than the problem or too big for a wide head."""
    n = named_args["n"]
    d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D", 64))
    keep = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        if d >= 256 and bm * bn > 64 * 64:
            continue
        if max(bm, bn) > max(16, triton.next_power_of_2(n)) and bm * bn > 16 * 16:
            continue
        keep.append(c)
    return keep or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]


def _configs(pairs):
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in pairs
    ]


_FWD_CONFIGS = _configs(
    [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 4), (128, 32, 4, 3), (64, 128, 4, 3), (64, 64, 4, 3),
     (64, 32, 4, 2), (32, 32, 4, 2), (16, 16, 4, 1)]
)
_DQ_CONFIGS = _configs(
    [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2),
     (32, 32, 4, 2), (16, 16, 4, 1)]
)
_DKDV_CONFIGS = _configs(
    [(64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (64, 64, 4, 2), (32, 64, 4, 2),
     (32, 32, 4, 2), (16, 16, 4, 1)]
)

# SA_TRITON_AUTOTUNE=0 pins one config on CUDA too: GPU test runs compile each shape once instead of ~5 times.
_AUTOTUNE = not _INTERPRET and os.environ.get("SA_TRITON_AUTOTUNE", "1") != "0"


def _fixed_gpu_config(row_bytes: int) -> dict:
    """The pinned config: 64-row tiles up to 256-byte rows (D=128 in 16-bit), then smaller ones (shared memory)."""
    blk = 64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16
    return {"BLOCK_M": blk, "BLOCK_N": blk, "num_warps": 4, "num_stages": 2}


if not _AUTOTUNE:
    _fwd, _dq, _dkdv = _fwd_kernel, _dq_kernel, _dkdv_kernel
else:
    _fwd = triton.autotune(_FWD_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune})(_fwd_kernel)
    _dq = triton.autotune(_DQ_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune})(_dq_kernel)
    _dkdv = triton.autotune(_DKDV_CONFIGS, key=_TUNE_KEY, prune_configs_by={"early_config_prune": _prune})(
        _dkdv_kernel
    )


def _interp_blocks(n: int) -> dict:
    """Interpreter config: the largest tiles up to 64 that the sequence fills (fewest programs and loop steps)."""
    blk = max(16, min(64, triton.next_power_of_2(n)))
    return {"BLOCK_M": blk, "BLOCK_N": blk}


def _tune_keys(n: int, left: int, right: int) -> tuple[int, int]:
    return triton.next_power_of_2(max(n, 1)), triton.next_power_of_2(left + right + 1)


# (kernel, n_key, band_key, kwargs, dtype, device) -> the config the autotuner chose. Later calls launch the jitted
# kernel with it directly: Triton's Autotuner.run rebuilds its key from every argument on each call (tens of
# microseconds of host time per launch, which is most of a launch at short sequence lengths).
_chosen: dict = {}


def _launch(kernel, heads_batch: tuple[int, int], args, kwargs, block_axis: str, n: int, row_bytes: int):
    if not _AUTOTUNE:
        cfg = _interp_blocks(n) if _INTERPRET else _fixed_gpu_config(row_bytes)
        kernel[(triton.cdiv(n, cfg[block_axis]), *heads_batch)](*args, **kwargs, **cfg)
        return
    key = (kernel, args[-2], args[-1], tuple(kwargs.items()), args[0].dtype, args[0].device)
    cfg = _chosen.get(key)
    if cfg is None:
        kernel[lambda meta: (triton.cdiv(n, meta[block_axis]), *heads_batch)](*args, **kwargs)
        _chosen[key] = kernel.best_config.all_kwargs()
    else:
        kernel.fn[(triton.cdiv(n, cfg[block_axis]), *heads_batch)](*args, **kwargs, **cfg)


# ----------------------------------------------------------------------------------------------------------------
# autograd wrapper
# ----------------------------------------------------------------------------------------------------------------


def _empty(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """Allocator of every kernel output (all fully overwritten; tests swap it for a NaN-filled one to prove it)."""
    return torch.empty(shape, device=like.device, dtype=like.dtype if dtype is None else dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """The kernels take any batch/head/row strides but need unit stride along the head dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _strides(x: torch.Tensor):
    return x.stride(0), x.stride(1), x.stride(2)


def _prepare_perm(perm: torch.Tensor | None, B: int, n: int, device) -> tuple[torch.Tensor | None, int]:
    if perm is None:
        return None, 0
    if perm.dim() not in (1, 2) or perm.shape[-1] != n or (perm.dim() == 2 and perm.shape[0] != B):
        raise ValueError(f"perm must have shape [n] or [B, n] with B={B}, n={n}; got {tuple(perm.shape)}")
    if perm.dtype not in (torch.int32, torch.int64):
        perm = perm.long()
    perm = perm.to(device)
    if perm.stride(-1) != 1:
        perm = perm.contiguous()
    return perm, (perm.stride(0) if perm.dim() == 2 else 0)


def _on_device(t: torch.Tensor):
    """Launch on the tensors' GPU, not whichever one is current."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _common(q, k, left, right):
    D = q.shape[-1]
    n = q.shape[2]
    block_d = max(16, triton.next_power_of_2(D))
    # clamp the band to the sequence (no change in meaning) so huge "full attention" bands fit in int32
    left, right = min(int(left), n), min(int(right), n)
    upcast = _INTERPRET and q.dtype == torch.bfloat16
    return n, D, block_d, left, right, upcast


class _TritonBandedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, left, right, perm, scale):
        B, Hq, _, _ = q.shape
        Hkv = k.shape[1]
        n, D, block_d, left, right, upcast = _common(q, k, left, right)
        q, k, v = _rows(q), _rows(k), _rows(v)
        perm_t, spb = _prepare_perm(perm, B, n, q.device)
        o = _empty(q.shape, q)
        lse = _empty((B, Hq, n), q, torch.float32)
        if n > 0 and B * Hq > 0:
            with _on_device(q):
                _launch(
                    _fwd, (Hq, B),
                    (q, k, v, o, lse, perm_t if perm_t is not None else q,
                     *_strides(q), *_strides(k), *_strides(v), *_strides(o), spb,
                     n, left, right, Hq, scale * _LOG2E, *_tune_keys(n, left, right)),
                    dict(GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_D=block_d, HAS_PERM=perm_t is not None, UPCAST=upcast),
                    "BLOCK_M", n, block_d * q.element_size(),
                )
        ctx.save_for_backward(q, k, v, o, lse, perm_t)
        ctx.band = (left, right, scale, spb)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, perm_t = ctx.saved_tensors
        left, right, scale, spb = ctx.band
        B, Hq, n, D = q.shape
        Hkv = k.shape[1]
        block_d = max(16, triton.next_power_of_2(D))
        upcast = _INTERPRET and q.dtype == torch.bfloat16
        do = _rows(do)
        dq = _empty(q.shape, q)
        dk = _empty(k.shape, k)
        dv = _empty(v.shape, v)
        if n == 0 or B * Hq == 0:
            return dq.zero_(), dk.zero_(), dv.zero_(), None, None, None, None
        with _on_device(q):
            delta = _empty(lse.shape, lse)
            perm_arg = perm_t if perm_t is not None else q
            flags = dict(GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_D=block_d, HAS_PERM=perm_t is not None, UPCAST=upcast)
            keys = _tune_keys(n, left, right)
            _launch(  # first: it also writes delta, which the dk/dv kernel reads
                _dq, (Hq, B),
                (q, k, v, o, do, lse, delta, dq, perm_arg,
                 *_strides(q), *_strides(k), *_strides(v), *_strides(o), *_strides(do), *_strides(dq), spb,
                 n, left, right, Hq, scale * _LOG2E, scale, *keys),
                flags, "BLOCK_M", n, block_d * q.element_size(),
            )
            _launch(
                _dkdv, (Hkv, B),
                (q, k, v, do, lse, delta, dk, dv, perm_arg,
                 *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv), spb,
                 n, left, right, Hq, Hkv, scale * _LOG2E, scale, *keys),
                flags, "BLOCK_N", n, block_d * q.element_size(),
            )
        return dq, dk, dv, None, None, None, None


def triton_banded_attention(q, k, v, left: int, right: int, perm=None, scale=None):
    """Fused banded attention. q [B,Hq,n,D], k/v [B,Hkv,n,D] in original order; perm None, [n] or [B,n].

    Returns the output [B,Hq,n,D] in original order and input dtype; differentiable w.r.t. q, k and v.
    """
    check_qkv(q, k, v)
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in TRITON_DTYPES:
        raise TypeError(f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if left < 0 or right < 0:
        raise ValueError(f"band must be non-negative (every query sees itself), got left={left}, right={right}")
    if q.shape[-1] > TRITON_MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[-1]} > {TRITON_MAX_HEAD_DIM} is not supported by the Triton kernel")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return _TritonBandedAttention.apply(q, k, v, left, right, perm, scale)
