"""How a training start relates to the runs before it: a resume of the run in its folder (its checkpoint, its own
overrides, its W&B run, its data stream), init_from (another run's weights at step 0) and a folder that holds an
earlier run's files (moved aside)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from model.config import attention_label
from tools.runlog import say


WANDB_ID_FILE = "wandb_run_id.txt"


def wandb_run_id(run_dir: Path, resume_step: int | None) -> str:
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
    if is_global_zero_from_env():
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, run_id + "\n")
    return run_id


EARLIER_RUN_FILES = ("metrics.csv", "hparams.yaml", "config.yaml", "overrides.yaml", "git_revision.txt", "eval",
                     "compare", WANDB_ID_FILE)


def is_global_zero_from_env() -> bool:
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


def set_aside_earlier_run(run_dir: Path, ckpt_dir: Path) -> Path | None:
    """Move an earlier run's checkpoint files, metrics, config and evaluations into run_dir/previous-<k>/ (rank zero
    only; ranks started later find nothing to move). The checkpoint files move, not their folder, which may be a link
    to other storage. tools/runs.py does not count previous-* folders as runs."""
    ckpts = sorted(ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []
    if (ckpt_dir / "weights").is_dir():  # trainer.keep_checkpoints' weights-only files of older steps
        ckpts.append(ckpt_dir / "weights")
    found = [run_dir / name for name in EARLIER_RUN_FILES if (run_dir / name).exists()]
    if not is_global_zero_from_env() or not (ckpts or (run_dir / "metrics.csv").exists()):
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


def own_checkpoint(ckpt: str | None, ckpt_dir: Path) -> bool:
    """Whether the checkpoint to load is one of this run's (anywhere under its checkpoints/, through links or not)."""
    if ckpt is None:
        return False
    for path, folder in ((Path(ckpt).absolute(), ckpt_dir.absolute()), (Path(ckpt).resolve(), ckpt_dir.resolve())):
        if path.is_relative_to(folder):
            return True
    return False


def resume_checkpoint(cfg, ckpt_dir: Path):
    if cfg.ckpt_path:
        return str(cfg.ckpt_path)
    if cfg.resume == "auto":
        candidates = checkpoints_by_age(ckpt_dir)
        return str(candidates[-1]) if candidates else None
    return None


def checkpoints_by_age(ckpt_dir: Path) -> list[Path]:
    """A run's checkpoints, oldest first: resume=auto continues from the newest."""
    return sorted(ckpt_dir.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)


def validation_missed(run_dir: Path, step: int | None, every: int, own_run: bool) -> bool:
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


def logged_val_loss(run_dir: Path, step: int) -> float | None:
    """The val/loss the run's own log holds at `step`, if any."""
    from tools.runs import read_metrics

    path = run_dir / "metrics.csv"
    return read_metrics(path).get("val/loss", {}).get(step) if path.is_file() else None


def evaluated_at(out_dir: Path, step: int, eval_cfg: dict, last: Path) -> Path | None:
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


def checkpoint_meta(path: str | None) -> dict | None:
    """What train() reads of a checkpoint it resumes or starts from, before the weights load: its hyper-parameters,
    tokenizer and step (one read; mmap, so the weights stay on disk)."""
    if path is None:
        return None
    from model.checkpoint import read_checkpoint

    ckpt = read_checkpoint(path)
    return {"path": str(path), "hyper_parameters": ckpt.get("hyper_parameters") or {},
            "tokenizer": ckpt.get("tokenizer"), "global_step": ckpt.get("global_step")}


def data_config(cfg: DictConfig, source: dict | None, console) -> DictConfig:
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


def check_against_checkpoints(module, source: dict | None, resuming: bool) -> None:
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


def init_weights(module, init: str, tokenizer_json: str, console) -> None:
    """init_from: the checkpoint's weights into the new run's model (step 0, fresh optimizer and schedule)."""
    from model.checkpoint import load_weights_into
    from model.config import ConfigError
    from model.lightning_module import same_tokenizer

    loaded = load_weights_into(module.model, init)
    if loaded["tokenizer"] is not None and not same_tokenizer(loaded["tokenizer"], tokenizer_json):
        raise ConfigError("data.tokenizer.path", "this run's", f"init_from={init} was trained with another "
                          "tokenizer; leave data.tokenizer.path null (the data is then tokenized with the "
                          "checkpoint's) or give the tokenizer.json it was trained with")
    skipped, why = continued_stream(module.hparams, loaded)
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


def continued_stream(hparams, loaded: dict) -> tuple[int, str | None]:
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


def resume_sampling(cfg, module, source: dict, overrides: list[str] | None, console) -> None:
    """A resume draws its windows as its checkpoint did, unless this command line sets data.sampling: the default
    changed to shuffled on 2026-12-02, and a run from before it (no key: with replacement) would switch streams."""
    from model.lightning_module import DATA_DEFAULTS

    trained = {**DATA_DEFAULTS, **(source["hyper_parameters"].get("data") or {})}["sampling"]
    asked = any(override_key(o)[0] == "data.sampling" for o in overrides or [])
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


def override_key(override: str) -> tuple[str, str]:
    """(key, prefix): ("trainer.foo", "+") for +trainer.foo=1."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    key = OverridesParser.create().parse_override(override).get_key_element()
    return key.lstrip("+~"), key[: len(key) - len(key.lstrip("+~"))]


def with_run_overrides(cfg: DictConfig) -> tuple[DictConfig, list[str]]:
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
    own = own_checkpoint(resume_checkpoint(cfg, run_dir / "checkpoints"), run_dir / "checkpoints")
    if not (cfg.resume == "auto" or own) or not (run_dir / RUN_OVERRIDES).is_file():
        return cfg, today  # resume=auto before the run's first checkpoint continues it as it was started too
    from tools.config_hints import unread_key, unread_top_key

    given = dict(override_key(o) for o in today)
    recorded = OmegaConf.to_container(OmegaConf.load(run_dir / RUN_OVERRIDES))
    earlier = []
    for override in recorded:
        key, prefix = override_key(override)
        # an addition (+key=..., ++key=...) stays when today's sets or deletes the key: that needs it added first
        carried = key not in NOT_CARRIED and not (key == "init_from" and cfg.ckpt_path)
        if carried and (key not in given or (prefix in ("+", "++") and given[key] in ("", "~"))):
            earlier.append(override)
    for override in list(earlier):  # recorded before such keys were refused: a requeued job goes on
        key, prefix = override_key(override)
        if prefix in ("+", "++") and (unread_key(key) or ("." not in key and unread_top_key(key, earlier + today))):
            say(f"resume: left out {override} of the run's own overrides: nothing reads {key} (the run ignored it)")
            earlier.remove(override)
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
