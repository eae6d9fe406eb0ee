"""Evaluate a checkpoint on the synthetic long-range probes (data/probes.py): accuracy by distance bucket.

    python -m analysis.probe_eval ckpt=runs/probes_cpu/multirun/<date>/2_sa_w32_s0
    python -m analysis.probe_eval ckpt=<file.ckpt> task=passkey num=300 buckets=6 attention.window=64
    python -m analysis.probe_eval ckpt=<run dir> seeds=5          # SA: mean and spread over 5 eval permutations

Prompts are generated in TOKEN units of the checkpoint's own tokenizer: as long as the run's training documents
when it trained on data=probes, else as long as the context allows (the model's max_seq_len; context=<tokens> sets
it), with the needed item at a uniformly drawn distance. An answer counts as correct when the model's greedy
(argmax) prediction at every answer position equals the expected token, i.e. greedy decoding reproduces the value;
all positions are scored in one teacher-forced forward pass over prompt + answer (for SA: under the eval-mode
permutation of that length, rather than a fresh one per decoding step), and padded batches carry their lengths (SA
permutes only real tokens, so batching changes nothing).
Distances are re-measured on the final token sequence; "beyond SWA" marks items further back than n_layers*(w-1),
the reach of an SWA stack with this checkpoint's depth and window (reach_window=<w> sets another window: for a full
attention run whose preset window is the whole context, the sweep's SWA window).

Read the accuracies against two things this file reports beside them:
- "constant guess": what always answering the subset's most common answer scores. Answers are drawn uniformly, but a
  subset of a few dozen prompts is not balanced, so it can lie well above 1/#answers.
- the spread over eval permutations (seeds=K; SA and gated SA+SWA only). Every prompt has the same length, so one
  eval seed scores all of them under one pi per layer, and which near positions that pi links to the question
  varies a lot from seed to seed.
The prompts all end at the same position (the context's end), so "within the SWA reach" also means "the needle is
among the last n_layers*(w-1) tokens": few tokens lie between it and the question, and SA's causal hops must land
there, so SA alone reaches near needles less often than far ones (gated SA+SWA has its SWA path for them).

Defaults for task, filler, pairs and the prompt length (the training documents' length in tokens) come from the run's
config.yaml when it trained on data=probes. Results go to
<run dir>/eval/probes/results.json and results.md (tools.compare picks them up), or to out=<dir>.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

from data.shards import atomic_write_text
from model.config import STOCHASTIC_KINDS

DEFAULTS = {"ckpt": None, "task": "kv,passkey", "num": 200, "num_pairs": 8, "key_digits": 3, "value_digits": 4,
            "filler": "sentences", "seed": 1234, "seeds": 1,
            "context": None, "min_distance": None, "max_distance": None, "buckets": 8, "batch_size": 8,
            "reach_window": None, "device": "cpu", "out": None}
ATTENTION_KEYS = ("kind", "window", "backend", "eval_seed")


# What a probe score measures beyond the checkpoint and attention: given otherwise than the run trained (or the
# defaults), they make another score, kept in a folder of its own and labelled apart by tools.compare. Not
# reach_window: it moves only the within / beyond split, which a full run needs at the sweep's reach to line up with
# the SWA and SA runs' columns (results.json keeps swa_reach).
MEASURE_KEYS = ("task", "num", "num_pairs", "key_digits", "value_digits", "filler", "seed", "context", "min_distance",
                "max_distance", "buckets")


def setting_suffix(setting: dict) -> str:
    """"" for the default measurement, else "_" + a short hash of the settings that differ (results.json spells them
    out), so that another measurement never overwrites the default one's folder."""
    import hashlib

    if not setting:
        return ""
    return "_" + hashlib.sha256(json.dumps(setting, sort_keys=True, default=str).encode()).hexdigest()[:8]


INT_KEYS = ("num", "num_pairs", "key_digits", "value_digits", "seed", "seeds", "context", "min_distance",
            "max_distance", "buckets", "batch_size", "reach_window")


def parse_args(argv: list[str], defaults: dict = DEFAULTS, int_keys: tuple = INT_KEYS) -> tuple[dict, dict]:
    """key=value arguments -> (the keys given, attention overrides)."""
    given, attention = {}, {}
    for arg in argv:
        if "=" not in arg:
            raise SystemExit(f"error: arguments are key=value, got {arg!r} (keys: {sorted(defaults)}, "
                             f"attention.{{{','.join(ATTENTION_KEYS)}}})")
        key, value = arg.split("=", 1)
        if key.startswith("attention."):
            sub = key.split(".", 1)[1]
            if sub not in ATTENTION_KEYS:
                raise SystemExit(f"error: unknown key {key!r}; attention overrides: {ATTENTION_KEYS}")
            try:
                attention[sub] = int(value) if sub in ("window", "eval_seed") else value
            except ValueError:
                raise SystemExit(f"error: {key}={value!r} must be an integer") from None
        elif key in defaults:
            try:
                given[key] = None if value in ("null", "None") else (int(value) if key in int_keys else value)
            except ValueError:
                raise SystemExit(f"error: {key}={value!r} must be an integer") from None
        else:
            raise SystemExit(f"error: unknown key {key!r}; known: {sorted(defaults)}")
    if not given.get("ckpt"):
        raise SystemExit("error: ckpt=<run dir or .ckpt file> is required")
    return given, attention


def run_dir_of(ckpt: Path) -> Path | None:
    """The training run a checkpoint belongs to (the folder holding config.yaml), if any: <run>/checkpoints/x.ckpt
    or <run>/checkpoints/weights/x.pt (trainer.keep_checkpoints)."""
    for folder in (ckpt, ckpt.parent, ckpt.parent.parent, ckpt.parent.parent.parent):
        if folder.is_dir() and (folder / "config.yaml").is_file():
            return folder
    return None


def trained_probe_defaults(run_dir: Path | None) -> dict:
    if run_dir is None:
        return {}
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / "config.yaml")
    probes = cfg.data.get("probes") if "data" in cfg else None
    if not probes:
        return {}
    keys = ("task", "filler", "num_pairs", "key_digits", "value_digits", "length")
    return {k: probes[k] for k in keys if k in probes}


def trained_context(tokenizer, trained: dict, max_seq_len: int) -> int:
    """Token length of the documents the run trained on (their `length` is in characters), capped by the model."""
    from data.probes import ProbeSpec, make_probe

    spec = ProbeSpec(task=str(trained.get("task", "kv")).split(",")[0], length=int(trained["length"]),
                     num_pairs=int(trained.get("num_pairs", 8)), filler=trained.get("filler", "sentences"),
                     key_digits=int(trained.get("key_digits", 3)), value_digits=int(trained.get("value_digits", 4)))
    tokens = max(len(tokenizer.encode(make_probe(spec, i).prompt, add_special_tokens=False).ids) for i in range(8))
    return min(max_seq_len, tokens + 8)


def build_examples(tokenizer, task: str, num: int, context: int, seed: int, num_pairs: int, filler: str,
                   min_distance=None, max_distance=None, key_digits: int = 3, value_digits: int = 4):
    """(prompt ids, answer ids, token distance) for `num` probes that fit in `context` tokens. The distance is what
    the first answer token needs: from the last prompt token back to the value's FIRST token (the probe's own
    distance counts to its last; every later answer token needs its own value token, at the same distance), so an
    SWA stack reaches the whole value iff distance <= layers * (window - 1)."""
    from data.probes import ProbeSpec, TokenUnits, make_probe

    units = TokenUnits(tokenizer)
    margin = 8  # answer tokens + slack for merges at piece boundaries
    spec = ProbeSpec(task=task, length=context - margin, num_pairs=num_pairs, filler=filler, seed=seed,
                     min_distance=min_distance, max_distance=max_distance, key_digits=key_digits,
                     value_digits=value_digits)
    examples, index = [], 0
    while len(examples) < num and index < 3 * num:
        probe = make_probe(spec, index, units)
        index += 1
        enc = tokenizer.encode(probe.prompt + probe.answer, add_special_tokens=False)  # as the shards were
        n_prompt = sum(1 for start, _ in enc.offsets if start < len(probe.prompt))
        ids = enc.ids
        if len(ids) > context or n_prompt >= len(ids):
            continue
        examples.append((ids[:n_prompt], ids[n_prompt:], probe.distance + len(ids) - n_prompt - 1))
    return examples


def score(model, examples, batch_size: int, pad_id: int, device) -> np.ndarray:
    """1 where greedy prediction reproduces every answer token."""
    import torch

    correct = []
    with torch.no_grad():
        for b in range(0, len(examples), batch_size):
            chunk = examples[b : b + batch_size]
            seqs = [p + a[:-1] for p, a, _ in chunk]  # the last answer token is only a target
            n = max(len(s) for s in seqs)
            x = torch.full((len(seqs), n), pad_id, dtype=torch.long)
            for i, s in enumerate(seqs):
                x[i, : len(s)] = torch.tensor(s)
            lengths = torch.tensor([len(s) for s in seqs])
            logits = model(x.to(device), lengths.to(device))
            for i, (p, a, _) in enumerate(chunk):
                pred = logits[i, len(p) - 1 : len(p) - 1 + len(a)].argmax(-1).cpu().tolist()
                correct.append(pred == list(a))
    return np.array(correct, dtype=bool)


def constant_guess(answers: list[tuple]) -> float:
    """The accuracy of always giving the most common of `answers` (0 for none)."""
    return max(Counter(answers).values()) / len(answers) if answers else 0.0


def bucketize(distances: np.ndarray, correct: np.ndarray, buckets: int, reach: float, answers: list[tuple]
              ) -> list[dict]:
    """Equal-width distance buckets, with one edge at the SWA reach so no bucket straddles it. correct: [seeds, N]."""
    hi = int(distances.max()) if len(distances) else 0
    edges = np.linspace(0, hi + 1, buckets + 1).round().astype(int)
    if math.isfinite(reach) and 0 < reach < hi:
        edges = np.append(edges, int(reach) + 1)
    edges = np.unique(edges)
    rows = []
    for lo, up in zip(edges[:-1], edges[1:]):
        sel = (distances >= lo) & (distances < up)
        if sel.any():
            rows.append({"lo": int(lo), "hi": int(up - 1), "n": int(sel.sum()), **_accuracy(correct[:, sel]),
                         "guess": constant_guess([a for a, s in zip(answers, sel) if s]),
                         "beyond_swa": bool(lo > reach)})
    return rows


def _accuracy(correct: np.ndarray) -> dict:
    """{"acc": mean over seeds and prompts, "acc_std": sample standard deviation of the per-seed accuracies (as the
    evaluation suites and tools.compare report; 0 for one seed)}."""
    per_seed = correct.mean(axis=1)
    return {"acc": float(per_seed.mean()), "acc_std": float(per_seed.std(ddof=1)) if len(per_seed) > 1 else 0.0}


def evaluate(given: dict, attention: dict | None = None, log=print) -> dict:
    """Run the probes; `given` = the key=value settings given (DEFAULTS fill the rest, after the trained ones)."""
    import torch

    from model.checkpoint import find_checkpoint, load_checkpoint

    started = time.time()
    ckpt = find_checkpoint(given["ckpt"])
    run_dir = run_dir_of(Path(given["ckpt"]))
    trained = trained_probe_defaults(run_dir)
    cfg = {**DEFAULTS, **{k: v for k, v in trained.items() if k != "length"}, **given}  # trained, unless given
    loaded = load_checkpoint(ckpt, attention=attention or None, device=cfg["device"])
    model, tok = loaded.model, loaded.tokenizer
    mcfg, acfg = model.cfg, model.attn_cfg
    if "length" in trained:  # in distribution: prompts as long as the training documents
        default_context = trained_context(tok, trained, mcfg.max_seq_len)
        if not cfg["context"]:
            log(f"probe context {default_context} tokens (the run's training documents; context=<tokens> to change)")
    else:
        default_context = mcfg.max_seq_len
    context = int(cfg["context"]) if cfg["context"] else default_context
    cfg["context"] = context
    base = {**DEFAULTS, **{k: v for k, v in trained.items() if k != "length"}, "context": default_context}
    setting = {k: cfg[k] for k in MEASURE_KEYS if k in given and cfg[k] != base.get(k)}
    if context > mcfg.max_seq_len:
        raise SystemExit(f"error: context={context} exceeds the model's max_seq_len={mcfg.max_seq_len}")
    if int(cfg["seeds"]) < 1:
        raise SystemExit(f"error: seeds={cfg['seeds']} must be >= 1 (eval permutation seeds to average over)")
    for key in ("num", "buckets", "reach_window"):  # buckets=0 left most prompts out of the table in silence
        if cfg[key] is not None and int(cfg[key]) < 1:
            raise SystemExit(f"error: {key}={cfg[key]} must be >= 1")
    uses_perm = acfg.kind in STOCHASTIC_KINDS
    seeds = [acfg.eval_seed + i for i in range(int(cfg["seeds"]) if uses_perm else 1)]
    if int(cfg["seeds"]) > 1 and not uses_perm:
        log(f"attention {acfg.kind} draws no permutation: one pass instead of seeds={cfg['seeds']}")
    # The same buckets and beyond/within split for every variant of a sweep: full attention is scored against the reach
    # an SWA stack of its depth and (configured) window would have, so its row lines up with the others; where its
    # preset's window is the whole context (attention=full of most experiments), reach_window= names the sweep's.
    reach = mcfg.n_layers * (int(cfg["reach_window"] or acfg.window) - 1)
    if acfg.kind == "full" and not cfg["reach_window"] and reach >= context - 1:
        log(f"attention full with window {acfg.window}: an SWA stack of that window reaches the whole context, so "
            "every prompt counts as within the reach; give reach_window=<the sweep's SWA window> to split this run's "
            "scores where the SWA runs' are split")
    tasks = [t for t in str(cfg["task"]).split(",") if t]
    summary = {"suite": "probes", "checkpoint": str(ckpt), **loaded.identity(),
               "attention": {"kind": acfg.kind, "window": acfg.window, "eval_seeds": seeds},
               "context": context, "swa_reach": reach, "setting": setting,
               "settings": cfg, "results": [], "buckets": {}}
    for task in tasks:
        examples = build_examples(tok, task, int(cfg["num"]), context, int(cfg["seed"]), int(cfg["num_pairs"]),
                                  cfg["filler"], cfg["min_distance"], cfg["max_distance"], int(cfg["key_digits"]),
                                  int(cfg["value_digits"]))
        if not examples:
            raise SystemExit(f"error: no {task} probe fits in {context} tokens")
        correct = []
        for seed in seeds:
            model.sampler.eval_seed = seed
            correct.append(score(model, examples, int(cfg["batch_size"]), loaded.eos_id, torch.device(cfg["device"])))
        correct = np.stack(correct)  # [seeds, prompts]
        distances = np.array([d for _, _, d in examples])
        answers = [tuple(a) for _, a, _ in examples]
        far = distances > reach
        for metric, sel in (("", np.ones_like(far)), ("_beyond_swa", far), ("_within_swa", ~far)):
            stats = _accuracy(correct[:, sel]) if sel.any() else {"acc": None, "acc_std": None}
            guess = constant_guess([a for a, s in zip(answers, sel) if s]) if sel.any() else None
            summary["results"] += [
                {"task": f"probe_{task}", "metric": f"acc{metric}", "value": stats["acc"], "n": int(sel.sum())},
                {"task": f"probe_{task}", "metric": f"guess{metric}", "value": guess, "n": int(sel.sum())}]
            if len(seeds) > 1:
                summary["results"].append({"task": f"probe_{task}", "metric": f"acc{metric}_seed_std",
                                           "value": stats["acc_std"], "n": len(seeds)})
        summary["buckets"][task] = bucketize(distances, correct, int(cfg["buckets"]), reach, answers)
        spread = f" ± {_accuracy(correct)['acc_std']:.3f} over {len(seeds)} eval seeds" if len(seeds) > 1 else ""
        log(f"probe {task}: {correct.mean():.3f}{spread} over {correct.shape[1]} examples "
            f"(constant guess {constant_guess(answers):.3f})")
    summary["seconds"] = round(time.time() - started, 1)
    return summary


def markdown(summary: dict) -> str:
    a = summary["attention"]
    seeds = a["eval_seeds"]
    seed_text = f"eval seed {seeds[0]}" if len(seeds) == 1 else f"eval seeds {seeds[0]}-{seeds[-1]}, mean ± std"
    lines = [f"## Probes: {summary['checkpoint']}", "",
             f"attention {a['kind']} (w={a['window']}, {seed_text}), context {summary['context']} tokens; SWA reach "
             f"of this depth and window: {summary['swa_reach']} tokens. Accuracy = greedy answer equals the expected "
             "value; constant guess = always the subset's most common answer.", ""]
    values = {(r["task"], r["metric"]): r for r in summary["results"]}
    for (task, metric), r in values.items():
        if metric == "acc":
            lines.append(f"- {task}: {_cell(r['value'], values.get((task, 'acc_seed_std'), {}).get('value'))} "
                         f"({r['n']} examples; constant guess {values[(task, 'guess')]['value']:.3f})")
    for task, rows in summary["buckets"].items():
        lines += ["", f"| {task}: token distance | examples | accuracy | constant guess | beyond SWA reach |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['lo']}–{r['hi']} | {r['n']} | {_cell(r['acc'], r['acc_std'] if len(seeds) > 1 else None)} | "
                  f"{r['guess']:.3f} | {'yes' if r['beyond_swa'] else 'no'} |" for r in rows]
    return "\n".join(lines) + "\n"


def default_folder(summary: dict, prefix: str = "probes") -> str:
    """eval/<this>: "probes" for the final checkpoint at its trained attention and probe settings, else named by what
    differs (the checkpoint, the attention, the first eval seed, the number of seeds, a hash of other probe settings),
    so scoring step 280, another window, another draw of SA's permutations or another context never overwrites the
    final result."""
    parts = [prefix]
    if Path(summary["checkpoint"]).name != "last.ckpt":
        parts.append(Path(summary["checkpoint"]).stem)
    trained = (summary.get("trained_attention") or {})
    for key in ("kind", "window"):
        if key in trained and summary["attention"][key] != trained[key]:
            parts.append(f"{key}{summary['attention'][key]}")
    seeds = summary["attention"]["eval_seeds"]
    if summary["attention"]["kind"] in STOCHASTIC_KINDS and seeds[0] != trained.get("eval_seed", 0):
        parts.append(f"seed{seeds[0]}")  # another draw of SA's permutations: the run's own result stays
    if len(seeds) > 1:
        parts.append(f"{len(seeds)}seeds")
    return "_".join(parts) + setting_suffix(summary.get("setting") or {})


def _cell(acc: float, std: float | None) -> str:
    return f"{acc:.3f}" if std is None else f"{acc:.3f} ± {std:.3f}"


def main(argv=None) -> int:
    given, attention = parse_args(list(sys.argv[1:] if argv is None else argv))
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        summary = evaluate(given, attention, log)
    except ValueError as err:  # a probe that does not fit the context, a bad argument
        raise SystemExit(f"error: {err}") from None
    if given.get("out"):
        out = Path(given["out"])
    else:
        run_dir = run_dir_of(Path(given["ckpt"]))
        out = (run_dir / "eval" / default_folder(summary)) if run_dir else Path("probe_eval")
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(summary)
    atomic_write_text(out / "results.json", json.dumps(summary, indent=1))
    atomic_write_text(out / "results.md", text)
    print(text)
    log(f"wrote {out / 'results.json'} and results.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
