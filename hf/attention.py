"""The attention function behind attn_implementation="sa_prefill": SWA / SA / MoBA at prefill, full attention decoding.

transformers calls ``fn(module, query, key, value, attention_mask, scaling=..., dropout=..., **kwargs)`` from every
attention layer, after RoPE (so positions are the original ones) and after the KV-cache update, with
query [B, Hq, q_len, D], key/value [B, Hkv, kv_len, D], and expects ``(output [B, q_len, Hq, D], weights or None)``.

* Prefill (q_len == kv_len > 1: the prompt, no cached prefix): the pattern stored on the module by
  ``hf.patch_model`` (``module.sa_prefill``, a PrefillSettings) with window w_eff, through our kernels:
  swa -> kernels.banded_attention(window=w_eff); sa -> the same with pi from PermutationSampler(eval_seed=seed)
  for the layer ``module.layer_idx`` (symmetric band, docs/method.md); moba -> kernels.moba.moba_attention with
  block size max(1, w_eff // 2) and top-2 blocks. GQA goes to the kernels as is (Hkv < Hq).
* Everything else (decoding, q_len < kv_len; kind="full") -> transformers' own sdpa attention over the whole cache.

Padding, read from the attention mask (we register transformers' sdpa mask builder for "sa_prefill", so the mask is
None without padding and a boolean [B, 1, n, n] causal+padding mask with it): each row's real tokens must form one
contiguous run. Right padding: lengths go to the permutation sampler (pi permutes only the real tokens, so a
sequence scores the same alone or padded in a batch). Left padding (generation): each row is rotated so its real
tokens come first, attended, and rotated back; RoPE was applied before, so only relative positions matter. Masks
that are not causal+padding (packed sequences, a model's own sliding-window layers, custom 4D masks) are refused.

This module does not import transformers at import time: ``prefill_attention`` and ``sequence_layout`` are plain
torch; ``sa_prefill_attention`` imports transformers' sdpa function only when it falls back to it.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import asdict, dataclass

import torch

from kernels import BACKENDS, banded_attention
from kernels.moba import moba_attention
from kernels.order import gather_rows, scatter_rows
from model.config import MOBA_TOP_K, moba_block_size
from model.permutation import PermutationSampler

log = logging.getLogger(__name__)

ATTN_NAME = "sa_prefill"
KINDS = ("full", "swa", "sa", "moba")


@dataclass(frozen=True)
class PrefillSettings:
    """What one patched model does at prefill. window = w_eff (slots per query for SWA/SA; MoBA: 2 blocks of w/2)."""

    kind: str
    window: int | None = None
    seed: int = 0  # SA: pi of layer l comes from (seed, l), like PermutationSampler's eval mode
    backend: str = "auto"  # kernels.banded_attention backend for swa/sa (MoBA is plain PyTorch)
    moba_top_k: int = MOBA_TOP_K

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "full" and (self.window is None or int(self.window) < 1):
            raise ValueError(f"kind={self.kind!r} needs window (w_eff) >= 1, got {self.window!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.moba_top_k < 1:
            raise ValueError(f"moba_top_k must be >= 1, got {self.moba_top_k}")

    @property
    def moba_block_size(self) -> int:
        return moba_block_size(self.window)

    def as_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------------------------------------------------- padding

# (weakref to the last mask, its version, batch, n, result): every layer gets the same mask; the version counter
# tells a mask buffer rewritten in place from the one measured (inference-mode tensors keep none: None)
_layout_cache: tuple | None = None


def sequence_layout(attention_mask: torch.Tensor | None, batch: int, n: int):
    """(starts, lengths) of each row's real tokens from a prefill mask, or (None, None) when no row is padded.

    attention_mask: None, [B, n] (1 = real token), or [B, 1|H, n, n] boolean (True = attend) / additive float
    (0 = attend). starts: LongTensor [B] (first real slot); lengths: list of B ints.
    """
    global _layout_cache
    if attention_mask is None:
        return None, None
    cached = _layout_cache
    version = None if attention_mask.is_inference() else attention_mask._version
    if cached is not None and cached[0]() is attention_mask and cached[1:4] == (version, batch, n):
        return cached[4]
    result = _sequence_layout(attention_mask, batch, n)
    try:
        _layout_cache = (weakref.ref(attention_mask), version, batch, n, result)
    except TypeError:  # not weak-referenceable: just don't cache
        _layout_cache = None
    return result


def _sequence_layout(mask: torch.Tensor, batch: int, n: int):
    keep = mask if mask.dtype == torch.bool else (mask == 0 if mask.dim() == 4 else mask != 0)
    if keep.dim() == 2:
        if keep.shape[-1] < n:
            raise ValueError(f"2D attention mask of length {keep.shape[-1]} for {n} tokens")
        valid, rows = keep[:, -n:], None
    elif keep.dim() == 4:
        if tuple(keep.shape[-2:]) != (n, n):
            raise ValueError(f"prefill attention mask must be [B, 1, {n}, {n}], got {tuple(mask.shape)}")
        if keep.shape[1] > 1 and not bool((keep == keep[:, :1]).all()):
            raise ValueError("sa_prefill: per-head attention masks are not supported")
        rows = keep[:, 0]
        # A real token sees itself; a pad query sees nothing, or everything (the old torch fix for an empty row;
        # a real row of length n sees everything only as the last slot). So the diagonal gives the real tokens
        # whether or not the mask also hides the pad queries of a right-padded row.
        pos = torch.arange(n, device=rows.device)
        valid = rows.diagonal(dim1=-2, dim2=-1) & ~(rows.all(-1) & (pos < n - 1))
    else:
        raise ValueError(f"attention mask must be 2D or 4D, got shape {tuple(mask.shape)}")
    if valid.shape[0] == 1 and batch > 1:
        valid = valid.expand(batch, n)
        rows = rows.expand(batch, n, n) if rows is not None else None
    pos = torch.arange(n, device=valid.device)
    lengths = valid.sum(-1)
    starts = valid.int().argmax(-1)
    run = (pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])
    if not torch.equal(run, valid):
        raise ValueError("sa_prefill: the real tokens of every row must be one contiguous run (left or right padding); "
                         "packed sequences / masks with holes are not supported")
    if rows is not None:
        expected = valid[:, None, :] & (pos[None, :] <= pos[:, None])
        # Pad queries: left pads see nothing, right pads see the real keys before them (an all-True row is the old
        # torch fix for empty rows). A pad query that sees another pad is a second document: packed sequences.
        pad_sees_pad = (rows & ~valid[:, None, :]).any(-1) & ~rows.all(-1) & ~valid
        if bool(((rows != expected) & valid[:, :, None]).any()) or bool(pad_sees_pad.any()):
            raise ValueError("sa_prefill: the attention mask is not causal + padding (a model with its own "
                             "sliding-window/chunked layers, packed sequences or a custom 4D mask?); not supported")
    if bool((lengths == n).all()):
        return None, None
    return starts, [int(x) for x in lengths.tolist()]


# ---------------------------------------------------------------------------------------------------------- prefill


def prefill_attention(q, k, v, settings: PrefillSettings, layer: int, scale: float | None = None, starts=None,
                      lengths=None) -> torch.Tensor:
    """q [B,Hq,n,D], k/v [B,Hkv,n,D] (original order, RoPE applied) -> [B,Hq,n,D] with the settings' pattern.

    starts / lengths: from sequence_layout (None = no padding). Rows with starts > 0 (left padding) are rotated so
    their real tokens come first, then rotated back.
    """
    B, _, n, _ = q.shape
    order = None
    if starts is not None and bool((starts > 0).any()):
        order = (torch.arange(n, device=q.device)[None, :] + starts.to(q.device)[:, None]) % n  # slot s <- token
        q, k, v = (gather_rows(t, order) for t in (q, k, v))
    kind, w = settings.kind, settings.window
    if kind == "swa":
        out = banded_attention(q, k, v, int(w), scale=scale, backend=settings.backend)
    elif kind == "sa":
        perm = PermutationSampler(eval_seed=settings.seed).sample(layer, n, B, training=False, lengths=lengths,
                                                                  device=q.device)
        out = banded_attention(q, k, v, int(w), perm=perm, scale=scale, backend=settings.backend, check_perm=False)
    elif kind == "moba":
        out = moba_attention(q, k, v, settings.moba_block_size, top_k=settings.moba_top_k, scale=scale)
    else:  # full causal, through the same kernel (a band as wide as the sequence)
        out = banded_attention(q, k, v, n, scale=scale, backend=settings.backend)
    return out if order is None else scatter_rows(out, order)


_warned: set[str] = set()


def _warn_once(key: str, msg: str):
    if key not in _warned:
        _warned.add(key)
        log.warning(msg)


def sa_prefill_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=None,
                         **kwargs):
    """The function registered as attn_implementation "sa_prefill" (see the module docstring)."""
    settings = getattr(module, "sa_prefill", None)
    if settings is None:
        raise RuntimeError("attn_implementation='sa_prefill' but this attention module carries no settings: "
                           "use hf.patch_model(model, kind, window) (or hf.load_hf_model) to switch a model to it")
    q_len, kv_len = query.shape[2], key.shape[2]
    if settings.kind == "full" or q_len == 1 or q_len != kv_len:
        if settings.kind != "full" and 1 < q_len < kv_len:
            _warn_once("chunked", f"sa_prefill: {q_len} queries on a cache of {kv_len} keys (chunked prefill, a "
                                  "cached prefix or a static cache): full attention for these queries")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    for name in ("softcap", "s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"sa_prefill: attention with {name} is not supported")
    if kwargs.get("sliding_window") is not None and q_len > kwargs["sliding_window"]:  # shorter: a no-op window
        raise NotImplementedError("sa_prefill: this layer has its own sliding window (model config), shorter than "
                                  f"the {q_len} tokens here; only full-attention layers are supported")
    if is_causal is False or not getattr(module, "is_causal", True):
        raise NotImplementedError("sa_prefill: non-causal attention (encoders) is not supported")
    if dropout and module.training:
        raise NotImplementedError("sa_prefill is training-free: call model.eval() (attention dropout is not applied)")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError(f"sa_prefill: {type(module).__name__} has no layer_idx (needed for the per-layer pi)")
    starts, lengths = sequence_layout(attention_mask, query.shape[0], q_len)
    if not query.dtype == key.dtype == value.dtype:  # autocast: RoPE's fp32 cos/sin made q and k fp32, v stayed bf16
        device = query.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else value.dtype
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    out = prefill_attention(query, key, value, settings, int(layer), scaling, starts, lengths)
    return out.transpose(1, 2).contiguous(), None
