"""Read local training run directories: config.yaml, metrics.csv (both written by train.py) and eval results.

A run directory is any folder holding both config.yaml and metrics.csv (Hydra's own .hydra/config.yaml is not one).
Eval results are the results.json files under <run>/eval/ (evaluation.runner and analysis.probe_eval both write
{"results": [{"task", "metric", "value"}, ...]}).
"""

from __future__ import annotations

import csv
import functools
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path


def read_metrics(path: Path) -> dict[str, dict[int, float]]:
    """metrics.csv -> {metric: {step: value}}. The last value wins when a step repeats (a resume), and a restart at an
    earlier step (the file's steps go backwards) drops what the abandoned attempt logged from that step on."""
    out: dict[str, dict[int, float]] = {}
    highest = -1
    text = Path(path).read_text()
    text = text[: text.rfind("\n") + 1]  # a last row without its newline is half-written (killed, or still writing)
    for row in csv.DictReader(io.StringIO(text)):
        try:
            step = int(row["step"])
        except (KeyError, TypeError, ValueError):  # a damaged row (a disk filled up mid-line): the others still count
            print(f"warning: {path}: skipping a row without a step: {row}", file=sys.stderr)
            continue
        if step < highest:  # resumed from an earlier checkpoint: the rows after it belong to an abandoned attempt
            for values in out.values():
                for s in [s for s in values if s > step]:
                    del values[s]
        highest = step
        for key, value in row.items():
            if key not in ("step", "epoch") and value not in ("", None):
                number = _number(value)
                if number is not None:
                    out.setdefault(key, {})[step] = number
    return out


def _number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _final_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint the run ended with: last.ckpt, else the highest-step one."""
    folder = run_dir / "checkpoints"
    if (folder / "last.ckpt").is_file():
        return folder / "last.ckpt"
    if not folder.is_dir():
        return None
    from model.checkpoint import step_checkpoints

    steps = step_checkpoints(folder)
    return steps[-1] if steps else None


def _attention_label(data: dict, trained: dict | None) -> str:
    """"" for results at the attention and context the run trained with, on whole evaluation sets, else what
    differs: " [window=64]", " [context=4096]", " [limit=10]", " [eval_seed=5]", " [seeds=3]", " [shots=5]",
    " [dtype=bfloat16]" (a window sweep at evaluation, a smoke test on 10 examples, another draw of SA's
    permutations or a mean over several, a few-shot score or one under autocast is another column, never the trained
    model's fp32 zero-shot score)."""
    from model.config import STOCHASTIC_KINDS

    used = data.get("attention") or {}
    run_config = trained or {}
    trained = data.get("trained_attention") or run_config
    diff = [f"{k}={used[k]}" for k in ("kind", "window") if k in used and k in trained and used[k] != trained[k]]
    # the first eval seed: evaluation.runner records it as eval_seed, probe_eval and position_loss as eval_seeds
    seed = used.get("eval_seed", (used.get("eval_seeds") or [None])[0])
    own = trained.get("eval_seed", run_config.get("eval_seed", 0))
    # evaluation.runner records its seeds at the top level, probe_eval and position_loss under attention
    listed = data.get("seeds") or used.get("eval_seeds")
    seeds = len(listed) if isinstance(listed, list) else 0
    if used.get("kind", trained.get("kind")) in STOCHASTIC_KINDS:
        if seed is not None and seed != own:
            diff.append(f"eval_seed={seed}")
        if seeds > 1:  # a mean over permutations: not the one-draw score of the same column
            diff.append(f"seeds={seeds}")
    if data.get("trained_context") and data.get("max_length") not in (None, data["trained_context"]):
        diff.append(f"context={data['max_length']}")
    if data.get("limit"):
        diff.append(f"limit={data['limit']}")
    shots = data.get("num_fewshot")  # one number when every task ran with it (eval.num_fewshot)
    if isinstance(shots, int) and not isinstance(shots, bool) and shots > 0:
        diff.append(f"shots={shots}")
    if data.get("dtype") not in (None, "float32"):  # evaluation.runner's autocast dtype; fp32 is a checkpoint's own
        diff.append(f"dtype={data['dtype']}")
    for key, value in (data.get("setting") or {}).items():  # an analysis run otherwise than its default
        diff.append(f"{key}={value}")  # in full: books.jsonl in two folders are two texts
    return f" [{', '.join(diff)}]" if diff else ""


def _stale(data: dict, final: Path | None, steps: int | None, identity) -> bool:
    """Whether results.json scored an earlier file of the final checkpoint's name. The same mtime: the same file.
    Another mtime is a copied run folder or a rewrite: the training attempt and step recorded in both tell them apart
    (a restart from an earlier checkpoint that ended at the scored step holds other weights); files written before
    2026-12-04 carry no attempt, and are stale when the run trained past the step that was scored. Files written
    before 2026-12-02 carry neither and are taken as they are."""
    mtime, step = data.get("checkpoint_mtime_ns"), data.get("checkpoint_step")
    if final is None or mtime is None or step is None or final.stat().st_mtime_ns == mtime:
        return False
    if data.get("checkpoint_attempt"):
        attempt, saved_step = identity()
        if attempt is not None:  # a restart from the same attempt's earlier checkpoint keeps its id, not its step
            return attempt != data["checkpoint_attempt"] or saved_step != step
    return steps is not None and step < steps


def _final_step_file(data: dict, final: Path | None, steps: int | None, identity) -> bool:
    """Whether results.json scored a step<N> file (.ckpt, or weights/*.pt) of the run's last step: the state
    last.ckpt holds, saved beside it by the same attempt."""
    step = data.get("checkpoint_step")
    if step is None or final is None or (steps is not None and step < steps):  # an earlier step's: no need to look
        return False
    attempt, final_step = identity()
    if final_step is None:  # unreadable: the run's own log says where it ended
        return step == steps
    return step == final_step and data.get("checkpoint_attempt") in (None, attempt)


def read_evals(run_dir: Path, trained_attention: dict | None = None, steps: int | None = None) -> dict[str, float]:
    """{"task/metric": value} from the eval/**/results.json files that scored the run's final weights (last.ckpt, or
    the step<N> file of its last step; those of an intermediate checkpoint, e.g. eval/probes_step280, and of an
    earlier last.ckpt are left out), the newest file
    winning where two give a metric; a warning names the files when their values differ. Results under another
    attention than the trained one, or on a limited number of examples, are keyed apart:
    "probe_needle/acc [window=64]", "lambada_openai/acc [limit=10]"."""
    final = _final_checkpoint(run_dir)
    # a run folder copied without its checkpoints still ended with last.ckpt (train.py always writes one)
    final_name = final.name if final is not None else "last.ckpt"

    @functools.cache
    def identity() -> tuple[str | None, int | None]:  # (attempt, step) of the final checkpoint, read once
        from model.checkpoint import checkpoint_identity

        return checkpoint_identity(final)

    found: list[tuple[float, Path, dict]] = []
    for path in sorted((run_dir / "eval").rglob("results.json")) if (run_dir / "eval").is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            print(f"warning: skipping unreadable {path}: {err}", file=sys.stderr)
            continue
        if not isinstance(data, dict):
            print(f"warning: skipping {path}: not a results.json (a JSON object)", file=sys.stderr)
            continue
        scored = data.get("checkpoint")
        if scored and Path(scored).name not in (final_name, "last.ckpt") \
                and not _final_step_file(data, final, steps, identity):
            continue  # an intermediate checkpoint's evaluation
        if _stale(data, final, steps, identity):
            print(f"warning: {run_dir.name}: {path} scored an earlier {final.name} (step {data.get('checkpoint_step')})"
                  "; left out", file=sys.stderr)
            continue
        found.append((path.stat().st_mtime, path, data))
    out: dict[str, float] = {}
    source: dict[str, Path] = {}
    for _, path, data in sorted(found, key=lambda item: item[0]):
        for entry in data.get("results") if isinstance(data.get("results"), list) else []:
            value = _number(entry.get("value")) if isinstance(entry, dict) else None
            if value is not None and "task" in entry and "metric" in entry:
                key = f"{entry['task']}/{entry['metric']}{_attention_label(data, trained_attention)}"
                if key in out and out[key] != value:
                    print(f"warning: {run_dir.name}: {key} is {out[key]:.4g} in {source[key]} and {value:.4g} in "
                          f"{path}; the newer ({path.parent.name}) is shown", file=sys.stderr)
                out[key], source[key] = value, path
    return out


# Config keys that say where or how a run was launched, computed, logged and evaluated, not what was trained: runs
# that differ only in these (and the seed) are seeds of one configuration. The compute ones change no more than the
# order of float sums (recomputed blocks, a chunked loss, validation batches).
RUN_LOCAL_KEYS = ("seed", "run_name", "ckpt_path", "resume", "task_name", "paths", "logger", "eval", "hydra",
                  "attention.backend", "attention.eval_seed", "trainer.compile", "trainer.log_every_n_steps",
                  "trainer.checkpoint_every_n_steps", "trainer.val_every_n_steps", "trainer.progress_bar",
                  "trainer.keep_checkpoints", "trainer.keep_weights", "trainer.activation_checkpointing",
                  "trainer.loss_chunk_tokens", "data.num_workers", "data.val_batch_size", "data.probes.file",
                  "data.cache_dir")  # config.yaml holds it resolved: the folder a run was launched from


def flat_config(config: dict, prefix: str = "", cache_dir: str | None = None) -> dict[str, str]:
    """{"a.b": value as text} for every leaf of the config, run-local keys left out. Data files under the run's
    paths.cache_dir (data=probes writes its documents there) are named relative to it: the folder a run was launched
    from, or $SA_CACHE_DIR, is not what it trained on."""
    if cache_dir is None and not prefix:
        cache_dir = str((config.get("paths") or {}).get("cache_dir") or "") or None
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if any(name == k or name.startswith(k + ".") for k in RUN_LOCAL_KEYS):
            continue
        if isinstance(value, dict):
            out.update(flat_config(value, name + ".", cache_dir))
            continue
        if name == "data.source.paths" and cache_dir and isinstance(value, list):
            value = [f"${{paths.cache_dir}}{v[len(cache_dir):]}" if isinstance(v, str) and v.startswith(cache_dir + "/")
                     else v for v in value]
        out[name] = json.dumps(value, sort_keys=True, default=str)
    return out


def count_parameters(config: dict) -> int | None:
    """Parameters of the model in config.yaml, built on the meta device (no memory, no weights)."""
    try:
        import torch

        from model.config import AttentionConfig, ModelConfig
        from model.decoder import Decoder

        with torch.device("meta"):
            model = Decoder(ModelConfig(**config["model"]), AttentionConfig(**config["attention"]))
        return model.num_parameters()
    except Exception:  # noqa: BLE001 - an unreadable config leaves the column empty
        return None


@dataclass
class Run:
    path: Path
    config: dict
    metrics: dict[str, dict[int, float]]
    evals: dict[str, float] = field(default_factory=dict)
    label: str = ""  # prefix of the group name (tools.compare sets the preset when several are compared)

    @property
    def variant(self) -> str:
        return str(self.config.get("attention", {}).get("kind", "?"))

    @property
    def window(self) -> int | None:
        return None if self.variant == "full" else self.config.get("attention", {}).get("window")

    @property
    def seed(self):
        return self.config.get("seed")

    @property
    def planned_steps(self) -> int | None:
        """trainer.max_steps as config.yaml holds it (None when it is an unresolved interpolation)."""
        try:
            return int(self.config.get("trainer", {}).get("max_steps"))
        except (TypeError, ValueError):
            return None

    group_extra: str = ""  # what else sets this run apart from runs of its variant and window (tools.compare sets it)

    @property
    def group(self) -> str:
        """Runs that differ only by seed (and run-local keys) share a group: the variant, for windowed variants the
        window, and any other config key in which runs of that variant and window differ."""
        base = self.variant if self.window is None else f"{self.variant} w={self.window}"
        return self.label + base + (f" ({self.group_extra})" if self.group_extra else "")

    def series(self, key: str) -> tuple[list[int], list[float]]:
        values = self.metrics.get(key, {})
        steps = sorted(values)
        return steps, [values[s] for s in steps]

    def last(self, key: str) -> float | None:
        steps, values = self.series(key)
        return values[-1] if values else None

    def steps_behind(self, step: int, key: str) -> int:
        """Optimizer steps done when the row of `key` at `step` was logged. A training row at step s is logged
        during step s + 1; a validation row at step s follows s steps (before training, periodic, or on the final
        weights). Runs written before 2026-12-02 kept Lightning's own labels for the periodic validations, one step
        early (at s after s + 1 steps): see _periodic_val_labelled_early."""
        if not key.startswith("val/"):
            return step + 1
        every = self._val_every()
        if self._periodic_val_labelled_early() and (step + 1) % every == 0:
            return step + 1
        return step

    def _val_every(self) -> int:
        return int(self.config.get("trainer", {}).get("val_every_n_steps", 0) or 0)

    def _periodic_val_labelled_early(self) -> bool:
        """Whether the periodic validations sit at s = k * every - 1 (Lightning's labels, one step early) rather than
        at k * every. Told from the validations between the first and the last (the last may be the final weights',
        at any step); with none in between, from a training row at the last one's step or later, which only an
        early label has (a validation at s follows the training row at s - 1)."""
        every = self._val_every()
        labels = sorted(s for s in self.metrics.get("val/loss", {}) if s > 0)
        trained = self.metrics.get("train/loss", {})
        if every == 1 and labels and trained:  # now the last validation follows the last training row's step
            return max(labels) <= max(trained)
        if every <= 1 or not labels:
            return False
        between = labels[:-1]
        if not between:
            return (labels[-1] + 1) % every == 0 and max(trained, default=-1) >= labels[-1]
        early = sum((s + 1) % every == 0 for s in between)
        return early > sum(s % every == 0 for s in between)

    @property
    def steps(self) -> int | None:
        """Optimizer steps run: the latest of the training and validation rows (a run that stops between two
        training log rows is seen through the validation of its final weights)."""
        done = []
        for key in ("train/loss", "val/loss"):
            steps, _ = self.series(key)
            if steps:
                done.append(self.steps_behind(steps[-1], key))
        return max(done) if done else None

    def tokens_per_step(self) -> float | None:
        """Training tokens per optimizer step: the train/tokens row at step s holds (s + 1) steps' worth; a run too
        short to log one: batch x context x accumulation x devices x nodes from its config, where all are numbers."""
        steps, tokens = self.series("train/tokens")
        if steps:
            return tokens[-1] / (steps[-1] + 1)
        data, trainer = self.config.get("data", {}), self.config.get("trainer", {})
        try:
            if self.config.get("optim", {}).get("tokens_per_step"):  # train.py derives the accumulation from it
                return float(int(self.config["optim"]["tokens_per_step"]))
            return float(int(data["batch_size"]) * int(data["seq_len"]) * int(trainer["accumulate_grad_batches"])
                         * int(trainer["devices"]) * int(trainer["num_nodes"]))
        except (KeyError, TypeError, ValueError):  # "auto" devices: not knowable from the file
            return None

    def tokens_at(self, steps: list[int], key: str = "val/loss") -> list[float]:
        """Training tokens behind the rows of `key` at `steps` (see steps_behind); [] when unknown."""
        per = self.tokens_per_step()
        return [] if per is None else [self.steps_behind(s, key) * per for s in steps]


def load_run(path: Path) -> Run:
    """The run in `path`; a ValueError naming the file when its config.yaml is no YAML mapping."""
    from omegaconf import OmegaConf

    try:
        config = OmegaConf.to_container(OmegaConf.load(path / "config.yaml"), resolve=False)
    except Exception as err:  # noqa: BLE001 - yaml's and omegaconf's errors, by what is wrong in the file
        raise ValueError(f"{path / 'config.yaml'} is unreadable: {str(err).splitlines()[0] if str(err) else err}")
    if not isinstance(config, dict):
        raise ValueError(f"{path / 'config.yaml'} is not a mapping of config keys")
    run = Run(path=path, config=config, metrics=read_metrics(path / "metrics.csv"))
    run.evals = read_evals(path, config.get("attention"), run.steps)
    return run


def is_run_dir(path: Path) -> bool:
    return (path / "config.yaml").is_file() and (path / "metrics.csv").is_file()


def find_runs(paths) -> list[Path]:
    """Run directories among `paths` (each a run directory, or a folder searched recursively, e.g. a multirun)."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such run or multirun directory")
        if is_run_dir(p):
            found.append(p)
            continue
        # previous-<k>/: an earlier run that train.py moved aside when a new one started in its folder
        found += sorted({c.parent for c in p.rglob("metrics.csv") if is_run_dir(c.parent) and ".hydra" not in c.parts
                         and not any(part.startswith("previous-") for part in c.relative_to(p).parts)})
    seen, unique = set(), []
    for p in found:
        if p.resolve() not in seen:
            seen.add(p.resolve())
            unique.append(p)
    return unique
