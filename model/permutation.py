"""The one permutation sampler of SA: model, analysis and tests all draw pi here.

Training: a fresh pi per layer and per forward pass, from a generator seeded by (run seed, micro-batch, layer, rank),
so a resumed run replays exactly the same permutations. Evaluation: pi from (eval seed, layer), so scores are
deterministic; an evaluator averages several eval seeds to see the spread.

Padding must not change a result: with right padding of lengths L_b, pi permutes only the first L_b slots and the pad
slots stay after them, and in eval mode each sequence's pi depends only on (eval seed, layer, L_b), never on what else
is in the batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator whose seed is a stable hash of the keys (no accidental collisions like seed + step)."""
    digest = hashlib.blake2b(repr(tuple(int(k) for k in keys)).encode(), digest_size=8).digest()
    gen = torch.Generator()
    gen.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return gen


def _randperm(n: int, gen: torch.Generator) -> torch.Tensor:
    """int32: the same draw as int64 for a given generator and half the bytes to copy to a GPU; every backend
    takes either."""
    return torch.randperm(n, generator=gen, dtype=torch.int32)


def _padded_permutation(n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    if length >= n:
        return _randperm(n, gen)
    return torch.cat([_randperm(length, gen), torch.arange(length, n, dtype=torch.int32)])


def _to_device(perm: torch.Tensor, device) -> torch.Tensor:
    """Pinned, non-blocking copy to a GPU: a plain copy from pageable memory makes the host wait for every queued
    kernel, once per SA layer, so the GPU would idle while Python issues the next layer."""
    if device is not None and torch.device(device).type == "cuda":
        return perm.pin_memory().to(device, non_blocking=True)
    return perm.to(device)


@dataclass
class PermutationSampler:
    seed: int = 0
    eval_seed: int = 0
    rank: int = 0
    step: int = 0  # the micro-batch index (global step x accumulation + position in it), set before every forward
    per_sequence: bool = True

    def sample(self, layer: int, n: int, batch: int, training: bool, lengths=None, device=None) -> torch.Tensor:
        """pi for one layer: [n] (shared by the batch) or [batch, n] (per sequence), on `device`."""
        if training:
            gen = seeded_generator(self.seed, self.step, layer, self.rank)
            if not self.per_sequence and lengths is None:
                return _to_device(_randperm(n, gen), device)
            lens = [n] * batch if lengths is None else [int(x) for x in lengths]
            return _to_device(torch.stack([_padded_permutation(n, length, gen) for length in lens]), device)
        if lengths is None:  # every sequence would draw the same pi: share it
            return _to_device(_randperm(n, seeded_generator(self.eval_seed, layer)), device)
        perms = [_padded_permutation(n, int(length), seeded_generator(self.eval_seed, layer)) for length in lengths]
        return _to_device(torch.stack(perms), device)
