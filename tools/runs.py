"""Read local training run directories: config.yaml, metrics.csv (both written by train.py) and eval results.

A run directory is any folder holding both config.yaml and metrics.csv (Hydra's own .hydra/config.yaml is not one).
Eval results are the results.json files under <run>/eval/ (evaluation.runner and analysis.probe_eval both write
{"results": [{"task", "metric", "value"}, ...]}).
"""

from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path


def read_metrics(path: Path) -> dict[str, dict[int, float]]:
    """metrics.csv -> {metric: {step: value}} (the last value wins when a step repeats, e.g. after a resume)."""
    out: dict[str, dict[int, float]] = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if key not in ("step", "epoch") and value not in ("", None):
                    out.setdefault(key, {})[int(row["step"])] = float(value)
    return out


def read_evals(run_dir: Path) -> dict[str, float]:
    """{"task/metric": value} from every eval/**/results.json of the run."""
    out: dict[str, float] = {}
    for path in sorted((run_dir / "eval").rglob("results.json")) if (run_dir / "eval").is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            print(f"warning: skipping unreadable {path}: {err}", file=sys.stderr)
            continue
        for entry in data.get("results", []):
            if isinstance(entry, dict) and entry.get("value") is not None and "task" in entry and "metric" in entry:
                out[f"{entry['task']}/{entry['metric']}"] = float(entry["value"])
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
    def group(self) -> str:
        """Runs that differ only by seed share a group: the variant and, for windowed variants, the window."""
        return self.label + (self.variant if self.window is None else f"{self.variant} w={self.window}")

    def series(self, key: str) -> tuple[list[int], list[float]]:
        values = self.metrics.get(key, {})
        steps = sorted(values)
        return steps, [values[s] for s in steps]

    def last(self, key: str) -> float | None:
        steps, values = self.series(key)
        return values[-1] if values else None

    def tokens_per_step(self) -> float | None:
        """Training tokens per optimizer step: the train/tokens row at step s holds (s + 1) steps' worth."""
        steps, tokens = self.series("train/tokens")
        return tokens[-1] / (steps[-1] + 1) if steps else None

    def tokens_at(self, steps: list[int], key: str = "val/loss") -> list[float]:
        """Training tokens behind the rows of `key` at `steps`. Lightning logs a row at step s after s + 1 optimizer
        steps (train and periodic validation alike), i.e. at the train/tokens value of the same step; the
        validation train.py runs before fitting is the val row at step 0 and has seen 0 tokens."""
        per = self.tokens_per_step() or 0.0
        logged = self.metrics.get("train/tokens", {})
        every = int(self.config.get("trainer", {}).get("val_every_n_steps", 0) or 0)
        out = []
        for s in steps:
            if key.startswith("val/") and s == 0 and every != 1:
                out.append(0.0)
            else:
                out.append(logged.get(s, (s + 1) * per))
        return out


def load_run(path: Path) -> Run:
    from omegaconf import OmegaConf

    config = OmegaConf.to_container(OmegaConf.load(path / "config.yaml"), resolve=False)
    return Run(path=path, config=config, metrics=read_metrics(path / "metrics.csv"), evals=read_evals(path))


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
        found += sorted({c.parent for c in p.rglob("metrics.csv") if is_run_dir(c.parent) and ".hydra" not in c.parts})
    seen, unique = set(), []
    for p in found:
        if p.resolve() not in seen:
            seen.add(p.resolve())
            unique.append(p)
    return unique
