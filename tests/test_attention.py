"""Attention against the dense masked reference of docs/method.md, and the invariants the spec asks for."""

import importlib.util
import weakref

import pytest
import torch

from kernels import banded_attention, default_band
from kernels.naive import band_mask, naive_banded_attention
from model.attention import Attention
from model.config import AttentionConfig, ModelConfig
from model.decoder import Decoder
from model.permutation import PermutationSampler

CPU_BACKENDS = ["torch", "naive"]


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def make_qkv(B, Hq, Hkv, n, D, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, n, D, generator=g, dtype=dtype).requires_grad_() for h in (Hq, Hkv, Hkv)]


def make_perm(kind, B, n, seed):
    g = torch.Generator().manual_seed(seed + 1)
    if kind is None:
        return None
    if kind == "shared":
        return torch.randperm(n, generator=g)
    return torch.stack([torch.randperm(n, generator=g) for _ in range(B)])


def dense_reference(q, k, v, window, perm):
    """Literal method.md: gather, dense mask (band and original-order causality), softmax, scatter."""
    left, right = default_band(window, perm is not None)
    return naive_banded_attention(q, k, v, left, right, perm)


def test_band_mask_matches_definition():
    pos = torch.tensor([3, 0, 2, 1])
    m = band_mask(pos, left=1, right=1)
    for i in range(4):
        for j in range(4):
            assert m[i, j] == (i - 1 <= j <= i + 1 and pos[j] <= pos[i])


@pytest.mark.parametrize("left,right", [(0, 0), (2, 0), (1, 3), (5, 5), (9, 1)])
def test_band_mask_of_per_sequence_orders_matches_definition(left, right):
    g = torch.Generator().manual_seed(left * 10 + right)
    pos = torch.stack([torch.randperm(9, generator=g) for _ in range(3)])
    m = band_mask(pos, left, right)
    assert m.shape == (3, 9, 9)
    for b in range(3):
        for i in range(9):
            for j in range(9):
                assert m[b, i, j] == (i - left <= j <= i + right and pos[b, j] <= pos[b, i])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_triton_asked_for_on_cpu_says_it_cannot_run(monkeypatch):
    """An explicit backend that cannot run here is an error that says what to use, never a silent fallback."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = make_qkv(1, 2, 2, 8, 16, seed=0)
    with pytest.raises(RuntimeError, match="needs a CUDA device .* use backend=auto or backend=torch"):
        banded_attention(q, k, v, 3, backend="triton")


def test_rows_move_through_pi_as_indexed_by_hand():
    from kernels.order import gather_rows, inverse_permutation, scatter_rows

    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 7, 4, generator=g)
    for perm in (torch.randperm(7, generator=g), torch.stack([torch.randperm(7, generator=g) for _ in range(2)])):
        rows = perm.expand(2, 7)
        gathered, inv = gather_rows(x, perm), inverse_permutation(perm)
        for b in range(2):
            for s in range(7):
                assert torch.equal(gathered[b, :, s], x[b, :, rows[b, s]])  # slot s holds token perm[s]
                assert inv.expand(2, 7)[b, rows[b, s]] == s
        assert torch.equal(scatter_rows(gathered, perm), x)


def test_reference_matches_a_loop_over_queries():
    """The dense reference against attention written one query and one key at a time from docs/method.md's rule:
    query at original position a sees key b iff b <= a and their slots (a's slot i = pi^-1[a]) are in the band."""
    import math

    g = torch.Generator().manual_seed(4)
    B, Hq, Hkv, n, D = 2, 4, 2, 11, 8
    q, k, v = (torch.randn(B, h, n, D, generator=g, dtype=torch.float64) for h in (Hq, Hkv, Hkv))
    for perm, (left, right) in ((None, (3, 0)), (torch.randperm(n, generator=g), (2, 1)),
                                (torch.stack([torch.randperm(n, generator=g) for _ in range(B)]), (1, 3))):
        out = naive_banded_attention(q, k, v, left, right, perm)
        for b in range(B):
            order = list(range(n)) if perm is None else perm.expand(B, n)[b].tolist()
            slot_of = {token: s for s, token in enumerate(order)}
            for h in range(Hq):
                kv = h // (Hq // Hkv)
                for a in range(n):
                    seen = [c for c in range(n) if c <= a and -left <= slot_of[c] - slot_of[a] <= right]
                    logits = [float(q[b, h, a] @ k[b, kv, c]) / math.sqrt(D) for c in seen]
                    top = max(logits)
                    weights = [math.exp(x - top) for x in logits]
                    expected = sum(w * v[b, kv, c] for w, c in zip(weights, seen)) / sum(weights)
                    torch.testing.assert_close(out[b, h, a], expected, rtol=1e-5, atol=1e-6)  # fp32 inside


@pytest.fixture(params=["dense-short", "blocked", "blocked-autograd"])
def torch_layout(request, monkeypatch):
    """The torch backend has two layouts (dense mask for short sequences, blocked band), the blocked one with two
    backward paths (the CPU's hand-written one; public SDPA and autograd, which GPUs take): test all on every shape."""
    import kernels.torch_band as torch_band

    monkeypatch.setattr(torch_band, "DENSE_MAX_N", 512 if request.param == "dense-short" else 0)
    monkeypatch.setattr(torch_band, "FUSED_CPU_BACKWARD", request.param != "blocked-autograd")
    return request.param


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer the torch backend allocates starts as NaN: a row it fails to write shows in the result."""
    import kernels.torch_band as torch_band

    monkeypatch.setattr(torch_band, "_empty", lambda shape, like: torch.full(shape, float("nan"), dtype=like.dtype,
                                                                             device=like.device))


@pytest.mark.parametrize("backend", ["torch"])
@pytest.mark.parametrize(
    "B,Hq,Hkv,n,D,window,perm_kind",
    [
        (2, 4, 4, 17, 16, 3, None),
        (2, 4, 2, 128, 16, 64, "batch"),
        (1, 4, 1, 257, 16, 64, "shared"),
        (2, 2, 2, 100, 32, 1, "batch"),
        (2, 4, 2, 33, 16, 1, None),
        (2, 2, 1, 40, 16, 64, None),  # w >= n
        (2, 2, 2, 40, 16, 100, "batch"),  # w >= n under pi
        (1, 2, 2, 1, 16, 3, "shared"),
        (2, 8, 2, 300, 64, 37, "batch"),
        (2, 8, 2, 1000, 64, 64, "batch"),
        (1, 4, 4, 1000, 16, 3, None),
        (2, 4, 1, 257, 64, 1000, "batch"),  # w >= n, GQA 4
    ],
)
def test_backend_matches_dense_reference(backend, B, Hq, Hkv, n, D, window, perm_kind, torch_layout, poisoned):
    q, k, v = make_qkv(B, Hq, Hkv, n, D, seed=n + window)
    perm = make_perm(perm_kind, B, n, seed=n)
    ref = dense_reference(q, k, v, window, perm)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    out = banded_attention(q, k, v, window, perm=perm, backend=backend)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert rel_err(out, ref) <= 1e-5
    for name, g, r in zip("qkv", grads, ref_grads):
        if r.norm() > 1e-4:  # w=1 or n=1: a lone key gets no gradient
            assert rel_err(g, r) <= 1e-5, f"d{name}"
        else:
            assert g.abs().max() <= 1e-5  # exactly zero in exact arithmetic


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # fp64: what backend=auto gives this path on CUDA
@pytest.mark.parametrize("perm_kind", [None, "shared", "batch"])
def test_torch_backend_on_cuda_matches_the_reference(dtype, perm_kind):
    """The blocked layout through public SDPA and autograd, the torch backend's path on a GPU (n > DENSE_MAX_N)."""
    q, k, v = (t.detach().to("cuda", dtype).requires_grad_() for t in make_qkv(2, 4, 2, 700, 32, seed=7))
    perm = make_perm(perm_kind, 2, 700, seed=7)
    perm = None if perm is None else perm.cuda()
    ref = dense_reference(q, k, v, 33, perm)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    out = banded_attention(q, k, v, 33, perm=perm, backend="torch")
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert rel_err(out, ref) <= 1e-5
    for name, g, r in zip("qkv", grads, ref_grads):
        assert rel_err(g, r) <= 1e-5, f"d{name}"


@pytest.mark.parametrize(
    "B,Hq,Hkv,n,D,window,perm_kind",
    [(2, 4, 2, 257, 64, 64, "batch"), (2, 4, 1, 1000, 16, 3, None), (1, 2, 2, 130, 64, 300, "shared"),
     (2, 4, 4, 600, 16, 17, "shared"), (1, 2, 2, 1, 16, 3, "shared"), (2, 2, 1, 17, 16, 1, "batch"),
     (2, 4, 2, 128, 64, 3, None)],
)
def test_fp16_matches_dense_reference(B, Hq, Hkv, n, D, window, perm_kind, torch_layout, poisoned):
    """fp16 inputs against the reference in fp32 on the same rounded values: output and gradients within 5e-3 of
    the reference norm."""
    q, k, v = (t.detach().half().requires_grad_() for t in make_qkv(B, Hq, Hkv, n, D, seed=n + window))
    perm = make_perm(perm_kind, B, n, seed=n)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = dense_reference(q32, k32, v32, window, perm)
    grad_out = torch.randn_like(ref).half()
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad_out.float())
    out = banded_attention(q, k, v, window, perm=perm, backend="torch")
    assert out.dtype == torch.float16
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    assert rel_err(out, ref) <= 5e-3
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g.dtype == torch.float16, f"d{name}"
        if r.norm() > 1e-4:  # w=1 or n=1: a lone key gets no gradient
            assert rel_err(g, r) <= 5e-3, f"d{name}"
        else:
            assert g.abs().max() <= 1e-3, f"d{name}"


@pytest.mark.parametrize("n", [150, 160])
@pytest.mark.parametrize("perm_kind", [None, "shared", "batch"])
def test_backend_takes_the_models_memory_layout(perm_kind, n, torch_layout):
    """The model's q, k, v (and the gradient arriving at the output) are [B, n, H, D] in memory, seen as [B, H, n, D]:
    rows of a head lie H x D apart, which the gathers and folds through pi must handle like contiguous heads.
    n = 160 is a multiple of the blocked layout's block (16 here): without pi, q then needs neither a gather nor
    padding and goes to the fused kernel's strided view as it is, which must first make it contiguous."""
    B, Hq, Hkv, D, window = 2, 4, 2, 16, 24
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, n, h, D, generator=g).transpose(1, 2).requires_grad_() for h in (Hq, Hkv, Hkv))
    grad_out = torch.randn(B, n, Hq, D, generator=g).transpose(1, 2)
    perm = make_perm(perm_kind, B, n, seed=3)
    ref = dense_reference(q, k, v, window, perm)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    out = banded_attention(q, k, v, window, perm=perm, backend="torch")
    assert rel_err(out, ref) <= 1e-5
    for name, got, want in zip("qkv", torch.autograd.grad(out, (q, k, v), grad_out), ref_grads):
        assert rel_err(got, want) <= 1e-5, f"d{name}"


@pytest.mark.parametrize("wanted", ["q", "k", "v", "kv"])
def test_a_gradient_for_some_of_q_k_v_only(wanted, torch_layout):
    """Frozen queries or keys/values (a probe, an attribution to the queries alone): the inputs that require a
    gradient get the reference's, the others none. The blocked CPU path has a no-graph inference branch: it may take
    it only when no input requires a gradient, else the output has no graph at all."""
    B, H, n, D, window = 2, 2, 90, 16, 9
    q, k, v = (t.detach() for t in make_qkv(B, H, H, n, D, seed=11))
    perm = make_perm("batch", B, n, seed=11)
    inputs = {"q": q, "k": k, "v": v}
    for name in wanted:
        inputs[name].requires_grad_()
    chosen = [inputs[name] for name in wanted]
    grad_out = torch.randn(B, H, n, D, generator=torch.Generator().manual_seed(12))
    ref = torch.autograd.grad(dense_reference(q, k, v, window, perm), chosen, grad_out)
    out = banded_attention(q, k, v, window, perm=perm, backend="torch")
    assert out.requires_grad
    for name, got, want in zip(wanted, torch.autograd.grad(out, chosen, grad_out), ref):
        assert rel_err(got, want) <= 1e-5, f"d{name}"


@pytest.mark.parametrize("n,left,right,block", [(37, 0, 0, 16), (37, 3, 0, 16), (50, 2, 5, 16), (20, 1, 1, 8),
                                                (32, 4, 4, 16)])
@pytest.mark.parametrize("perm_kind", [None, "shared", "batch"])
def test_block_masks_are_the_dense_band_mask_cut_into_blocks(n, left, right, block, perm_kind):
    """The blocked layout's mask slot by slot against band_mask (docs/method.md's rule): in block b, column c is key
    slot b * block - left + c, and a real query sees exactly the keys the dense mask gives it (pad slots, before 0 or
    from n on, never). A padded query (slots n.. up to the last block's end, discarded) must see at least one key:
    an all -inf row is a softmax over nothing, NaN in the kernel's output and log-sum-exp, which a kernel may carry
    into the gradients of the real keys in its span (with a narrow band, left < the padding, only pad keys are near)."""
    from kernels.order import storage_positions
    from kernels.torch_band import _block_masks

    B, span = 2, block + left + right
    pos = storage_positions(make_perm(perm_kind, B, n, seed=n + left), n, "cpu")
    nb = -(-n // block)
    mask = _block_masks(pos, n, left, right, block, nb, torch.float32)
    Bp = 1 if pos.dim() == 1 else B
    assert mask.shape == (Bp, nb, 1, block, span)
    assert bool(((mask == 0) | (mask == float("-inf"))).all())
    visible = (mask[:, :, 0] == 0).reshape(Bp, nb * block, span)  # row i: query slot i
    dense = band_mask(pos, left, right).expand(Bp, n, n)
    for i in range(nb * block):
        keys = torch.arange(span) + (i // block) * block - left  # the key slot of each column
        real = (keys >= 0) & (keys < n)
        if i < n:
            want = torch.zeros(Bp, span, dtype=torch.bool)
            want[:, real] = dense[:, i, keys[real]]
            assert torch.equal(visible[:, i], want), i
        else:
            assert bool(visible[:, i].any(-1).all()), f"padded query slot {i} sees no key"


def test_identity_permutation_with_causal_band_is_swa(torch_layout):
    q, k, v = make_qkv(2, 4, 2, 70, 16, seed=1)
    w = 9
    ident = torch.arange(70)
    for backend in CPU_BACKENDS:
        swa = banded_attention(q, k, v, w, backend=backend)
        sa = banded_attention(q, k, v, w, perm=ident, band=(w - 1, 0), backend=backend)
        torch.testing.assert_close(sa, swa, rtol=0, atol=1e-6)


def test_swa_with_window_at_least_n_is_full_attention(torch_layout):
    q, k, v = make_qkv(2, 4, 4, 50, 16, seed=2)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for w in (50, 51, 1000):
        for backend in CPU_BACKENDS:
            torch.testing.assert_close(banded_attention(q, k, v, w, backend=backend), full, rtol=1e-5, atol=1e-5)


def test_every_query_sees_at_least_itself():
    pos = torch.randperm(64)
    m = band_mask(pos, *default_band(1, permuted=True))
    assert bool(m.diagonal().all()) and int(m.sum()) == 64


def test_sa_key_count_matches_expectation():
    # The token at original position t sees itself + each other band slot with probability ~ t/n.
    n, w = 4096, 65
    pos = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    m = band_mask(pos, *default_band(w, permuted=True))
    seen = m.sum(-1).float()  # per storage slot
    late = seen[pos >= 3 * n // 4].mean().item()  # tokens near the end see almost the whole band
    early = seen[pos < n // 4].mean().item()
    assert 1 + (w - 1) * 0.8 < late <= w
    assert early < 1 + (w - 1) * 0.2


def test_bad_arguments_are_refused():
    q, k, v = make_qkv(1, 3, 2, 8, 16, seed=0)
    with pytest.raises(ValueError, match="multiple"):
        banded_attention(q, k, v, 4)
    with pytest.raises(ValueError, match="multiple"):  # no key/value head: a ZeroDivisionError before
        banded_attention(q, k[:, :0], v[:, :0], 4)
    q, k, v = make_qkv(1, 2, 2, 8, 16, seed=0)
    with pytest.raises(ValueError, match="window"):
        banded_attention(q, k, v, 0)
    with pytest.raises(ValueError, match="backend"):
        banded_attention(q, k, v, 4, backend="cuda-magic")
    with pytest.raises(ValueError, match="perm"):
        banded_attention(q, k, v, 4, perm=torch.arange(7))
    with pytest.raises(ValueError, match="perm"):  # [B', n] with B' != B: every backend refuses, at any n
        banded_attention(q, k, v, 4, perm=torch.stack([torch.randperm(8), torch.randperm(8)]))
    with pytest.raises(ValueError, match="band"):
        banded_attention(q, k, v, 4, band=(-1, 2))



@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["torch", "naive", "flex", "triton"])
def test_a_perm_that_is_not_a_permutation_is_refused(backend, monkeypatch):
    """Out of range, Triton read past the tensors (-1 crashed the process); a repeated entry left rows unwritten
    (Triton) or took an inverse from uninitialised memory (torch): each is refused before a kernel runs."""
    monkeypatch.setenv("SA_FLEX_COMPILE", "0")  # eager flex: the check comes first either way
    q, k, v = make_qkv(2, 2, 2, 8, 16, seed=0)
    good = torch.stack([torch.randperm(8), torch.randperm(8)])
    bad = {
        "out of range": (good.clone().index_fill_(1, torch.tensor([3]), 8), ValueError, r"\[0, 8\)"),
        "negative": (good.clone().index_fill_(1, torch.tensor([0]), -1), ValueError, r"\[0, 8\)"),
        "repeated": (torch.cat([good[:1], torch.tensor([[0, 1, 2, 3, 4, 5, 6, 6]])]), ValueError,
                     r"perm\[1\] is not a permutation of 0..7: it repeats entries and misses 1 \(e.g. 7\)"),
        "float": (good.float(), TypeError, "integer"),
        "bool": (good > 3, TypeError, "integer"),
    }
    for name, (perm, error, message) in bad.items():
        with pytest.raises(error, match=message):
            banded_attention(q, k, v, 4, perm=perm, backend=backend)
    with pytest.raises(ValueError, match="not a permutation"):  # a shared [n] pi too
        banded_attention(q, k, v, 4, perm=torch.zeros(8, dtype=torch.long), backend=backend)
    with torch.no_grad():  # int32 and a strided view are fine, and so is an empty batch
        out = banded_attention(q, k, v, 4, perm=good.int().t().contiguous().t(), backend=backend)
        ref = banded_attention(q, k, v, 4, perm=good, backend="naive")
        empty = banded_attention(q[:0], k[:0], v[:0], 4, perm=good[:0], backend=backend)
    assert rel_err(out, ref) <= 1e-5
    assert empty.shape == (0, 2, 8, 16)


def test_inputs_of_mixed_dtype_or_a_fractional_window_are_refused():
    q, k, v = make_qkv(1, 2, 2, 8, 16, seed=0)
    with pytest.raises(TypeError, match="one dtype"):
        banded_attention(q, k.half(), v, 4)
    with pytest.raises(TypeError, match="integer number of slots"):
        banded_attention(q, k, v, 2.5)
    with pytest.raises(TypeError, match="integer number of slots"):
        banded_attention(q, k, v, True)
    with pytest.raises(TypeError):
        banded_attention(q, k, v, 4, band=(2.0, 1))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("n", [40, 600])  # the torch backend's dense path, and its blocked one (raw CPU kernels)
@pytest.mark.parametrize("perm_kind", [None, "shared"])
def test_under_autocast_every_path_runs_in_its_dtype(backend, n, perm_kind):
    """fp32 inputs under bf16 autocast run in bf16 as SDPA's do, on every path: the same output as bf16 inputs given
    outside autocast, also for q and k made fp32 by RoPE's cos/sin next to a bf16 v. The torch backend's blocked path
    returned fp32 here while its dense path returned bf16."""
    q, k, v = make_qkv(1, 2, 2, n, 16, seed=n)
    perm = make_perm(perm_kind, 1, n, seed=n)
    expected = banded_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 8, perm, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = banded_attention(q, k, v, 8, perm, backend=backend)
        mixed = banded_attention(q, k, v.bfloat16(), 8, perm, backend=backend)
    assert got.dtype == mixed.dtype == torch.bfloat16
    assert torch.equal(got, expected) and torch.equal(mixed, expected)
    got.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()  # gradients reach the fp32 leaves


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_shapes_pass_through_on_the_meta_device(backend):
    """Shape and FLOP tools run forwards on meta tensors, which have no autocast to ask about."""
    q = torch.empty(2, 4, 40, 16, device="meta")
    kv = torch.empty(2, 2, 40, 16, device="meta")
    assert banded_attention(q, kv, kv, 8, backend=backend).shape == (2, 4, 40, 16)


def test_auto_backend_picks_one_that_takes_the_input():
    from kernels import resolve_backend

    cuda = torch.device("cuda")
    q = torch.empty(1, 2, 8, 64, device="meta")
    if importlib.util.find_spec("triton") is not None:
        assert resolve_backend("auto", cuda, q) == "triton"
    assert resolve_backend("auto", cuda, q.double()) == "torch"  # fp64: the Triton kernel takes fp16/bf16/fp32
    assert resolve_backend("auto", cuda, torch.empty(1, 2, 8, 512, device="meta")) == "torch"  # head dim > 256
    assert resolve_backend("auto", torch.device("cpu"), q) == "torch"


def test_default_band_and_explicit_backends_that_cannot_run(monkeypatch):
    """SA's band under pi is (floor((w-1)/2), floor(w/2)), SWA's (w-1, 0); head dim 256 still takes Triton; a missing
    triton package is a clear error for backend=triton and auto's reason to take torch; a negative right edge is
    refused like a negative left one."""
    import kernels

    assert default_band(8, False) == (7, 0) and default_band(8, True) == (3, 4) and default_band(7, True) == (3, 3)
    cuda = torch.device("cuda")
    if importlib.util.find_spec("triton") is not None:
        assert kernels.resolve_backend("auto", cuda, torch.empty(1, 2, 8, 256, device="meta")) == "triton"
    q, k, v = make_qkv(1, 2, 2, 8, 16, seed=0)
    with pytest.raises(ValueError, match="band"):
        banded_attention(q, k, v, 4, band=(2, -1))
    monkeypatch.setattr(kernels, "_triton_available", lambda: False)
    assert kernels.resolve_backend("auto", cuda, q) == "torch"
    with pytest.raises(RuntimeError, match="not installed"):
        kernels.resolve_backend("triton", cuda, q)


def _layer(kind, window=8, backend="torch", n_kv_heads=2, seed=0):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=64, n_layers=1, d_model=64, n_heads=4, n_kv_heads=n_kv_heads, max_seq_len=64)
    return Attention(cfg, AttentionConfig(kind=kind, window=window, backend=backend), layer=0,
                     sampler=PermutationSampler(seed=3))


@pytest.mark.parametrize("open_path", ["sa", "swa"])
def test_gates_at_zero_or_one_reproduce_one_path(open_path):
    gated = _layer("gated_sa_swa")
    single = _layer(open_path)
    single.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("gate.")})
    with torch.no_grad():
        gated.gate.weight.zero_()
        inf = float("inf")
        sa_bias, swa_bias = (inf, -inf) if open_path == "sa" else (-inf, inf)
        gated.gate.bias[:4] = sa_bias
        gated.gate.bias[4:] = swa_bias
    gated.eval(), single.eval()
    x = torch.randn(2, 40, 64)
    torch.testing.assert_close(gated(x), single(x), rtol=0, atol=0)


def test_gated_mix_at_random_gates_is_two_independent_sigmoids():
    """Away from 0, 1/2 and 1, where a softmax over the paths or sigma and 1 - sigma give the same outputs:
    y_h = sigmoid(g_sa,h) * y_SA,h + sigmoid(g_swa,h) * y_SWA,h with the gates of the layer input."""
    layer = _layer("gated_sa_swa").eval()
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.5)
        layer.gate.bias.normal_(0, 1.0)
    B, n, H, Hkv, D = 2, 40, 4, 2, 16
    x = torch.randn(B, n, 64)
    perm = layer.sampler.sample(0, n, B, training=False)
    q = layer.rotary(layer.q_proj(x).view(B, n, H, D).transpose(1, 2))
    k = layer.rotary(layer.k_proj(x).view(B, n, Hkv, D).transpose(1, 2))
    v = layer.v_proj(x).view(B, n, Hkv, D).transpose(1, 2)
    gates = torch.sigmoid(layer.gate(x)).transpose(1, 2)[..., None]  # [B, 2H, n, 1]: SA's first, then SWA's
    y = gates[:, :H] * dense_reference(q, k, v, 8, perm.expand(B, n)) + gates[:, H:] * dense_reference(q, k, v, 8, None)
    torch.testing.assert_close(layer(x), layer.o_proj(y.transpose(1, 2).reshape(B, n, H * D)), rtol=1e-5, atol=1e-5)


def test_per_sequence_perm_off_shares_one_pi_across_the_batch():
    def drawn(per_sequence):
        dec = Decoder(ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=2, max_seq_len=32),
                      AttentionConfig(kind="sa", window=4, per_sequence_perm=per_sequence)).train()
        return dec.blocks[0].attn.draw_perm(32, 3)

    assert drawn(False).shape == (32,)  # one pi for every sequence of the batch
    per_sequence = drawn(True)
    assert per_sequence.shape == (3, 32) and not torch.equal(per_sequence[0], per_sequence[1])


@pytest.mark.parametrize("kind", ["sa", "gated_sa_swa"])
def test_each_layer_gets_its_own_pi_and_its_normed_input(kind):
    """The decoder hands layer l the sampler's pi for l, in training and evaluation, with padding lengths too (layer
    0's pi reused by every layer passed every other test), and each block's attention and gates read its pre-norm
    input (the raw residual passed too)."""
    cfg = ModelConfig(vocab_size=50, n_layers=3, d_model=32, n_heads=2, max_seq_len=24)
    model = Decoder(cfg, AttentionConfig(kind=kind, window=4))
    with torch.no_grad():  # gates off their zero init, so that their input shows in the output
        for block in model.blocks:
            if block.attn.gate is not None:
                block.attn.gate.weight.normal_()
            block.attn_norm.weight.uniform_(0.5, 1.5)
    blocks_in, attn_in, gate_in = [], [], []
    hooks = [block.register_forward_pre_hook(lambda _, args: blocks_in.append(args)) for block in model.blocks]
    hooks += [block.attn.register_forward_pre_hook(lambda _, args: attn_in.append(args[0])) for block in model.blocks]
    hooks += [block.attn.gate.register_forward_pre_hook(lambda _, args: gate_in.append(args[0]))
              for block in model.blocks if block.attn.gate is not None]
    tokens = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(0))
    try:
        for training, lengths in ((True, None), (False, None), (False, torch.tensor([20, 13])),
                                  (True, torch.tensor([13, 20]))):
            for seen in (blocks_in, attn_in, gate_in):
                seen.clear()
            model.train(training)
            model(tokens, lengths)
            perms = [args[2] for args in blocks_in]
            for layer, perm in enumerate(perms):
                assert torch.equal(perm, model.sampler.sample(layer, 20, 2, training, lengths)), (training, layer)
            assert all(not torch.equal(perms[a], perms[b]) for a in range(3) for b in range(a + 1, 3))
            for block, (x, *_), got in zip(model.blocks, blocks_in, attn_in):
                assert torch.equal(got, block.attn_norm(x))
            assert len(gate_in) == (0 if kind == "sa" else 3) and all(g is a for g, a in zip(gate_in, attn_in))
    finally:
        for hook in hooks:
            hook.remove()


def test_gates_start_at_one_half():
    layer = _layer("gated_sa_swa")
    assert layer.gate.weight.abs().sum() == 0 and layer.gate.bias.abs().sum() == 0
    dec = Decoder(ModelConfig(vocab_size=64, n_layers=2, d_model=64, n_heads=4, max_seq_len=32),
                  AttentionConfig(kind="gated_sa_swa", window=4))
    assert all(b.attn.gate.weight.abs().sum() == 0 for b in dec.blocks)
    extra = 2 * 4 * (64 + 1) * 2  # 2*Hq*(d_model+1) per layer
    base = Decoder(ModelConfig(vocab_size=64, n_layers=2, d_model=64, n_heads=4, max_seq_len=32),
                   AttentionConfig(kind="sa", window=4))
    assert dec.num_parameters() - base.num_parameters() == extra


def test_sa_layer_equals_manual_pipeline():
    """RoPE at original positions, gather by pi, band, scatter: the layer against a hand-written dense version."""
    layer = _layer("sa", window=5, backend="torch").eval()
    x = torch.randn(2, 30, 64)
    perm = layer.sampler.sample(0, 30, 2, training=False)
    B, n, H, Hkv, D = 2, 30, 4, 2, 16
    q = layer.rotary(layer.q_proj(x).view(B, n, H, D).transpose(1, 2))
    k = layer.rotary(layer.k_proj(x).view(B, n, Hkv, D).transpose(1, 2))
    v = layer.v_proj(x).view(B, n, Hkv, D).transpose(1, 2)
    y = dense_reference(q, k, v, 5, perm.expand(B, n))
    expected = layer.o_proj(y.transpose(1, 2).reshape(B, n, H * D))
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_permutations_are_seeded_per_layer_step_and_rank():
    s = PermutationSampler(seed=1, eval_seed=7)
    a = s.sample(0, 50, 2, training=True)
    assert a.shape == (2, 50) and not torch.equal(a[0], a[1])  # per sequence
    assert torch.equal(a, s.sample(0, 50, 2, training=True))  # same (seed, step, layer, rank)
    assert not torch.equal(a, s.sample(1, 50, 2, training=True))  # another layer
    s.step = 1
    assert not torch.equal(a, s.sample(0, 50, 2, training=True))  # another step
    s.step, s.rank = 0, 1
    assert not torch.equal(a, s.sample(0, 50, 2, training=True))  # another rank
    e = s.sample(0, 50, 2, training=False)
    assert torch.equal(e, PermutationSampler(seed=99, eval_seed=7).sample(0, 50, 2, training=False))
    assert not torch.equal(e, PermutationSampler(eval_seed=8).sample(0, 50, 2, training=False))
    for p in a:
        assert torch.equal(p.sort().values, torch.arange(50))


def test_runs_with_nearby_seeds_steps_or_layers_draw_unrelated_permutations():
    """pi's generator is keyed by the tuple (seed, step, layer, rank), hashed: a key summed like seed + step would give
    the run with seed 1 at step s the permutations of the run with seed 0 at step s + 1 (two "independent" seeds
    replaying one stream, one step apart), and likewise for step and layer, or layer and rank."""
    def pi(seed=0, step=0, layer=0, rank=0):
        return PermutationSampler(seed=seed, step=step, rank=rank).sample(layer, 64, 2, training=True)

    draws = [pi(), pi(seed=1), pi(step=1), pi(layer=1), pi(rank=1), pi(seed=1, step=1), pi(step=1, layer=1),
             pi(layer=1, rank=1), pi(seed=2), pi(step=2), pi(layer=2), pi(rank=2)]
    for a in range(len(draws)):
        for b in range(a + 1, len(draws)):
            assert not torch.equal(draws[a], draws[b]), (a, b)


@pytest.mark.parametrize("kind", ["full", "swa", "sa", "gated_sa_swa", "moba"])
def test_padding_does_not_change_a_sequence(kind):
    torch.manual_seed(0)
    dec = Decoder(ModelConfig(vocab_size=50, n_layers=2, d_model=32, n_heads=2, max_seq_len=40),
                  AttentionConfig(kind=kind, window=4, backend="torch")).eval()
    seq = torch.randint(0, 50, (1, 23))
    other = torch.randint(0, 50, (1, 40))
    batch = torch.cat([torch.cat([seq, torch.zeros(1, 17, dtype=torch.long)], 1), other])
    alone = dec(seq, lengths=torch.tensor([23]))
    padded = dec(batch, lengths=torch.tensor([23, 40]))
    torch.testing.assert_close(padded[0, :23], alone[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["full", "swa", "sa", "gated_sa_swa"])
def test_decoder_backends_agree_and_state_dict_is_backend_free(kind):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=40)
    a = Decoder(cfg, AttentionConfig(kind=kind, window=6, backend="torch")).eval()
    b = Decoder(cfg, AttentionConfig(kind=kind, window=6, backend="naive")).eval()
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, 50, (2, 37))
    torch.testing.assert_close(a(tokens), b(tokens), rtol=1e-5, atol=1e-5)


def test_keep_freed_memory_applies_once_and_can_be_turned_off(monkeypatch):
    """The glibc tuning the entry points call: idempotent, off with SA_CPU_MALLOC=0, a no-op where libc lacks it."""
    import platform

    import kernels.cpu_malloc as cpu_malloc

    monkeypatch.setattr(cpu_malloc, "_applied", None)
    monkeypatch.setenv("SA_CPU_MALLOC", "0")
    assert cpu_malloc.keep_freed_memory() is False
    monkeypatch.setattr(cpu_malloc, "_applied", None)
    monkeypatch.delenv("SA_CPU_MALLOC")
    first = cpu_malloc.keep_freed_memory()
    assert first is (platform.libc_ver()[0] == "glibc")
    assert cpu_malloc.keep_freed_memory() is first  # once per process
    big = torch.randn(3, 2**22)  # 48 MB: above glibc's largest mmap threshold, served from the heap now
    assert torch.equal(big.clone(), big)


@pytest.mark.parametrize("kind", ["swa", "sa", "gated_sa_swa", "moba"])
@pytest.mark.parametrize("n", [1, 2, 7, 16])
def test_the_window_at_which_a_variant_becomes_full_attention(kind, n):
    """AttentionConfig.sees_every_earlier_token (the warning train.py and evaluate.py give) against the masks the
    variants run: at the smallest such window the output is full causal attention, one slot below it is not."""
    from kernels.moba import moba_attention

    q, k, v = make_qkv(1, 2, 2, n, 8, seed=n)
    full = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    # pi with position 0 in the first slot and n-1 in the last: a band one slot narrower than the whole sequence
    # hides the first token from the last query
    perm = torch.cat([torch.tensor([0]), 1 + torch.randperm(n - 2, generator=torch.Generator().manual_seed(n)),
                      torch.tensor([n - 1])]) if n > 1 else torch.zeros(1, dtype=torch.long)

    def run(w):
        if kind == "moba":
            return moba_attention(q, k, v, block_size=max(1, w // 2), top_k=2)
        paths = [(None, "swa"), (perm, "sa")] if kind == "gated_sa_swa" else [(perm if kind == "sa" else None, kind)]
        return [naive_banded_attention(q, k, v, *default_band(w, p is not None), p) for p, _ in paths]

    lowest = 2 if kind == "moba" else 1  # MoBA's blocks of window/2 need window >= 2
    smallest = next(w for w in range(lowest, 4 * n + 4)
                    if AttentionConfig(kind=kind, window=w).sees_every_earlier_token(n))
    for out in (run(smallest) if kind != "moba" else [run(smallest)]):
        assert rel_err(out, full) < 1e-5
    if smallest > lowest and n > 1:
        below = run(smallest - 1) if kind != "moba" else [run(smallest - 1)]
        assert any(rel_err(out, full) > 1e-3 for out in below)  # one slot narrower: not full attention


@pytest.mark.parametrize("Hkv", [1, 2, 4])
def test_full_attention_with_grouped_kv_heads_matches_the_reference(Hkv, monkeypatch):
    """On the CPU, SDPA reads each K/V head for its group of query heads (enable_gqa, no expanded copy): output and
    gradients."""
    from model.attention import full_causal_attention

    torch.manual_seed(Hkv)
    q = torch.randn(2, 4, 37, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, Hkv, 37, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    ref = full_causal_attention(q, k, v, backend="naive")
    if Hkv < 4:
        monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **kw: pytest.fail("K/V copied per head"))
    ours = full_causal_attention(q, k, v)
    monkeypatch.undo()
    torch.testing.assert_close(ours, ref)  # fp64 tolerances: the reference computes in fp64 too
    g = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, (q, k, v), g)
    for got, want in zip(grads, torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_second_order_gradient_raises_instead_of_dropping_terms(backend, monkeypatch):
    """The hand-written backwards return gradients without a graph: under create_graph=True their own gradient was
    silently zero (d/dk of |dq|^2: 7.1 for 182.7), now it is an error."""
    import kernels.torch_band as torch_band

    monkeypatch.setattr(torch_band, "DENSE_MAX_N", 0)  # the blocked layout, whose CPU backward is by hand
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 24, 16, seed=5))
    out = banded_attention(q, k, v, 4, perm=torch.randperm(24), backend=backend)
    dq, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.square().sum().backward()


def test_inference_keeps_one_sequence_of_buffers_at_a_time(monkeypatch):
    """Without a gradient to come the blocked torch path kept every sequence's padded q/k/v, output and LSE until
    it returned (~3x the input); now each sequence's go before the next, and the output is the same."""
    from kernels import torch_band

    B, H, n, D = 4, 2, 600, 16  # past DENSE_MAX_N: the blocked path
    q, k, v = make_qkv(B, H, H, n, D, seed=3)
    perm = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(b)) for b in range(B)])
    live, peak, real = [0], [0], torch_band._empty

    def counting(shape, like):
        t = real(shape, like)
        live[0] += t.numel()
        peak[0] = max(peak[0], live[0])
        weakref.finalize(t, lambda size=t.numel(): live.__setitem__(0, live[0] - size))
        return t

    monkeypatch.setattr(torch_band, "_empty", counting)
    with torch.no_grad():
        out = torch_band.torch_banded_attention(q, k, v, 4, 4, perm)
    torch.testing.assert_close(out, naive_banded_attention(q, k, v, 4, 4, perm), rtol=1e-5, atol=1e-5)
    assert peak[0] < 2 * q.numel()  # the output and one sequence's buffers (1.8x); all 4 sequences' made it 4.1x


def test_padded_permutations_move_real_tokens_only_and_ignore_the_rest_of_the_batch():
    """Right padding: pi permutes the first L_b slots among themselves and leaves the pads in place, in training (where
    lengths were ignored, pads drawn into the band of real tokens) and at evaluation, for L_b = n - 1 too; an eval
    sequence's pi depends only on (eval seed, layer, L_b), never on the rows before it (one generator shared by the
    batch gave the second row another pi than alone)."""
    n, lengths = 40, [40, 23, 39, 1, 23]
    samplers = (PermutationSampler(seed=2), PermutationSampler(seed=2, per_sequence=False),
                PermutationSampler(eval_seed=4))
    for sampler, training in zip(samplers, (True, True, False)):
        perms = sampler.sample(1, n, len(lengths), training=training, lengths=torch.tensor(lengths)).long()
        assert perms.shape == (len(lengths), n)
        for p, length in zip(perms, lengths):
            assert torch.equal(p[:length].sort().values, torch.arange(length))
            assert torch.equal(p[length:], torch.arange(length, n))
            assert length < 3 or not torch.equal(p[:length], torch.arange(length))  # real tokens are permuted
        if not training:
            for p, length in zip(perms, lengths):
                assert torch.equal(p, sampler.sample(1, n, 1, training=False, lengths=[length])[0].long())
            assert torch.equal(perms[0], sampler.sample(1, n, 1, training=False).long())  # unpadded: the shared pi


def test_rotary_turns_each_half_pair_by_its_original_position():
    """RoPE (rotate-half, model/layers.py): component i and i + D/2 form one complex number that position t turns by
    t * theta^(-2i/D). Written here with complex numbers, not the layer's cos/sin tables: a swapped cos and sin, the
    opposite turn, interleaved pairs (not what the Llama export maps to) or a wrong base or exponent all change which
    relative positions a head can tell apart, and every attention backend would agree with the wrong q and k."""
    from model.layers import Rotary

    B, H, n, D, theta = 2, 3, 40, 16, 500.0
    x = torch.randn(B, H, n, D)
    got = Rotary(D, max_seq_len=64, theta=theta)(x)  # a table longer than the input: rows 0..n-1 are used
    t = torch.arange(n, dtype=torch.float64)[:, None]
    angle = t * theta ** (-2 * torch.arange(D // 2, dtype=torch.float64) / D)
    z = torch.complex(x[..., : D // 2].double(), x[..., D // 2:].double()) * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(got, torch.cat([z.real, z.imag], dim=-1).float(), atol=1e-5, rtol=1e-5)


def test_rmsnorm_and_swiglu_follow_their_definitions():
    """RMSNorm is x / sqrt(mean(x^2) + eps) * weight (eps inside the root; a large eps here, so its place shows) and
    SwiGLU is down(silu(gate x) * up x): the Llama definitions the export and pretrained-model comparisons rely on."""
    from model.layers import RMSNorm, SwiGLU

    x = torch.randn(3, 5, 32) * 0.3
    norm = RMSNorm(32, eps=0.05)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    want = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 0.05) * norm.weight.double()
    torch.testing.assert_close(norm(x).double(), want, atol=1e-6, rtol=1e-5)
    mlp = SwiGLU(32, 48)
    gate, up, down = (m.weight.double() for m in (mlp.gate, mlp.up, mlp.down))
    hidden = x.double() @ gate.T
    want = (hidden * torch.sigmoid(hidden) * (x.double() @ up.T)) @ down.T
    torch.testing.assert_close(mlp(x).double(), want, atol=1e-6, rtol=1e-5)


def test_decoder_init_scales_the_residual_projections_by_depth():
    """reset_parameters: N(0, init_std) for every matrix but the two that write into the residual stream (o_proj,
    down), which get init_std / sqrt(2 * n_layers) (GPT-2), norms at 1 and gates at 0. A wrong std starts every run
    elsewhere (the stream's variance grows with depth) and no output comparison would notice."""
    L, std = 3, 0.05
    dec = Decoder(ModelConfig(vocab_size=256, n_layers=L, d_model=64, n_heads=4, max_seq_len=16, init_std=std,
                              tie_embeddings=False), AttentionConfig(kind="gated_sa_swa", window=4))
    kinds = set()
    for name, p in dec.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        elif ".attn.gate." in name:
            assert not p.any(), name
        else:
            want = std / (2 * L) ** 0.5 if name.endswith(("o_proj.weight", "mlp.down.weight")) else std
            assert p.std().item() == pytest.approx(want, rel=0.1), name
            assert abs(p.mean().item()) < 0.1 * want, name
            kinds.add(name.split(".")[-2])
    assert {"embed", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "gate", "up", "down"} <= kinds


def test_a_sequence_longer_than_max_seq_len_is_refused_by_name():
    """RoPE's tables hold max_seq_len positions: one more token must be a ValueError naming model.max_seq_len, not a
    shape error from inside a layer (or, with longer tables, positions the model never trained on)."""
    dec = Decoder(ModelConfig(vocab_size=32, n_layers=1, d_model=32, n_heads=2, max_seq_len=16),
                  AttentionConfig(kind="swa", window=4, backend="torch"))
    assert dec(torch.randint(0, 32, (1, 16))).shape == (1, 16, 32)
    with pytest.raises(ValueError, match="17 tokens exceeds model.max_seq_len=16"):
        dec(torch.randint(0, 32, (1, 17)))
