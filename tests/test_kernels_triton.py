"""Fused Triton banded attention vs the dense reference (kernels/naive.py): forward and dq, dk, dv.

On CPU the kernels run through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so sizes are
small and blocks large. Error measure: ||kernel - reference|| / ||reference|| over the whole tensor, with the
reference computed in fp32 from the same inputs; a gradient that is zero in exact arithmetic (w=1: one key per query)
must be zero to within the threshold elementwise. Thresholds: 1e-4 for fp32, 5e-3 for fp16, 3e-2 for bf16 (the
interpreter truncates fp32 -> bf16 instead of rounding). Every buffer the kernels allocate is pre-filled with NaN, so
a row the kernels forget to write fails the test.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kernels import banded_attention, default_band  # noqa: E402
from kernels.naive import naive_banded_attention  # noqa: E402

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cuda" if CUDA and not INTERPRET else "cpu"
requires_cuda = pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU (compiled Triton)")
pytestmark = pytest.mark.skipif(not (CUDA or INTERPRET), reason="Triton needs CUDA or TRITON_INTERPRET=1")

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def pin_tiles(tb, monkeypatch, bm: int, bn: int) -> None:
    """Every kernel on BLOCK_M x BLOCK_N tiles: the interpreter's config, and on a GPU the pinned one with autotuning
    off (compiled sm_90 code meets rectangular tiles and both tile loops here too, not only under the interpreter)."""
    monkeypatch.setattr(tb, "_interp_blocks", lambda n: {"BLOCK_M": bm, "BLOCK_N": bn})
    monkeypatch.setattr(tb, "_AUTOTUNE", False)
    monkeypatch.setattr(tb, "_fixed_gpu_config",
                        lambda row_bytes: {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": 4, "num_stages": 2})
    for name, kernel in (("_fwd", tb._fwd_kernel), ("_dq", tb._dq_kernel), ("_dkdv", tb._dkdv_kernel)):
        monkeypatch.setattr(tb, name, kernel)  # not the autotuner, which a GPU import wraps them in


@pytest.fixture(autouse=True)
def tb(monkeypatch):
    """The kernel module (imported lazily, after conftest set TRITON_INTERPRET), with NaN-poisoned allocations."""
    import kernels.triton_band as module

    def poisoned(shape, like, dtype=None):
        return torch.full(shape, float("nan"), device=like.device, dtype=like.dtype if dtype is None else dtype)

    monkeypatch.setattr(module, "_empty", poisoned)
    return module


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative to the reference norm; the largest absolute error where the reference is exactly zero."""
    diff, norm = (out.float() - ref.float()), ref.float().norm()
    if norm > 0:
        return (diff.norm() / norm).item()
    return diff.abs().amax().item() if diff.numel() else 0.0


def make_perm(kind: str, B: int, n: int, gen: torch.Generator):
    if kind == "none":
        return None
    if kind == "shared":
        return torch.randperm(n, generator=gen).to(DEVICE)
    if kind == "identity":
        return torch.arange(n, device=DEVICE)
    # "batch": [B, n], int32 as model.permutation draws it ("shared" stays int64: both dtypes are launched)
    return torch.stack([torch.randperm(n, generator=gen, dtype=torch.int32) for _ in range(B)]).to(DEVICE)


def make_inputs(B, Hq, Hkv, n, D, dtype, gen):
    q = torch.randn(B, Hq, n, D, generator=gen)
    k = torch.randn(B, Hkv, n, D, generator=gen)
    v = torch.randn(B, Hkv, n, D, generator=gen)
    do = torch.randn(B, Hq, n, D, generator=gen)
    return [t.to(DEVICE, dtype) for t in (q, k, v)], do.to(DEVICE, dtype)


def check_against_naive(qkv, do, left, right, perm, dtype, scale=None, tol=None):
    from kernels.triton_band import triton_banded_attention

    tol = TOL[dtype] if tol is None else tol
    q, k, v = (t.detach().requires_grad_() for t in qkv)
    out = triton_banded_attention(q, k, v, left, right, perm, scale)
    grads = torch.autograd.grad(out, (q, k, v), do)
    # reference in fp32 from the same (rounded) inputs
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in qkv)
    ref = naive_banded_attention(q32, k32, v32, left, right, perm, scale)
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), do.float())

    assert out.dtype == dtype and out.shape == q.shape
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), f"{name} has non-finite values (unwritten rows?)"
        err = rel_err(a, b)
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:g}"
    return out, grads


F32, F16 = torch.float32, torch.float16
# (B, Hq, Hkv, n, D, window, perm kind, dtype); band = default_band(window, permuted): SWA (w-1, 0), SA symmetric
CASES = [
    (2, 2, 2, 1, 16, 1, "none", F32),
    (2, 4, 1, 1, 64, 3, "batch", F32),
    (2, 4, 2, 17, 16, 3, "none", F32),
    (2, 4, 1, 17, 64, 64, "batch", F32),  # w >= n
    (2, 2, 1, 17, 16, 1, "shared", F16),
    (2, 2, 2, 128, 64, 64, "none", F32),
    (2, 4, 2, 128, 16, 1, "batch", F32),
    (2, 4, 4, 128, 64, 3, "shared", F16),
    (2, 4, 1, 128, 64, 200, "batch", F32),  # band covers the whole sequence: SA = full causal attention
    (2, 2, 1, 257, 64, 64, "batch", F32),
    (2, 4, 2, 257, 16, 300, "none", F16),  # SWA with w >= n = full causal attention
    (2, 2, 2, 257, 64, 3, "shared", F32),
    (2, 2, 1, 1000, 64, 64, "batch", F32),
    (1, 4, 1, 1000, 16, 64, "none", F16),
    (2, 2, 1, 600, 64, 300, "batch", F16),  # per-sequence pi in fp16, through the interior-tile loops
    (2, 2, 2, 1, 16, 3, "batch", F16),
    (2, 4, 1, 257, 16, 3, "batch", F16),
]


@pytest.mark.parametrize("B,Hq,Hkv,n,D,w,kind,dtype", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_matches_naive(B, Hq, Hkv, n, D, w, kind, dtype):
    gen = torch.Generator().manual_seed(1000 * n + 10 * w + D)
    qkv, do = make_inputs(B, Hq, Hkv, n, D, dtype, gen)
    left, right = default_band(w, kind != "none")
    check_against_naive(qkv, do, left, right, make_perm(kind, B, n, gen), dtype)


def test_identity_perm_with_causal_band_equals_swa():
    """SA with pi = identity and band (w-1, 0) is SWA: same kernels, HAS_PERM on and off."""
    from kernels.triton_band import triton_banded_attention

    gen = torch.Generator().manual_seed(1)
    (q, k, v), do = make_inputs(2, 2, 1, 90, 32, F32, gen)
    a = triton_banded_attention(q, k, v, 9, 0, None)
    b = triton_banded_attention(q, k, v, 9, 0, make_perm("identity", 2, 90, gen))
    assert rel_err(a, b) <= 1e-6


def test_strided_inputs_int32_perm_custom_scale():
    """[B,n,H,D] -> [B,H,n,D] views (no copy), a K whose head dim is strided (copied), int32 [B,n] perm, scale."""
    gen = torch.Generator().manual_seed(2)
    B, Hq, Hkv, n, D = 2, 4, 2, 70, 32
    q = torch.randn(B, n, Hq, D, generator=gen).to(DEVICE).transpose(1, 2)
    k = torch.randn(B, Hkv, D, n, generator=gen).to(DEVICE).transpose(2, 3)
    v = torch.randn(B, n, Hkv, D, generator=gen).to(DEVICE).transpose(1, 2)
    do = torch.randn(B, n, Hq, D, generator=gen).to(DEVICE).transpose(1, 2)
    perm = make_perm("batch", B, n, gen).to(torch.int32)
    check_against_naive((q, k, v), do, 5, 6, perm, F32, scale=0.3)


def test_non_power_of_two_head_dim():
    gen = torch.Generator().manual_seed(3)
    qkv, do = make_inputs(1, 2, 1, 33, 24, F32, gen)
    check_against_naive(qkv, do, 4, 4, make_perm("shared", 1, 33, gen), F32)


@pytest.mark.parametrize("bm,bn", [(32, 16), (16, 32)])
def test_rectangular_tiles(tb, monkeypatch, bm, bn):
    """BLOCK_M != BLOCK_N (as some autotune configs): band ranges and masks of query and key tiles differ."""
    pin_tiles(tb, monkeypatch, bm, bn)
    gen = torch.Generator().manual_seed(4)
    qkv, do = make_inputs(2, 2, 1, 70, 16, F32, gen)
    check_against_naive(qkv, do, 7, 8, make_perm("batch", 2, 70, gen), F32)
    check_against_naive(qkv, do, 20, 0, None, F32)


@pytest.mark.parametrize("kind,left,right,bm,bn,split", [
    ("batch", 40, 41, 16, 16, True), ("none", 60, 0, 16, 16, True), ("none", 30, 10, 16, 16, True),
    ("shared", 70, 5, 32, 16, True), ("batch", 40, 41, 16, 32, True), ("batch", 40, 41, 16, 16, False),
])
def test_interior_tiles(tb, monkeypatch, kind, left, right, bm, bn, split):
    """Bands several tiles wide: each tile loop runs its edge, interior (pi-only or no mask) and edge parts.

    n = 150 leaves a ragged last tile; ("none", 30, 10) is a band reaching right of the query without pi, whose
    keys are never visible (causal), which the kernel drops before splitting the loop; split=False is the single
    masked loop that SA_TRITON_SPLIT=0 selects for A/B timing.
    """
    pin_tiles(tb, monkeypatch, bm, bn)
    monkeypatch.setattr(tb, "_SPLIT", split)
    gen = torch.Generator().manual_seed(11)
    qkv, do = make_inputs(2, 2, 1, 150, 16, F32, gen)
    check_against_naive(qkv, do, left, right, make_perm(kind, 2, 150, gen), F32)


def test_backward_is_deterministic():
    """No atomics: two backward passes give the same bits. The interpreter runs programs one after another, so only
    a GPU run can catch an order-dependent sum; bench/gpu_session.sh runs this file there."""
    from kernels.triton_band import triton_banded_attention

    gen = torch.Generator().manual_seed(5)
    qkv, do = make_inputs(2, 4, 1, 100, 32, F32, gen)
    perm = make_perm("batch", 2, 100, gen)
    runs = []
    for _ in range(2):
        q, k, v = (t.detach().requires_grad_() for t in qkv)
        out = triton_banded_attention(q, k, v, 12, 12, perm)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's exp2 overflows in lanes masked after it
@pytest.mark.parametrize("dtype,scale", [(F32, 30.0), (F16, 5.0)])
def test_padded_slots_stay_out_of_gradients(dtype, scale):
    """Slots past n (n=17 in 32- or 64-slot tiles) must not reach any row. Queries far from every key give a large
    negative lse, so a padded key in dq had p = exp2(-lse) = inf (or an fp16 overflow of ds) times its zero row:
    NaN in dq, when the dq kernel relied on zero rows instead of masking padded keys (review of 9681eb8)."""
    gen = torch.Generator().manual_seed(9)
    n, D = 17, 16
    ones = torch.ones(1, 1, n, D)
    q = -scale * ones + 0.01 * torch.randn(1, 1, n, D, generator=gen)
    k = ones + 0.01 * torch.randn(1, 1, n, D, generator=gen)
    v = torch.randn(1, 1, n, D, generator=gen)
    do = torch.randn(1, 1, n, D, generator=gen)
    perm = torch.randperm(n, generator=gen, dtype=torch.int32)
    # fp16: every key is ~ones, so dq = sum_j ds_ij k_j nearly cancels (||dq|| = 0.07 against ||dk|| = 25) and ds's
    # fp16 rounding is 3% of it; the point here is that no NaN or inf gets in
    tol = 5e-2 if dtype == F16 else None
    check_against_naive([t.to(DEVICE, dtype) for t in (q, k, v)], do.to(DEVICE, dtype), 3, 3, perm.to(DEVICE), dtype,
                        tol=tol)


def test_bf16():
    """bf16 in, bf16 out, fp32 accumulation (the interpreter takes an fp32 tl.dot path for bf16)."""
    gen = torch.Generator().manual_seed(6)
    qkv, do = make_inputs(2, 2, 1, 40, 32, torch.bfloat16, gen)
    check_against_naive(qkv, do, 3, 4, make_perm("batch", 2, 40, gen), torch.bfloat16)


def test_dispatch_from_banded_attention():
    gen = torch.Generator().manual_seed(7)
    (q, k, v), _ = make_inputs(2, 2, 2, 50, 16, F32, gen)
    perm = make_perm("batch", 2, 50, gen)
    for p in (None, perm):
        out = banded_attention(q, k, v, 8, perm=p, backend="triton")
        ref = banded_attention(q, k, v, 8, perm=p, backend="naive")
        assert rel_err(out, ref) <= 1e-5


def test_inference_path_matches_autograd_path():
    """Without grad (no_grad, or inputs that need none) the forward runs without an autograd node: same output."""
    from kernels.triton_band import triton_banded_attention

    gen = torch.Generator().manual_seed(12)
    (q, k, v), _ = make_inputs(2, 4, 2, 70, 16, F32, gen)
    perm = make_perm("batch", 2, 70, gen)
    with_grad = triton_banded_attention(*(t.clone().requires_grad_() for t in (q, k, v)), 9, 10, perm)
    assert with_grad.grad_fn is not None
    with torch.no_grad():
        no_grad = triton_banded_attention(*(t.clone().requires_grad_() for t in (q, k, v)), 9, 10, perm)
    plain = triton_banded_attention(q, k, v, 9, 10, perm)
    for out in (no_grad, plain):
        assert out.grad_fn is None and torch.equal(out, with_grad.detach())


def test_rejects_bad_arguments():
    from kernels.triton_band import triton_banded_attention

    q = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError):
        triton_banded_attention(q, q, q, -1, 0, None)
    with pytest.raises(ValueError):
        triton_banded_attention(q, q, q, 1, 0, torch.arange(7, device=DEVICE))
    with pytest.raises(TypeError, match="one dtype"):
        triton_banded_attention(q, q.double(), q, 1, 0, None)
    with pytest.raises(TypeError, match="fp16, bf16 or fp32"):
        triton_banded_attention(q.double(), q.double(), q.double(), 1, 0, None)


def test_autotuned_kernels_keep_their_timings_on_disk(monkeypatch):
    """On a GPU (not interpreting) the autotuner keeps its timings in Triton's cache: a resumed run launches the
    configs it ran before. The interpreter never autotunes; here it is switched off just to build the autotuner."""
    import inspect

    import triton

    import kernels.triton_band as tb

    if "cache_results" not in inspect.signature(triton.autotune).parameters:
        pytest.skip(f"Triton {triton.__version__} keeps no autotune timings on disk (3.4 and later do)")
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "interpret", False)
    tuner = tb._autotuned(tb._dq_kernel, tb._DQ_CONFIGS)
    assert isinstance(tuner, triton.runtime.Autotuner)
    assert tuner.cache_results and tuner.keys == tb._TUNE_KEY and tuner.configs == tb._DQ_CONFIGS


def test_the_autotuned_launch_path_matches_the_reference(tb, monkeypatch):
    """CI runs the kernels at one config; a GPU autotunes, then launches the chosen config directly (`_launch`'s
    cache). That path runs here under the interpreter, with two configs timed by a CPU clock: the autotuner's
    benchmark calls must leave correct outputs (the kernels overwrite, never accumulate into, what they write), and
    the second call of each shape takes the cached config."""
    import time

    def cpu_bench(fn, quantiles=None, **_):
        start = time.perf_counter()
        fn()
        ms = (time.perf_counter() - start) * 1e3
        return [ms] * len(quantiles) if quantiles else ms

    configs = tb._configs([(16, 16, 4, 1), (32, 32, 4, 1)])
    monkeypatch.setattr(tb, "_AUTOTUNE", True)
    monkeypatch.setattr(tb, "_chosen", {})
    for name, kernel in (("_fwd", tb._fwd_kernel), ("_dq", tb._dq_kernel), ("_dkdv", tb._dkdv_kernel)):
        monkeypatch.setattr(tb, name, tb._autotuned(kernel, configs, do_bench=cpu_bench))
    gen = torch.Generator().manual_seed(7)
    qkv, do = make_inputs(2, 4, 2, 45, 16, F32, gen)
    for kind in ("none", "batch"):
        perm = make_perm(kind, 2, 45, gen)
        for _ in range(2):  # autotune, then the cached config
            check_against_naive(qkv, do, *default_band(9, perm is not None), perm, F32)
    assert len(tb._chosen) == 6  # three kernels, with and without pi
    assert {cfg["BLOCK_M"] for cfg in tb._chosen.values()} <= {16, 32}
    # one sequence (an evaluation) is tuned apart from the batch: the grid's size decides the best tiles
    check_against_naive([t[:1] for t in qkv], do[:1], *default_band(9, False), None, F32)
    assert len(tb._chosen) == 9 and {key[3] for key in tb._chosen} == {8, 4}  # bh_key: B x Hq rounded up


@pytest.mark.skipif(not INTERPRET, reason="each drawn shape compiles its own kernels on a GPU (minutes)")
@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 100),
    D=st.sampled_from([16, 24, 64]),
    Hkv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 3, 4]),
    B=st.integers(1, 2),
    kind=st.sampled_from(["none", "shared", "batch"]),
    dtype=st.sampled_from([F32, F16]),
    tiles=st.sampled_from([(16, 16), (16, 32), (32, 16), (32, 32)]),
    split=st.booleans(),
)
def test_property_random_shapes(data, n, D, Hkv, group, B, kind, dtype, tiles, split):
    """Random shapes, bands and orders, on tiles of 16 or 32 rows so that sequences span several query and key
    tiles (under the interpreter; a GPU picks its own), through the split and the single masked tile loop."""
    import kernels.triton_band as module

    left = data.draw(st.integers(0, n + 2), label="left")
    right = 0 if kind == "none" else data.draw(st.integers(0, n + 2), label="right")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    qkv, do = make_inputs(B, Hkv * group, Hkv, n, D, dtype, gen)
    perm = None if kind == "none" else torch.tensor(  # per-sequence pi as int32, as model.permutation draws it
        [data.draw(st.permutations(range(n)), label="pi") for _ in range(B if kind == "batch" else 1)], device=DEVICE,
        dtype=torch.int32 if kind == "batch" else torch.int64)
    perm = perm if perm is None or kind == "batch" else perm[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "_interp_blocks", lambda _: {"BLOCK_M": tiles[0], "BLOCK_N": tiles[1]})
        mp.setattr(module, "_SPLIT", split)
        check_against_naive(qkv, do, left, right, perm, dtype)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("kind,w", [("batch", 256), ("none", 512), ("shared", 1024)])
def test_gpu_bf16_long_sequence(kind, w):
    gen = torch.Generator().manual_seed(8)
    B, Hq, Hkv, n, D = 2, 8, 2, 4096, 128
    qkv, do = make_inputs(B, Hq, Hkv, n, D, torch.bfloat16, gen)
    left, right = default_band(w, kind != "none")
    check_against_naive(qkv, do, left, right, make_perm(kind, B, n, gen), torch.bfloat16, tol=2e-2)


def _all_autotune_configs():
    import kernels.triton_band as tb

    lists = (tb._FWD_CONFIGS, tb._DQ_CONFIGS, tb._DKDV_CONFIGS)
    return [tuple(configs[min(i, len(configs) - 1)] for configs in lists) for i in range(max(map(len, lists)))]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("index", range(len(_all_autotune_configs())) if CUDA and not INTERPRET else [])
def test_gpu_every_autotune_config_matches_the_reference(tb, monkeypatch, index):
    """Each config the autotuner may pick (tiles, warps, stages), compiled, at a ragged n with a band narrower than
    a tile and one several tiles wide, in bf16 and fp16, split loops on and off: the tests above pin one config."""
    import triton

    fwd, dq, dkdv = _all_autotune_configs()[index]
    chosen = {tb._fwd_kernel: fwd, tb._dq_kernel: dq, tb._dkdv_kernel: dkdv}

    def launch(kernel, heads_batch, args, kwargs, block_axis, n, row_bytes):
        config = chosen[kernel]
        cfg = {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}
        kernel[(triton.cdiv(n, cfg[block_axis]), *heads_batch)](*args, **kwargs, **cfg)

    monkeypatch.setattr(tb, "_launch", launch)
    for name, kernel in (("_fwd", tb._fwd_kernel), ("_dq", tb._dq_kernel), ("_dkdv", tb._dkdv_kernel)):
        monkeypatch.setattr(tb, name, kernel)
    monkeypatch.setattr(tb, "_SPLIT", index % 2 == 0)
    dtype = torch.bfloat16 if index % 2 == 0 else F16
    gen = torch.Generator().manual_seed(100 + index)
    qkv, do = make_inputs(2, 4, 2, 1999, 64, dtype, gen)
    for w in (24, 300):
        check_against_naive(qkv, do, *default_band(w, True), make_perm("batch", 2, 1999, gen), dtype, tol=2e-2)
    check_against_naive(qkv, do, *default_band(300, False), None, dtype, tol=2e-2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("D", [32, 128, 256])
def test_gpu_fp32_head_dims(D):
    gen = torch.Generator().manual_seed(9)
    qkv, do = make_inputs(2, 4, 2, 1500, D, F32, gen)
    check_against_naive(qkv, do, 63, 64, make_perm("batch", 2, 1500, gen), F32)
