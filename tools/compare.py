"""Compare training runs from their local run directories (no W&B needed).

    python -m tools.compare runs/ablation/multirun/2026-11-30_10-00-00
    python -m tools.compare runs/window_sweep/multirun/<date> runs/ablation/multirun/<date> --out runs/compare

Prints a markdown table (one row per run: variant, window, seed, steps, tokens, final train loss, final val loss,
val perplexity, tokens/s, parameters, eval metrics of the final checkpoint under <run>/eval/**/results.json) and a
summary per configuration (variant, window and any other config key its runs differ in; mean ± std over seeds; runs
that stopped early apart), and writes compare.md and val_loss_vs_tokens.png (validation and training loss against
training tokens, one colour per configuration, thin lines per run, mean and min-max band across seeds) to --out
(default: <the single directory given>/compare, a sweep's or a run's, else ./compare).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import numpy as np

from data.shards import atomic_write, atomic_write_text
from tools.runs import Run, count_parameters, find_runs, flat_config, load_run

VARIANT_ORDER = {"full": 0, "swa": 1, "sa": 2, "gated_sa_swa": 3, "moba": 4}


def _sort_key(run: Run):
    return (VARIANT_ORDER.get(run.variant, 9), run.window or 0, str(run.seed), str(run.path))


def _num(x, fmt="{:.4f}"):
    if x is None:
        return "—"
    return "nan" if isinstance(x, float) and math.isnan(x) else fmt.format(x)  # nan: logged, and diverged


def _params(n):
    return "—" if n is None else f"{n / 1e6:.2f}M"


# metrics.csv values shown beside the eval scores when a run logs them (the probe presets' headline: the accuracy of
# the answers, data.loss_only_after)
LOGGED_SCORES = ("val/answer_acc",)


def run_rows(runs: list[Run]) -> tuple[list[dict], list[str]]:
    logged = [k for k in LOGGED_SCORES if any(r.last(k) is not None for r in runs)]
    eval_keys = logged + sorted({k for r in runs for k in r.evals})
    rows = []
    param_cache: dict[str, int | None] = {}
    for r in runs:
        steps, tps = r.series("train/tokens_per_s")
        key = repr((r.config.get("model"), r.config.get("attention", {}).get("kind")))
        if key not in param_cache:
            param_cache[key] = count_parameters(r.config)
        per = r.tokens_per_step()
        rows.append({
            "run": r.path.name, "path": str(r.path), "variant": r.variant, "window": r.window, "seed": r.seed,
            "group": r.group, "steps": r.steps, "planned_steps": r.planned_steps,
            "tokens": r.steps * per if r.steps and per else None,
            "train_loss": r.last("train/loss"), "val_loss": r.last("val/loss"),
            "val_ppl": r.last("val/ppl"), "tokens_per_s": statistics.median(tps) if tps else None,
            "params": param_cache[key],
            **{f"eval:{k}": r.last(k) if k in logged else r.evals.get(k) for k in eval_keys},
        })
    return rows, eval_keys


def _stopped_early(row: dict) -> bool:
    """A run that stopped before trainer.max_steps (killed, or still running)."""
    return row["steps"] is not None and row["planned_steps"] is not None and row["steps"] < row["planned_steps"]


def _steps(row: dict) -> str:
    """Steps run, as "430/1500" for a run that stopped early."""
    return f"{row['steps']}/{row['planned_steps']}" if _stopped_early(row) else _num(row["steps"], "{}")


def markdown_table(rows: list[dict], eval_keys: list[str]) -> str:
    head = ["run", "variant", "window", "seed", "steps", "tokens", "train loss", "val loss", "val ppl", "tokens/s",
            "params"] + eval_keys
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["run"], r["variant"], "—" if r["window"] is None else str(r["window"]), str(r["seed"]),
                 _steps(r), _num(r["tokens"], "{:,.0f}"), _num(r["train_loss"]), _num(r["val_loss"]),
                 _num(r["val_ppl"], "{:.2f}"), _num(r["tokens_per_s"], "{:,.0f}"), _params(r["params"])]
        cells += [_num(r[f"eval:{k}"]) for k in eval_keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_table(rows: list[dict], eval_keys: list[str]) -> str:
    """Mean ± std per configuration. A run that stopped early is pooled only with seeds that stopped at the same
    step: its last values come from fewer steps (or from before a divergence) than its finished seeds'."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        early = f" [stopped at {r['steps']}/{r['planned_steps']}]" if _stopped_early(r) else ""
        groups.setdefault(r["group"] + early, []).append(r)

    def stat(values, fmt="{:.4f}"):
        """Mean ± sample std; a non-finite value (a diverged seed) makes the cell nan; (n=k) where only k of the
        group's runs have the value."""
        present = [v for v in values if v is not None]
        if not present:
            return "—"
        text = _num(float(np.mean(present)), fmt)
        if len(present) > 1:
            text += f" ± {_num(float(np.std(present, ddof=1)), fmt)}"
        return text if len(present) == len(values) else f"{text} (n={len(present)})"

    head = ["variant / window", "seeds", "val loss", "val ppl", "train loss", "tokens/s"] + eval_keys
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, members in groups.items():
        seeds = [m["seed"] for m in members]
        if len(set(map(str, seeds))) < len(seeds):
            print(f"warning: group {name!r} holds seed(s) {sorted({str(x) for x in seeds if seeds.count(x) > 1})} "
                  "more than once (the same run in two folders, or a continuation beside its parent?)",
                  file=sys.stderr)
        cells = [name, str(len(members)), stat([m["val_loss"] for m in members]),
                 stat([m["val_ppl"] for m in members], "{:.2f}"), stat([m["train_loss"] for m in members]),
                 stat([m["tokens_per_s"] for m in members], "{:,.0f}")]
        cells += [stat([m[f"eval:{k}"] for m in members]) for k in eval_keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean_band(curves: list[tuple[list[float], list[float]]]):
    """Mean, min and max across the runs that have a value at each x (the same steps for the same config; a run
    that stopped early leaves the later points to the others)."""
    xs = sorted(set().union(*(set(x) for x, _ in curves)))
    if not xs:
        return None
    points = [dict(zip(x, y)) for x, y in curves]
    ys = [[p[x] for p in points if x in p] for x in xs]
    return (np.array(xs), np.array([np.mean(y) for y in ys]), np.array([min(y) for y in ys]),
            np.array([max(y) for y in ys]))


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.group, []).append(r)
    cmap = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, members) in enumerate(groups.items()):
        color = cmap(i % cmap.N)
        style = ("-", "--", ":")[(i // cmap.N) % 3]  # past 20 groups colours repeat: the line style tells them apart
        for ax, key in ((axes[0], "val/loss"), (axes[1], "train/loss")):
            curves = []
            for r in members:
                steps, values = r.series(key)
                x = r.tokens_at(steps, key)
                if x:
                    curves.append((x, values))
                    ax.plot(x, values, color=color, alpha=0.3, lw=0.8)
            band = _mean_band(curves) if curves else None
            if band is not None:
                x, mean, lo, hi = band
                ax.plot(x, mean, color=color, lw=2, ls=style, label=f"{name} (n={len(members)})",
                        marker="o" if len(x) == 1 else None)  # a single point draws no line
                if len(members) > 1:
                    ax.fill_between(x, lo, hi, color=color, alpha=0.15)
    for ax, title in zip(axes, ("validation loss", "training loss")):
        ax.set_xlabel("training tokens")
        ax.set_ylabel(title)
        ax.set_title(f"{title} vs tokens (mean, min-max over seeds)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def label_differences(runs: list[Run]) -> None:
    """Runs of one variant and window that differ in another config key (steps, model, data, optimizer, ...) are
    not seeds of one configuration: name those keys in their group, so they are never pooled into one mean."""
    by_base: dict[str, list[tuple[Run, dict]]] = {}
    for r in runs:
        r.group_extra = ""
        by_base.setdefault(r.group, []).append((r, flat_config(r.config)))
    for members in by_base.values():
        keys = sorted({k for _, flat in members for k in flat})
        differing = [k for k in keys if len({flat.get(k) for _, flat in members}) > 1]
        for r, flat in members:
            r.group_extra = ", ".join(f"{k}={flat.get(k, '—')}" for k in differing)


def compare(paths, out: Path | None = None, plots: bool = True) -> dict:
    run_dirs = find_runs(paths)
    if not run_dirs:
        raise SystemExit(f"error: no run directories (config.yaml + metrics.csv) under {' '.join(map(str, paths))}")
    runs = []
    for path in run_dirs:  # one damaged run folder leaves that run out, not the table
        try:
            runs.append(load_run(path))
        except (OSError, ValueError) as err:
            print(f"warning: skipping run {path}: {err}", file=sys.stderr)
    if not runs:
        raise SystemExit("error: no readable run directory (see the warnings above)")
    runs.sort(key=_sort_key)
    if len({r.config.get("task_name") for r in runs}) > 1:  # several presets: keep their runs apart
        for r in runs:
            r.label = f"{r.config.get('task_name')}: "
    label_differences(runs)
    rows, eval_keys = run_rows(runs)
    early = [f"{r['run']} stopped at step {r['steps']} of {r['planned_steps']} (killed, diverged or still running): "
             "its final values are not the configured run's" for r in filter(_stopped_early, rows)]
    for line in early:
        print(f"warning: {line}", file=sys.stderr)
    text = ("## Runs\n\n" + markdown_table(rows, eval_keys) + "\n\n## Per configuration (mean ± std over seeds)\n\n"
            + summary_table(rows, eval_keys) + "\n\nFinal values = last logged; tokens/s = median over the run; "
            "params rebuilt from config.yaml on the meta device.\n" + "".join(f"\nNote: {line}." for line in early)
            + ("\n" if early else ""))
    if out is None:  # beside the one folder given (a sweep, or a run: <run>/compare), else ./compare
        out = Path(paths[0]) / "compare" if len(paths) == 1 else Path("compare")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "compare.md", text)
    files = [out / "compare.md"]
    if plots:
        plot(runs, out / "val_loss_vs_tokens.png")
        files.append(out / "val_loss_vs_tokens.png")
    return {"rows": rows, "eval_keys": eval_keys, "markdown": text, "files": files}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", help="multirun directories and/or run directories")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    try:
        result = compare(args.paths, args.out, plots=not args.no_plots)
    except FileNotFoundError as err:
        raise SystemExit(f"error: {err}") from None
    print(result["markdown"])
    print("wrote " + ", ".join(map(str, result["files"])), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
