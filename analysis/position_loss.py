"""Held-out loss by token position: how much each model gains from context further back, up to and past the
context it was trained with (SWA's gain stops near its reach n_layers * (w - 1); SA's should not).

    python -m analysis.position_loss ckpt=runs/ablation/<swa run>,runs/ablation/<sa run> context=4096
    python -m analysis.position_loss ckpt=<run dir> text='/data/books/*.jsonl.gz' windows=64 seeds=3

Text: `text=` files (txt / jsonl / json / parquet, compressed too; `text_field=`), else each run's own validation shard
(its prepared data, found through the run's config.yaml). Windows of context + 1 tokens are cut from inside
documents (none crosses a document boundary, so position t has t tokens of its document before it), evenly over
all such windows, up to `windows` of them; the loss at position t is the mean next-token loss there (nats), over the
windows and, for SA and gated SA+SWA, over `seeds` eval permutation seeds. `context` past the trained max_seq_len
builds the model for it (RoPE positions never seen in training). Writes results.json and results.md per run to
<run dir>/eval/position_loss_<context>/ (tools.compare reads the mean and the last bucket's; another checkpoint,
attention, seeds, text or number of windows gets a folder of its own, named as probe_eval's) and, for all runs together,
position_loss.{json,md,png} to out= (default: the one run's folder, or runs/analysis/position_loss for several).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from analysis.probe_eval import default_folder, parse_args, run_dir_of
from data.shards import atomic_write, atomic_write_text
from model.config import STOCHASTIC_KINDS

DEFAULTS = {"ckpt": None, "text": None, "text_field": "text", "context": None, "windows": 128, "buckets": 12,
            "seeds": 1, "batch_size": 4, "device": "cpu", "out": None}
INT_KEYS = ("context", "windows", "buckets", "seeds", "batch_size")
MEASURE_KEYS = ("text", "text_field", "windows", "buckets")  # other values: another measurement (context: max_length)
BANDED = ("swa", "gated_sa_swa")  # variants with a sliding-window path, whose reach the table and plot mark


def documents_of(loaded, run_dir: Path | None, text: str | None, text_field: str) -> tuple[list[np.ndarray], str]:
    """Token arrays, one per document, in the checkpoint's tokenizer; and where they came from."""
    if text:
        from data.sources import file_documents

        docs = [np.asarray(e.ids, dtype=np.int64)
                for e in loaded.tokenizer.encode_batch(list(file_documents(text.split(","), text_field)),
                                                       add_special_tokens=False)]
        return docs, text
    if run_dir is None:
        raise ValueError("this checkpoint is not inside a run directory: give text=<files> to score")
    from omegaconf import OmegaConf

    from data import shards
    from data.prepare import prepared_root
    from model.lightning_module import same_tokenizer

    cfg = OmegaConf.load(run_dir / "config.yaml")
    root = prepared_root(cfg.data, cfg.data.cache_dir)
    tokenizer = root / "tokenizer.json"
    if not (root / "meta.json").is_file():
        raise ValueError(f"the run's prepared data is not at {root} (another machine or cache?): give text=<files>")
    if not same_tokenizer(tokenizer.read_text(), loaded.tokenizer.to_str()):
        raise ValueError(f"{root} was tokenized with another tokenizer than the checkpoint's: give text=<files>")
    stream = np.asarray(shards.read_shard(root / "val.bin"), dtype=np.int64)
    ends = np.flatnonzero(stream == loaded.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [stream[a:b] for a, b in zip(starts, ends)], str(root / "val.bin")


def cut_windows(docs: list[np.ndarray], length: int, limit: int) -> np.ndarray:
    """[k, length] windows from inside documents (consecutive, non-overlapping), `limit` of them spread evenly."""
    spans = [(i, s) for i, doc in enumerate(docs) for s in range(0, len(doc) - length + 1, length)]
    if not spans:
        longest = max((len(d) for d in docs), default=0)
        raise ValueError(f"no document holds {length} tokens (the longest has {longest}): give longer documents "
                         "(text=<books>) or a smaller context=")
    picks = np.unique(np.linspace(0, len(spans) - 1, min(limit, len(spans))).round().astype(int))
    return np.stack([docs[spans[p][0]][spans[p][1]: spans[p][1] + length] for p in picks])


def position_losses(model, windows: np.ndarray, batch_size: int, device, per_window: bool = False) -> np.ndarray:
    """Mean next-token loss at each of the context positions of `windows` [k, context + 1]: [context] (nats), or
    each window's [k, context] with per_window."""
    import torch
    import torch.nn.functional as F

    total = torch.zeros(len(windows), windows.shape[1] - 1, dtype=torch.float64)
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            batch = torch.from_numpy(windows[start: start + batch_size]).to(device)
            hidden = model.hidden_states(batch[:, :-1])
            for lo in range(0, hidden.shape[1], 512):  # the head one slice at a time: [B, 512, vocab] at most
                logits = model.lm_head(hidden[:, lo: lo + 512]).float()
                nll = F.cross_entropy(logits.transpose(1, 2), batch[:, lo + 1: lo + 513], reduction="none")
                total[start: start + len(batch), lo: lo + 512] = nll.double().cpu()
    return total.numpy() if per_window else total.mean(0).numpy()


def bucket_edges(context: int, buckets: int) -> list[int]:
    """Log-spaced position buckets [edge_i, edge_i+1) over 0..context (near positions are where the loss moves)."""
    edges = np.unique(np.geomspace(1, context + 1, buckets + 1).round().astype(int) - 1)
    return [int(e) for e in edges]


def _seed_curve(model, seed: int, windows: np.ndarray, given: dict) -> np.ndarray:
    model.sampler.eval_seed = seed
    return position_losses(model, windows, int(given["batch_size"]), given["device"], per_window=True)


def score_run(ckpt: str, given: dict, attention: dict, log) -> dict:
    from model.checkpoint import find_checkpoint, load_checkpoint

    started = time.time()
    path = find_checkpoint(ckpt)
    run_dir = run_dir_of(Path(ckpt))
    loaded = load_checkpoint(path, attention=attention or None, device=given["device"], context=given["context"],
                             window_if_banded=True)  # a full-attention baseline among the runs stays full
    model, acfg = loaded.model, loaded.model.attn_cfg
    context = model.cfg.max_seq_len
    trained = loaded.identity()["trained_context"]
    if context > trained:
        log(f"{ckpt}: context {context} past the trained {trained}: positions from {trained} on test length "
            "extrapolation (RoPE positions never seen in training)")
    docs, source = documents_of(loaded, run_dir, given["text"], given["text_field"])
    windows = cut_windows(docs, context + 1, int(given["windows"]))
    seeds = [acfg.eval_seed + i for i in range(int(given["seeds"]))] if acfg.kind in STOCHASTIC_KINDS else [0]
    if loaded.loss_only_after:
        log(f"warning: {ckpt} trained its loss only on the token after {loaded.loss_only_after!r} "
            "(data.loss_only_after); its loss on every other token says little about it")
    per_window = np.mean([_seed_curve(model, seed, windows, given) for seed in seeds], axis=0)  # [windows, context]
    loss = per_window.mean(0)
    edges = bucket_edges(context, int(given["buckets"]))
    # the standard error over windows: neighbouring buckets differ by the text as much as by the position
    buckets = [{"lo": lo, "hi": hi - 1, "loss": float(loss[lo:hi].mean()),
                "stderr": float(per_window[:, lo:hi].mean(1).std(ddof=1) / np.sqrt(len(windows)))
                if len(windows) > 1 else None} for lo, hi in zip(edges, edges[1:])]
    label = f"{acfg.kind}" + (f" w={acfg.window}" if acfg.kind != "full" else "") + f" ({Path(ckpt).name})"
    identity = loaded.identity()
    log(f"{label}: {len(windows)} windows of {context} tokens from {source}, {len(seeds)} seed(s), "
        f"loss {buckets[0]['loss']:.3f} (first positions) -> {buckets[-1]['loss']:.3f} (last)")
    return {"suite": "position_loss", "checkpoint": str(path), **identity, "label": label,
            "attention": {"kind": acfg.kind, "window": acfg.window, "eval_seeds": seeds},
            "max_length": context, "swa_reach": model.cfg.n_layers * (acfg.window - 1), "text": source,
            "setting": {k: given[k] for k in MEASURE_KEYS if given[k] != DEFAULTS[k]},
            "windows": len(windows), "loss": [round(float(x), 5) for x in loss], "buckets": buckets,
            "results": [{"task": "position_loss", "metric": "loss", "value": float(loss.mean())},
                        {"task": "position_loss", "metric": "loss_last_bucket", "value": buckets[-1]["loss"]}],
            "seconds": round(time.time() - started, 1), "run_dir": str(run_dir or "")}


def _cell(bucket: dict) -> str:
    return f"{bucket['loss']:.3f}" + (f" ± {bucket['stderr']:.3f}" if bucket.get("stderr") is not None else "")


def markdown(runs: list[dict]) -> str:
    context = runs[0]["max_length"]
    lines = [f"## Held-out loss by position (nats ± standard error over windows; context {context} tokens)", "",
             "| positions | " + " | ".join(r["label"] for r in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for i, bucket in enumerate(runs[0]["buckets"]):
        lines.append(f"| {bucket['lo']}–{bucket['hi']} | " + " | ".join(_cell(r["buckets"][i]) for r in runs) + " |")
    banded = [r for r in runs if r["attention"]["kind"] in BANDED]
    lines += ["", "Trained context: " + ", ".join(f"{r['label']} {r['trained_context']}" for r in runs) + "."]
    if banded:
        lines[-1] += " SWA reach n_layers·(w−1): " + ", ".join(f"{r['label']} {r['swa_reach']}" for r in banded) + "."
    return "\n".join(lines) + "\n"


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:  # means over log-spaced bins: one position's mean over a few windows is noise
        loss = np.asarray(run["loss"])
        edges = bucket_edges(len(loss), 40)
        centers = [np.sqrt(max(lo, 1) * hi) for lo, hi in zip(edges, edges[1:])]
        ax.plot(centers, [loss[lo:hi].mean() for lo, hi in zip(edges, edges[1:])], marker=".", label=run["label"])
    for context in sorted({r["trained_context"] for r in runs}):
        ax.axvline(context, color="gray", ls="--", lw=1)
    for reach in sorted({r["swa_reach"] for r in runs if r["attention"]["kind"] in BANDED}):
        ax.axvline(reach, color="tab:orange", ls=":", lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("token position (tokens of context before it); dashed: trained context, dotted: SWA reach")
    ax.set_ylabel("next-token loss (nats)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=120))
    plt.close(fig)


def _folder(run: dict) -> str:
    """eval/<this>: position_loss_<context> for the final checkpoint at its trained attention and the default text,
    else named as probe_eval names its folders (the checkpoint, the attention, the seeds, a hash of other settings),
    so that another measurement never overwrites the default one."""
    return default_folder(run, prefix=f"position_loss_{run['max_length']}")


def main(argv=None) -> int:
    given, attention = parse_args(list(sys.argv[1:] if argv is None else argv), DEFAULTS, INT_KEYS)
    given = {**DEFAULTS, **given}
    given["text"] = given["text"] or None  # text= (empty): the run's validation shard, as when not given
    if given["text"] is None:
        given["text_field"] = DEFAULTS["text_field"]  # a field of no text given: nothing to measure otherwise
    for key in ("windows", "buckets", "seeds", "batch_size"):
        if int(given[key]) < 1:
            raise SystemExit(f"error: {key}={given[key]} must be >= 1")
    if given["context"] is not None and int(given["context"]) < 2:
        raise SystemExit(f"error: context={given['context']} must be >= 2 tokens")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    from model.checkpoint import find_checkpoint

    ckpts = [c for c in str(given["ckpt"]).split(",") if c]
    for ckpt in ckpts:  # every path checked before the first run is scored (minutes each)
        try:
            find_checkpoint(ckpt)
        except FileNotFoundError as err:
            raise SystemExit(f"error: {ckpt}: {err}") from None
    runs = []
    for ckpt in ckpts:
        try:
            run = score_run(ckpt, given, attention, log)
        except (ValueError, FileNotFoundError) as err:
            raise SystemExit(f"error: {ckpt}: {err}") from None
        if run["run_dir"]:
            folder = Path(run["run_dir"]) / "eval" / _folder(run)
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_text(folder / "results.json", json.dumps(run, indent=1))
            atomic_write_text(folder / "results.md", markdown([run]))
        runs.append(run)
    if len({r["max_length"] for r in runs}) > 1:
        raise SystemExit("error: the runs have other trained contexts: give context=<tokens> to score them alike")
    out = Path(given["out"] or (Path(runs[0]["run_dir"]) / "eval" / _folder(runs[0])
                                if len(runs) == 1 and runs[0]["run_dir"] else "runs/analysis/position_loss"))
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(runs)
    atomic_write_text(out / "position_loss.json", json.dumps(runs, indent=1))
    atomic_write_text(out / "position_loss.md", text)
    plot(runs, out / "position_loss.png")
    print(text)
    log(f"wrote {out / 'position_loss.md'}, .json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
