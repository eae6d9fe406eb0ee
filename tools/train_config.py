"""What train.py checks before any work starts (and the settings it reads the same way): every value a run would
refuse only after hours of data preparation or training is refused here, as a ConfigError naming the key."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from tools.runlog import say


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
        if value is not None and not isinstance(value, int) and whole_number(value) is not None:
            OmegaConf.update(cfg, key, whole_number(value), merge=False)


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
    if whole_number(cfg.get("seed")) is None or not 0 <= cfg.seed < 2**32:
        raise ConfigError("seed", cfg.get("seed"), "a whole number in [0, 2**32), e.g. seed=1")
    if (whole_number(cfg.data.seq_len) or 0) < 1:
        raise ConfigError("data.seq_len", cfg.data.seq_len, "sequence length, a positive integer")
    if cfg.data.seq_len > model_cfg.max_seq_len:
        raise ConfigError("data.seq_len", cfg.data.seq_len, f"must be <= model.max_seq_len={model_cfg.max_seq_len}")
    for key in ("max_steps", "val_every_n_steps", "checkpoint_every_n_steps", "accumulate_grad_batches",
                "log_every_n_steps"):
        if (whole_number(cfg.trainer[key]) or 0) < 1:  # 2.5 would be cut to 2 in silence
            raise ConfigError(f"trainer.{key}", cfg.trainer[key], "must be a positive integer")
    for key in ("batch_size", "val_windows"):
        if (whole_number(cfg.data[key]) or 0) < 1:
            raise ConfigError(f"data.{key}", cfg.data[key], "must be a positive integer")
    val_batch = cfg.data.get("val_batch_size")
    if val_batch is not None and (whole_number(val_batch) or 0) < 1:
        raise ConfigError("data.val_batch_size", val_batch, "must be a positive integer (or null: data.batch_size)")
    workers = whole_number(cfg.data.get("num_workers", 0))
    if workers is None or workers < 0:
        raise ConfigError("data.num_workers", cfg.data.num_workers, "DataLoader worker processes, an integer >= 0")
    _check_trainer_and_optim(cfg)
    if cfg.get("eval") and cfg.eval.get("after_train"):  # what would fail only after training
        from evaluation.runner import check_eval_config, check_task_names, local_tasks

        eval_cfg = eval_config(cfg)
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


def trainer_devices(cfg: DictConfig):
    """trainer.devices as a plain value (a ListConfig of GPU ids becomes a list)."""
    devices = cfg.trainer.devices
    return OmegaConf.to_object(devices) if OmegaConf.is_config(devices) else devices


def device_count(devices, use_cuda: bool) -> int:
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
    devices = trainer_devices(cfg)
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
    if (whole_number(t.num_nodes) or 0) < 1:
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
    if not (finite_number(o.lr) or 0) > 0:
        raise ConfigError("optim.lr", o.lr, "must be a positive number")
    if finite_number(o.weight_decay) is None or finite_number(o.weight_decay) < 0:
        raise ConfigError("optim.weight_decay", o.weight_decay, "must be a number >= 0")
    if not (finite_number(o.get("eps", 1e-8)) or 0) > 0:
        raise ConfigError("optim.eps", o.eps, "AdamW's epsilon, a small positive number, e.g. 1e-8")
    if len(o.betas) != 2 or not all(finite_number(b) is not None and 0 <= finite_number(b) < 1 for b in o.betas):
        raise ConfigError("optim.betas", list(o.betas), "two numbers in [0, 1), e.g. [0.9, 0.95]")
    # a fraction overshot the peak (2.5: 1.2x)
    if whole_number(o.warmup_steps) is None or whole_number(o.warmup_steps) < 0:
        raise ConfigError("optim.warmup_steps", o.warmup_steps, "a whole number of steps >= 0")
    steps = o.get("schedule_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError("optim.schedule_steps", steps, "a positive number of steps (or null: trainer.max_steps)")
    schedule = int(steps or t.max_steps)
    if str(t.precision) == "16-true" and (finite_number(o.get("eps", 1e-8)) or 0) < 6e-8:
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
    if finite_number(o.min_lr_ratio) is None or not 0 <= finite_number(o.min_lr_ratio) <= 1:
        raise ConfigError("optim.min_lr_ratio", o.min_lr_ratio, "must lie in [0, 1] (a fraction of optim.lr)")
    if o.get("grad_clip") is not None and (finite_number(o.grad_clip) is None or finite_number(o.grad_clip) < 0):
        raise ConfigError("optim.grad_clip", o.grad_clip, "must be a number >= 0 (0 or null: no clipping)")
    tokens = o.get("tokens_per_step")
    if tokens is not None and (whole_number(tokens) or 0) < 1:
        raise ConfigError("optim.tokens_per_step", tokens, "must be a positive integer (or null)")


def whole_number(value) -> int | None:
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


def finite_number(value) -> float | None:
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
    if isinstance(trainer_devices(cfg), list) and not torch.backends.mps.is_available():
        raise ConfigError("trainer.devices", trainer_devices(cfg), "a list of GPU ids, on a machine without one; give "
                          "a count on the CPU, e.g. trainer.devices=1")
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


def accumulation_steps(cfg: DictConfig, world: int) -> int:
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


def loss_token_id(text: str, tokenizer_path: Path, val_shard: Path) -> int:
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


def trainer_precision(cfg, accelerator_is_cuda: bool) -> str:
    """trainer.precision by its full name; auto = bf16-mixed on CUDA, 32-true elsewhere."""
    if str(cfg.trainer.precision) != "auto":
        return _PRECISION_ALIASES.get(str(cfg.trainer.precision), str(cfg.trainer.precision))
    return "bf16-mixed" if accelerator_is_cuda else "32-true"


def eval_config(cfg: DictConfig) -> dict:
    """cfg.eval as a dict; with eval.data_dir, the converted tasks go where the data cache is."""
    from evaluation.runner import default_task_dir

    eval_cfg = OmegaConf.to_container(cfg.eval, resolve=True)
    if eval_cfg.get("data_dir") and not eval_cfg.get("task_dir"):
        eval_cfg["task_dir"] = str(default_task_dir(eval_cfg["data_dir"], cfg.paths.cache_dir))
    return eval_cfg
