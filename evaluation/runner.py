"""Run an evaluation suite on a checkpoint: local or hub tasks, K SA permutation seeds, JSON + markdown out.

    from evaluation import evaluate_checkpoint
    evaluate_checkpoint("runs/train/<run>", {"tasks": ["wikitext", "lambada_openai"], "data_dir": None}, None, out)

Tasks come from `data_dir` (layout of shared/evaldata, converted by evaluation/local_tasks.py) when their files are
there, else from the HF hub under lm-eval's official task names. A task reachable neither way is skipped, and one
line on stderr says which and how to fix it; the rest still runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from data.shards import atomic_write_text
from model.config import STOCHASTIC_KINDS, AttentionConfig, attention_label

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = {"name": "custom", "tasks": ["wikitext", "lambada_openai"], "data_dir": None, "batch_size": 16,
            "limit": None, "num_seeds": 1, "device": "auto", "dtype": None, "max_length": None,
            "bootstrap_iters": 1000, "task_dir": None, "after_train": False, "num_fewshot": None}


# the eval settings a suite's scores depend on (batch size and device do not change them), recorded in results.json
SCORED_SETTINGS = ("tasks", "data_dir", "limit", "num_seeds", "num_fewshot", "max_length", "dtype", "bootstrap_iters")


def scored_settings(eval_cfg: dict | None) -> dict:
    """SCORED_SETTINGS of an eval config, defaults filled in, as results.json's "eval_config" holds them."""
    cfg = {**DEFAULTS, **dict(eval_cfg or {})}
    return {k: task_names(cfg[k]) if k == "tasks" else cfg[k] for k in SCORED_SETTINGS}


def remove_stale_seed_files(raw_dir: Path, written: list[int]) -> None:
    """An earlier evaluation into the same out_dir left lm_eval/seed<k>.json files that results.json no longer
    lists: only the seeds this one wrote stay."""
    keep = {f"seed{seed}.json" for seed in written}
    for stale in sorted(Path(raw_dir).glob("seed*.json")):
        if stale.name not in keep:
            stale.unlink()


def default_task_dir(data_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Converted local tasks are cached per data folder: <cache_dir> (default $SA_CACHE_DIR, else <repo>/.cache)
    /eval_tasks/<hash>."""
    import hashlib

    root = Path(cache_dir or os.environ.get("SA_CACHE_DIR") or ROOT / ".cache")
    key = hashlib.sha1(str(Path(data_dir).resolve()).encode()).hexdigest()[:12]
    return root / "eval_tasks" / key


def task_names(tasks, key: str = "eval.tasks") -> list[str]:
    """eval.tasks as a list of names; a string (`eval.tasks=wikitext` on the command line) is comma-separated. `key`:
    the setting an error names (`--tasks` on a command line of flags)."""
    from model.config import ConfigError

    names = [str(t).strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks or [])]
    if not names or not all(names):
        example = "eval.tasks=[wikitext,lambada_openai]" if key == "eval.tasks" else f"{key} wikitext,lambada_openai"
        raise ConfigError(key, tasks, f"give task names, e.g. {example}")
    return names


def check_num_fewshot(shots) -> None:
    from model.config import ConfigError

    if shots is not None and (isinstance(shots, bool) or not isinstance(shots, int) or shots < 0):
        raise ConfigError("eval.num_fewshot", shots, "solved examples before each question, an integer >= 0 (null: "
                          "each task's own)")


def check_eval_config(eval_cfg: dict, hf: bool = False) -> None:
    """Refuse eval settings that would fail (or be ignored) only once scoring starts: evaluate.py before the model
    loads, train.py (eval.after_train) before training. hf: the model.hf path, which takes batch_size=auto too."""
    from omegaconf import OmegaConf

    from evaluation.lm import DTYPES
    from model.config import ConfigError
    from tools.config_hints import refuse_unread_keys

    batch = eval_cfg.get("batch_size")
    if not (isinstance(batch, int) and not isinstance(batch, bool) and batch >= 1) and not (hf and batch == "auto"):
        raise ConfigError("eval.batch_size", batch, "must be an integer >= 1" + (" or auto" if hf else ""))
    if eval_cfg.get("dtype") not in (None, "auto", *DTYPES):
        raise ConfigError("eval.dtype", eval_cfg["dtype"], f"must be null (the model's own), auto or one of "
                          f"{tuple(DTYPES)}")
    if eval_cfg.get("data_dir") and not Path(eval_cfg["data_dir"]).is_dir():
        raise ConfigError("eval.data_dir", eval_cfg["data_dir"], "no such folder (it holds the task files: "
                          "see evaluation/README.md)")
    check_num_fewshot(eval_cfg.get("num_fewshot"))
    for key, what in (("limit", "the first N examples of every task"), ("max_length", "tokens of context")):
        value = eval_cfg.get(key)  # lm-eval would read a limit under 1 as a fraction of each task, 0 as no example
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"eval.{key}", value, f"must be null or an integer >= 1 ({what})")
    refuse_unread_keys(OmegaConf.create({"eval": eval_cfg}))
    if eval_cfg.get("num_seeds") is not None and int(eval_cfg["num_seeds"]) < 1:
        raise ConfigError("eval.num_seeds", eval_cfg["num_seeds"], "must be >= 1 (permutation seeds to average)")


def check_task_names(tasks, key: str = "eval.tasks") -> list[str]:
    """eval.tasks as names, each a local task or one of lm-eval's (whose index, ~14 s, is read only when a name is
    not local): for train.py to refuse a misspelled suite before training rather than after it, and hf's sweep
    before it loads the model."""
    from evaluation.local_tasks import KNOWN_TASKS

    names = task_names(tasks, key)
    if any(name not in KNOWN_TASKS for name in names):
        from lm_eval.tasks import TaskManager

        _refuse_unknown(names, TaskManager(), key)
    return names


# the evaldata folders' names (and common short names) of tasks lm-eval names otherwise
TASK_ALIASES = {"siqa": "social_iqa", "obqa": "openbookqa", "wikitext2": "wikitext", "wikitext-2": "wikitext",
                "arc_e": "arc_easy", "arc_c": "arc_challenge", "lambada_test": "lambada_openai"}


def _refuse_unknown(tasks: list[str], task_manager, key: str = "eval.tasks") -> None:
    """A misspelled name is a config error, not a task whose data could not be found."""
    import difflib

    from evaluation.local_tasks import KNOWN_TASKS
    from model.config import ConfigError

    known = [*KNOWN_TASKS, *task_manager.all_tasks]
    lookup = set(known)
    problems = []
    for name in (t for t in tasks if t not in lookup):
        close = [TASK_ALIASES[name]] if name in TASK_ALIASES else difflib.get_close_matches(name, known, n=1)
        problems.append(f"unknown task {name!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
    if problems:
        raise ConfigError(key, tasks, "; ".join(problems) + f" (local tasks: {', '.join(KNOWN_TASKS)}; "
                          "`lm-eval ls tasks` lists lm-eval's)")


@dataclass
class TaskPlan:
    run: list[str]  # names handed to lm-eval
    source: dict[str, str]  # task -> "local:<yaml>" | "hub"
    skipped: dict[str, str] = field(default_factory=dict)  # task -> why
    notes: list[str] = field(default_factory=list)
    task_manager: object = None


def _offline_mode() -> bool:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE: datasets reads its local cache and fails at once on a miss."""
    offline_vars = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    return any(os.environ.get(k, "").lower() in ("1", "true", "yes", "on") for k in offline_vars)


def _hub_unreachable() -> bool:
    """No offline mode set and no connection to the hub: datasets would retry for minutes per task. Behind a proxy
    the direct connection test says nothing, so the hub is tried."""
    if _offline_mode() or any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    return not _hub_reachable()


_HUB_REACHABLE: bool | None = None


def _hub_reachable(timeout: float = 3.0) -> bool:
    """One quick connection attempt, so a machine without network skips hub tasks at once instead of retrying."""
    global _HUB_REACHABLE
    if _HUB_REACHABLE is None:
        import socket
        from urllib.parse import urlparse

        host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
        try:
            socket.create_connection((host, 443), timeout=timeout).close()
            _HUB_REACHABLE = True
        except OSError:
            _HUB_REACHABLE = False
    return _HUB_REACHABLE


def official_dirs(tasks: list[str]) -> list[Path] | None:
    """Folders of lm-eval's own YAMLs for `tasks` (None if one is not ours: then index all 14k built-in tasks)."""
    from evaluation.local_tasks import SPECS, official_tasks_dir

    dirs = []
    for task in tasks:
        if task == "mmlu":
            dirs.append(official_tasks_dir() / "mmlu" / "default")
        elif task in SPECS:
            dirs.append((official_tasks_dir() / SPECS[task].official).parent)
        else:
            return None
    return list(dict.fromkeys(dirs))


def _default_metric_note(record) -> bool:
    """False for lm-eval's notes that a task's metric takes the registry's default aggregation or direction
    (wikitext's three perplexities, six lines at every evaluation): the official task means those defaults."""
    message = str(record.msg)
    return not ("is defined, but aggregation is not" in message or "is defined, but higher_is_better is not" in message)


@contextlib.contextmanager
def records_this_code():
    """lm-eval records `git describe` of the working directory as results.json's git_hash, and outside a git
    checkout git prints "fatal: not a git repository" into the evaluation's output: record this code's commit."""
    import lm_eval.evaluator

    from tools.runlog import code_revision

    own, revision = lm_eval.evaluator.get_git_commit_hash, code_revision()
    lm_eval.evaluator.get_git_commit_hash = lambda: revision
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = own


def local_tasks(tasks: list[str], data_dir: str | Path, task_dir: str | Path | None, num_fewshot: int | None,
                fewshot_key: str = "eval.num_fewshot"):
    """The suite's tasks that data_dir holds, converted into task_dir (default: default_task_dir), with the shots
    refused that a local test-only task cannot give. No hub task is loaded and no network probed: train.py calls
    it alone before training (the converted tasks are kept for the evaluation after it)."""
    from evaluation.local_tasks import KNOWN_TASKS, check_fewshot, write_local_tasks

    task_dir = Path(task_dir) if task_dir else default_task_dir(data_dir)
    local = write_local_tasks(data_dir, [t for t in tasks if t in KNOWN_TASKS], task_dir,
                              cache_dir=task_dir / "hf_datasets")
    check_fewshot(local, tasks, num_fewshot, fewshot_key)
    return local


def plan_tasks(tasks: list[str], data_dir: str | Path | None, task_dir: str | Path | None = None,
               num_fewshot: int | None = None, fewshot_key: str = "eval.num_fewshot") -> TaskPlan:
    """Decide where each task's data comes from; build the TaskManager lm-eval will use.

    Hub tasks keep their official definitions; indexing only their folders (not all ~14k built-in tasks, ~14 s)
    when every task is one we know. Local task folders come last in include_path, so they win name clashes.
    Raises ConfigError for an unknown task name, or for num_fewshot > 0 on a local task that only has a test split.
    """
    from lm_eval.tasks import TaskManager

    task_log = logging.getLogger("lm_eval.api.task")
    if _default_metric_note not in task_log.filters:
        task_log.addFilter(_default_metric_note)

    plan = TaskPlan(run=[], source={})
    local = None
    if data_dir is not None:
        local = local_tasks(tasks, data_dir, task_dir, num_fewshot, fewshot_key)
        plan.notes += local.notes
        for name, yaml_path in local.available.items():
            plan.source[name] = f"local:{yaml_path}"
    hub = [t for t in tasks if t not in plan.source]
    local_dirs = [str(local.task_dir)] if local is not None and local.available else []
    if not hub:
        plan.task_manager = TaskManager(include_path=local_dirs, include_defaults=False)
    else:
        dirs = official_dirs(hub)
        plan.task_manager = TaskManager(include_path=[*map(str, dirs or []), *local_dirs] or None,
                                        include_defaults=dirs is None)
        if dirs is None:  # some name is not one of ours: only lm-eval's full index can tell a typo
            _refuse_unknown(hub, plan.task_manager)
        unreachable = _hub_unreachable()
        for name in hub:
            here = local.missing.get(name) if local is not None else "eval.data_dir is not set"
            if unreachable:  # don't let datasets retry a hub it cannot reach (minutes of back-off per task)
                why = "HF hub unreachable"
                plan.skipped[name] = f"{here}; {why}" if here else why
                continue
            # online, or offline mode: a dataset in the local HF cache is used, a missing one fails at once
            try:
                plan.task_manager.load([name])
                plan.source[name] = "hub"
            except Exception as err:  # noqa: BLE001 - any failure to get the data means: skip this task
                why = ("HF hub offline and not in the local datasets cache" if _offline_mode()
                       else f"HF hub: {type(err).__name__}: {str(err)[:120]}")
                plan.skipped[name] = f"{here}; {why}" if here else why
    plan.run = [t for t in tasks if t in plan.source]
    return plan


def skipped_line(skipped: dict[str, str], data_dir) -> str:
    """The one line that says which tasks have no data and how to get it."""
    reasons = "; ".join(f"{task} ({why})" for task, why in skipped.items())
    fix = ("put the files under eval.data_dir in the layout of shared/evaldata (evaluation/README.md)"
           if data_dir is not None else "pass eval.data_dir=<folder in the layout of shared/evaldata>")
    return f"eval: skipping {reasons} -- fix: {fix}, or run online (unset HF_HUB_OFFLINE/HF_DATASETS_OFFLINE)"


def full_attention_note(kind: str, window, context: int) -> str | None:
    """What to say when the band of `window` spans `context`: every query then sees every earlier token (None when
    it does not, and for full attention, which has no band)."""
    if kind == "full" or not AttentionConfig(kind=kind, window=int(window)).sees_every_earlier_token(context):
        return None
    gates = " (scaled by the sum of its two gates)" if kind == "gated_sa_swa" else ""
    return (f"window {window} at context {context}: every query sees every earlier token, so {kind} scores as full "
            f"causal attention here{gates}")


def evaluate_checkpoint(ckpt, eval_cfg: dict, attention_overrides: dict | None, out_dir: str | Path, *,
                        loaded=None, log=None) -> dict:
    """Evaluate a checkpoint (file or run dir) on the suite `eval_cfg`; writes results.json + results.md to out_dir.

    eval_cfg keys: tasks, data_dir, batch_size, limit, num_seeds, device (and optionally dtype, max_length,
    bootstrap_iters, task_dir, name). attention_overrides: kind / window / backend / eval_seed for the rebuilt model.
    `loaded` (a model.checkpoint.LoadedModel) skips loading `ckpt` again. Returns a summary dict (see the JSON).
    An unknown task name raises model.config.ConfigError (key eval.tasks) before the model loads.
    """
    import lm_eval

    from evaluation.lm import SALM
    from evaluation.report import avg_accuracy, combine_seeds, contexts_cut_note, extract, fewshot_of, markdown_table

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cfg = {**DEFAULTS, **{k: v for k, v in dict(eval_cfg or {}).items()}}
    tasks = task_names(cfg["tasks"])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    # before the model loads: it refuses bad names, and shots a local test-only task cannot give
    plan = plan_tasks(tasks, cfg["data_dir"], cfg["task_dir"], num_fewshot=cfg["num_fewshot"])

    overrides = {k: v for k, v in dict(attention_overrides or {}).items() if v is not None}
    dtype = cfg["dtype"] if cfg["dtype"] not in (None, "auto") else "float32"  # a checkpoint's own: fp32 weights
    lm_kwargs = dict(batch_size=int(cfg["batch_size"]), device=cfg["device"], dtype=dtype, max_length=cfg["max_length"])
    if loaded is not None and overrides:
        raise ValueError("attention_overrides apply when the checkpoint is loaded here; pass loaded=None")
    if loaded is not None:
        lm = SALM(loaded=loaded, **lm_kwargs)
    else:
        lm = SALM(checkpoint=str(ckpt), **overrides, **lm_kwargs)
    info = lm.get_model_info()
    kind = info["attention"]["kind"]
    num_seeds = max(1, int(cfg["num_seeds"]))
    notes: list[str] = []
    trained = dict(lm.loaded.hparams.get("attention", {}))
    # only the command line's attention.window / attention.kind make these differ: said, not taught
    # a full model's recorded window is its context (conf/attention/full.yaml's placeholder), not a window
    if kind != "full" and trained.get("kind") != "full" and trained.get("window") not in (None,
                                                                                       info["attention"]["window"]):
        notes.append(f"window {info['attention']['window']} (trained with {trained['window']})")
    if trained.get("kind") not in (None, kind):
        notes.append(f"attention {kind} (trained as {trained['kind']})")
    trained_context = lm.loaded.identity()["trained_context"]
    if lm.max_length != trained_context:
        notes.append(f"context {lm.max_length} tokens (trained with {trained_context}"
                     f"{'; RoPE past it is extrapolation' if lm.max_length > trained_context else ''}; "
                     "eval.max_length sets it)")
    covers = full_attention_note(kind, info["attention"]["window"], lm.max_length)
    if covers:
        notes.append(covers)
    if (kind not in STOCHASTIC_KINDS or covers) and num_seeds > 1:
        notes.append(f"attention kind={kind} is deterministic{' at this window' if covers else ''}: 1 seed instead "
                     f"of {num_seeds}")
        num_seeds = 1
    seeds = [lm.eval_seed + k for k in range(num_seeds)]

    notes += plan.notes
    for note in notes:
        log(f"eval: {note}")
    if plan.skipped:
        log(skipped_line(plan.skipped, cfg["data_dir"]))

    per_seed, raw_dir, seconds, shots, cut = [], out_dir / "lm_eval", [], 0, None
    for seed in seeds if plan.run else []:
        lm.eval_seed = seed
        lm.requests_scored = lm.contexts_cut = 0
        t0 = time.time()
        with records_this_code():
            results = lm_eval.simple_evaluate(model=lm, tasks=plan.run, task_manager=plan.task_manager,
                                              limit=cfg["limit"], bootstrap_iters=int(cfg["bootstrap_iters"]),
                                              num_fewshot=cfg["num_fewshot"], log_samples=False)
        seconds.append(time.time() - t0)
        log(f"eval: seed {seed}: {len(plan.run)} task(s) in {seconds[-1]:.0f} s")
        per_seed.append(extract(results, plan.run))
        shots = fewshot_of(results) if len(per_seed) == 1 else shots
        if len(per_seed) == 1 and lm.contexts_cut:
            cut = {"requests": lm.contexts_cut, "of": lm.requests_scored}
            notes.append(contexts_cut_note(cut, lm.max_length, shots))
            log(f"eval: {notes[-1]}")
        raw_dir.mkdir(exist_ok=True)
        from lm_eval.utils import handle_non_serializable

        atomic_write_text(raw_dir / f"seed{seed}.json", json.dumps(
            {k: v for k, v in results.items() if k != "samples"}, indent=1, default=handle_non_serializable))
    lm.eval_seed = seeds[0]
    if per_seed:
        remove_stale_seed_files(raw_dir, seeds)

    combined = combine_seeds(per_seed)
    avgs = [avg_accuracy(run) for run in per_seed]
    avg_values = [a for a, _ in avgs if a is not None]
    avg_entry = None
    if avg_values:
        import statistics

        avg_entry = {"value": statistics.fmean(avg_values), "per_seed": avg_values,
                     "std": statistics.stdev(avg_values) if len(avg_values) > 1 else 0.0, "tasks": avgs[0][1]}
    label = attention_label(kind, info["attention"]["window"])
    as_trained = attention_label(trained.get("kind"), trained.get("window"))
    if trained.get("kind") is not None and as_trained != label:  # a model scored as it was not trained says so
        label += f" [trained {as_trained}]"
    if lm.max_length != trained_context:
        label += f" [context {lm.max_length}]"
    table = markdown_table([(label, combined, avg_entry)], len(seeds), tasks)

    summary = {
        "suite": cfg["name"], "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "lm_eval_version": lm_eval.__version__ if hasattr(lm_eval, "__version__") else _version("lm_eval"),
        "checkpoint": info["checkpoint"], **lm.loaded.identity(), "attention": info["attention"],
        "attention_overrides": overrides, "eval_config": scored_settings(cfg),
        "dtype": info["dtype"], "batch_size": lm.batch_size, "device": str(lm.device), "max_length": lm.max_length,
        "n_parameters": info["n_parameters"], "seeds": seeds, "limit": cfg["limit"],
        "bootstrap_iters": int(cfg["bootstrap_iters"]), "num_fewshot": shots, "data_dir": cfg["data_dir"],
        "data": plan.source, "skipped": plan.skipped, "notes": notes, "contexts_cut": cut,
        "results": [{"task": task, "metric": metric, **entry} for task, metrics in combined.items()
                    for metric, entry in metrics.items()],
        "avg_acc": avg_entry, "seconds_per_seed": seconds, "seconds_total": time.time() - started,
    }
    atomic_write_text(out_dir / "results.json", json.dumps(summary, indent=1))
    footer = ["", f"Suite `{cfg['name']}` ({', '.join(tasks)}) on `{info['checkpoint']}`; "
              f"lm-eval {summary['lm_eval_version']}, "
              + (f"{shots}-shot, " if isinstance(shots, int) else "shots per task in results.json, ")
              + f"{info['dtype']}, batch {lm.batch_size}, seeds {seeds}"
              + (f", limit {cfg['limit']}" if cfg["limit"] else "")
              + ". Accuracies in %; Avg = mean of the accuracy columns"
              + (f" ({', '.join(avg_entry['tasks'])})" if avg_entry else "") + "."]
    if len(seeds) > 1:
        footer.append("Cells: mean ± std over SA permutation seeds.")
    if plan.skipped:
        footer.append("Skipped (no data): " + ", ".join(plan.skipped) + ".")
    if cut:
        footer.append(f"Contexts cut to {lm.max_length} tokens: {cut['requests']} of {cut['of']} requests.")
    markdown = table + "\n" + "\n".join(footer) + "\n"
    atomic_write_text(out_dir / "results.md", markdown)
    summary.update(table=markdown, json=str(out_dir / "results.json"), markdown=str(out_dir / "results.md"))
    summary["by_task"] = combined
    return summary


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package.replace("_", "-"))
    except PackageNotFoundError:
        return "unknown"
