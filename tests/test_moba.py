"""MoBA baseline (kernels/moba.py): the chunked gather implementation against its dense masked reference."""

import pytest
import torch

import kernels.moba as moba_module
from kernels.moba import moba_attention, moba_attention_reference, moba_mask
from kernels.naive import naive_banded_attention


def _qkv(B, Hq, Hkv, n, D, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=gen).to(dtype) for h in (Hq, Hkv, Hkv)]


@pytest.mark.parametrize("B,Hq,Hkv,n,D,block,top_k", [
    (2, 4, 2, 37, 8, 5, 2),   # odd n, partial last block, GQA 2:1
    (1, 6, 2, 33, 16, 4, 3),  # GQA 3:1
    (2, 2, 2, 16, 8, 4, 2),   # n a multiple of the block
    (1, 4, 1, 29, 8, 1, 2),   # block size 1 (w_eff = 2 or 3)
    (1, 2, 2, 7, 8, 16, 2),   # one block larger than the sequence
])
def test_moba_matches_dense_reference(B, Hq, Hkv, n, D, block, top_k):
    q, k, v = _qkv(B, Hq, Hkv, n, D)
    torch.testing.assert_close(moba_attention(q, k, v, block, top_k), moba_attention_reference(q, k, v, block, top_k),
                               atol=2e-6, rtol=1e-5)


def _moba_loop(q, k, v, block, top_k):
    """MoBA one query at a time, written from the rule alone (not from the implementation's gate code): the own block
    (causal), plus the top_k - 1 earlier blocks whose mean key scores highest against the query."""
    B, Hq, n, D = q.shape
    group = Hq // k.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        for h in range(Hq):
            keys, values = k[b, h // group], v[b, h // group]
            for t in range(n):
                own = t // block
                past = sorted(range(own), key=lambda c: -float(q[b, h, t] @ keys[c * block:(c + 1) * block].mean(0)))
                chosen = [j for c in past[: top_k - 1] for j in range(c * block, (c + 1) * block)]
                chosen += list(range(own * block, t + 1))
                scores = keys[chosen] @ q[b, h, t] / D**0.5
                out[b, h, t] = torch.softmax(scores, 0) @ values[chosen]
    return out


@pytest.mark.parametrize("B,Hq,Hkv,n,block,top_k", [(1, 4, 2, 23, 4, 2), (2, 3, 1, 19, 3, 3), (1, 2, 2, 9, 1, 2)])
def test_moba_matches_a_per_query_loop(B, Hq, Hkv, n, block, top_k):
    q, k, v = _qkv(B, Hq, Hkv, n, 8, seed=7)
    torch.testing.assert_close(moba_attention(q, k, v, block, top_k), _moba_loop(q, k, v, block, top_k),
                               atol=2e-6, rtol=1e-5)


def test_moba_query_chunks_and_scale(monkeypatch):
    """The per-chunk gather (small memory budget: many query chunks) and an explicit scale give the same result."""
    q, k, v = _qkv(2, 4, 2, 41, 8, seed=1)
    ref = moba_attention_reference(q, k, v, 6, 2, scale=0.3)
    monkeypatch.setattr(moba_module, "_GATHER_BUDGET", 2 * 4 * 2 * 6 * 8 * 3)  # 3 queries per chunk
    torch.testing.assert_close(moba_attention(q, k, v, 6, 2, scale=0.3), ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("n,block,top_k", [(37, 5, 8), (37, 5, 100), (20, 10, 2), (64, 32, 2)])
def test_moba_with_every_block_selected_is_full_attention(n, block, top_k):
    q, k, v = _qkv(2, 4, 2, n, 8, seed=2)
    full = naive_banded_attention(q, k, v, n - 1, 0)  # causal, band as wide as the sequence
    torch.testing.assert_close(moba_attention(q, k, v, block, top_k), full, atol=2e-6, rtol=1e-5)


def test_moba_mask_rules():
    """Own block always (causal inside), no future block, exactly min(top_k, own block + 1) blocks per query."""
    n, block, top_k = 30, 4, 3
    q, k, _ = _qkv(1, 2, 1, n, 8, seed=3)
    mask = moba_mask(q, k, block, top_k)[0]  # [H, n, n]
    t = torch.arange(n)
    assert not (mask & (t[None, :] > t[:, None])).any()  # causal
    own = (t[None, :] // block == t[:, None] // block) & (t[None, :] <= t[:, None])
    assert (mask | ~own).all()  # the causal part of the own block is always visible
    blocks = torch.stack([mask[..., t // block == c].any(-1) for c in range(-(-n // block))], -1)  # [H, n, nb]
    assert torch.equal(blocks.sum(-1), torch.clamp(t // block + 1, max=top_k).expand(2, n))


def test_moba_gate_picks_the_block_with_the_matching_mean():
    """One query aligned with the mean of one past block attends to that block (and its own), not the others."""
    n, block, D = 16, 4, 4
    k = torch.zeros(1, 1, n, D)
    k[0, 0, 4:8, 0] = 1.0  # block 1 points along e0
    k[0, 0, 0:4, 1] = 1.0  # block 0 along e1
    k[0, 0, 8:12, 2] = 1.0  # block 2 along e2
    q = torch.zeros(1, 1, n, D)
    q[0, 0, 13, 0] = 1.0  # query in block 3 looks for e0
    mask = moba_mask(q, k, block, 2)[0, 0, 13]
    assert mask[4:8].all() and mask[12:14].all() and not mask[:4].any() and not mask[8:12].any() and not mask[14:].any()


def test_moba_backward_and_bf16():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 4, 2, 19, 8, seed=4))
    out = moba_attention(q, k, v, 3, 2)
    out.square().sum().backward()
    got = [t.grad for t in (q, k, v)]
    want = torch.autograd.grad(moba_attention_reference(q, k, v, 3, 2).square().sum(), (q, k, v))
    for name, a, b in zip("qkv", got, want):  # the gradients the dense masked reference gives (the block choice is
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)  # discrete: it carries no gradient)
    qb, kb, vb = (t.detach().bfloat16() for t in (q, k, v))
    out16 = moba_attention(qb, kb, vb, 3, 2)
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), moba_attention_reference(qb, kb, vb, 3, 2).float(), atol=3e-2, rtol=3e-2)


def test_moba_refuses_bad_shapes():
    q, k, v = _qkv(1, 3, 2, 8, 4)
    with pytest.raises(ValueError, match="multiple"):
        moba_attention(q, k, v, 2)
    q, k, v = _qkv(1, 2, 2, 8, 4)
    with pytest.raises(ValueError, match="block_size"):
        moba_attention(q, k, v, 0)
