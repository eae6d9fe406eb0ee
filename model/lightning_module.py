"""Training step, optimizer groups, warmup + cosine schedule, and the per-step logs."""

from __future__ import annotations

import math
import time

import lightning as L
import torch
import torch.nn.functional as F

from model.config import AttentionConfig, ModelConfig
from model.decoder import Decoder

# Dense bf16 peak FLOP/s per device, for model FLOPs utilisation. Unknown devices log no MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "A10G": 125e12, "L4": 121e12, "4090": 165e12}


class NonFiniteLossError(RuntimeError):
    pass


def lr_lambda(warmup_steps: int, max_steps: int, min_lr_ratio: float):
    """Linear warmup, then cosine decay to min_lr_ratio * lr at max_steps."""

    def fn(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return fn


class LitDecoder(L.LightningModule):
    def __init__(self, model: dict, attention: dict, optim: dict, seed: int = 0, max_steps: int = 1000):
        super().__init__()
        self.save_hyperparameters()
        self.model = Decoder(ModelConfig(**model), AttentionConfig(**attention), seed=seed)
        self.optim_cfg = optim
        self.max_steps = max_steps
        self._last_time = None
        self._peak = None
        self.tokenizer_json: str | None = None  # saved inside every checkpoint, so a checkpoint alone can be evaluated
        self.loss_after_id: int | None = None  # data.loss_only_after: only targets that follow this token count

    def on_save_checkpoint(self, checkpoint):
        if self.tokenizer_json is not None:
            checkpoint["tokenizer"] = self.tokenizer_json

    def on_load_checkpoint(self, checkpoint):
        self.tokenizer_json = checkpoint.get("tokenizer", self.tokenizer_json)

    def forward(self, tokens, lengths=None):
        return self.model(tokens, lengths)

    def on_train_start(self):
        self.model.sampler.rank = self.global_rank
        if self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
            self._peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)

    def on_train_batch_start(self, batch, batch_idx):
        self.model.sampler.step = self.global_step  # SA permutations seeded by (seed, step, layer, rank)

    def _loss(self, batch):
        """(mean loss over the counted targets, their number, how many of them greedy decoding gets right or None)."""
        tokens, targets = batch[:, :-1], batch[:, 1:]
        logits = self.model(tokens)
        if self.loss_after_id is None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
            return loss, targets.numel(), None
        counted = tokens == self.loss_after_id
        picked, answers = logits[counted].float(), targets[counted]
        # A batch without the token contributes a zero loss (and no gradient) rather than a NaN mean.
        loss = F.cross_entropy(picked, answers, reduction="sum") / max(1, answers.numel())
        return loss, answers.numel(), (picked.argmax(-1) == answers).sum()

    def training_step(self, batch, batch_idx):
        loss, _, _ = self._loss(batch)
        if not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"training loss became {loss.item()} at step {self.global_step}; stopping. The last good checkpoint "
                "is kept in the run's checkpoints/ folder (try a lower optim.lr or a longer warmup)."
            )
        trainer = self.trainer
        tokens_per_step = batch[:, :-1].numel() * trainer.world_size * trainer.accumulate_grad_batches
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/tokens", float((self.global_step + 1) * tokens_per_step))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        now = time.perf_counter()
        if self._last_time is not None:
            tokens_per_s = batch[:, :-1].numel() * self.trainer.world_size / (now - self._last_time)
            self.log("train/tokens_per_s", tokens_per_s, prog_bar=True)
            if self._peak:
                flops = self.model.flops_per_token(batch.shape[1] - 1) * tokens_per_s / self.trainer.world_size
                self.log("train/mfu", flops / self._peak)
        self._last_time = now

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        clip = self.optim_cfg.get("grad_clip") or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), clip)
        self.log("train/grad_norm", norm)

    def validation_step(self, batch, batch_idx):
        loss, counted, right = self._loss(batch)
        if right is None:
            self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch.shape[0])
        elif counted:  # answers only: weight each batch by its number of answers
            self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=counted)
            self.log("val/answer_acc", right.float() / counted, sync_dist=True, batch_size=counted)
        return loss

    def on_validation_epoch_end(self):
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None:
            self.log("val/ppl", torch.exp(loss), sync_dist=True)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            # No weight decay on norms, biases or embeddings (the tied head shares the embedding).
            (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
        cfg = self.optim_cfg
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=cfg["eps"],
        )
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(cfg["warmup_steps"], self.max_steps, cfg["min_lr_ratio"])
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer):
        self.log("train/lr", optimizer.param_groups[0]["lr"])
