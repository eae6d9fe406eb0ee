"""Training step, optimizer groups, the learning-rate schedule, and the per-step logs."""

from __future__ import annotations

import collections
import math
import time
import uuid

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from model.config import AttentionConfig, ConfigError, ModelConfig
from model.decoder import Decoder
from model.loss import head_cross_entropy

# Dense bf16 peak FLOP/s per device (the SXM / flagship parts), for model FLOPs utilisation, matched on the whole
# model name in torch.cuda.get_device_name: "L4" must not take "L40S", nor "H100" the PCIe card (756e12). Devices
# not listed log no MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "A10G": 125e12, "L4": 121e12, "L40S": 362e12,
              "RTX 4090": 165e12}


def peak_flops(device_name: str) -> float | None:
    """PEAK_FLOPS of a CUDA device name: "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"
    (every A100 part: 312e12), "NVIDIA GeForce RTX 4090"; the model is the first word after the vendor, up to a dash.
    H100 / H200 PCIe and NVL parts run at other clocks: None, as for devices not listed."""
    name = device_name.removeprefix("NVIDIA").strip().removeprefix("GeForce").strip()
    if name in PEAK_FLOPS:
        return PEAK_FLOPS[name]
    model = name.split("-")[0].split(" ")[0]
    if model in ("H100", "H200") and any(part in name.upper() for part in ("PCIE", "NVL")):
        return None
    return PEAK_FLOPS.get(model)


def adamw(groups: list[dict], grad_scaler: bool = False, **options) -> torch.optim.AdamW:
    """AdamW, fused (one kernel over every parameter of a group instead of a loop of per-tensor ops) where torch has
    it: parameters on CUDA or the CPU (`python -m bench.optimizer`: 2.6-3.2x faster steps on the CPU). A resumed run
    keeps the setting its checkpoint's optimizer was made with.

    Not fused under a GradScaler (precision=16-mixed): a fused AdamW unscales the gradients inside its own step, so
    Lightning leaves them scaled, and configure_gradient_clipping would clip (and log) the scaled norm."""
    params = [p for group in groups for p in group["params"]]
    return torch.optim.AdamW(groups, fused=_fusable(params, grad_scaler) or None, **options)


def _fusable(params, grad_scaler: bool) -> bool:
    return not grad_scaler and all(p.device.type in ("cuda", "cpu") and p.is_floating_point() for p in params)


class NonFiniteLossError(RuntimeError):
    pass


_WRAPPERS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def _unwrapped_name(name: str) -> str:
    """A parameter's name with the segments that FSDP, activation checkpointing and torch.compile insert removed."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


SCHEDULES = ("cosine", "linear", "wsd", "constant")
# optim keys added after the first checkpoints were written: an older checkpoint trained with these values
OPTIM_DEFAULTS = {"schedule": "cosine", "decay_fraction": 0.2}
# what checkpoints from before these data keys trained with
DATA_DEFAULTS = {"sampling": "random", "val_split": "index"}
_DEFAULTS = {"optim": OPTIM_DEFAULTS, "data": DATA_DEFAULTS}


def lr_lambda(warmup_steps: int, max_steps: int, min_lr_ratio: float, schedule: str = "cosine",
              decay_fraction: float = 0.2):
    """Linear warmup, then down to min_lr_ratio * lr at max_steps: cosine, linear, or wsd (warmup-stable-decay:
    the full rate until the last decay_fraction of the steps, at least one, then a linear cool-down; a checkpoint of
    the stable phase resumed with another optim.schedule_steps branches a decay for another budget), or constant.
    As in HF's schedules the rate reaches min_lr_ratio at step max_steps, one past the last update of a run that
    trains max_steps steps."""
    decay_steps = max(1, round(decay_fraction * max_steps))
    decay_start = max(warmup_steps, max_steps - decay_steps) if schedule == "wsd" else warmup_steps

    def fn(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, max(0, step - decay_start) / max(1, max_steps - decay_start))
        if schedule == "cosine":
            return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0 - (1 - min_lr_ratio) * progress  # linear, and wsd's cool-down

    return fn


# keys that change how a run is executed, not what it trains: not compared on resume
RUN_LOCAL = {"attention": ("backend",), "data": ("cache_dir", "num_workers", "val_batch_size")}
# model keys that change the parameters' shapes: a checkpoint of another shape cannot be resumed
SHAPE_KEYS = ("vocab_size", "n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_hidden", "tie_embeddings")


def _check_resumed_config(saved: dict, now: dict) -> None:
    """A resumed (or continued) run whose config differs from the checkpoint's: a shape change is refused before the
    weights are loaded; any other change is warned about, the schedule's length with how to keep the old one."""
    from dataclasses import asdict

    changes = []
    if saved.get("seed", now.get("seed")) != now.get("seed"):
        changes.append(f"seed: {saved['seed']!r} -> {now.get('seed')!r} (the data order and SA's permutations follow "
                       "the new seed from here on)")
    for group in ("model", "attention", "optim", "data"):
        if not saved.get(group):  # an older checkpoint without it: nothing to compare
            continue
        old, new = dict(saved[group]), dict(now.get(group) or {})
        old = {**_DEFAULTS.get(group, {}), **old}
        if group == "model":  # as built: n_kv_heads None is n_heads, ffn_hidden None its computed width
            old, new = asdict(ModelConfig(**old)), asdict(ModelConfig(**new))
        for key in sorted(set(old) | set(new)):
            if old.get(key) != new.get(key) and key not in RUN_LOCAL.get(group, ()):
                if group == "model" and key in SHAPE_KEYS:
                    raise ConfigError(f"model.{key}", new.get(key), f"the checkpoint was trained with "
                                      f"{old.get(key)!r}; a model of another shape cannot load its weights")
                if group == "attention" and key == "kind" and "gated_sa_swa" in (old.get(key), new.get(key)):
                    raise ConfigError("attention.kind", new.get(key), f"the checkpoint was trained with "
                                      f"{old.get(key)!r}; the gates of gated_sa_swa are parameters of their own")
                changes.append(f"{group}.{key}: {old.get(key)!r} -> {new.get(key)!r}")
    if saved.get("max_steps") not in (None, now.get("max_steps")):
        changes.append(f"learning-rate schedule length: {saved['max_steps']} -> {now.get('max_steps')} steps (the "
                       f"rate follows the new schedule from here on; optim.schedule_steps={saved['max_steps']} keeps "
                       "the old)")
    if changes:
        rank_zero_warn("resuming with a config that differs from the checkpoint's: " + "; ".join(changes))


def same_tokenizer(a: str, b: str) -> bool:
    """Whether two tokenizer.json texts give the same token ids (truncation and padding are call settings)."""
    import json

    def core(text):
        spec = json.loads(text)
        return {k: v for k, v in spec.items() if k not in ("truncation", "padding")}

    return a == b or core(a) == core(b)


class LitDecoder(L.LightningModule):
    def __init__(self, model: dict, attention: dict, optim: dict, seed: int = 0, max_steps: int = 1000,
                 data: dict | None = None, init_from: dict | None = None):
        super().__init__()
        self.save_hyperparameters()
        self.model = Decoder(ModelConfig(**model), AttentionConfig(**attention), seed=seed)
        # Which parameters decay, decided on the unwrapped model: under FSDP configure_optimizers sees every parameter
        # as a flat 1-D shard, so a shape test there would decay nothing. No decay on norms, biases or embeddings
        # (the tied head shares the embedding).
        self._decay_names = {n for n, p in self.model.named_parameters() if p.dim() >= 2 and "embed" not in n}
        self.optim_cfg = optim
        self.max_steps = max_steps
        self._last_time = None
        self._save_started = None
        self._recent_batches = None  # (tokens, seconds) of the latest micro-batches, for train/tokens_per_s
        self._peak = None
        # counted here, on the whole model: under FSDP a parameter outside the forward holds only this rank's shard,
        # and a count taken then shrank MFU by the world size
        self._params_non_embedding = self.model.num_parameters(non_embedding=True)
        self._loss_sum, self._loss_count = None, 0  # the micro-batch losses of the current optimizer step
        self._loss_weight = 0  # the targets they count
        self._step_positions = 1  # target positions of the step's first micro-batch (data.loss_only_after's scale)
        self.tokenizer_json: str | None = None  # saved inside every checkpoint, so a checkpoint alone can be evaluated
        # data.loss_only_after: the loss counts only the target right after each occurrence of this token (its id).
        self.loss_only_after: str | None = None
        self.loss_after_id: int | None = None
        self._val_totals = None
        self.resume_config_checked = False  # train.py compared the config with the checkpoint's already
        self.loss_chunk_tokens = 0  # trainer.loss_chunk_tokens: the loss over chunks of this many tokens (0: whole)
        # the step a validation outside fit is logged at, when its weights come from a checkpoint (validate() does
        # not restore the step count): train.py's validation of a resumed checkpoint's weights
        self.validation_label: int | None = None
        # Which training attempt wrote a checkpoint: a restart from an earlier checkpoint that ends at the same step
        # as a scored last.ckpt holds other weights, and tools.runs must tell it from a copy of the same file.
        self._attempt: str | None = None  # drawn at fit start, the same on every rank
        self._resumed_from: tuple[str | None, int | None] = (None, None)  # the loaded checkpoint's attempt and step

    def on_save_checkpoint(self, checkpoint):
        # the first save after the step (ModelCheckpoint writes step<N>.ckpt, then last.ckpt) is where the step ended
        self._save_started = self._save_started or time.perf_counter()
        if self.tokenizer_json is not None:
            checkpoint["tokenizer"] = self.tokenizer_json
        checkpoint["loss_only_after"] = self.loss_only_after
        if self._trainer is not None:
            checkpoint["layout"] = self._layout()
        attempt, step = self._resumed_from
        # nothing trained since the resume (a re-save of the same weights): the same attempt
        checkpoint["attempt"] = attempt if attempt and step == checkpoint.get("global_step") else self._attempt

    def _layout(self) -> dict:
        """How the steps were cut: a resume with another world size or accumulation does not continue the data
        order; under FSDP the optimizer state is numbered in another order."""
        trainer = self.trainer
        return {"world_size": trainer.world_size, "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "fsdp": "FSDP" in type(trainer.strategy).__name__}

    def on_load_checkpoint(self, checkpoint):
        self._resumed_from = (checkpoint.get("attempt"), checkpoint.get("global_step"))
        saved_tokenizer = checkpoint.get("tokenizer")
        if saved_tokenizer is not None and self.tokenizer_json is not None:
            if not same_tokenizer(saved_tokenizer, self.tokenizer_json):
                # the checkpoint's embeddings belong to its token ids: new ids would train on, silently, and every
                # later checkpoint would carry a tokenizer its data was not made with
                raise ConfigError("data.tokenizer.path", "this run's", "the checkpoint was trained with another "
                                  "tokenizer; leave data.tokenizer.path null (a resume then tokenizes with the "
                                  "checkpoint's) or give the tokenizer.json it was trained with")
        self.tokenizer_json = self.tokenizer_json or saved_tokenizer
        started = (checkpoint.get("hyper_parameters") or {}).get("init_from")
        if started and not self.hparams.get("init_from"):  # a resumed init_from run: where it started stays recorded
            self.hparams["init_from"] = started
        saved_layout = checkpoint.get("layout")
        if saved_layout and self._trainer is not None:
            now = self._layout()
            if saved_layout["fsdp"] != now["fsdp"]:
                raise ConfigError("trainer.strategy", type(self.trainer.strategy).__name__,
                                  f"the checkpoint was written {'under' if saved_layout['fsdp'] else 'without'} FSDP, "
                                  "whose optimizer state Lightning numbers in another order; resume with the "
                                  "strategy it was trained with")
            changed = [f"{k}: {saved_layout[k]} -> {now[k]}" for k in ("world_size", "accumulate_grad_batches")
                       if saved_layout[k] != now[k]]
            if changed:
                rank_zero_warn("resuming with another layout (" + "; ".join(changed) + "): the data order does not "
                               "continue exactly, and some batches may be seen twice; keep trainer.devices, "
                               "trainer.num_nodes and optim.tokens_per_step for an exact resume")
        if not self.resume_config_checked:  # train.py checks before the data preparation
            _check_resumed_config(checkpoint.get("hyper_parameters") or {}, dict(self.hparams))
        saved = checkpoint.get("loss_only_after")  # absent in older checkpoints: they trained on every token
        if saved != self.loss_only_after:
            raise ConfigError("data.loss_only_after", self.loss_only_after,
                              f"the checkpoint was trained with {saved!r}; resume with the same objective")

    def forward(self, tokens, lengths=None):
        return self.model(tokens, lengths)

    def on_fit_start(self):
        self._attempt = self.trainer.strategy.broadcast(uuid.uuid4().hex)

    def on_train_start(self):
        self.model.sampler.rank = self.global_rank
        if self.device.type == "cuda":
            self._peak = peak_flops(torch.cuda.get_device_name(self.device))
        self._apply_optim_config()
        self._note_unfused_resume()

    def _note_unfused_resume(self):
        """A checkpoint's optimizer state brings its own `fused` flag: one made before the fused AdamW (2026-12-02)
        resumes unfused, so its steps continue bit for bit. Say so, or the slower steps are a mystery."""
        for opt in self.trainer.optimizers:
            params = [p for group in opt.param_groups for p in group["params"]]
            if _fusable(params, self._grad_scaler()) and not any(group.get("fused") for group in opt.param_groups):
                rank_zero_info("AdamW runs unfused, as in the checkpoint this run resumed from (its steps continue "
                               "exactly); a new run uses torch's fused AdamW, whose steps are 2.6-3.2x faster "
                               "(python -m bench.optimizer)")

    def _grad_scaler(self) -> bool:
        """Whether the gradients reach the optimizer scaled (precision=16-mixed): AdamW is not fused then."""
        return self._trainer is not None and getattr(self.trainer.precision_plugin, "scaler", None) is not None

    def _apply_optim_config(self):
        """Set the optimizer and the schedule to this run's optim config. A resume restores both from the checkpoint,
        param groups and base rates included, so a resume with another optim.lr, weight_decay, betas or eps kept the
        old values while config.yaml and the resume warning showed the new. A run that resumes with its own config
        gets the values it already has."""
        cfg = self.optim_cfg
        for config in self.trainer.lr_scheduler_configs:
            sched = config.scheduler
            for group, decay, fn in zip(sched.optimizer.param_groups, (cfg["weight_decay"], 0.0), sched.lr_lambdas):
                group.update(initial_lr=cfg["lr"], weight_decay=decay, betas=tuple(cfg["betas"]), eps=cfg["eps"],
                             lr=cfg["lr"] * fn(sched.last_epoch))
            sched.base_lrs = [cfg["lr"]] * len(sched.base_lrs)
            sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]

    def on_train_batch_start(self, batch, batch_idx):
        # SA permutations are seeded by (seed, micro-batch, layer, rank): every forward pass draws fresh ones, also
        # within one accumulated optimizer step, and a resumed run draws the same ones again.
        accumulate = self.trainer.accumulate_grad_batches
        self.model.sampler.step = self.global_step * accumulate + batch_idx % accumulate
        # Lightning labels logged rows with its own count of optimizer steps, restored from a checkpoint by a guess
        # about where in the loop it was saved: resumed from train.py's final checkpoint (written after fit), a run
        # labelled every row one step late. That count is the global step.
        self.trainer.fit_loop.epoch_loop._batches_that_stepped = self.global_step

    def on_validation_start(self):
        # Inside fit Lightning runs validation before it counts the step that just ran, so the weights after 3 updates
        # were logged at step 2, while a validation at the start or after fit is labelled with the updates done. After
        # a resume both labels met: the post-fit validation of step 5 and the in-fit one after step 6 were both "5",
        # and one was lost from the curve. Every validation is labelled with the updates its weights have had.
        label = self.global_step if self.validation_label is None else self.validation_label
        self.trainer.fit_loop.epoch_loop._batches_that_stepped = label

    def _loss(self, batch):
        """(mean loss over the counted targets, their number, how many of them greedy decoding gets right or None).

        With data.loss_only_after the mean is over the micro-batch's answers; one without any gives a zero loss.
        """
        tokens, targets = batch[:, :-1], batch[:, 1:]
        hidden, head = self.model.hidden_states(tokens), self.model.lm_head.weight
        if self.loss_after_id is None:
            return head_cross_entropy(hidden, head, targets, self.loss_chunk_tokens) / targets.numel(), \
                targets.numel(), None
        counted = tokens == self.loss_after_id
        total = head_cross_entropy(hidden, head, targets.masked_fill(~counted, -100), self.loss_chunk_tokens)
        count = counted.sum()
        right = None
        if not self.training:  # the head on the answer positions only
            right = (self.model.lm_head(hidden[counted]).argmax(-1) == targets[counted]).sum()
        return total / count.clamp_min(1), count, right

    def training_step(self, batch, batch_idx):
        loss, count, _ = self._loss(batch)  # checked once per optimizer step (on_before_optimizer_step)
        trainer = self.trainer
        positions = batch[:, :-1].numel()
        tokens_per_step = positions * trainer.world_size * trainer.accumulate_grad_batches
        if not self._loss_count:
            self._step_positions = positions
        self._add_to_step_loss(loss.detach(), count)
        self.log("train/tokens", float((self.global_step + 1) * tokens_per_step))
        if self.loss_after_id is None:
            return loss
        # The answers' summed loss over a constant: the step's gradient is then the sum over all its answers, which
        # on_before_optimizer_step divides by their number over every micro-batch and rank (_answer_mean_gradients).
        # Returning each micro-batch's own mean let one with 1 answer weigh as much as one with 50.
        return loss * count / self._step_positions

    def _add_to_step_loss(self, loss: torch.Tensor, count):
        """train/loss is logged once per optimizer step (on_before_optimizer_step): the mean over the targets its
        micro-batches count on every rank. Logged per micro-batch, it was the last one of rank zero,
        1/accumulation of the step's data; a plain mean of micro-batch means let data.loss_only_after's micro-batches
        without an answer (loss 0) pull it down."""
        weighted = loss * count
        self._loss_sum = weighted if self._loss_sum is None else self._loss_sum + weighted
        self._loss_weight = self._loss_weight + count
        self._loss_count += 1

    def _step_loss(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's loss over the targets of every rank (ranks whose micro-batches held fewer answers weigh less),
        and the number of those targets."""
        totals = torch.stack([self._loss_sum.float(), torch.as_tensor(self._loss_weight, dtype=torch.float32,
                                                                      device=self._loss_sum.device)])
        if self._trainer is not None and self.trainer.world_size > 1:
            totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        return totals[0] / totals[1].clamp_min(1), totals[1]

    def _answer_mean_gradients(self, answers: torch.Tensor) -> None:
        """data.loss_only_after: turns the step's gradient, a sum over its answers divided by the constant
        positions x accumulation x world size (Lightning divides by the accumulation, DDP/FSDP average over ranks),
        into the mean over every answer of the step, as one batch holding all its micro-batches would give.
        Multiplied on the device (no host sync), before clipping; a step without answers keeps its zero gradient."""
        trainer = self.trainer
        scale = self._step_positions * trainer.accumulate_grad_batches * trainer.world_size / answers.clamp_min(1)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, scale.to(grads[0].device))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        now = time.perf_counter()
        end = self._save_started or now  # a checkpoint saved after this step (ModelCheckpoint runs first) is left out
        if self._last_time is not None:
            # over the micro-batches of the last logging interval: one micro-batch alone is as noisy as the machine
            # (a collection, a busy core read as a 5x slower step)
            window = self.trainer.log_every_n_steps * self.trainer.accumulate_grad_batches
            if self._recent_batches is None or self._recent_batches.maxlen != window:
                self._recent_batches = collections.deque(maxlen=window)
            self._recent_batches.append((batch[:, :-1].numel() * self.trainer.world_size, end - self._last_time))
            tokens, seconds = (sum(column) for column in zip(*self._recent_batches))
            tokens_per_s = tokens / seconds
            self.log("train/tokens_per_s", tokens_per_s, prog_bar=True)
            if self._peak:
                flops = self._flops(batch.shape[1] - 1) * tokens_per_s / self.trainer.world_size
                self.log("train/mfu", flops / self._peak)
        if self.device.type == "cuda":  # the highest of any rank: the one that runs out first
            self.log("train/max_memory_gib", torch.cuda.max_memory_allocated(self.device) / 2**30, reduce_fx="max",
                     sync_dist=True)
        self._last_time, self._save_started = now, None

    def _flops(self, seq_len: int) -> float:
        return self.model.flops_per_token(seq_len, self._params_non_embedding)

    def on_validation_end(self):
        if self._last_time is not None:  # inside fit: the next step's time starts after the validation
            self._last_time = time.perf_counter()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        clip = self.optim_cfg.get("grad_clip") or float("inf")
        root = self.trainer.model
        if hasattr(root, "clip_grad_norm_"):  # FSDP: the norm over all shards, not over this rank's shard only
            norm = root.clip_grad_norm_(clip)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), clip)
        self.log("train/grad_norm", norm)
        # A finite loss can still give a non-finite gradient (an overflow in the backward; an answer-less micro-batch
        # of data.loss_only_after, whose loss is 0, through NaN activations). Under 16-mixed the GradScaler skips
        # such a step itself; otherwise it would reach the weights, and the next checkpoint.
        if not self._grad_scaler() and not bool(torch.isfinite(norm)):
            raise NonFiniteLossError(
                f"the gradient became non-finite at step {self.global_step} (norm {float(norm)}) with a finite loss; "
                "stopping before the update. The checkpoints written before it are kept in the run's checkpoints/ "
                "folder (try a lower optim.lr or a longer warmup)."
            )

    def on_validation_epoch_start(self):
        self._val_totals = torch.zeros(3, device=self.device)  # answers only: loss sum, answers, right answers

    def validation_step(self, batch, batch_idx):
        loss, counted, right = self._loss(batch)
        gates = self.model.gate_openness(batch[:, :-1]) if batch_idx == 0 else None
        for layer, (sa, swa) in enumerate(gates if gates is not None else []):  # the first batch: a mean of B*n tokens
            self.log(f"gates/sa/layer{layer:02d}", sa, sync_dist=True, batch_size=batch.shape[0])
            self.log(f"gates/swa/layer{layer:02d}", swa, sync_dist=True, batch_size=batch.shape[0])
        if self.loss_after_id is None:
            self.log("val/loss", loss, prog_bar=True, sync_dist=True, batch_size=batch.shape[0])
        else:  # summed here and reduced once at the end: batches and ranks weigh by their number of answers
            self._val_totals += torch.stack([loss.detach() * counted, counted.float(), right.float()])
        return loss

    def on_validation_epoch_end(self):
        if self.loss_after_id is not None:
            totals = self.trainer.strategy.reduce(self._val_totals, reduce_op="sum")
            if totals[1] > 0:
                self.log("val/loss", totals[0] / totals[1], prog_bar=True)
                self.log("val/answer_acc", totals[2] / totals[1])
            else:
                rank_zero_warn(f"no validation window holds data.loss_only_after={self.loss_only_after!r}; "
                               "raise data.val_windows")
                return  # no val/ppl either: callback_metrics still holds the previous validation's loss
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None:
            self.log("val/ppl", torch.exp(loss), sync_dist=True)

    def configure_optimizers(self):
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (decay if _unwrapped_name(name) in self._decay_names else no_decay).append(p)
        cfg = self.optim_cfg
        opt = adamw([{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
                    grad_scaler=self._grad_scaler(), lr=cfg["lr"], betas=tuple(cfg["betas"]), eps=cfg["eps"])
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lr_lambda(cfg["warmup_steps"], self.max_steps, cfg["min_lr_ratio"],
                           cfg.get("schedule", OPTIM_DEFAULTS["schedule"]),
                           float(cfg.get("decay_fraction", OPTIM_DEFAULTS["decay_fraction"])))
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer):
        """Logs the step's loss and stops on a non-finite one before the weights change. Checked here, once per
        optimizer step, not after every micro-batch's forward: that check waited for the device before the backward
        could be queued (and, under DDP, all-reduced a flag each time). The loss is summed over the ranks, so one
        rank's NaN stops every rank at the same step."""
        self.log("train/lr", optimizer.param_groups[0]["lr"])
        if self._loss_count:
            loss, counted = self._step_loss()
            self._loss_sum, self._loss_count, self._loss_weight = None, 0, 0
            if not bool(torch.isfinite(loss)):
                raise NonFiniteLossError(
                    f"training loss became non-finite at step {self.global_step} (the step's loss over every rank: "
                    f"{loss.item()}); stopping before the update. The checkpoints written before it are kept in the "
                    "run's checkpoints/ folder (try a lower optim.lr or a longer warmup)."
                )
            if self.loss_after_id is not None:
                self._answer_mean_gradients(counted)
            self.log("train/loss", loss, prog_bar=True)


class StepProgressBar(RichProgressBar):
    """Rich's bar for a run counted in steps (max_epochs=-1): it titled the bar "Epoch 0/-2"; now "Epoch 0", the
    pass over the data the bar's batches belong to."""

    @property
    def total_train_batches(self):
        """Lightning counts the steps left as batches: under trainer.accumulate_grad_batches=2 a 30-step run's bar
        read 60/30. A step is that many micro-batches (batches, for the bar)."""
        trainer = self.trainer
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            left = (trainer.max_steps - trainer.global_step) * trainer.accumulate_grad_batches
            done = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # the bar counts on from a resume's batch
            return min(trainer.num_training_batches, left + done)
        return super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        text = f"Epoch {current_epoch}" + (f"/{self.trainer.max_epochs - 1}" if (self.trainer.max_epochs or 0) > 0
                                           else "")
        return f"{text:{len(self.validation_description)}}"  # padded as Lightning does: no flicker between bars


def save_step_checkpoint(trainer, ckpt_dir) -> None:
    """step<N>.ckpt and last.ckpt at the step reached, named as ModelCheckpoint names its own."""
    for name in (f"step{trainer.global_step:07d}.ckpt", "last.ckpt"):  # whole (optimizer too): a resume needs it
        trainer.save_checkpoint(ckpt_dir / name, weights_only=False)


class PruneStepCheckpoints(L.Callback):
    """trainer.keep_checkpoints: the newest `keep` step checkpoints stay whole, older ones shrink to their weights
    (keep_weights) or go (prune_step_checkpoints). Once per optimizer step, on rank zero: Lightning runs
    ModelCheckpoint after the other callbacks, so a new checkpoint is never what makes room for itself."""

    def __init__(self, ckpt_dir, keep: int, keep_weights: bool):
        self.ckpt_dir, self.keep, self.keep_weights = ckpt_dir, keep, keep_weights
        self._step = None

    def on_train_batch_end(self, trainer, pl_module, *args):
        if trainer.is_global_zero and trainer.global_step != self._step:
            self._step = trainer.global_step
            started = time.perf_counter()
            if self.prune():  # reading and rewriting checkpoints is no training step's time (train/tokens_per_s)
                pl_module._save_started = pl_module._save_started or started

    def prune(self) -> list:
        from model.checkpoint import prune_step_checkpoints

        return prune_step_checkpoints(self.ckpt_dir, self.keep, self.keep_weights)


class StepCheckpoint(ModelCheckpoint):
    """ModelCheckpoint that never saves between the micro-batches of an optimizer step. Its "saved at this step" mark
    starts at step 0, not at the step a resume starts from: resumed at step N (a multiple of the checkpoint period)
    under gradient accumulation, it saved again after the first micro-batch of step N + 1, while global_step still
    read N, overwriting step<N>.ckpt and last.ckpt with a state that counts that micro-batch as trained but holds
    none of its gradient. A resume from there made step N + 1 of one micro-batch and ran the data one behind."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if getattr(pl_module, "_loss_count", 0):  # between the micro-batches of a step
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


class CheckpointOnSigterm(L.Callback):
    """SIGTERM (scancel, preemption): stop at the end of the current optimizer step (after its validation, if one
    is due), on every rank together, and save a checkpoint there, as train.py's own final save names them.

    Lightning's own handler stopped after whatever batch was running (mid-step under accumulation: nothing could
    be saved that would resume exactly), stopped a validation midway (nothing saved either), and with several ranks
    it ran a collective inside the signal handler: scancel signals every rank, the collectives no longer matched,
    and the job hung (3 runs of 4). Here the handler only notes the signal (installed in setup, before Lightning
    registers its handlers, for every stage); at each step's end the ranks agree on it (one all-reduce) and raise
    Lightning's own stop flag together, which Lightning reads at the end of that step's batch."""

    def __init__(self, ckpt_dir):
        self.ckpt_dir = ckpt_dir
        self.signalled = False  # this rank received SIGTERM
        self._stopping = False  # the ranks agreed to stop after the validation that follows this step

    def setup(self, trainer, pl_module, stage):
        trainer._signal_connector._sigterm_notifier_fn = self._note

    def _note(self, signum, frame):
        self.signalled = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module._loss_count:  # between the micro-batches of a step: wait for its end
            return
        stop = self.signalled
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = torch.tensor([float(stop)], device=pl_module.device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)  # one rank signalled: all stop
            stop = bool(flag.item())
        if stop and _validation_follows(trainer):
            self._stopping = True  # Lightning would stop the validation midway, where nothing can be saved
        elif stop:
            trainer._signal_connector.received_sigterm = True

    def on_validation_end(self, trainer, pl_module):
        if self._stopping and trainer.state.fn == "fit":
            trainer._signal_connector.received_sigterm = True  # read right after this validation

    def on_exception(self, trainer, pl_module, exception):
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if not isinstance(exception, SIGTERMException) or pl_module._loss_count or not trainer.training:
            return
        save_step_checkpoint(trainer, self.ckpt_dir)
        rank_zero_warn(f"SIGTERM: saved {self.ckpt_dir / 'last.ckpt'} at step {trainer.global_step}")


def _validation_follows(trainer) -> bool:
    """Whether Lightning validates after this training batch (its own test, a private one: False where absent)."""
    try:
        return bool(trainer.fit_loop.epoch_loop._should_check_val_fx(None))
    except Exception:  # noqa: BLE001 - another Lightning: stop at once, as its own handler would
        return False
