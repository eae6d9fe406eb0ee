"""torch.compile: each decoder block compiles to one graph (fullgraph) that computes what the eager model does.

The Triton backend enters a compiled graph as the custom op sa_kernels::banded_attention (run here through the
Triton interpreter); the permutations are drawn before the blocks, so a new pi is a new input, not a recompile.
"""

import os

import pytest
import torch

from model.config import AttentionConfig, ModelConfig
from model.decoder import Decoder


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # every test compiles from scratch: no cache limit reached by earlier tests
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def tiny_decoder(kind: str, backend: str) -> Decoder:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=97, n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, max_seq_len=128)
    return Decoder(cfg, AttentionConfig(kind=kind, window=8, backend=backend), seed=5)


def loss_and_grads(model: Decoder, tokens: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    logits.float().pow(2).mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def assert_close(actual, expected, what: str):
    err = (actual - expected).norm() / expected.norm()
    assert err <= 1e-5, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("kind,backend,layout", [("sa", "torch", "dense"), ("gated_sa_swa", "torch", "dense"),
                                                 ("gated_sa_swa", "torch", "blocked"), ("gated_sa_swa", "triton", "")])
def test_compiled_blocks_match_the_eager_model(kind, backend, layout, monkeypatch):
    """layout: the torch backend's dense mask (n <= DENSE_MAX_N) or its blocked band (longer sequences, here forced),
    whose gathers through pi wrote into strided views with out=, which a compiled graph refused."""
    if backend == "triton" and not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs a GPU or the Triton interpreter")
    if layout == "blocked":
        import kernels.torch_band

        monkeypatch.setattr(kernels.torch_band, "DENSE_MAX_N", 0)
    # the Triton backend runs on the GPU where there is one (the GPU session runs this file), else interpreted
    device = "cuda" if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    eager, compiled = tiny_decoder(kind, backend).to(device), tiny_decoder(kind, backend).to(device)
    compiled.compile_blocks()
    tokens = torch.randint(0, 97, (2, 75), device=device)  # not a multiple of any tile
    for step in (3, 4):  # two training passes: each draws fresh permutations
        eager.sampler.step = compiled.sampler.step = step
        with torch._dynamo.config.patch(error_on_recompile=step == 4):  # a new pi must not recompile the block
            got_logits, got_grads = loss_and_grads(compiled, tokens)
        want_logits, want_grads = loss_and_grads(eager, tokens)
        assert_close(got_logits, want_logits, f"logits, step {step}")
        for (name, _), got, want in zip(eager.named_parameters(), got_grads, want_grads):
            assert_close(got, want, f"grad of {name}, step {step}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it did compile (no silent eager run)
    eager.eval(), compiled.eval()
    with torch.no_grad():
        assert_close(compiled(tokens), eager(tokens), "logits in eval mode")


def test_triton_custom_op_passes_torch_opcheck():
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of the compiled path's op."""
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        pytest.skip("needs a GPU or the Triton interpreter")
    from kernels.triton_band import _banded_op

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 37, 16, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(2, 2, 37, 16, generator=gen).to(device).requires_grad_() for _ in range(2))
    perms = torch.stack([torch.randperm(37, generator=gen) for _ in range(2)]).to(device)
    for perm, left, right in ((None, 5, 0), (perms, 3, 4), (perms[0].int(), 40, 40)):
        torch.library.opcheck(_banded_op, (q, k, v, perm, left, right, 0.25))


def test_compiled_blocks_with_activation_checkpointing_match_the_eager_model():
    """trainer.compile and trainer.activation_checkpointing together: the recomputed compiled blocks give the eager
    gradients, and recomputation adds no graph."""
    tokens = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    eager = tiny_decoder("gated_sa_swa", "torch").train()
    model = tiny_decoder("gated_sa_swa", "torch").train()
    model.checkpoint_activations = True
    model.compile_blocks()
    for step in range(2):  # a new pi at the second step
        eager.sampler.step = model.sampler.step = step
        expected_logits, expected = loss_and_grads(eager, tokens)
        logits, grads = loss_and_grads(model, tokens)
        assert_close(logits, expected_logits, f"logits, step {step}")
        for i, (g, e) in enumerate(zip(grads, expected)):
            assert_close(g, e, f"gradient {i}, step {step}")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_a_bad_permutation_is_refused_in_a_compiled_graph_too():
    """The values check waits for the device, so compiled graphs skipped it: a pi repeating an entry ran, and the
    torch backend read the inverse's unwritten slot (an output row copied from elsewhere)."""
    from kernels import banded_attention

    q, k, v = (torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    attend = torch.compile(lambda q, k, v, p: banded_attention(q, k, v, 3, perm=p, backend="torch"),
                           fullgraph=True, backend="eager")
    good = torch.randperm(8, generator=torch.Generator().manual_seed(0))
    expected = banded_attention(q, k, v, 3, perm=good, backend="torch")
    torch.testing.assert_close(attend(q, k, v, good), expected)
    with pytest.raises(RuntimeError, match="not a permutation"):
        attend(q, k, v, torch.tensor([0, 1, 2, 3, 4, 5, 6, 6]))
