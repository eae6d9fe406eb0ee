"""The LM head's cross-entropy, whole or over chunks of tokens.

A 360M model at batch 16 x 2048 with a 32000-token vocabulary keeps ~4 GB of fp32 log-probabilities for the
backward, and their gradient takes as much again while it runs: more than its 24 blocks' attention. Over chunks of
`chunk_tokens` rows, the logits of one chunk exist at a time and the gradients of the hidden states and of the head
weight are computed in the forward pass (as Liger-Kernel's fused linear cross-entropy does), so the backward only
scales them: no logits are saved or recomputed, and the FLOPs are those of the plain path. What it keeps from the
forward to the backward instead: the hidden states' gradient ([tokens, d], in their dtype) and the head weight's in
float32 ([vocab, d], ~131 MB for the 360M model, whole on every rank under FSDP).

The head weight is read directly (not through the lm_head module): under FSDP it lies in the root unit, unsharded
during the wrapped training and validation steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int = 0,
                       ignore_index: int = -100) -> torch.Tensor:
    """Summed cross-entropy of ``hidden @ weight.T`` against `targets` (rows equal to `ignore_index` count zero),
    a float32 scalar. hidden [..., d], weight [vocab, d], targets [...]; chunk_tokens 0: the whole batch at once.
    The logits are taken in float32 (under autocast their matmul runs in the autocast dtype, as ``lm_head`` does)."""
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    if chunk_tokens <= 0 or chunk_tokens >= hidden.shape[0]:
        logits = F.linear(hidden, weight).float()
        return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):  # no gradient work to do
        return _chunked(hidden, weight, targets, chunk_tokens, ignore_index, False, False)[0]
    return _ChunkedHeadCrossEntropy.apply(hidden, weight, targets, chunk_tokens, ignore_index)


def _chunked(hidden, weight, targets, chunk_tokens, ignore_index, want_hidden, want_weight):
    """(summed loss, its gradient for hidden or None, for weight in float32 or None), one chunk of logits at a time."""
    grad_hidden = torch.empty_like(hidden) if want_hidden else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        logp = torch.log_softmax(F.linear(h, weight).float(), dim=-1)
        counted = t != ignore_index
        t = t.masked_fill(~counted, 0)
        total -= (logp.gather(1, t[:, None]).squeeze(1) * counted).sum()
        if want_hidden or want_weight:
            # d(summed loss)/d(logits) = softmax - one_hot(target), zero on ignored rows; in place over logp
            grad = logp.exp_()
            grad[torch.arange(len(t), device=t.device), t] -= 1
            grad = grad.mul_(counted[:, None]).to(h.dtype)
            if want_hidden:
                grad_hidden[start : start + chunk_tokens] = grad @ weight.to(h.dtype)
            if want_weight:
                grad_weight += grad.T @ h
    return total, grad_hidden, grad_weight


class _ChunkedHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_tokens, ignore_index):
        total, grad_hidden, grad_weight = _chunked(hidden, weight, targets, chunk_tokens, ignore_index,
                                                   *ctx.needs_input_grad[:2])
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable  # the gradients were computed in the forward: no double backward
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:  # scaled in float32: 1/count rounded to bf16 would bias every block's gradient
            grad_hidden = (grad_hidden.float() * grad_total).to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_total).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None
