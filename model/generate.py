"""Text from a trained decoder: temperature, top-k and top-p (nucleus) sampling, or greedy decoding.

No KV cache: SA draws its permutation for the sequence's length, so each new token is a new length, a new pi in
every layer and new keys for every position. Each step re-runs the whole context (its last max_seq_len tokens once
it is longer), as the evaluator's greedy decoding does (evaluation/lm.py): O(n * w) per token and layer.
"""

from __future__ import annotations

import torch


def next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: argmax at temperature 0, else a draw from softmax(logits / temperature)
    restricted to the top_k most likely tokens and to the smallest set whose probability reaches top_p."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        before = sorted_logits.softmax(-1).cumsum(-1) - sorted_logits.softmax(-1)  # mass of the tokens ranked above
        sorted_logits = sorted_logits.masked_fill(before >= top_p, float("-inf"))  # the top token always stays
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, prompt: list[int], max_new_tokens: int, num_samples: int = 1, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
             generator: torch.Generator | None = None, autocast_dtype: torch.dtype | None = None) -> list[list[int]]:
    """`num_samples` continuations of `prompt` (token ids), each up to max_new_tokens long and ended before its
    first eos_id. The model runs in eval mode (SA: the eval-seed permutations of each length) and is given back in
    the mode it came in (a sample from a training callback leaves it training)."""
    if not prompt:
        raise ValueError("the prompt holds no token (start from the end-of-text token for unconditioned text)")
    device = next(model.parameters()).device
    context = int(model.cfg.max_seq_len)
    rows = torch.tensor([prompt] * num_samples, dtype=torch.long, device=device)
    done = torch.zeros(num_samples, dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in range(num_samples)]
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            with torch.autocast(device.type, dtype=autocast_dtype or torch.float32,
                                enabled=autocast_dtype is not None):
                hidden = model.hidden_states(rows[:, -context:])[:, -1]
                logits = model.lm_head(hidden).float()
            token = next_token(logits, temperature, top_k, top_p, generator)
            for i in (~done).nonzero().flatten().tolist():
                if eos_id is not None and int(token[i]) == eos_id:
                    done[i] = True
                else:
                    out[i].append(int(token[i]))
            if bool(done.all()):
                break
            rows = torch.cat([rows, token[:, None]], dim=1)
    finally:
        model.train(was_training)
    return out
