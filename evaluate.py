"""Evaluate a trained checkpoint with lm-evaluation-harness (suites in conf/eval/).

    python evaluate.py ckpt=runs/train/<run>                                        # quick: WikiText + LAMBADA
    python evaluate.py ckpt=runs/train/<run> eval=paper eval.data_dir=/path/to/evaldata   # offline, Table 1
    python evaluate.py ckpt=<file>.ckpt eval=full attention.window=64 eval.num_seeds=5 eval.limit=100

Writes results.json, results.md and lm-eval's raw output per seed to <run dir>/eval/<suite>-<timestamp>/
(<suite>-w64-<timestamp> at a window given on the command line; or out_dir=...) and prints the table.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from model.config import (attention_from_command_line, attention_given, attention_label, attention_tag,
                          check_window_for, refuse_context_given, trained_window_unless_given)
from tools.runlog import log_to_file, say

ROOT = Path(__file__).resolve().parent


def report(text: str) -> None:
    """The results on stdout, and in evaluate.log with the notes (say: stderr and the log)."""
    print(text)
    log_to_file(text)


def run_dir_of(ckpt: str | Path) -> Path:
    """A run directory, or the run directory a checkpoint file belongs to (<run>/checkpoints/x.ckpt and
    trainer.keep_checkpoints' <run>/checkpoints/weights/x.pt -> <run>)."""
    path = Path(ckpt)
    if path.is_file():
        folder = path.parent.parent if path.parent.name == "weights" else path.parent
        return folder.parent if folder.name == "checkpoints" else path.parent
    return path


def eval_out_dir(ckpt, out_dir, suite, stamp, kind=None, window=None, hf=None, overrides=()) -> str:
    """hydra.run.dir: out_dir if given, else <run dir>/eval/<suite>-<timestamp> (runs/eval/... for a missing ckpt),
    with the attention chosen on the command line between them (<suite>-sa_w16-<timestamp>, <suite>-w16-<...>),
    so a run's evaluations at other windows are told apart by their folders as well as by their results.json.
    For a checkpoint or a model.hf export a preset's window is no choice (the model's own wins, see
    trained_window_unless_given); a hub model runs at it."""
    if out_dir not in (None, ""):
        return str(out_dir)
    base = run_dir_of(ckpt) / "eval" if ckpt and Path(str(ckpt)).exists() else Path("runs") / "eval"
    hub = hf not in (None, "") and _exported_attention(str(hf)) is None
    if not hub and "window" not in attention_given(overrides):
        window = None
    if window in (None, ""):
        tag = kind or ""
    else:
        tag = f"w{window}" if kind in (None, "") else attention_tag(kind, window)
    return str(base / "-".join(part for part in (suite, tag, stamp) if part))


OmegaConf.register_new_resolver("sa_eval_out_dir", eval_out_dir, replace=True)


@hydra.main(version_base="1.3", config_path="conf", config_name="evaluate")
def main(cfg: DictConfig):
    from hydra.core.hydra_config import HydraConfig

    from tools.runlog import only_launch_files, remove_refused_launch

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    new_folder = only_launch_files(out_dir, "evaluate.log", log_empty=True)
    try:
        return _evaluate(cfg)
    except SystemExit as stop:
        if stop.code == 2 and new_folder:  # refused before it scored anything
            # and runs/eval/ if that leaves it empty (the folder of a missing checkpoint's evaluations)
            runs = Path(os.getcwd(), "runs")
            remove_refused_launch(out_dir, "evaluate.log", within=runs if runs / "eval" in out_dir.parents else None)
        raise


def _evaluate(cfg: DictConfig):
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import logging

    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # per-subtask INFO lines (57 for MMLU) drown the table
    from hydra.core.hydra_config import HydraConfig

    from evaluation.runner import check_eval_config, default_task_dir, evaluate_checkpoint
    from kernels.cpu_malloc import keep_freed_memory
    from model.checkpoint import CheckpointError
    from model.config import ConfigError
    from tools.config_hints import refuse_unread_top_keys_of_launch

    keep_freed_memory()

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    eval_cfg = OmegaConf.to_container(cfg.eval, resolve=True)
    if eval_cfg.get("data_dir") and not eval_cfg.get("task_dir") and cfg.paths.cache_dir:  # as train.py's
        eval_cfg["task_dir"] = str(default_task_dir(eval_cfg["data_dir"], cfg.paths.cache_dir))
    given = attention_given(HydraConfig.get().overrides.task)
    attention = attention_from_command_line(OmegaConf.to_container(cfg.attention, resolve=True))
    try:  # before a model loads
        refuse_unread_top_keys_of_launch(cfg, "evaluate")
        refuse_context_given(HydraConfig.get().overrides.task, "eval.max_length=<tokens> sets the context scored")
        check_eval_config(eval_cfg, hf=bool(cfg.model.hf))
    except ConfigError as err:
        say(f"error: {err}")
        sys.exit(2)
    if cfg.model.hf:
        return evaluate_hf_model(cfg.model.hf, eval_cfg, attention, out_dir, given)
    if not cfg.ckpt:
        say("error: give ckpt=<run dir or .ckpt file> (or model.hf=<HuggingFace model>)")
        sys.exit(2)
    try:
        summary = evaluate_checkpoint(cfg.ckpt, eval_cfg, trained_window_unless_given(attention, given), out_dir,
                                      log=say)
    except (FileNotFoundError, ConfigError, CheckpointError) as err:
        say(f"error: {err}")
        sys.exit(2)
    if not summary["results"]:
        say(f"error: nothing was evaluated: every task of the suite was skipped (see above); results.json in "
            f"{out_dir} lists them")
        sys.exit(1)
    report(summary["table"])
    report(f"results: {summary['json']}\n         {summary['markdown']}\n"
           f"time   : {summary['seconds_total']:.0f} s ({len(summary['seeds'])} seed(s))")
    return summary.get("avg_acc", {}) and summary["avg_acc"]["value"]


def exported_attention(name: str, attention: dict, given: set[str] | None = None) -> dict:
    """A folder written by hf.export runs with the attention it was trained with unless attention.kind is given
    (it would otherwise run as full attention, silently), and with its window and eval_seed unless they are given.
    `given`: the attention keys the command line set itself; a preset's window and eval_seed (attention=sa has 32
    and 0) are defaults, not a choice of this model's (None: every key in `attention` counts as given)."""
    trained = _exported_attention(name)
    if trained is None:
        return attention
    if given is not None:
        attention = trained_window_unless_given(attention, given)
    if "eval_seed" not in attention and "eval_seed" in trained:  # SA's permutations: those of the trained model
        attention = {**attention, "eval_seed": trained["eval_seed"]}
        if trained["eval_seed"]:
            say(f"eval: SA eval seed {trained['eval_seed']}, as {name} was trained (attention.eval_seed=<s> sets "
                "another)")
    if "kind" in attention:  # another kind, at the trained window unless one is given
        check_window_for(trained["kind"], attention["kind"], attention.get("window"), name)
        if attention["kind"] != "full" and "window" not in attention and trained["window"]:
            attention = {**attention, "window": trained["window"]}
            say(f"eval: window {trained['window']}, as {name} was trained (sa_export.json; attention.window=<w> "
                "sets another)")
        return attention
    check_window_for(trained["kind"], trained["kind"], attention.get("window"), name)
    attention = {**attention, "kind": trained["kind"], "window": attention.get("window", trained["window"])}
    shown = attention_label(trained["kind"], attention["window"])  # full attention names no window
    how = f"as {name} was trained" if shown == attention_label(trained["kind"], trained["window"]) else \
        f"{name} was trained with w={trained['window']}"
    say(f"eval: attention {shown}, {how} (sa_export.json; attention.kind=<kind> sets another)")
    return attention


def _exported_attention(name: str) -> dict | None:
    """The attention an exported checkpoint was trained with (its sa_export.json), None for other models."""
    import json

    exported = Path(name) / "sa_export.json"
    return json.loads(exported.read_text())["attention"] if exported.is_file() else None


def _trained_label(name: str, kind: str, window) -> str:
    """' [trained sa (w=32)]' when an exported model is scored at another attention than it was trained with."""
    trained = _exported_attention(name)
    if trained is None:
        return ""
    as_trained = attention_label(trained["kind"], trained["window"])
    return "" if attention_label(kind, window) == as_trained else f" [trained {as_trained}]"


def evaluate_hf_model(name: str, eval_cfg: dict, attention: dict, out_dir: Path, given: set[str] | None = None):
    """A pretrained HuggingFace model with SA / SWA / MoBA at prefill (weights untouched), through lm-eval's HFLM.

    SA with eval.num_seeds=K loads the model once and re-patches it with K permutation seeds; results.json holds
    the first seed's lm-eval output plus every seed's scores, results.md the mean (and spread) over seeds, with a
    column per task of the suite (not per MMLU subject). eval.dtype null loads the checkpoint's own dtype."""
    import json
    import statistics

    from lm_eval.utils import handle_non_serializable

    from data.shards import atomic_write_text
    from evaluation.runner import plan_tasks, remove_stale_seed_files, skipped_line, task_names
    from hf.attention import PrefillSettings
    from hf.lm_eval_runner import evaluate_hf, primary_scores
    from hf.patch import load_hf_model
    from model.config import ConfigError

    try:
        attention = exported_attention(name, attention, given)
    except ConfigError as err:
        say(f"error: {err}")
        sys.exit(2)
    kind = attention.get("kind", "full")
    if kind not in ("full", "swa", "sa", "moba"):
        say(f"error: attention.kind={kind!r} is not available for HuggingFace models (full, swa, sa, moba)")
        sys.exit(2)
    num_seeds = max(1, int(eval_cfg.get("num_seeds") or 1))
    if kind != "sa" and num_seeds > 1:
        say(f"eval: attention kind={kind} is deterministic: 1 seed instead of {num_seeds}")
        num_seeds = 1
    first = int(attention.get("eval_seed", 0))
    seeds = list(range(first, first + num_seeds))
    window, backend = attention.get("window"), attention.get("backend", "auto")
    try:  # the settings and one plan for all seeds, before the (possibly large) model loads
        PrefillSettings(kind=kind, window=window, backend=backend)
    except ValueError as err:
        say(f"error: attention: {err} (attention.window=<w_eff>, attention.backend=<backend>)")
        sys.exit(2)
    try:
        tasks = task_names(eval_cfg["tasks"])
        plan = plan_tasks(tasks, eval_cfg.get("data_dir"), eval_cfg.get("task_dir"),
                          num_fewshot=eval_cfg.get("num_fewshot"))
    except ConfigError as err:
        say(f"error: {err}")
        sys.exit(2)
    out_dir.mkdir(parents=True, exist_ok=True)
    if plan.skipped:
        say(skipped_line(plan.skipped, eval_cfg.get("data_dir")))
    if not plan.run:
        atomic_write_text(out_dir / "results.json", json.dumps({"model": name, "skipped": plan.skipped}, indent=1))
        say(f"error: nothing was evaluated: every task of the suite was skipped (see above); results.json in "
            f"{out_dir} lists them")
        sys.exit(1)
    try:
        model, tokenizer = load_hf_model(name, kind, window, seed=first, backend=backend,
                                         dtype=eval_cfg.get("dtype") or "auto", device=eval_cfg.get("device", "auto"))
    except OSError as err:
        say(f"error: {err}")
        sys.exit(2)
    if kind != "full":  # a band that spans every request is full causal attention (and K SA seeds score alike)
        from evaluation.runner import full_attention_note
        from hf.lm_eval_runner import context_length

        covers = full_attention_note(kind, window, context_length(model, tokenizer, eval_cfg.get("max_length")))
        if covers:
            fewer = f": 1 seed instead of {num_seeds}" if num_seeds > 1 else ""
            say(f"eval: {covers}{fewer}")
            num_seeds, seeds = 1, seeds[:1]
    per_seed = []
    for seed in seeds:  # evaluate_hf re-patches the loaded model with this seed
        results = evaluate_hf(name, kind, window, plan.run, task_manager=plan.task_manager,
                              batch_size=eval_cfg.get("batch_size", 8), limit=eval_cfg.get("limit"), seed=seed,
                              backend=backend, max_length=eval_cfg.get("max_length"),
                              bootstrap_iters=eval_cfg.get("bootstrap_iters", 1000),
                              num_fewshot=eval_cfg.get("num_fewshot"), model=model, tokenizer=tokenizer)
        results.update(skipped=plan.skipped, data=plan.source, dtype=str(model.dtype).removeprefix("torch."))
        per_seed.append(results)
        if len(per_seed) == 1 and (cut := results.get("contexts_cut")):
            say(f"eval: {_cut_line(cut, results)}")
        if num_seeds > 1:
            atomic_write_text(out_dir / "lm_eval" / f"seed{seed}.json",
                              json.dumps(results, indent=1, default=handle_non_serializable))
    remove_stale_seed_files(out_dir / "lm_eval", seeds if num_seeds > 1 else [])
    runs = [{**primary_scores(r), **_perplexities(r)} for r in per_seed]
    summary = {**per_seed[0], "seeds": seeds, "scores_per_seed": runs}
    atomic_write_text(out_dir / "results.json", json.dumps(summary, indent=1, default=handle_non_serializable))

    def cell(key: str) -> str:
        values = [run[key] for run in runs if key in run]
        digits = 3 if "perplexity" in key else 1  # perplexities as before; accuracies in %
        spread = f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
        return f"{statistics.fmean(values):.{digits}f}{spread}"

    # a column per suite task (accuracy in %; not one per MMLU subject), then the perplexities
    from evaluation.report import primary_accuracy

    accuracies = [task for task in tasks if task in runs[0]]
    perplexities = list(_perplexities(per_seed[0]))
    columns = accuracies + perplexities
    titles = [f"{task} {primary_accuracy(task)} %" for task in accuracies] + [k.replace("/", " ") for k in perplexities]
    w_eff = window if kind != "full" and window else "-"  # full attention ignores a window
    lines = ["| model | attention | w_eff | " + " | ".join(titles) + " |",
             "|---|---|---|" + "---|" * len(columns),
             f"| {name} | {kind}{_trained_label(name, kind, window)} | {w_eff} | "
             + " | ".join(cell(c) for c in columns) + " |"]
    if num_seeds > 1:
        lines.append(f"mean ± std over SA seeds {seeds}")
    if cut := per_seed[0].get("contexts_cut"):
        lines.append(_cut_line(cut, per_seed[0]))
    atomic_write_text(out_dir / "results.md", "\n".join(lines) + "\n")
    report("\n".join(lines) + f"\nresults: {out_dir / 'results.json'}")
    return None


def _cut_line(cut: dict, results: dict) -> str:
    from evaluation.report import contexts_cut_note, fewshot_of

    return contexts_cut_note(cut, cut["to"], fewshot_of(results))


def _perplexities(results: dict) -> dict[str, float]:
    """{"<task>/<perplexity metric>": value} of an lm-eval results dict."""
    out = {}
    for task, metrics in (results.get("results") or {}).items():
        for key in ("perplexity,none", "word_perplexity,none"):
            if isinstance(metrics.get(key), (int, float)):
                out[f"{task}/{key.split(',')[0]}"] = float(metrics[key])
    return out


if __name__ == "__main__":
    from tools.config_hints import run_with_key_hints

    run_with_key_hints(main, "evaluate")
