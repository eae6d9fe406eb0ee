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


@pytest.mark.parametrize("n,chunk", [(2, 1), (17, 1), (17, 5), (128, 32), (257, 64), (100, 99)])
@pytest.mark.parametrize("ignored_every", [0, 3])
def test_chunked_loss_and_gradients_equal_the_plain_ones(n, chunk, ignored_every):
    hidden, weight, targets = _inputs(n, 24, 37, seed=n * 31 + chunk, ignored_every=ignored_every)
    want, want_h, want_w = _reference(hidden, weight, targets)
    got = head_cross_entropy(hidden, weight, targets, chunk)
    got_h, got_w = torch.autograd.grad(got * 2.5, (hidden, weight))  # the backward scales by the incoming gradient
    assert abs(got.item() - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    assert got.dtype == torch.float32
    if not want_h.any():  # every target ignored: no gradient at all
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


def test_bf16_inputs_get_unbiased_gradients():
    """bf16 hidden states and head (FSDP's param_dtype, bf16-true): the loss of a micro-batch is scaled by 1/count
    (here 1/3000) before the backward; rounding that factor to bf16 first scaled every block's gradient by 1.0014."""
    hidden, weight, targets = _inputs(3000, 32, 64, seed=5)
    hidden = hidden.detach().bfloat16().requires_grad_()
    weight = weight.detach().bfloat16().requires_grad_()
    unit_h, unit_w = torch.autograd.grad(head_cross_entropy(hidden, weight, targets, 512), (hidden, weight))
    got_h, got_w = torch.autograd.grad(head_cross_entropy(hidden, weight, targets, 512) / 3000, (hidden, weight))
    assert got_h.dtype == got_w.dtype == torch.bfloat16
    for got, unit in ((got_h, unit_h), (got_w, unit_w)):
        want = unit.double() / 3000
        ratio = (got.double() * want).sum() / (want * want).sum()  # the mean scale of the gradient
        assert abs(ratio.item() - 1) < 3e-4, ratio.item()
    plain = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
    plain_h, plain_w = torch.autograd.grad(plain, (hidden, weight))
    assert _rel(unit_h.float(), plain_h.float()) <= 1e-2 and _rel(unit_w.float(), plain_w.float()) <= 1e-2


@pytest.mark.parametrize("trained", ["hidden", "weight"])
def test_a_frozen_head_or_frozen_hidden_states_leave_the_other_gradient_whole(trained):
    """Only one of hidden and weight requires a gradient (a frozen head under a trained body, or a head fitted on
    fixed features): the chunked path must still take its own backward for that one, keeping no logits (autograd
    through the chunks would keep every chunk's log-probabilities, the memory the chunking exists to save), and match
    the plain gradient; the no-gradient shortcut is for when neither asks for one."""
    hidden, weight, targets = _inputs(50, 16, 200, seed=7, ignored_every=4)
    hidden.requires_grad_(trained == "hidden")
    weight.requires_grad_(trained == "weight")
    wanted = hidden if trained == "hidden" else weight
    plain = F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=-100, reduction="sum")
    want, = torch.autograd.grad(plain, wanted)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        got = head_cross_entropy(hidden, weight, targets, 8)
    assert got.requires_grad
    assert sum(saved) <= wanted.numel() < hidden.shape[0] * weight.shape[0]  # its gradient, no [tokens, vocab]
    assert _rel(torch.autograd.grad(got, wanted)[0], want) <= 1e-5


def test_an_ignore_index_that_is_a_vocabulary_id_is_left_out():
    """ignore_index may be a real token id (a pad id, say): rows with that target count zero, in value and gradient,
    like F.cross_entropy's (a check of the target's sign instead, right for the default -100 only, would count them)."""
    hidden, weight, targets = _inputs(60, 16, 23, seed=8)
    ignored = int(targets[0])
    assert (targets == ignored).sum() < len(targets)
    plain = F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=ignored, reduction="sum")
    want_h, want_w = torch.autograd.grad(plain, (hidden, weight))
    for chunk in (0, 16):
        got = head_cross_entropy(hidden, weight, targets, chunk, ignore_index=ignored)
        got_h, got_w = torch.autograd.grad(got, (hidden, weight))
        assert abs(got.item() - plain.item()) <= 1e-5 * abs(plain.item()), chunk
        assert _rel(got_h, want_h) <= 1e-5 and _rel(got_w, want_w) <= 1e-5, chunk
        assert not got_h[targets == ignored].any()
