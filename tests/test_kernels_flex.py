"""FlexAttention backend vs the dense reference (forward only: torch 2.13 has no flex backward on CPU).

Most cases run eager flex (``compiled=False``: exact, but it ignores the block structure and evaluates mask_mod on
every pair), so the block lists are checked on their own against the dense mask, and one test runs the compiled
kernel (which does use them) on multi-block SWA and SA inputs. Error measure: ||flex - reference|| / ||reference||.
"""

from __future__ import annotations

import pytest
import torch

from kernels import banded_attention, default_band
from kernels.naive import band_mask, naive_banded_attention

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5


@pytest.fixture
def kf():
    import kernels.flex as module

    return module


def rel_err(out, ref):
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_case(B, Hq, Hkv, n, D, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, n, D, generator=gen).to(DEVICE) for h in (Hq, Hkv, Hkv))
    if kind == "none":
        perm = None
    elif kind == "shared":
        perm = torch.randperm(n, generator=gen).to(DEVICE)
    else:
        perm = torch.stack([torch.randperm(n, generator=gen) for _ in range(B)]).to(DEVICE)
    return q, k, v, perm


# (B, Hq, Hkv, n, D, window, perm kind)
CASES = [
    (2, 2, 2, 1, 16, 1, "none"),
    (2, 4, 2, 17, 16, 3, "none"),
    (2, 4, 1, 17, 32, 64, "batch"),  # w >= n
    (2, 2, 2, 60, 16, 1, "batch"),
    (1, 4, 2, 60, 32, 8, "shared"),
    (2, 4, 1, 300, 16, 200, "none"),
    (2, 2, 1, 300, 16, 64, "batch"),
    (2, 2, 2, 128, 64, 128, "none"),
    (2, 4, 1, 257, 64, 64, "batch"),
    (1, 2, 2, 1000, 16, 3, "shared"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,Hq,Hkv,n,D,w,kind", CASES)
def test_eager_matches_naive(kf, B, Hq, Hkv, n, D, w, kind, dtype):
    """fp16 inputs against the reference in fp32 on the same rounded values, within 5e-3 of its norm."""
    q, k, v, perm = make_case(B, Hq, Hkv, n, D, kind, seed=n + w)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    left, right = default_band(w, perm is not None)
    out = kf.flex_banded_attention(q, k, v, left, right, perm, compiled=False)
    ref = naive_banded_attention(q.float(), k.float(), v.float(), left, right, perm)
    assert out.shape == q.shape and out.dtype == dtype
    assert rel_err(out, ref) <= (TOL if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("compiled", [False, True])
def test_fp16_matches_naive(kf, compiled):
    """fp16 inputs, the reference in fp32 on the same (rounded) values; 5e-3 of the reference norm."""
    q, k, v, perm = make_case(2, 4, 2, 257, 64, "batch", seed=11)
    q, k, v = (t.half() for t in (q, k, v))
    for p in (None, perm):
        left, right = default_band(64, p is not None)
        out = kf.flex_banded_attention(q, k, v, left, right, p, compiled=compiled)
        assert out.dtype == torch.float16
        assert rel_err(out, naive_banded_attention(q.float(), k.float(), v.float(), left, right, p)) <= 5e-3


def _blocks(dense: torch.Tensor, n: int, bs: int):
    nb = (n + bs - 1) // bs
    pad = torch.zeros(nb * bs, nb * bs, dtype=torch.bool)
    pad[:n, :n] = dense
    blk = pad.view(nb, bs, nb, bs)
    return blk.any(3).any(1), blk.all(3).all(1)


def _listed(num, idx, nb: int):
    m = torch.zeros(nb, nb, dtype=torch.bool)
    if num is not None:
        for i in range(nb):
            m[i, idx[0, 0, i, : num[0, 0, i]].long().cpu()] = True
    return m


@pytest.mark.parametrize("n", [1, 100, 128, 129, 300, 700])
def test_block_lists_cover_the_band_exactly(kf, n):
    """Listed blocks = blocks the mask touches (nothing missed, nothing wasted); full blocks are all-visible."""
    bs, nb = kf.BLOCK_SIZE, (n + kf.BLOCK_SIZE - 1) // kf.BLOCK_SIZE
    for left, right in [(0, 0), (5, 0), (127, 0), (129, 0), (300, 0), (2000, 0), (3, 3), (64, 64), (200, 100)]:
        l2, r2 = min(left, n), min(right, n)
        bm = kf._swa_block_mask(n, l2, 0, "cpu")
        touched, all_visible = _blocks(band_mask(torch.arange(n), left, 0), n, bs)
        partial = _listed(bm.kv_num_blocks, bm.kv_indices, nb)
        full = _listed(bm.full_kv_num_blocks, bm.full_kv_indices, nb)
        assert not (partial & full).any()
        assert torch.equal(partial | full, touched), (n, left)
        assert not (full & ~all_visible).any(), (n, left)

        sm = kf._sa_block_mask(n, l2, r2, torch.randperm(n))
        band_only, _ = _blocks(band_mask(torch.zeros(n), left, right), n, bs)  # pos all equal: band alone
        assert torch.equal(_listed(sm.kv_num_blocks, sm.kv_indices, nb), band_only), (n, left, right)
        assert sm.full_kv_num_blocks is None


def test_full_blocks_are_exact_at_every_band_width(kf):
    """Every left edge over three blocks: a block counted as full one slot too early shows only at some widths
    (left = 126 mod 128 of a 128-slot block), which the list above did not hold."""
    n, bs = 300, kf.BLOCK_SIZE
    nb = (n + bs - 1) // bs
    for left in range(3 * bs):
        bm = kf._swa_block_mask(n, min(left, n), 0, "cpu")
        touched, all_visible = _blocks(band_mask(torch.arange(n), left, 0), n, bs)
        partial = _listed(bm.kv_num_blocks, bm.kv_indices, nb)
        full = _listed(bm.full_kv_num_blocks, bm.full_kv_indices, nb)
        assert torch.equal(partial | full, touched) and not (partial & full).any(), left
        assert not (full & ~all_visible).any(), left


def test_one_compiled_flex_per_device_and_sa_masks_read_pos_in_bounds_in_the_tail_block(kf):
    """The compiled flex_attention is built once per device type and reused; an SA mask_mod evaluated in the padded
    tail of its last block (where a kernel may look) reads pos inside its bounds and never sees a pad."""
    assert kf._flex_fn(True, "cpu") is kf._flex_fn(True, "cpu")
    n = 100
    sm = kf._sa_block_mask(n, 3, 4, torch.randperm(n))
    last = torch.tensor(kf.BLOCK_SIZE - 1)
    assert bool(sm.mask_mod(0, 0, last, last))  # a pad slot sees itself only
    assert not bool(sm.mask_mod(0, 0, torch.tensor(n - 1), torch.tensor(n)))  # no real query sees a pad


def test_compiled_matches_naive(kf):
    """The compiled kernel uses the block lists; SA with a new pi reuses the compiled graph (a new window may not)."""
    for kind, w, seed in [("none", 200, 0), ("batch", 64, 1), ("batch", 9, 2)]:
        q, k, v, perm = make_case(2, 4, 2, 300, 16, kind, seed)
        left, right = default_band(w, perm is not None)
        out = kf.flex_banded_attention(q, k, v, left, right, perm, compiled=True)
        ref = naive_banded_attention(q, k, v, left, right, perm)
        assert rel_err(out, ref) <= TOL, (kind, w)
    assert not kf._compile_failed
    new_pi = torch.stack([torch.randperm(300, generator=torch.Generator().manual_seed(s)) for s in (8, 9)])
    with torch._dynamo.config.patch(error_on_recompile=True):
        out = kf.flex_banded_attention(q, k, v, left, right, new_pi.to(q.device), compiled=True)
    assert rel_err(out, naive_banded_attention(q, k, v, left, right, new_pi.to(q.device))) <= TOL
    if DEVICE == "cpu":  # static shapes there: lengths run padded to a power of two, so 257..512 share one kernel
        for n in (257, 511, 512):
            q, k, v, perm = make_case(2, 4, 2, n, 16, "batch", n)
            with torch._dynamo.config.patch(error_on_recompile=True):
                out = kf.flex_banded_attention(q, k, v, left, right, perm, compiled=True)
            assert rel_err(out, naive_banded_attention(q, k, v, left, right, perm)) <= TOL, n


def test_past_the_recompile_limit_flex_fails_loudly(kf, monkeypatch):
    """Past dynamo's recompile limit compiled flex used to run eager silently (n x n scores: 64 GiB at n=32768 on the
    GPU); now it says so. A limit of 1 and two mask kinds (SWA, then SA) pass it for sure."""
    monkeypatch.setattr(kf, "RECOMPILE_LIMIT", 1)
    monkeypatch.setattr(kf, "_compile_failed", False)
    with torch._dynamo.config.patch(recompile_limit=1), \
            pytest.raises(RuntimeError, match="flex.*compiled variants.*recompile_limit"):
        for kind in ("none", "shared"):
            q, k, v, perm = make_case(1, 2, 2, 40, 8, kind, seed=3)
            left, right = default_band(16, perm is not None)
            kf.flex_banded_attention(q, k, v, left, right, perm, compiled=True)
    assert not kf._compile_failed  # not taken for a failed compile (that would turn eager for the whole process)


@pytest.mark.skipif(DEVICE != "cuda", reason="flex has a backward on CUDA only")
@pytest.mark.parametrize("kind", ["none", "batch"])
def test_cuda_gradients_match_naive(kf, kind):
    q, k, v, perm = make_case(2, 4, 2, 300, 64, kind, seed=12)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    left, right = default_band(64, perm is not None)
    out = kf.flex_banded_attention(q, k, v, left, right, perm, compiled=True)
    ref = naive_banded_attention(q, k, v, left, right, perm)
    grad_out = torch.randn_like(ref)
    assert rel_err(out, ref) <= 1e-4
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), grad_out),
                          torch.autograd.grad(ref, (q, k, v), grad_out)):
        assert rel_err(a, b) <= 1e-4, f"d{name}"


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU-only limitation")
def test_grad_on_cpu_raises_clear_error(kf):
    q, k, v, perm = make_case(1, 2, 1, 20, 16, "batch", 3)
    q.requires_grad_()
    with pytest.raises(RuntimeError, match="backend='torch'"):
        kf.flex_banded_attention(q, k, v, 4, 5, perm, compiled=False)
    with pytest.raises(RuntimeError, match="no backward on CPU"):
        banded_attention(q, k, v, 10, perm=perm, backend="flex")
    with torch.no_grad():  # inference with parameters that require grad is fine
        out = kf.flex_banded_attention(q, k, v, 4, 5, perm, compiled=False)
    assert rel_err(out, naive_banded_attention(q.detach(), k, v, 4, 5, perm)) <= TOL


def test_dispatch_from_banded_attention(monkeypatch):
    monkeypatch.setenv("SA_FLEX_COMPILE", "0")
    q, k, v, perm = make_case(2, 2, 1, 40, 16, "batch", 4)
    for p in (None, perm):
        out = banded_attention(q, k, v, 7, perm=p, backend="flex")
        ref = banded_attention(q, k, v, 7, perm=p, backend="naive")
        assert rel_err(out, ref) <= TOL


@pytest.mark.skipif(DEVICE != "cpu", reason="the eager fallback is CPU-only")
def test_failed_cpu_compile_falls_back_to_eager(kf, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("simulated inductor failure")

    monkeypatch.setattr(kf, "_compiled_flex", {"cpu": broken})
    monkeypatch.setattr(kf, "_compile_failed", False)
    q, k, v, perm = make_case(1, 2, 2, 30, 16, "shared", 5)
    with pytest.warns(UserWarning, match="falling back to eager"):
        out = kf.flex_banded_attention(q, k, v, 3, 3, perm, compiled=True)
    assert kf._compile_failed
    assert rel_err(out, naive_banded_attention(q, k, v, 3, 3, perm)) <= TOL
