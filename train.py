"""Train a decoder with full, SWA, SA or gated SA+SWA attention.

    python train.py attention=gated_sa_swa
    python train.py -m attention=full,swa,sa,gated_sa_swa trainer.max_steps=20
    python train.py experiment=paper_360m trainer=ddp
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from model.config import attention_label, attention_tag, window_tag
from tools.runlog import RunConsole, code_revision, say, warnings_to_log

ROOT = Path(__file__).resolve().parent
# run names and sweep folders: full attention carries no window
OmegaConf.register_new_resolver("sa_attention_tag", attention_tag, replace=True)
OmegaConf.register_new_resolver("sa_window_tag", window_tag, replace=True)
OmegaConf.register_new_resolver("steps", lambda tokens, per: max(1, int(float(tokens)) // int(per)), replace=True)
# data.max_tokens counts the held-out documents too: a training budget plus twice its validation share (the hash
# split holds out about val_fraction, by documents) leaves the whole budget for training, with no wrap into a
# second pass at the end
OmegaConf.register_new_resolver("with_validation", lambda tokens, val_fraction: int(
    float(tokens) * (1 + 2 * float(val_fraction))), replace=True)


# Integer settings outside model/attention (whose dataclasses check their own). Hydra reads 1e9 as 1000000000.0 and
# ${oc.env:...} as a string: check_config writes each whole number as an int, so the checks, every later int() and
# the data cache's key see one spelling. (data.tokenizer.train_chars is left as written: 2e7 was always accepted, and
# the caches prepared with it are found under its spelling.)
WHOLE_NUMBER_KEYS = ("seed", "data.seq_len", "data.batch_size", "data.val_windows", "data.val_batch_size",
                     "data.num_workers", "data.max_tokens", "data.shard_tokens", "data.tokenizer.vocab_size",
                     "trainer.max_steps", "trainer.val_every_n_steps",
                     "trainer.checkpoint_every_n_steps", "trainer.accumulate_grad_batches",
                     "trainer.log_every_n_steps", "trainer.loss_chunk_tokens", "trainer.keep_checkpoints",
                     "trainer.num_nodes", "optim.warmup_steps", "optim.schedule_steps", "optim.tokens_per_step")


def _as_whole_numbers(cfg: DictConfig) -> None:
    for key in WHOLE_NUMBER_KEYS:
        value = OmegaConf.select(cfg, key, default=None)
        if value is not None and not isinstance(value, int) and _whole(value) is not None:
            OmegaConf.update(cfg, key, _whole(value), merge=False)


def check_config(cfg: DictConfig):
    """Validate everything cheap to check before any work; raises ConfigError naming the key."""
    from data.prepare import validate_data_config
    from model.config import AttentionConfig, ConfigError, ModelConfig, from_mapping

    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:  # a preset's required value (???) left unset: name it, not the error reading '???' causes later
        raise ConfigError(missing[0], "???", f"a value the chosen preset requires; give it on the command line: "
                          f"{missing[0]}=<value>")
    from tools.config_hints import refuse_unread_keys

    refuse_unread_keys(cfg)
    _as_whole_numbers(cfg)
    model_cfg = from_mapping(ModelConfig, cfg.model, "model")
    attn_cfg = from_mapping(AttentionConfig, cfg.attention, "attention")
    if _whole(cfg.get("seed")) is None or not 0 <= cfg.seed < 2**32:
        raise ConfigError("seed", cfg.get("seed"), "a whole number in [0, 2**32), e.g. seed=1")
    if (_whole(cfg.data.seq_len) or 0) < 1:
        raise ConfigError("data.seq_len", cfg.data.seq_len, "sequence length, a positive integer")
    if cfg.data.seq_len > model_cfg.max_seq_len:
        raise ConfigError("data.seq_len", cfg.data.seq_len, f"must be <= model.max_seq_len={model_cfg.max_seq_len}")
    for key in ("max_steps", "val_every_n_steps", "checkpoint_every_n_steps", "accumulate_grad_batches",
                "log_every_n_steps"):
        if (_whole(cfg.trainer[key]) or 0) < 1:  # 2.5 would be cut to 2 in silence
            raise ConfigError(f"trainer.{key}", cfg.trainer[key], "must be a positive integer")
    for key in ("batch_size", "val_windows"):
        if (_whole(cfg.data[key]) or 0) < 1:
            raise ConfigError(f"data.{key}", cfg.data[key], "must be a positive integer")
    val_batch = cfg.data.get("val_batch_size")
    if val_batch is not None and (_whole(val_batch) or 0) < 1:
        raise ConfigError("data.val_batch_size", val_batch, "must be a positive integer (or null: data.batch_size)")
    workers = _whole(cfg.data.get("num_workers", 0))
    if workers is None or workers < 0:
        raise ConfigError("data.num_workers", cfg.data.num_workers, "DataLoader worker processes, an integer >= 0")
    _check_trainer_and_optim(cfg)
    if cfg.get("eval") and cfg.eval.get("after_train"):  # what would fail only after training
        from evaluation.runner import check_eval_config, check_task_names, local_tasks

        eval_cfg = _eval_config(cfg)
        tasks = check_task_names(eval_cfg["tasks"])
        check_eval_config(eval_cfg)
        if eval_cfg.get("data_dir") and eval_cfg.get("num_fewshot"):  # shots a local test-only task cannot give
            local_tasks(tasks, eval_cfg["data_dir"], eval_cfg["task_dir"], eval_cfg["num_fewshot"])
    if cfg.trainer.strategy == "ddp_spawn":  # its workers hand no loop state back to this process
        raise ConfigError("trainer.strategy", cfg.trainer.strategy, "not supported: the spawned workers return no "
                          "step count, so the final checkpoint and validation would be skipped and a resume cannot be "
                          "pickled; use ddp (one run at a time for multi-device sweeps, see tools/README.md)")
    if cfg.trainer.strategy not in ("auto", "ddp", "fsdp"):
        raise ConfigError("trainer.strategy", cfg.trainer.strategy, "choose auto, ddp or fsdp")
    from tools.guards import refuse_multirun_ddp

    refuse_multirun_ddp(cfg)  # Hydra multirun + subprocess DDP re-runs the sweep on every rank: refuse up front
    if cfg.resume not in (None, "auto"):
        raise ConfigError("resume", cfg.resume, "use resume=auto, or ckpt_path=<file> for a specific checkpoint")
    if cfg.ckpt_path and not Path(cfg.ckpt_path).is_file():
        raise ConfigError("ckpt_path", cfg.ckpt_path, "no such checkpoint file")
    if cfg.get("init_from"):
        from model.checkpoint import find_checkpoint

        if cfg.ckpt_path:
            raise ConfigError("init_from", cfg.init_from, "give ckpt_path (continue that run) or init_from (start a "
                              "new run from its weights), not both")
        try:
            find_checkpoint(cfg.init_from)
        except FileNotFoundError as err:
            if cfg.resume != "auto":  # a resume of the run it started needs it no more (train() looks it up then)
                raise ConfigError("init_from", cfg.init_from, str(err)) from None
    validate_data_config(OmegaConf.to_container(cfg.data, resolve=True))
    _check_vocabulary(cfg.data.tokenizer, model_cfg.vocab_size)
    return model_cfg, attn_cfg


def _check_vocabulary(tokenizer: DictConfig, model_vocab: int) -> None:
    """A tokenizer larger than the model's embedding, or without an end-of-text token, refused before the corpus is
    tokenized with it (train() checks the prepared one again: a resume may take its checkpoint's tokenizer)."""
    from model.config import ConfigError

    if tokenizer.get("path"):
        from tokenizers import Tokenizer

        from data.tokenizer import eos_id, id_bound

        try:
            tok = Tokenizer.from_file(str(tokenizer.path))
        except Exception as err:  # noqa: BLE001 - the tokenizers library's own error says what is wrong in the file
            raise ConfigError("data.tokenizer.path", tokenizer.path, f"not a tokenizer.json the tokenizers library "
                              f"reads ({str(err).splitlines()[0][:200]})") from None
        try:
            eos_id(tok)
        except ValueError as err:  # found here, before the corpus is read
            raise ConfigError("data.tokenizer.path", tokenizer.path, str(err)) from None
        size, what = id_bound(tok), f"{tokenizer.path}'s vocabulary (its largest id + 1)"
    else:
        size, what = int(tokenizer.vocab_size), "data.tokenizer.vocab_size"
    if size > model_vocab:
        raise ConfigError("model.vocab_size", model_vocab, f"smaller than {what} ({size}); raise it to >= {size}")


# Lightning 2.x's precision values and aliases, plus our "auto" (bf16-mixed on CUDA, 32-true on CPU).
PRECISIONS = ("auto", "32-true", "16-mixed", "bf16-mixed", "bf16-true", "16-true", "64-true", "transformer-engine",
              "transformer-engine-float16", "64", "32", "16", "bf16")


def _devices(cfg: DictConfig):
    """trainer.devices as a plain value (a ListConfig of GPU ids becomes a list)."""
    devices = cfg.trainer.devices
    return OmegaConf.to_object(devices) if OmegaConf.is_config(devices) else devices


def _device_count(devices, use_cuda: bool) -> int:
    """Devices per node as Lightning counts them: an int or digit string, -1 or auto (every visible GPU), a list."""
    import torch

    if devices == -1 or (devices == "auto" and use_cuda):
        return max(1, torch.cuda.device_count())
    if devices == "auto":
        return 1
    return len(devices) if isinstance(devices, (list, tuple)) else int(devices)


def _check_trainer_and_optim(cfg: DictConfig):
    """What L.Trainer and AdamW would only refuse after data preparation (hours for a large corpus)."""
    from model.config import ConfigError

    t, o = cfg.trainer, cfg.optim
    if str(t.precision) not in PRECISIONS:
        raise ConfigError("trainer.precision", t.precision, f"choose one of {', '.join(PRECISIONS)}")
    if t.accelerator not in ("auto", "cpu", "gpu", "cuda", "mps"):
        raise ConfigError("trainer.accelerator", t.accelerator, "choose auto, cpu, gpu, cuda or mps")
    devices = _devices(cfg)
    ids = isinstance(devices, list) and devices and all(isinstance(d, int) and d >= 0 for d in devices)
    count = (isinstance(devices, int) and devices >= 1) or (isinstance(devices, str) and devices.isdigit()
                                                            and int(devices) >= 1)
    if not (devices in ("auto", -1) or count or ids):
        raise ConfigError("trainer.devices", devices, "give a device count (>= 1), a list of GPU ids, -1 for all "
                          "GPUs, or auto")
    if devices == -1 and t.accelerator == "cpu":
        raise ConfigError("trainer.devices", devices, "-1 (every GPU) needs a GPU accelerator; give a count on CPU")

    if t.accelerator in ("gpu", "cuda") and not cfg.get("prepare_only"):  # data is prepared on CPU nodes too
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("trainer.accelerator", t.accelerator, "this machine has no CUDA GPU; on CPU use "
                              "trainer=ddp_cpu (several processes) or trainer.accelerator=cpu")
    if not isinstance(t.get("activation_checkpointing", False), bool):
        raise ConfigError("trainer.activation_checkpointing", t.activation_checkpointing, "true or false")
    if not isinstance(t.get("compile", False), bool):
        raise ConfigError("trainer.compile", t.compile, "true or false (torch.compile every decoder block)")
    if t.get("compile") and cfg.attention.backend == "flex":
        raise ConfigError("trainer.compile", True, "attention.backend=flex compiles its own kernel; use backend "
                          "auto, torch or triton with a compiled model")
    chunk = t.get("loss_chunk_tokens", 0)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
        raise ConfigError("trainer.loss_chunk_tokens", chunk, "the loss over chunks of this many tokens, an integer "
                          ">= 0 (0: the whole micro-batch at once); e.g. 8192")
    if (_whole(t.num_nodes) or 0) < 1:
        raise ConfigError("trainer.num_nodes", t.num_nodes, "must be a positive integer")
    keep = t.get("keep_checkpoints")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ConfigError("trainer.keep_checkpoints", keep, "how many of the newest step checkpoints stay whole, "
                          ">= 1 (null: every one)")
    if not isinstance(t.get("keep_weights", True), bool):
        raise ConfigError("trainer.keep_weights", t.keep_weights, "true or false")
    if not cfg.get("prepare_only"):
        _check_cpu_training(cfg)
    # a NaN passes every comparison's "not" and an inf every lower bound: each must be a finite number
    if not (_real(o.lr) or 0) > 0:
        raise ConfigError("optim.lr", o.lr, "must be a positive number")
    if _real(o.weight_decay) is None or _real(o.weight_decay) < 0:
        raise ConfigError("optim.weight_decay", o.weight_decay, "must be a number >= 0")
    if not (_real(o.get("eps", 1e-8)) or 0) > 0:
        raise ConfigError("optim.eps", o.eps, "AdamW's epsilon, a small positive number, e.g. 1e-8")
    if len(o.betas) != 2 or not all(_real(b) is not None and 0 <= _real(b) < 1 for b in o.betas):
        raise ConfigError("optim.betas", list(o.betas), "two numbers in [0, 1), e.g. [0.9, 0.95]")
    if _whole(o.warmup_steps) is None or _whole(o.warmup_steps) < 0:  # a fraction overshot the peak (2.5: 1.2x)
        raise ConfigError("optim.warmup_steps", o.warmup_steps, "a whole number of steps >= 0")
    steps = o.get("schedule_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError("optim.schedule_steps", steps, "a positive number of steps (or null: trainer.max_steps)")
    schedule = int(steps or t.max_steps)
    if str(t.precision) == "16-true" and (_real(o.get("eps", 1e-8)) or 0) < 6e-8:
        say(f"warning: trainer.precision=16-true keeps weights and AdamW's state in fp16, where "
            f"optim.eps={o.get('eps', 1e-8)} rounds to 0 (fp16's smallest value is 6e-8) and no loss scaling guards "
            "the gradients: expect a non-finite loss within steps; prefer bf16-mixed or 16-mixed")
    if int(o.warmup_steps) >= schedule:  # legal (short test runs), but rarely meant
        say(f"warning: optim.warmup_steps={o.warmup_steps} >= the schedule's {schedule} steps: the learning rate "
            "never leaves warmup (no decay)")
    from model.lightning_module import SCHEDULES

    if o.get("schedule", "cosine") not in SCHEDULES:
        raise ConfigError("optim.schedule", o.schedule, f"one of {', '.join(SCHEDULES)}")
    fraction = o.get("decay_fraction", 0.2)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ConfigError("optim.decay_fraction", fraction, "a share of the schedule's steps in (0, 1], e.g. 0.2")
    if _real(o.min_lr_ratio) is None or not 0 <= _real(o.min_lr_ratio) <= 1:
        raise ConfigError("optim.min_lr_ratio", o.min_lr_ratio, "must lie in [0, 1] (a fraction of optim.lr)")
    if o.get("grad_clip") is not None and (_real(o.grad_clip) is None or _real(o.grad_clip) < 0):
        raise ConfigError("optim.grad_clip", o.grad_clip, "must be a number >= 0 (0 or null: no clipping)")
    tokens = o.get("tokens_per_step")
    if tokens is not None and (_whole(tokens) or 0) < 1:
        raise ConfigError("optim.tokens_per_step", tokens, "must be a positive integer (or null)")


def _whole(value) -> int | None:
    """An integer setting: an int, a float that is one (Hydra reads 1e3 as 1000.0) or a string of one
    (${oc.env:...}); None for anything else (2.5 was cut to 2 in silence, True counted as 1)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _real(value) -> float | None:
    """A finite number (or a string of one); None for nan, inf and anything else (nan passes every bound's `not`,
    inf every lower bound)."""
    import math

    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _check_cpu_training(cfg: DictConfig):
    """Training on the CPU: what the kernels and Lightning refuse there only after the data is prepared."""
    import torch

    from kernels import triton_interpreting
    from model.config import ConfigError

    accelerator = cfg.trainer.accelerator
    if accelerator in ("gpu", "cuda", "mps") or (accelerator == "auto" and torch.cuda.is_available()):
        return
    if isinstance(_devices(cfg), list) and not torch.backends.mps.is_available():
        raise ConfigError("trainer.devices", _devices(cfg), "a list of GPU ids, on a machine without one; give a "
                          "count on the CPU, e.g. trainer.devices=1")
    if cfg.trainer.strategy == "fsdp":
        raise ConfigError("trainer.strategy", "fsdp", "FSDP needs CUDA GPUs (torch has no CPU FSDP); on the CPU use "
                          "trainer=ddp_cpu")
    backend = cfg.attention.backend
    if backend == "triton" and not triton_interpreting():
        raise ConfigError("attention.backend", backend, "the Triton kernels need a CUDA GPU (TRITON_INTERPRET=1 runs "
                          "them on the CPU, slowly, for tests); on the CPU use auto or torch")
    if backend == "flex":
        raise ConfigError("attention.backend", backend, "FlexAttention has no backward on the CPU (it serves "
                          "evaluation there); train with auto or torch")
    if str(cfg.trainer.precision) in ("16-mixed", "16", "16-true"):  # 16-true: fp16 weights, no loss scaling
        raise ConfigError("trainer.precision", cfg.trainer.precision, "fp16 training needs a GPU; on the CPU use "
                          "auto (32-true) or bf16-mixed")


def _accumulation(cfg: DictConfig, world: int) -> int:
    """Micro-batches per optimizer step: trainer.accumulate_grad_batches, or what optim.tokens_per_step needs."""
    from model.config import ConfigError

    if not cfg.optim.get("tokens_per_step"):
        return int(cfg.trainer.accumulate_grad_batches)
    per_micro = int(cfg.data.batch_size) * int(cfg.data.seq_len) * world
    accumulate, rest = divmod(int(cfg.optim.tokens_per_step), per_micro)
    if accumulate < 1 or rest:
        raise ConfigError("optim.tokens_per_step", cfg.optim.tokens_per_step,
                          f"must be a multiple of data.batch_size x data.seq_len x devices = {per_micro}; e.g. "
                          f"{max(1, round(int(cfg.optim.tokens_per_step) / per_micro)) * per_micro}")
    given = int(cfg.trainer.accumulate_grad_batches)
    if given not in (1, accumulate):  # 1 is the default; another value would be overridden in silence
        raise ConfigError("trainer.accumulate_grad_batches", given, f"optim.tokens_per_step sets the accumulation "
                          f"({cfg.optim.tokens_per_step} / (batch x seq_len x devices = {per_micro}) = {accumulate}); "
                          "give one of the two")
    return accumulate


def _loss_token(text: str, tokenizer_path: Path, val_shard: Path) -> int:
    """The id of the one token whose successors carry the loss; refused if the text is not one token or never occurs
    in the validation text (e.g. " ?" passed unquoted through a shell arrives as "?", a different token)."""
    from data.shards import read_shard
    from data.tokenizer import load_tokenizer, single_token_id
    from model.config import ConfigError

    tok = load_tokenizer(tokenizer_path)
    token_id = single_token_id(tok, text)
    if token_id is None:
        pieces = tok.encode(text, add_special_tokens=False).tokens
        raise ConfigError("data.loss_only_after", text, f"is {pieces} with this run's tokenizer; give text that is "
                          "exactly one token (mind the leading space)")
    if not (read_shard(val_shard) == token_id).any():
        raise ConfigError("data.loss_only_after", text,
                          f"token {tok.id_to_token(token_id)!r} never occurs in the validation text, so nothing would "
                          "be trained; check the leading space (on a shell: 'data.loss_only_after=\" ?\"')")
    return token_id


# Lightning's short names (Hydra passes 32 / 16 / 64 as ints)
_PRECISION_ALIASES = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}


def _precision(cfg, accelerator_is_cuda: bool) -> str:
    """trainer.precision by its full name; auto = bf16-mixed on CUDA, 32-true elsewhere."""
    if str(cfg.trainer.precision) != "auto":
        return _PRECISION_ALIASES.get(str(cfg.trainer.precision), str(cfg.trainer.precision))
    return "bf16-mixed" if accelerator_is_cuda else "32-true"


def _fsdp_strategy(cfg, precision: str):
    """Each decoder block sharded; under a mixed precision with the numerics of DDP: fp32 weights gathered, matmuls
    under the precision's autocast, gradients reduced in fp32. Lightning's default for bf16-mixed gathers bf16
    weights, which makes the embedding's output, and with it the residual stream through every block, bf16 (fp32
    under DDP) and reduces the gradients in bf16: a run would not compare with the same run under DDP. The cost is
    twice the all-gather bytes. A "-true" precision keeps Lightning's (everything in that dtype)."""
    import torch
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import MixedPrecision

    from model.decoder import Block

    fp32 = MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    return FSDPStrategy(auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD",
                        mixed_precision=fp32 if "mixed" in precision else None,
                        activation_checkpointing_policy={Block} if cfg.trainer.get("activation_checkpointing")
                        else None)


def _wandb_mode(requested: str) -> str:
    if requested != "auto":
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    has_key = bool(os.environ.get("WANDB_API_KEY")) or "api.wandb.ai" in (
        Path.home().joinpath(".netrc").read_text() if Path.home().joinpath(".netrc").is_file() else "")
    return "online" if has_key else "offline"


def _loggers(cfg, run_dir: Path, resume_step: int | None):
    from lightning.pytorch.loggers import WandbLogger

    from model.csv_log import RunCSVLogger

    loggers = [RunCSVLogger(run_dir)]
    wb = cfg.logger.get("wandb") if cfg.get("logger") else None
    if wb:
        mode = _wandb_mode(wb.mode)
        if mode != "disabled":
            os.environ["WANDB_MODE"] = mode
            loggers.append(WandbLogger(project=wb.project, entity=wb.entity, group=wb.group, name=cfg.run_name,
                                       tags=[t for t in wb.tags if t], save_dir=str(run_dir), offline=mode == "offline",
                                       config=OmegaConf.to_container(cfg, resolve=True),
                                       id=_wandb_run_id(run_dir, resume_step), resume="allow"))
    return loggers


WANDB_ID_FILE = "wandb_run_id.txt"


def _wandb_run_id(run_dir: Path, resume_step: int | None) -> str:
    """One W&B run per training run: a resume from this run's own checkpoint (at resume_step) continues the W&B run
    it started (each preemption opened a new one, which split the curves), a fresh run gets a new id. So does a
    resume from a checkpoint older than the steps already logged (a hard kill: SIGKILL, a node lost), whose steps
    would be logged twice into one W&B run. Rank zero keeps the id in the run directory; the other ranks log
    nothing to W&B."""
    path = run_dir / WANDB_ID_FILE
    if resume_step is not None and path.is_file():
        from tools.runs import read_metrics

        logged = read_metrics(run_dir / "metrics.csv").get("train/loss", {}) if (run_dir / "metrics.csv").is_file() \
            else {}
        if max(logged, default=-1) < resume_step:
            return path.read_text().strip()
        say(f"W&B: the checkpoint (step {resume_step}) is older than the steps already logged (to "
            f"{max(logged)}): a new W&B run for the resumed one")
    import uuid

    from data.shards import atomic_write_text

    run_id = uuid.uuid4().hex[:12]
    if _is_global_zero_from_env():
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, run_id + "\n")
    return run_id


EARLIER_RUN_FILES = ("metrics.csv", "hparams.yaml", "config.yaml", "overrides.yaml", "git_revision.txt", "eval",
                     "compare", WANDB_ID_FILE)


def _is_global_zero_from_env() -> bool:
    """Rank zero before the Trainer has set up its ranks: not when a node or local rank variable is set and not 0
    (Lightning's launcher sets them in the processes it starts, where an SLURM_PROCID inherited from `srun --pty`
    still reads 0), else torchrun's RANK or srun's SLURM_PROCID, else yes."""
    if any(int(os.environ[key]) for key in ("NODE_RANK", "GROUP_RANK", "LOCAL_RANK")
           if os.environ.get(key, "").isdigit()):
        return False
    for key in ("RANK", "SLURM_PROCID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key]) == 0
    return all(int(os.environ.get(key) or 0) == 0 for key in ("NODE_RANK", "GROUP_RANK", "LOCAL_RANK"))


def _set_aside_earlier_run(run_dir: Path, ckpt_dir: Path) -> Path | None:
    """Move an earlier run's checkpoint files, metrics, config and evaluations into run_dir/previous-<k>/ (rank zero
    only; ranks started later find nothing to move). The checkpoint files move, not their folder, which may be a link
    to other storage. tools/runs.py does not count previous-* folders as runs."""
    ckpts = sorted(ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []
    if (ckpt_dir / "weights").is_dir():  # trainer.keep_checkpoints' weights-only files of older steps
        ckpts.append(ckpt_dir / "weights")
    found = [run_dir / name for name in EARLIER_RUN_FILES if (run_dir / name).exists()]
    if not _is_global_zero_from_env() or not (ckpts or (run_dir / "metrics.csv").exists()):
        return None
    k = 1
    while (aside := run_dir / f"previous-{k}").exists():
        k += 1
    (aside / "checkpoints").mkdir(parents=True)
    for path in found:
        path.rename(aside / path.name)
    for path in ckpts:
        shutil.move(str(path), aside / "checkpoints" / path.name)
    return aside


def _own_checkpoint(ckpt: str | None, ckpt_dir: Path) -> bool:
    """Whether the checkpoint to load is one of this run's (anywhere under its checkpoints/, through links or not)."""
    if ckpt is None:
        return False
    for path, folder in ((Path(ckpt).absolute(), ckpt_dir.absolute()), (Path(ckpt).resolve(), ckpt_dir.resolve())):
        if path.is_relative_to(folder):
            return True
    return False


def _resume_checkpoint(cfg, ckpt_dir: Path):
    if cfg.ckpt_path:
        return str(cfg.ckpt_path)
    if cfg.resume == "auto":
        candidates = _checkpoints_by_age(ckpt_dir)
        return str(candidates[-1]) if candidates else None
    return None


def _checkpoints_by_age(ckpt_dir: Path) -> list[Path]:
    """A run's checkpoints, oldest first: resume=auto continues from the newest."""
    return sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)


def _validation_missed(run_dir: Path, step: int | None, every: int, own_run: bool) -> bool:
    """Whether the validation due at a resumed checkpoint's step is missing from the run's log. Inside fit the
    checkpoint of step N is written before step N's validation, and a resume from it goes on to step N + 1: a run
    killed during that validation, or started from another folder's checkpoint, never logged it. Only a run's own
    log is read (rank 0 moves another run's aside, and a rank that read it first would skip a validation the others
    run)."""
    if not step or step % every:
        return False
    if not own_run:
        return True
    from tools.runs import read_metrics

    path = run_dir / "metrics.csv"
    return not path.is_file() or step not in read_metrics(path).get("val/loss", {})


def _logged_val_loss(run_dir: Path, step: int) -> float | None:
    """The val/loss the run's own log holds at `step`, if any."""
    from tools.runs import read_metrics

    path = run_dir / "metrics.csv"
    return read_metrics(path).get("val/loss", {}).get(step) if path.is_file() else None


def _evaluated_at(out_dir: Path, step: int, eval_cfg: dict, last: Path) -> Path | None:
    """The results.json of eval.after_train's suite if it scored last.ckpt (its step, written by its training
    attempt) with this launch's settings, every task of the suite scored and the model as trained."""
    import json

    from evaluation.runner import scored_settings
    from model.checkpoint import checkpoint_identity

    path = out_dir / "results.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    done = (data.get("checkpoint_step") == step and data.get("results") and not data.get("skipped")
            and not data.get("attention_overrides") and data.get("eval_config") == scored_settings(eval_cfg))
    return path if done and data.get("checkpoint_attempt") == checkpoint_identity(last)[0] else None


def _checkpoint_meta(path: str | None) -> dict | None:
    """What train() reads of a checkpoint it resumes or starts from, before the weights load: its hyper-parameters,
    tokenizer and step (one read; mmap, so the weights stay on disk)."""
    if path is None:
        return None
    from model.checkpoint import read_checkpoint

    ckpt = read_checkpoint(path)
    return {"path": str(path), "hyper_parameters": ckpt.get("hyper_parameters") or {},
            "tokenizer": ckpt.get("tokenizer"), "global_step": ckpt.get("global_step")}


def _data_config(cfg: DictConfig, source: dict | None, console) -> DictConfig:
    """cfg.data, or, resuming from a checkpoint whose tokenizer this config would not rebuild (the data prepared
    anew: another corpus, other tokenizer settings, a preparation format of another version of this code), cfg.data
    with that tokenizer: the weights belong to its token ids. A cache that already holds it is used as it is."""
    from data.prepare import prepared_root
    from data.shards import atomic_write_text
    from model.lightning_module import same_tokenizer

    if source is None or cfg.data.tokenizer.get("path"):
        return cfg.data
    saved = source["tokenizer"]
    if saved is None:
        return cfg.data
    root = prepared_root(cfg.data, cfg.data.cache_dir)
    if (root / "meta.json").is_file() and same_tokenizer(saved, (root / "tokenizer.json").read_text()):
        return cfg.data
    digest = hashlib.sha256(saved.encode()).hexdigest()[:16]
    path = Path(cfg.data.cache_dir) / "checkpoint_tokenizers" / f"{digest}.json"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, saved)
    console.print(f"[yellow]checkpoint[/]: the data is tokenized with the checkpoint's tokenizer ({path}); this "
                  "config would train another")
    data = OmegaConf.to_container(cfg.data, resolve=True)
    data["tokenizer"]["path"] = str(path)
    return OmegaConf.create(data)


def _check_against_checkpoints(module, source: dict | None, resuming: bool) -> None:
    """A resume whose config the checkpoint refuses (another shape, a switch to or from gated SA+SWA) and an
    init_from checkpoint of another shape stop here, before the data is prepared. The resume's warnings are given
    here too, once (the module's own check at load time then stays quiet)."""
    from model.checkpoint import check_same_shape
    from model.lightning_module import _check_resumed_config

    if source is None:
        return
    if resuming:
        _check_resumed_config(source["hyper_parameters"], dict(module.hparams))
        module.resume_config_checked = True
    else:
        check_same_shape(source["hyper_parameters"]["model"], module.model.cfg, f"init_from={source['path']}")


def _init_weights(module, init: str, tokenizer_json: str, console) -> None:
    """init_from: the checkpoint's weights into the new run's model (step 0, fresh optimizer and schedule)."""
    from model.checkpoint import load_weights_into
    from model.config import ConfigError
    from model.lightning_module import same_tokenizer

    loaded = load_weights_into(module.model, init)
    if loaded["tokenizer"] is not None and not same_tokenizer(loaded["tokenizer"], tokenizer_json):
        raise ConfigError("data.tokenizer.path", "this run's", f"init_from={init} was trained with another "
                          "tokenizer; leave data.tokenizer.path null (the data is then tokenized with the "
                          "checkpoint's) or give the tokenizer.json it was trained with")
    skipped, why = _continued_stream(module.hparams, loaded)
    module.hparams["init_from"] = {"checkpoint": init, "step": loaded["step"], "attention": loaded["attention"],
                                   "samples_skipped": skipped}
    console.print(f"[bold]init_from[/]: the data stream starts after the {skipped:,} windows the checkpoint trained "
                  "on (the rest of its pass)" if skipped else f"[bold]init_from[/]: the data stream starts at its "
                  f"beginning ({why})")
    trained = loaded["attention"]
    note = ("; the gates start at 0.5" if loaded["new_gates"] else
            "; its gates are dropped" if loaded["dropped_gates"] else "")
    console.print(f"[bold]init_from[/]: weights of {init} (step {loaded['step']}, trained as "
                  f"{attention_label(trained.get('kind'), trained.get('window'))}{note}); step 0, a fresh optimizer "
                  "and schedule")


# what makes two runs' training windows the same windows in the same order (data.tokenizer: init_from uses the
# checkpoint's tokenizer, or refuses another)
STREAM_KEYS = ("source", "val_fraction", "val_split", "max_tokens", "seq_len", "window_start", "sampling")


def _continued_stream(hparams, loaded: dict) -> tuple[int, str | None]:
    """(samples to skip, why none): an init_from run on its source's stream (the same seed, corpus and windows, taken
    once per pass) starts where the source stopped, instead of training again, in order, on the windows the source
    began with. On another stream skipping would only cut the first pass short."""
    from model.lightning_module import DATA_DEFAULTS

    source_data = {**DATA_DEFAULTS, **(loaded["data"] or {})}
    if loaded["samples"] is None:
        return 0, "the checkpoint does not record how its steps were cut"
    if loaded["seed"] != hparams.get("seed"):
        return 0, f"the checkpoint's seed {loaded['seed']} is not this run's"
    differ = [k for k in STREAM_KEYS if source_data.get(k) != hparams["data"].get(k)]
    if differ:
        return 0, f"data.{differ[0]} differs"
    if hparams["data"].get("sampling") != "shuffled":
        return 0, "data.sampling=random"
    return loaded["samples"], None


def _resume_sampling(cfg, module, source: dict, overrides: list[str] | None, console) -> None:
    """A resume draws its windows as its checkpoint did, unless this command line sets data.sampling: the default
    changed to shuffled on 2026-12-02, and a run from before it (no key: with replacement) would switch streams."""
    from model.lightning_module import DATA_DEFAULTS

    trained = {**DATA_DEFAULTS, **(source["hyper_parameters"].get("data") or {})}["sampling"]
    asked = any(_override_key(o)[0] == "data.sampling" for o in overrides or [])
    if trained == cfg.data.get("sampling") or asked:
        return
    OmegaConf.update(cfg, "data.sampling", trained, force_add=True)
    module.hparams["data"]["sampling"] = trained
    if overrides is not None:  # recorded with the run: its next resume composes it
        overrides.append(f"data.sampling={trained}")
    console.print(f"[yellow]data.sampling[/]: {trained}, as the checkpoint trained (data.sampling=<...> on the "
                  "command line switches)")


RUN_OVERRIDES = "overrides.yaml"  # the run's own record: Hydra's .hydra/overrides.yaml is rewritten at every start
# what a resume does not take from the run's record: how this start resumes. init_from is carried unless this start
# names its checkpoint (ckpt_path): a resume before the run's first checkpoint starts it again from init_from's
# weights, and a resume from one ignores it (train.py loads the checkpoint; a source moved since is no error then)
NOT_CARRIED = ("resume", "ckpt_path", "prepare_only")


def _override_key(override: str) -> tuple[str, str]:
    """(key, prefix): ("trainer.foo", "+") for +trainer.foo=1."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    key = OverridesParser.create().parse_override(override).get_key_element()
    return key.lstrip("+~"), key[: len(key) - len(key.lstrip("+~"))]


def _with_run_overrides(cfg: DictConfig) -> tuple[DictConfig, list[str]]:
    """(config, overrides) of this start. A resume of a run (resume=auto, or a ckpt_path under its checkpoints/)
    continues it as it was started: the overrides it ran with (<run dir>/overrides.yaml) first, then today's, so
    `python train.py hydra.run.dir=<run dir> resume=auto` resumes an SA run on its own corpus, where it had
    composed the defaults (full attention, the embedded corpus) and trained those on from the SA checkpoint. What
    those overrides set in Hydra's own config is applied too: the environment (env_set) and the job callbacks (the
    data=probes file), which Hydra ran only for today's command line."""
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    today = list(hydra_cfg.overrides.task)
    run_dir = Path(cfg.paths.run_dir)
    own = _own_checkpoint(_resume_checkpoint(cfg, run_dir / "checkpoints"), run_dir / "checkpoints")
    if not (cfg.resume == "auto" or own) or not (run_dir / RUN_OVERRIDES).is_file():
        return cfg, today  # resume=auto before the run's first checkpoint continues it as it was started too
    from tools.config_hints import unread_key

    given = dict(_override_key(o) for o in today)
    earlier = []
    for override in OmegaConf.to_container(OmegaConf.load(run_dir / RUN_OVERRIDES)):
        key, prefix = _override_key(override)
        if prefix in ("+", "++") and unread_key(key):  # recorded before such keys were refused: a requeued job goes on
            say(f"resume: left out {override} of the run's own overrides: nothing reads {key} (the run ignored it)")
            continue
        # an addition (+key=..., ++key=...) stays when today's sets or deletes the key: that needs it added first
        carried = key not in NOT_CARRIED and not (key == "init_from" and cfg.ckpt_path)
        if carried and (key not in given or (prefix in ("+", "++") and given[key] in ("", "~"))):
            earlier.append(override)
    if not earlier:
        return cfg, today
    merged = earlier + today
    say(f"resume: the run's own overrides ({' '.join(earlier)}), then today's")
    full = compose(config_name=hydra_cfg.job.config_name, overrides=merged, return_hydra_config=True)
    _apply_hydra_job_settings(full, hydra_cfg)
    resumed = compose(config_name=hydra_cfg.job.config_name, overrides=merged)
    OmegaConf.copy_cache(from_config=cfg, to_config=resumed)
    saved = OmegaConf.load(run_dir / "config.yaml") if (run_dir / "config.yaml").is_file() else None
    if saved is not None and OmegaConf.select(saved, "logger.wandb.group") is not None and \
            OmegaConf.select(resumed, "logger.wandb.group") is not None and "logger.wandb.group" not in given:
        resumed.logger.wandb.group = saved.logger.wandb.group  # a sweep's group names its first start (${now:})
    return resumed, merged


def _apply_hydra_job_settings(full: DictConfig, running) -> None:
    """The env_set entries and job callbacks of `full` (a config recomposed with the run's own overrides) that
    today's Hydra config does not have: Hydra applied only today's before the job started."""
    import hydra.utils

    env = {k: str(v) for k, v in (full.hydra.job.env_set or {}).items() if k not in (running.job.env_set or {})}
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # torch has read it already
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for name, spec in (full.hydra.callbacks or {}).items():
        if name not in (running.callbacks or {}):
            callback = hydra.utils.instantiate(spec)
            if hasattr(callback, "on_job_start"):
                callback.on_job_start(config=full)


def train(cfg: DictConfig, overrides: list[str] | None = None) -> dict:
    """Compose -> validate -> prepare data -> fit. Returns the final metrics. `overrides` (the command line's) are
    kept in the run directory, for a resume to start from."""
    warnings_to_log()  # a resume's config changes, a SIGTERM save: train.log is where they are looked for
    model_cfg, attn_cfg = check_config(cfg)

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import LambdaCallback
    from lightning.pytorch.utilities.exceptions import SIGTERMException
    from rich.console import Console

    from data.datamodule import TokenDataModule
    from data.prepare import prepare
    from data.shards import atomic_write_text
    from model.checkpoint import CheckpointError
    from model.config import ConfigError
    from model.lightning_module import (CheckpointOnSigterm, LitDecoder, PruneStepCheckpoints, StepCheckpoint,
                                        StepProgressBar, save_step_checkpoint)

    console = RunConsole(Console(stderr=True, soft_wrap=True))  # one message, one line (logs are grepped)
    run_dir = Path(cfg.paths.run_dir)
    ckpt_dir = run_dir / "checkpoints"
    accelerator = cfg.trainer.accelerator
    use_cuda = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    devices = _devices(cfg)
    prepare_only = bool(cfg.get("prepare_only"))  # on a CPU node, for the GPU job: its devices are not this node's
    world = int(cfg.trainer.num_nodes) * _device_count(devices, use_cuda)
    accumulate = None if prepare_only else _accumulation(cfg, world)  # refused before the data preparation

    ckpt = _resume_checkpoint(cfg, ckpt_dir)
    if cfg.resume == "auto" and ckpt is None:  # said before the data is prepared: a mistyped run dir shows at once
        what = ("the run recorded there, as it was started" if (run_dir / RUN_OVERRIDES).is_file() else
                "a new run: no run was started in this folder before (check hydra.run.dir if you meant one)")
        console.print(f"[yellow]resume=auto[/]: no checkpoint in {ckpt_dir}; starting from step 0 {what}")
    init = None  # init_from starts a run; a resume of that run continues from its own checkpoint instead
    if ckpt is None and cfg.get("init_from"):
        from model.checkpoint import find_checkpoint

        try:
            init = str(find_checkpoint(cfg.init_from))
        except FileNotFoundError as err:
            again = ("; this run was started from it and has no checkpoint of its own yet: give init_from=<where it "
                     "is now>") if cfg.resume == "auto" else ""
            raise ConfigError("init_from", cfg.init_from, f"{err}{again}") from None
    try:
        source = _checkpoint_meta(ckpt or init)
    except CheckpointError as err:  # resume=auto took the newest file: name the one before it
        older = _checkpoints_by_age(ckpt_dir)[:-1] if ckpt and not cfg.ckpt_path else []
        if not older:
            raise
        raise CheckpointError(f"{err}; to continue from the checkpoint before it: ckpt_path={older[-1]}") from None
    if not prepare_only:  # built before the (possibly long) preparation: its size is printed first
        L.seed_everything(cfg.seed, workers=True, verbose=False)
        module = LitDecoder(model=OmegaConf.to_container(cfg.model, resolve=True),
                            attention=OmegaConf.to_container(cfg.attention, resolve=True),
                            optim=OmegaConf.to_container(cfg.optim, resolve=True), seed=cfg.seed,
                            max_steps=int(cfg.optim.get("schedule_steps") or cfg.trainer.max_steps),
                            data=OmegaConf.to_container(cfg.data, resolve=True),
                            init_from={"checkpoint": init} if init else None)
        n_params = module.model.num_parameters()
        console.print(f"[bold]model[/]: {n_params / 1e6:.2f}M parameters "
                      f"({module.model.num_parameters(non_embedding=True) / 1e6:.2f}M non-embedding), "
                      f"{attn_cfg.describe()}")
        if attn_cfg.kind != "full" and attn_cfg.sees_every_earlier_token(int(cfg.data.seq_len)):
            console.print(f"[yellow]attention.window={attn_cfg.window}[/] at data.seq_len={cfg.data.seq_len}: every "
                          f"query sees every earlier token, so this {attn_cfg.kind} run is full causal attention in "
                          "effect (a window below the context compares the variants)")
        if ckpt is not None:
            _resume_sampling(cfg, module, source, overrides, console)
        _check_against_checkpoints(module, source, ckpt is not None)  # before data work and config.yaml

    data = prepare(_data_config(cfg, source, console), cfg.data.cache_dir)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no tokenizer thread pool in forked DataLoader workers
    if data.vocab_size > model_cfg.vocab_size:
        raise ConfigError("model.vocab_size", model_cfg.vocab_size,
                          f"smaller than the tokenizer's vocabulary ({data.vocab_size}); "
                          f"raise it to >= {data.vocab_size}")
    counts = data.meta["tokens"]
    held_out = f" ({counts['val_documents']:,} of {counts['documents']:,} documents)" if "val_documents" in counts \
        else ""
    console.print(f"[bold]data[/]: {counts['train']:,} train / {counts['val']:,} val tokens{held_out} in {data.root}")
    if prepare_only:
        console.print("prepare_only=true: the data is prepared; a training run with the same data.* config and "
                      "paths.cache_dir uses it as it is")
        return {}
    if init:
        _init_weights(module, init, data.tokenizer_path.read_text(), console)
    # under FSDP its own wrapper recomputes the blocks (activation_checkpointing_policy below)
    module.model.checkpoint_activations = bool(cfg.trainer.get("activation_checkpointing")) and \
        cfg.trainer.strategy != "fsdp"
    module.loss_chunk_tokens = cfg.trainer.get("loss_chunk_tokens", 0)
    if cfg.trainer.get("compile"):
        module.model.compile_blocks()

    module.tokenizer_json = data.tokenizer_path.read_text()
    if cfg.data.get("loss_only_after") is not None:
        module.loss_only_after = str(cfg.data.loss_only_after)
        module.loss_after_id = _loss_token(module.loss_only_after, data.tokenizer_path, data.val_shard)

    max_steps = int(cfg.trainer.max_steps)
    # an init_from run may continue its source's data stream (_init_weights decides, the checkpoints record it)
    started = module.hparams.get("init_from") if init else (source or {}).get("hyper_parameters", {}).get("init_from")
    sampling = str(module.hparams["data"].get("sampling", "shuffled"))
    # independent draws have no place in a stream to continue from (a resume may switch to them on its command line)
    sample_offset = int((started or {}).get("samples_skipped") or 0) if sampling == "shuffled" else 0
    datamodule = TokenDataModule(data.train_shards, data.val_shard, seq_len=int(cfg.data.seq_len),
                                 batch_size=int(cfg.data.batch_size), seed=int(cfg.seed),
                                 val_windows=int(cfg.data.val_windows),
                                 val_batch_size=int(cfg.data.val_batch_size or cfg.data.batch_size),
                                 num_workers=int(cfg.data.num_workers), total_micro_batches=max_steps * accumulate,
                                 window_start=str(cfg.data.get("window_start", "any")),
                                 eos_id=data.meta["tokenizer"]["eos_id"],
                                 sampling=sampling, sample_offset=sample_offset)

    strategy = _fsdp_strategy(cfg, _precision(cfg, use_cuda)) if cfg.trainer.strategy == "fsdp" else \
        cfg.trainer.strategy
    sigterm = CheckpointOnSigterm(ckpt_dir)
    # no version counter: a restart from an earlier checkpoint (or a resume in a copied run folder) overwrites
    # last.ckpt and step<N>.ckpt, where Lightning wrote last-v1.ckpt beside them and every reader of last.ckpt
    # (sample.py, evaluate.py, eval.after_train, tools.compare) took the abandoned attempt's weights
    callbacks = [StepCheckpoint(dirpath=ckpt_dir, filename="step{step:07d}", auto_insert_metric_name=False,
                                every_n_train_steps=int(cfg.trainer.checkpoint_every_n_steps), save_top_k=-1,
                                save_last=True, enable_version_counter=False), sigterm]
    keep = cfg.trainer.get("keep_checkpoints")
    prune = PruneStepCheckpoints(ckpt_dir, int(keep), bool(cfg.trainer.get("keep_weights", True))) if keep else None
    callbacks += [prune] if prune else []
    if cfg.trainer.progress_bar:
        callbacks.append(StepProgressBar(leave=True))
    # A run continues its own history only from one of its own checkpoints. Otherwise an earlier run's checkpoints
    # and metrics in this folder are moved aside: its last.ckpt and step checkpoints would be taken for this run's
    # until overwritten, and its metrics.csv rows would join this run's.
    resuming = _own_checkpoint(ckpt, ckpt_dir)
    if not resuming:
        aside = _set_aside_earlier_run(run_dir, ckpt_dir)
        if aside is not None:
            console.print(f"[yellow]{run_dir}[/] held an earlier run's files: moved to {aside}")
    resume_step = source["global_step"] if resuming else None
    # a relaunch of a run that reached trainer.max_steps (a requeued job, a sweep run again) trains nothing: what
    # its log and eval/ already hold is not validated or evaluated again (a second row at the same step)
    finished = resuming and int(resume_step) >= max_steps
    if finished:
        console.print(f"resume: the run finished at step {resume_step} (trainer.max_steps={max_steps}); raise "
                      "trainer.max_steps to train on")
    if resuming:  # Lightning warns about the run's own checkpoints/ (a new run's earlier files were moved aside)
        warnings.filterwarnings("ignore", message=f"Checkpoint directory {re.escape(os.path.realpath(ckpt_dir))} "
                                "exists and is not empty")

    def record_run():
        run_dir.mkdir(parents=True, exist_ok=True)
        # atomically: a resume and tools.runs read config.yaml back
        atomic_write_text(run_dir / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
        if overrides is not None:
            atomic_write_text(run_dir / RUN_OVERRIDES, OmegaConf.to_yaml(OmegaConf.create(
                [o for o in overrides if _override_key(o)[0] not in ("resume", "ckpt_path")])))
        atomic_write_text(run_dir / "git_revision.txt", code_revision() + "\n")

    if resuming:  # recorded once the checkpoint has taken the config (a refused resume leaves the run's record)
        callbacks.append(LambdaCallback(on_train_start=lambda trainer, _: trainer.is_global_zero and record_run()))
    loggers = _loggers(cfg, run_dir, resume_step)
    trainer = L.Trainer(
        accelerator=cfg.trainer.accelerator, devices=devices, num_nodes=int(cfg.trainer.num_nodes), strategy=strategy,
        precision=_precision(cfg, use_cuda), max_steps=max_steps, max_epochs=-1,
        accumulate_grad_batches=accumulate, val_check_interval=int(cfg.trainer.val_every_n_steps) * accumulate,
        check_val_every_n_epoch=None, log_every_n_steps=int(cfg.trainer.log_every_n_steps), logger=loggers,
        callbacks=callbacks, enable_progress_bar=bool(cfg.trainer.progress_bar), use_distributed_sampler=False,
        num_sanity_val_steps=0, default_root_dir=str(run_dir), enable_model_summary=False,
    )
    if trainer.is_global_zero and not resuming:
        record_run()
    ok = False
    # Under FSDP a validate() outside fit wraps the blocks in place; fit then finds them wrapped, leaves the root
    # unwrapped and the first step fails on a flat embedding shard (Lightning #19015): validation runs inside fit only
    outside_fit = cfg.trainer.strategy != "fsdp"
    if not outside_fit and trainer.is_global_zero:
        console.print("[yellow]trainer=fsdp[/]: no validation before training or of final weights between "
                      "validation steps (Lightning #19015); align trainer.max_steps with trainer.val_every_n_steps")
    try:
        trainer.validate(module, datamodule=datamodule, verbose=False) if ckpt is None and outside_fit else None
        start_loss = trainer.callback_metrics.get("val/loss")
        if start_loss is None and resuming and (run_dir / "metrics.csv").is_file():  # the run's own step-0 score
            from tools.runs import read_metrics

            start_loss = read_metrics(run_dir / "metrics.csv").get("val/loss", {}).get(0)
        if ckpt is not None and outside_fit and _validation_missed(run_dir, source["global_step"],
                                                                   int(cfg.trainer.val_every_n_steps), resuming):
            module.validation_label = int(source["global_step"])
            trainer.validate(module, datamodule=datamodule, ckpt_path=ckpt, verbose=False)
            module.validation_label = None
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
        if trainer.global_step % int(cfg.trainer.checkpoint_every_n_steps):
            # ModelCheckpoint writes last.ckpt at train end only when the fit saved nothing: after step 28000 of
            # 28610, last.ckpt would hold step 28000 while val/loss and eval.after_train speak of step 28610.
            save_step_checkpoint(trainer, ckpt_dir)
        if prune and trainer.is_global_zero:
            prune.prune()
        if trainer.strategy.reduce_boolean_decision(sigterm.signalled, all=False):  # came after the last step
            raise SIGTERMException()  # the final checkpoint is saved: no validation or evaluation after it
        # rank zero's reading for all: ranks that read the log apart could disagree on the validate() below and hang
        logged = trainer.strategy.broadcast(_logged_val_loss(run_dir, trainer.global_step) if finished else None)
        if trainer.global_step % int(cfg.trainer.val_every_n_steps) and outside_fit and logged is None:
            trainer.validate(module, datamodule=datamodule, verbose=False)  # the final weights too
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if logged is not None and "val/loss" not in metrics:
            metrics["val/loss"] = logged
        if start_loss is not None:
            metrics["val/loss_at_start"] = float(start_loss)
        if trainer.is_global_zero and cfg.get("eval") and cfg.eval.after_train:
            done = _evaluated_at(run_dir / "eval" / str(cfg.eval.get("name", "suite")), trainer.global_step,
                                 _eval_config(cfg), ckpt_dir / "last.ckpt")
            if finished and done:
                console.print(f"eval: the suite's scores of step {trainer.global_step} are in {done}", markup=False)
            else:
                metrics.update(_evaluate_after_training(cfg, ckpt_dir / "last.ckpt", run_dir, loggers, trainer,
                                                        console))
        ok = True
    finally:
        _finish_wandb(ok)
    if trainer.is_global_zero:
        _summary(console, run_dir, ckpt_dir, metrics, loggers)
    return metrics


def _eval_config(cfg: DictConfig) -> dict:
    """cfg.eval as a dict; with eval.data_dir, the converted tasks go where the data cache is."""
    from evaluation.runner import default_task_dir

    eval_cfg = OmegaConf.to_container(cfg.eval, resolve=True)
    if eval_cfg.get("data_dir") and not eval_cfg.get("task_dir"):
        eval_cfg["task_dir"] = str(default_task_dir(eval_cfg["data_dir"], cfg.paths.cache_dir))
    return eval_cfg


def _evaluate_after_training(cfg, ckpt: Path, run_dir: Path, loggers, trainer, console) -> dict:
    """Score the final checkpoint on the configured suite; log the numbers to W&B and the CSV like training metrics."""
    from evaluation.runner import evaluate_checkpoint

    eval_cfg = _eval_config(cfg)
    summary = evaluate_checkpoint(ckpt, eval_cfg, None, run_dir / "eval" / eval_cfg.get("name", "suite"),
                                  log=lambda msg: console.print(msg, markup=False))
    scores = {f"eval/{r['task']}/{r['metric']}": float(r["value"]) for r in summary["results"]
              if isinstance(r.get("value"), (int, float))}
    if scores:
        for lg in loggers:
            lg.log_metrics(scores, step=trainer.global_step)
            lg.save()
        console.print(summary["table"], markup=False)
    else:
        val = trainer.callback_metrics.get("val/ppl")
        console.print(f"eval: no suite data reachable; held-out perplexity on the training corpus: "
                      f"{float(val):.2f}" if val is not None else "eval: no suite data reachable", markup=False)
    return scores


def _finish_wandb(ok: bool):
    if "wandb" in sys.modules:
        import wandb

        if wandb.run is not None:
            wandb.finish(exit_code=0 if ok else 1)


def _summary(console, run_dir: Path, ckpt_dir: Path, metrics: dict, loggers):
    lines = [f"run directory : {run_dir}",
             f"checkpoints   : {ckpt_dir / 'last.ckpt'}",
             f"config        : {run_dir / 'config.yaml'}",
             f"metrics (CSV) : {run_dir / 'metrics.csv'}"]
    for lg in loggers:
        if type(lg).__name__ == "WandbLogger":
            lines.append(f"W&B run       : {run_dir / 'wandb'} (offline runs upload with `wandb sync <dir>`)")
    if (run_dir / "eval").is_dir():
        lines.append(f"evaluation    : {run_dir / 'eval'}")
    if "val/loss_at_start" in metrics and "val/loss" in metrics:
        lines.append(f"val loss      : {metrics['val/loss_at_start']:.3f} -> {metrics['val/loss']:.3f}")
    console.print("\n".join(lines))


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig):
    from data.sources import DataSourceError
    from kernels.cpu_malloc import keep_freed_memory
    from model.checkpoint import CheckpointError
    from model.config import ConfigError

    keep_freed_memory()  # big CPU tensors stop paying page faults every step (SA_CPU_MALLOC=0: off)

    import logging

    from lightning.pytorch.utilities.exceptions import SIGTERMException

    if logging.getLogger().handlers:  # Hydra's (console and train.log) print Lightning's lines: not its own twice
        for handler in list(logging.getLogger("lightning").handlers):
            logging.getLogger("lightning").removeHandler(handler)

    from tools.runlog import only_launch_files, remove_refused_launch

    run_dir = Path(cfg.paths.run_dir)
    new_folder = only_launch_files(run_dir, "train.log", log_empty=True)
    try:
        cfg, overrides = _with_run_overrides(cfg)
        metrics = train(cfg, overrides)
    except (ConfigError, DataSourceError, CheckpointError) as err:
        say(f"error: {err}")
        if new_folder:
            remove_refused_launch(run_dir, "train.log")
        sys.exit(2)
    except SIGTERMException:
        # Lightning stops on SIGTERM (scancel, preemption) with a SystemExit of code 0: a sweep went on as if the
        # job had finished, and a scheduler read "completed". 128 + 15, as a process killed by the signal.
        say("stopped by SIGTERM; continue with resume=auto in the same run directory")
        sys.exit(143)
    return metrics.get("val/loss")


if __name__ == "__main__":
    from tools.config_hints import run_with_key_hints

    run_with_key_hints(main, "train")
