"""Which lm-eval numbers we report, how seeds are combined, and the paper-shaped markdown table."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Per task: the metrics we keep (lm-eval names); the first one is the table's column. Accuracies follow the GLA /
# Mamba tables whose recipe the paper follows (Yang et al. 2024, Gu & Dao 2023): acc_norm for HellaSwag and ARC-c (and
# OpenBookQA, as lm-eval's literature reports it), acc for the others, PIQA and ARC-e included; results.json keeps
# both where lm-eval gives both.
METRICS: dict[str, tuple[str, ...]] = {
    "wikitext": ("word_perplexity", "byte_perplexity", "bits_per_byte"),
    "lambada_openai": ("perplexity", "acc"),
    "lambada_standard": ("perplexity", "acc"),
    "piqa": ("acc", "acc_norm"),
    "hellaswag": ("acc_norm", "acc"),
    "winogrande": ("acc",),
    "arc_easy": ("acc", "acc_norm"),
    "arc_challenge": ("acc_norm", "acc"),
    "boolq": ("acc",),
    "openbookqa": ("acc_norm", "acc"),
    "social_iqa": ("acc",),
    "mmlu": ("acc",),
}


@dataclass(frozen=True)
class Column:
    title: str
    task: str
    metric: str
    accuracy: bool  # counted in Avg, shown in percent


COLUMNS = (
    Column("Wiki ppl ↓", "wikitext", "word_perplexity", False),
    Column("LMB ppl ↓", "lambada_openai", "perplexity", False),
    Column("LMB acc ↑", "lambada_openai", "acc", True),
    Column("LMB-std ppl ↓", "lambada_standard", "perplexity", False),
    Column("LMB-std acc ↑", "lambada_standard", "acc", True),
    Column("PIQA (acc)", "piqa", "acc", True),
    Column("Hella (acc_norm)", "hellaswag", "acc_norm", True),
    Column("Wino (acc)", "winogrande", "acc", True),
    Column("ARC-e (acc)", "arc_easy", "acc", True),
    Column("ARC-c (acc_norm)", "arc_challenge", "acc_norm", True),
    Column("BoolQ (acc)", "boolq", "acc", True),
    Column("OBQA (acc_norm)", "openbookqa", "acc_norm", True),
    Column("SIQA (acc)", "social_iqa", "acc", True),
    Column("MMLU (acc)", "mmlu", "acc", True),
)


def primary_accuracy(task: str) -> str:
    """The accuracy metric a task's table column reports (acc for tasks this table does not know)."""
    return next((m for m in METRICS.get(task, ()) if m.startswith("acc")), "acc")


def _number(value):
    if value is None or isinstance(value, str):
        return None
    value = float(value)
    return None if math.isnan(value) else value


def extract(lm_eval_results: dict, tasks: list[str]) -> dict[str, dict[str, dict]]:
    """lm-eval's results dict -> {task: {metric: {"value", "stderr"}}} for the metrics in METRICS."""
    out: dict[str, dict[str, dict]] = {}
    for task in tasks:
        row = lm_eval_results.get("results", {}).get(task)
        if row is None:
            continue
        # (metric, filter): a task outside METRICS keeps every metric, under any filter (gsm8k reports
        # "exact_match,strict-match"); its name carries the filter unless that is lm-eval's "none"
        keys = [(m, "none") for m in METRICS[task]] if task in METRICS else [
            tuple(k.split(",", 1)) for k in row if "," in k and "_stderr" not in k.split(",")[0]]
        for metric, filt in keys:
            if f"{metric},{filt}" in row:
                name = metric if filt == "none" else f"{metric},{filt}"
                out.setdefault(task, {})[name] = {"value": _number(row[f"{metric},{filt}"]),
                                                   "stderr": _number(row.get(f"{metric}_stderr,{filt}"))}
    return out


def fewshot_of(lm_eval_results: dict) -> int | dict[str, int]:
    """The shots lm-eval ran with (each task config's num_fewshot; a task's YAML may set one): one number when the
    tasks agree, else {task: shots}."""
    shots = {task: int(c.get("num_fewshot") or 0) for task, c in (lm_eval_results.get("configs") or {}).items()}
    values = set(shots.values()) or {0}
    return values.pop() if len(values) == 1 else dict(sorted(shots.items()))


def contexts_cut_note(cut: dict, max_length: int, shots) -> str:
    """The note on requests whose context lost its start to the model's context (cut: {"requests", "of"})."""
    return (f"{cut['requests']} of {cut['of']} scored requests had their context cut to the last {max_length} tokens"
            + (f" ({shots}-shot prompts lose their first examples)" if isinstance(shots, int) and shots > 0 else ""))


def avg_accuracy(per_task: dict[str, dict[str, dict]]) -> tuple[float | None, list[str]]:
    """Mean of the accuracy columns present (LAMBADA acc included, as in the GLA/Mamba-style tables; with eval=paper
    both LAMBADA variants count, since the paper's table has both and which ones its Avg takes is not known)."""
    used = [c for c in COLUMNS if c.accuracy and per_task.get(c.task, {}).get(c.metric, {}).get("value") is not None]
    if not used:
        return None, []
    return sum(per_task[c.task][c.metric]["value"] for c in used) / len(used), [f"{c.task}/{c.metric}" for c in used]


def combine_seeds(per_seed: list[dict[str, dict[str, dict]]]) -> dict[str, dict[str, dict]]:
    """Seeds -> value = mean, std = sample std over seeds (0 for one seed), stderr = mean lm-eval stderr."""
    combined: dict[str, dict[str, dict]] = {}
    for task in dict.fromkeys(t for run in per_seed for t in run):
        for metric in dict.fromkeys(m for run in per_seed for m in run.get(task, {})):
            values = [run[task][metric]["value"] for run in per_seed if run.get(task, {}).get(metric)]
            values = [v for v in values if v is not None]
            errors = [run[task][metric]["stderr"] for run in per_seed if run.get(task, {}).get(metric)]
            errors = [e for e in errors if e is not None]
            combined.setdefault(task, {})[metric] = {
                "value": statistics.fmean(values) if values else None,
                "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "stderr": statistics.fmean(errors) if errors else None,
                "per_seed": values,
            }
    return combined


def _cell(entry: dict | None, accuracy: bool, seeds: int) -> str:
    if not entry or entry.get("value") is None:
        return "–"
    scale = 100.0 if accuracy else 1.0
    text = f"{entry['value'] * scale:.1f}" if accuracy else f"{entry['value']:.2f}"
    if seeds > 1:
        text += f" ± {entry.get('std', 0.0) * scale:.1f}" if accuracy else f" ± {entry.get('std', 0.0):.2f}"
    return text


def markdown_table(rows: list[tuple[str, dict, dict | None]], seeds: int, tasks: list[str]) -> str:
    """rows: (label, combined results, avg entry) -> the paper's table shape: ppl columns, accuracies, Avg."""
    columns = [c for c in COLUMNS if c.task in tasks]
    extra = [t for t in tasks if t not in {c.task for c in COLUMNS}]
    header = ["Model", *[c.title for c in columns], *extra, "Avg ↑"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    wanted = sum(c.accuracy for c in columns)
    for label, combined, avg in rows:
        cells = [_cell(combined.get(c.task, {}).get(c.metric), c.accuracy, seeds) for c in columns]
        for task in extra:  # a task outside the paper's columns: its first metric, in % unless it is a perplexity
            metric, entry = next(iter(combined.get(task, {}).items()), ("", None))
            cells.append(_cell(entry, not any(word in metric for word in ("perplexity", "bits_per_byte")), seeds))
        mean = _cell(avg, True, seeds)
        if avg and len(avg.get("tasks", ())) < wanted:  # an average over fewer columns is another number: say so
            mean += f" ({len(avg['tasks'])}/{wanted} tasks)"
        lines.append("| " + " | ".join([label, *cells, mean]) + " |")
    return "\n".join(lines)
