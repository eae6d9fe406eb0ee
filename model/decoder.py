"""The decoder: embeddings, pre-norm blocks (attention + SwiGLU), final norm, LM head."""

from __future__ import annotations

import contextlib
import importlib.util
import math

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from kernels import default_band
from model.attention import Attention
from model.config import AttentionConfig, ModelConfig
from model.layers import RMSNorm, SwiGLU
from model.permutation import PermutationSampler


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: AttentionConfig, layer: int, sampler: PermutationSampler):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, attn, layer, sampler)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x, lengths=None, perm=None):
        x = x + self.attn(self.attn_norm(x), lengths, perm)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: AttentionConfig, seed: int = 0):
        super().__init__()
        self.cfg, self.attn_cfg = cfg, attn
        self.sampler = PermutationSampler(seed=seed, eval_seed=attn.eval_seed, per_sequence=attn.per_sequence_perm)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, attn, i, self.sampler) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # trainer.activation_checkpointing: keep only each block's input in training, recompute the rest backward
        self.checkpoint_activations = False
        self.reset_parameters()

    def reset_parameters(self):
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif "attn.gate" in name:
                nn.init.zeros_(p)  # both gates start at sigmoid(0) = 0.5
            elif name.endswith(("o_proj.weight", "down.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.n_layers))  # GPT-2 scaled residual init
            else:
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, n] -> logits [B, n, vocab]. `lengths` marks right padding (SA then permutes real tokens only)."""
        return self.lm_head(self.hidden_states(tokens, lengths))

    def hidden_states(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, n] -> final normed hidden states [B, n, d_model]; ``lm_head`` of a row gives its logits.

        Scoring code applies the head only to the positions it reads (the vocabulary projection is the largest
        matmul of a small model)."""
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens exceeds model.max_seq_len={self.cfg.max_seq_len}")
        # Every pi is drawn before the first block: a compiled block (compile_blocks) then holds no host-side sampling
        # and no graph break; the draws are the same as drawing inside each layer (one generator per layer).
        B, n = tokens.shape
        # lengths read to the host once, not by every layer's draw (each read of a GPU tensor waits for the device)
        drawn = lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths
        perms = [block.attn.draw_perm(n, B, drawn, tokens.device) for block in self.blocks]
        x = self.embed(tokens)
        recompute = self.checkpoint_activations and self.training and torch.is_grad_enabled()
        for block, perm in zip(self.blocks, perms):
            # recomputed in the backward from its inputs, pi included: the same permutations, the same result
            x = checkpoint(block, x, lengths, perm, use_reentrant=False) if recompute else block(x, lengths, perm)
        return self.norm(x)

    def compile_blocks(self, **options) -> None:
        """torch.compile every decoder block in place (fullgraph; state-dict names unchanged), as torchtitan does:
        blocks share one graph, and the Triton attention enters it as an opaque custom op.

        Call the blocks through this Decoder, which draws pi before them: a compiled block given no pi would have to
        draw it inside the graph (host-side seeding), which fullgraph refuses."""
        if self.attn_cfg.backend in ("auto", "triton") and importlib.util.find_spec("triton") is not None:
            import kernels.triton_band  # noqa: F401  registers the custom ops before any tracing starts
        for block in self.blocks:
            block.compile(fullgraph=True, **options)

    @torch.no_grad()
    def gate_openness(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Gated SA+SWA: the mean sigmoid gate of each layer's SA and SWA path over `tokens` [B, n] (batch,
        positions and heads), [n_layers, 2] (SA, SWA); None for other variants. One eager forward pass (compiled
        blocks run eagerly for it, where torch can force that), the gates' inputs read by forward hooks."""
        if self.attn_cfg.kind != "gated_sa_swa":
            return None
        H = self.cfg.n_heads
        means = []
        hooks = [block.attn.gate.register_forward_hook(
            lambda _, __, g: means.append(torch.sigmoid(g.float()).reshape(-1, 2, H).mean(dim=(0, 2))))
            for block in self.blocks]
        stance = getattr(torch.compiler, "set_stance", None)
        try:
            with stance("force_eager") if stance else contextlib.nullcontext():
                self.hidden_states(tokens)
        finally:
            for hook in hooks:
                hook.remove()
        return torch.stack(means)

    def num_parameters(self, non_embedding: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if non_embedding:
            total -= self.embed.weight.numel()
            if not self.cfg.tie_embeddings:
                total -= self.lm_head.weight.numel()
        return total

    def flops_per_token(self, seq_len: int, non_embedding_params: int | None = None) -> float:
        """Training FLOPs per token, for MFU: 6 x (the non-embedding parameters + the LM head's d x V matmul, which runs
        whether or not it shares the embedding's weights) + attention over the keys a query sees, on average, as
        FlashAttention counts causal attention (the masked half is not model FLOPs): a causal band of w keys (SWA;
        full attention is w = n) has w - w(w-1)/(2n); SA's permuted band holds itself and, of the others, the earlier
        half (a random order), 1 + (n w - L(L+1)/2 - R(R+1)/2 - n) / (2n) for the band (L, R) clipped at the ends.
        The kernels compute SA's whole band, so SA's MFU is about half SWA's for the attention part."""
        n, kind = seq_len, self.attn_cfg.kind
        w = n if kind == "full" else min(self.attn_cfg.window, n)
        causal_band = w - w * (w - 1) / (2 * n)
        left, right = (min(edge, n - 1) for edge in default_band(self.attn_cfg.window if kind != "full" else n, True))
        permuted_band = 1 + (n * (left + right + 1) - left * (left + 1) / 2 - right * (right + 1) / 2 - n) / (2 * n)
        span = {"full": causal_band, "swa": causal_band, "gated_sa_swa": permuted_band + causal_band,
                "sa": permuted_band}.get(kind, w)
        attn = 12 * self.cfg.n_layers * self.cfg.d_model * span
        if non_embedding_params is None:  # counted by the caller where the parameters may be sharded (FSDP)
            non_embedding_params = self.num_parameters(non_embedding=True)
        return 6 * (non_embedding_params + self.cfg.vocab_size * self.cfg.d_model) + attn
