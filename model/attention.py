"""Attention variants (docs/method.md): projections, RoPE at original positions, gates, one call into kernels."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels import banded_attention
from model.config import MOBA_TOP_K, STOCHASTIC_KINDS, AttentionConfig, ModelConfig, moba_block_size
from model.layers import Rotary
from model.permutation import PermutationSampler


def full_causal_attention(q, k, v, backend: str = "auto"):
    if backend == "naive":
        return banded_attention(q, k, v, window=q.shape[2], backend="naive")
    gqa = q.shape[1] != k.shape[1]
    if gqa and q.device.type != "cpu":
        # on CUDA only the flash kernel takes fewer K/V heads (not fp32, pre-Ampere GPUs, head dims > 256):
        # elsewhere enable_gqa falls to the O(n^2)-memory math kernel, while an expanded copy keeps a fused one
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        gqa = False
    # the CPU flash kernel reads each K/V head for its group of query heads, with no expanded copy
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class Attention(nn.Module):
    """Causal self-attention whose pattern is full, SWA, SA or gated SA+SWA.

    SA draws pi from the shared sampler (one pi per layer, shared by all heads). Gated SA+SWA runs both paths on the
    same q, k, v and mixes them per head with two independent sigmoid gates of the layer input:
    y_h = sigmoid(g_sa,h) * y_SA,h + sigmoid(g_swa,h) * y_SWA,h.
    """

    def __init__(self, cfg: ModelConfig, attn: AttentionConfig, layer: int, sampler: PermutationSampler):
        super().__init__()
        self.cfg, self.attn, self.layer, self.sampler = cfg, attn, layer, sampler
        H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, H * D, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, Hkv * D, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, Hkv * D, bias=False)
        self.o_proj = nn.Linear(H * D, cfg.d_model, bias=False)
        self.rotary = Rotary(D, cfg.max_seq_len, cfg.rope_theta)
        # W_g: d_model -> 2*H (first H: SA gates, last H: SWA gates); zero init = both gates at 0.5.
        self.gate = nn.Linear(cfg.d_model, 2 * H, bias=True) if attn.kind == "gated_sa_swa" else None
        if self.gate is not None:
            nn.init.zeros_(self.gate.weight)
            nn.init.zeros_(self.gate.bias)

    @property
    def uses_perm(self) -> bool:
        return self.attn.kind in STOCHASTIC_KINDS

    def draw_perm(self, n: int, batch: int, lengths=None, device=None) -> torch.Tensor | None:
        """This layer's pi for the next forward pass (None when the layer has no SA path)."""
        if not self.uses_perm:
            return None
        return self.sampler.sample(self.layer, n, batch, self.training, lengths, device)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None,
                perm: torch.Tensor | None = None) -> torch.Tensor:
        """`perm`: pi drawn beforehand (Decoder does, so that a compiled block holds no sampling); None draws it."""
        B, n, _ = x.shape
        if perm is None and self.uses_perm:
            perm = self.draw_perm(n, B, lengths, x.device)
        H, Hkv, D = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        q = self.rotary(self.q_proj(x).view(B, n, H, D).transpose(1, 2))
        k = self.rotary(self.k_proj(x).view(B, n, Hkv, D).transpose(1, 2))
        v = self.v_proj(x).view(B, n, Hkv, D).transpose(1, 2)
        kind, w, backend = self.attn.kind, self.attn.window, self.attn.backend
        if kind == "full":
            y = full_causal_attention(q, k, v, backend)
        elif kind == "swa":
            y = banded_attention(q, k, v, w, backend=backend)
        elif kind == "moba":  # baseline: top-2 key blocks of w/2 by q . mean(K_block), own block always on
            from kernels.moba import moba_attention

            y = moba_attention(q, k, v, block_size=moba_block_size(w), top_k=MOBA_TOP_K)
        elif kind == "sa":
            y = banded_attention(q, k, v, w, perm=perm, backend=backend, check_perm=False)  # the sampler's pi
        else:
            y_sa = banded_attention(q, k, v, w, perm=perm, backend=backend, check_perm=False)
            y_swa = banded_attention(q, k, v, w, backend=backend)
            g = torch.sigmoid(self.gate(x)).transpose(1, 2).unsqueeze(-1)  # [B, 2H, n, 1]
            y = g[:, :H] * y_sa + g[:, H:] * y_swa
        return self.o_proj(y.transpose(1, 2).reshape(B, n, H * D))
