"""The LM head's chunked cross-entropy (trainer.loss_chunk_tokens) against the plain logits + F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F

from model.loss import head_cross_entropy


def _inputs(n, d, vocab, seed, ignored_every=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=gen).requires_grad_()
    weight = (torch.randn(vocab, d, generator=gen) * 0.3).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=gen)
    if ignored_every:
        targets[::ignored_every] = -100
    return hidden, weight, targets


def _reference(hidden, weight, targets):
    loss = F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=-100, reduction="sum")
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("n,chunk", [(1, 1), (17, 1), (17, 5), (128, 32), (257, 64), (100, 99)])
@pytest.mark.parametrize("ignored_every", [0, 3])
def test_chunked_loss_and_gradients_equal_the_plain_ones(n, chunk, ignored_every):
    hidden, weight, targets = _inputs(n, 24, 37, seed=n * 31 + chunk, ignored_every=ignored_every)
    want, want_h, want_w = _reference(hidden, weight, targets)
    got = head_cross_entropy(hidden, weight, targets, chunk)
    got_h, got_w = torch.autograd.grad(got * 2.5, (hidden, weight))  # the backward scales by the incoming gradient
    assert abs(got.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    assert got.dtype == torch.float32
    if not want_h.any():  # n=1 with its one target ignored: no gradient at all
        assert not got_h.any() and not got_w.any()
        return
    assert _rel(got_h / 2.5, want_h) <= 1e-5 and _rel(got_w / 2.5, want_w) <= 1e-5
    if ignored_every:
        assert not got_h[::ignored_every].any()  # an ignored row gets no gradient


def test_batched_inputs_tied_weights_and_no_grad():
    """[B, n, d] hidden states; a head tied to the embedding (the gradient reaches the shared weight once through
    each use); under no_grad the value alone, with nothing saved."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(50, 16)
    tokens = torch.randint(0, 50, (3, 11))
    targets = torch.randint(0, 50, (3, 11))
    grads = {}
    for chunk in (0, 4):
        embed.zero_grad()
        hidden = torch.tanh(embed(tokens))
        loss = head_cross_entropy(hidden, embed.weight, targets, chunk)
        loss.backward()
        grads[chunk] = (loss.item(), embed.weight.grad.clone())
    assert abs(grads[0][0] - grads[4][0]) <= 1e-4 and _rel(grads[4][1], grads[0][1]) <= 1e-5
    with torch.no_grad():
        value = head_cross_entropy(torch.tanh(embed(tokens)), embed.weight, targets, 4)
    assert not value.requires_grad and abs(value.item() - grads[0][0]) <= 1e-4


def test_chunked_loss_under_bf16_autocast_follows_the_plain_path():
    """The head's matmul runs in bf16 as lm_head's does under autocast; the softmax in fp32; fp32 gradients."""
    hidden, weight, targets = _inputs(200, 32, 64, seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
        got = head_cross_entropy(hidden, weight, targets, 48)
    want_h, want_w = torch.autograd.grad(want, (hidden, weight))
    got_h, got_w = torch.autograd.grad(got, (hidden, weight))
    assert got_h.dtype == got_w.dtype == torch.float32
    assert abs(got.item() - want.item()) <= 1e-4 * abs(want.item())
    assert _rel(got_h, want_h) <= 2e-2 and _rel(got_w, want_w) <= 2e-2  # bf16 products, rounded in another order
