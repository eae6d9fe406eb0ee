"""Train a decoder with full, SWA, SA or gated SA+SWA attention.

    python train.py attention=gated_sa_swa
    python train.py -m attention=full,swa,sa,gated_sa_swa trainer.max_steps=20
    python train.py experiment=paper_360m trainer=ddp
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from model.config import attention_tag, window_tag
from tools.resume import (RUN_OVERRIDES, check_against_checkpoints, checkpoint_meta, checkpoints_by_age, data_config,
                          evaluated_at, init_weights, logged_val_loss, override_key, own_checkpoint, resume_checkpoint,
                          resume_sampling, set_aside_earlier_run, validation_missed, wandb_run_id, with_run_overrides)
from tools.runlog import RunConsole, code_revision, say, warnings_to_log
from tools.train_config import (accumulation_steps, check_config, device_count, eval_config, loss_token_id,
                                trainer_devices, trainer_precision)

# run names and sweep folders: full attention carries no window
OmegaConf.register_new_resolver("sa_attention_tag", attention_tag, replace=True)
OmegaConf.register_new_resolver("sa_window_tag", window_tag, replace=True)
OmegaConf.register_new_resolver("steps", lambda tokens, per: max(1, int(float(tokens)) // int(per)), replace=True)
# data.max_tokens counts the held-out documents too: a training budget plus twice its validation share (the hash
# split holds out about val_fraction, by documents) leaves the whole budget for training, with no wrap into a
# second pass at the end
OmegaConf.register_new_resolver("with_validation", lambda tokens, val_fraction: int(
    float(tokens) * (1 + 2 * float(val_fraction))), replace=True)


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
                                       id=wandb_run_id(run_dir, resume_step), resume="allow"))
    return loggers


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
    devices = trainer_devices(cfg)
    prepare_only = bool(cfg.get("prepare_only"))  # on a CPU node, for the GPU job: its devices are not this node's
    world = int(cfg.trainer.num_nodes) * device_count(devices, use_cuda)
    accumulate = None if prepare_only else accumulation_steps(cfg, world)  # refused before the data preparation

    ckpt = resume_checkpoint(cfg, ckpt_dir)
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
        source = checkpoint_meta(ckpt or init)
    except CheckpointError as err:  # resume=auto took the newest file: name the one before it
        older = checkpoints_by_age(ckpt_dir)[:-1] if ckpt and not cfg.ckpt_path else []
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
            resume_sampling(cfg, module, source, overrides, console)
        check_against_checkpoints(module, source, ckpt is not None)  # before data work and config.yaml

    data = prepare(data_config(cfg, source, console), cfg.data.cache_dir)
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
        init_weights(module, init, data.tokenizer_path.read_text(), console)
    # under FSDP its own wrapper recomputes the blocks (activation_checkpointing_policy below)
    module.model.checkpoint_activations = bool(cfg.trainer.get("activation_checkpointing")) and \
        cfg.trainer.strategy != "fsdp"
    module.loss_chunk_tokens = cfg.trainer.get("loss_chunk_tokens", 0)
    if cfg.trainer.get("compile"):
        module.model.compile_blocks()

    module.tokenizer_json = data.tokenizer_path.read_text()
    if cfg.data.get("loss_only_after") is not None:
        module.loss_only_after = str(cfg.data.loss_only_after)
        module.loss_after_id = loss_token_id(module.loss_only_after, data.tokenizer_path, data.val_shard)

    max_steps = int(cfg.trainer.max_steps)
    # an init_from run may continue its source's data stream (init_weights decides, the checkpoints record it)
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

    strategy = _fsdp_strategy(cfg, trainer_precision(cfg, use_cuda)) if cfg.trainer.strategy == "fsdp" else \
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
    resuming = own_checkpoint(ckpt, ckpt_dir)
    if not resuming:
        aside = set_aside_earlier_run(run_dir, ckpt_dir)
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
                [o for o in overrides if override_key(o)[0] not in ("resume", "ckpt_path")])))
        atomic_write_text(run_dir / "git_revision.txt", code_revision() + "\n")

    if resuming:  # recorded once the checkpoint has taken the config (a refused resume leaves the run's record)
        callbacks.append(LambdaCallback(on_train_start=lambda trainer, _: trainer.is_global_zero and record_run()))
    loggers = _loggers(cfg, run_dir, resume_step)
    trainer = L.Trainer(
        accelerator=cfg.trainer.accelerator, devices=devices, num_nodes=int(cfg.trainer.num_nodes), strategy=strategy,
        precision=trainer_precision(cfg, use_cuda), max_steps=max_steps, max_epochs=-1,
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
        if ckpt is not None and outside_fit and validation_missed(run_dir, source["global_step"],
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
        logged = trainer.strategy.broadcast(logged_val_loss(run_dir, trainer.global_step) if finished else None)
        if trainer.global_step % int(cfg.trainer.val_every_n_steps) and outside_fit and logged is None:
            trainer.validate(module, datamodule=datamodule, verbose=False)  # the final weights too
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
        if logged is not None and "val/loss" not in metrics:
            metrics["val/loss"] = logged
        if start_loss is not None:
            metrics["val/loss_at_start"] = float(start_loss)
        if trainer.is_global_zero and cfg.get("eval") and cfg.eval.after_train:
            done = evaluated_at(run_dir / "eval" / str(cfg.eval.get("name", "suite")), trainer.global_step,
                                 eval_config(cfg), ckpt_dir / "last.ckpt")
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


def _evaluate_after_training(cfg, ckpt: Path, run_dir: Path, loggers, trainer, console) -> dict:
    """Score the final checkpoint on the configured suite; log the numbers to W&B and the CSV like training metrics."""
    from evaluation.runner import evaluate_checkpoint

    eval_cfg = eval_config(cfg)
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

    from tools.config_hints import refuse_unread_top_keys_of_launch
    from tools.runlog import only_launch_files, remove_refused_launch

    run_dir = Path(cfg.paths.run_dir)
    new_folder = only_launch_files(run_dir, "train.log", log_empty=True)
    try:
        cfg, overrides = with_run_overrides(cfg)
        refuse_unread_top_keys_of_launch(cfg, "train", overrides)
        metrics = train(cfg, overrides)
    except (ConfigError, DataSourceError, CheckpointError) as err:
        say(f"error: {err}")
        if new_folder:
            remove_refused_launch(run_dir, "train.log", within=cfg.paths.log_dir)
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
