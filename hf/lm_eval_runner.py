"""lm-evaluation-harness on a pretrained HF model patched with SWA / SA / MoBA at prefill (paper section 6).

    from hf.lm_eval_runner import evaluate_hf
    results = evaluate_hf("Qwen/Qwen3-8B", "sa", 128, ["boolq", "arc_easy"], batch_size=16, limit=None,
                          device="cuda", seed=0, dtype="bfloat16", data_dir="/path/to/evaldata")

The w_eff sweep of the paper (loads the model once, re-patches it per configuration, one JSON per configuration):

    python -m hf.lm_eval_runner --model Qwen/Qwen3-8B --kinds full,swa,sa,moba --windows 16,32,64,128,256,512 \
        --tasks mmlu,boolq,hellaswag,lambada_openai,arc_easy,arc_challenge --data_dir /path/to/evaldata \
        --dtype bfloat16 --batch_size 16 --out runs/hf_eval/qwen3_8b_weff

The model class is lm-eval's own HFLM (`pretrained=<patched model object>, tokenizer=...`), subclassed only to hand
the model an attention mask for SA: HFLM right-pads a batch and calls the model without a mask, which is harmless
for causal full / SWA / MoBA attention (a real token never sees the pads after it) but would let SA's pi spread the
pads among the real tokens, so a score would depend on the batch it lands in. The subclass records the row lengths
HFLM pads (lm_eval.models.huggingface.pad_and_concat) and passes the matching attention mask: pi then permutes only
the real tokens of each row (hf/attention.py), and a score is the same alone or in any batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PAPER_TASKS = ("mmlu", "boolq", "hellaswag", "lambada_openai", "arc_easy", "arc_challenge")
PAPER_WINDOWS = (16, 32, 64, 128, 256, 512)


class _PadLengths:
    """Lengths of the rows of the last batch HFLM padded (set by the wrapped pad_and_concat)."""

    lengths: list[int] | None = None
    side: str | None = None


@contextlib.contextmanager
def _record_padding(state: _PadLengths):
    import lm_eval.models.huggingface as hflm_module

    original = getattr(hflm_module, "pad_and_concat", None)
    if original is None:  # pragma: no cover - another lm-eval layout
        log.warning("lm_eval.models.huggingface.pad_and_concat not found: SA scores of padded rows may depend on "
                    "the batch; use batch_size=1 for exact SA scores")
        yield
        return

    def recording_pad_and_concat(max_length, tensors, padding_side="right"):
        state.lengths = [int(t.shape[-1]) for t in tensors]
        state.side = padding_side
        return original(max_length, tensors, padding_side=padding_side)

    hflm_module.pad_and_concat = recording_pad_and_concat
    try:
        yield
    finally:
        hflm_module.pad_and_concat = original


def make_lm(model, tokenizer, batch_size=8, max_length: int | None = None, pad_state: _PadLengths | None = None):
    """lm-eval's HFLM around a patched model; with pad_state, padded batches get their attention mask (for SA)."""
    from lm_eval.models.huggingface import HFLM

    from evaluation.lm import scored_request

    class PrefillHFLM(HFLM):
        def _model_call(self, inps, attn_mask=None, labels=None):
            lengths = pad_state.lengths if pad_state is not None else None
            if pad_state is not None:
                pad_state.lengths = None
            if (attn_mask is None and labels is None and lengths is not None and len(lengths) == inps.shape[0]
                    and max(lengths) == inps.shape[1] and min(lengths) < inps.shape[1]):
                n = inps.shape[1]
                lens = torch.tensor(lengths, device=inps.device)[:, None]
                pos = torch.arange(n, device=inps.device)[None, :]
                mask = (pos < lens) if pad_state.side == "right" else (pos >= n - lens)
                with torch.no_grad(), torch.autocast(device_type=self.device.type,
                                                     dtype=getattr(self, "mixed_precision_dtype", None),
                                                     enabled=getattr(self, "mixed_precision_dtype", None) is not None):
                    return self.model(inps, attention_mask=mask.long()).logits
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)

        def _loglikelihood_tokens(self, requests, *args, **kwargs):
            # counted as the native path counts them (evaluation.lm.SALM): HFLM keeps the last max_length tokens
            # of context + continuation and warns once per request, which tells no total
            for key, context_enc, continuation_enc in requests:
                if scored_request(key):
                    self.requests_scored += 1
                    self.contexts_cut += len(context_enc) + len(continuation_enc) > self.max_length + 1
            return super()._loglikelihood_tokens(requests, *args, **kwargs)

    kwargs = {} if max_length is None else {"max_length": int(max_length)}
    lm = PrefillHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, **kwargs)
    lm.requests_scored = lm.contexts_cut = 0
    return lm


def context_length(model, tokenizer, max_length: int | None = None) -> int:
    """The length lm-eval truncates requests to: max_length, else what HFLM reads from the model's config."""
    return int(make_lm(model, tokenizer, max_length=max_length).max_length)


def _task_setup(tasks, data_dir, task_manager, task_dir=None, num_fewshot=None):
    """(task list for lm-eval, TaskManager, skipped {task: why})."""
    from lm_eval.tasks import TaskManager

    from evaluation.runner import task_names

    tasks = task_names(tasks) if isinstance(tasks, str) else list(tasks)
    if task_manager is not None:
        return tasks, task_manager, {}
    names = [t for t in tasks if isinstance(t, str)]
    if data_dir is not None and names:
        from evaluation.runner import plan_tasks  # offline task definitions of this repository (eval.data_dir)

        plan = plan_tasks(names, data_dir, task_dir, num_fewshot=num_fewshot, fewshot_key="num_fewshot")
        for note in plan.notes:
            log.info("eval: %s", note)
        return plan.run + [t for t in tasks if not isinstance(t, str)], plan.task_manager, plan.skipped
    # Only task dicts: don't index lm-eval's ~15k built-in tasks (~14 s).
    return tasks, TaskManager(include_defaults=bool(names)), {}


def evaluate_hf(model_name_or_path, kind: str, window: int | None, tasks_or_task_dicts, batch_size=8, limit=None,
                device: str | None = "auto", seed: int = 0, *, dtype="auto", backend: str = "auto",
                moba_top_k: int = 2, data_dir=None, task_dir=None, task_manager=None, max_length: int | None = None,
                num_fewshot: int | None = None, bootstrap_iters: int = 1000, model=None, tokenizer=None,
                log_samples: bool = False) -> dict:
    """Run lm-eval's HFLM on `model_name_or_path` with `kind` (full|swa|sa|moba) at w_eff=`window` during prefill.

    tasks_or_task_dicts: lm-eval task names (a string: comma-separated) and/or task config dicts. data_dir: a folder
    in the layout of shared/evaldata (task names are then served offline through evaluation.runner.plan_tasks, which
    converts them into task_dir, default evaluation.runner.default_task_dir); task_manager: an explicit lm_eval
    TaskManager instead. model / tokenizer: an already loaded model (re-patched here) to skip
    loading. Returns lm-eval's results dict (without per-sample logs unless log_samples) plus
    "sa_prefill" (the settings), "model", "skipped", "seconds" and "contexts_cut" (None, or how many of the scored
    requests lost the start of their context to the model's max_length).
    """
    import lm_eval

    from hf.patch import load_hf_model, patch_model

    started = time.time()
    run, manager, skipped = _task_setup(tasks_or_task_dicts, data_dir, task_manager, task_dir, num_fewshot)
    if model is None:
        model, tokenizer = load_hf_model(model_name_or_path, kind, window, seed=seed, backend=backend, dtype=dtype,
                                         device=device, moba_top_k=moba_top_k)
    else:
        if tokenizer is None:
            raise ValueError("evaluate_hf(model=...) needs tokenizer= too")
        patch_model(model.eval(), kind, window, seed=seed, backend=backend, moba_top_k=moba_top_k)
    for task, why in skipped.items():
        log.warning("eval: skipping %s (%s)", task, why)
    pad_state = _PadLengths()
    lm = make_lm(model, tokenizer, batch_size=batch_size, max_length=max_length,
                 pad_state=pad_state if kind == "sa" else None)
    results = {}
    if run:
        from evaluation.runner import records_this_code

        with _record_padding(pad_state) if kind == "sa" else contextlib.nullcontext(), records_this_code():
            results = lm_eval.simple_evaluate(model=lm, tasks=run, task_manager=manager, limit=limit,
                                              num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters,
                                              log_samples=log_samples) or {}
        if not log_samples:
            results.pop("samples", None)
    results["sa_prefill"] = model.sa_prefill.as_dict()
    results["contexts_cut"] = ({"requests": lm.contexts_cut, "of": lm.requests_scored, "to": int(lm.max_length)}
                               if lm.contexts_cut else None)
    results["model"] = str(model_name_or_path)
    results["skipped"] = skipped
    results["seconds"] = time.time() - started
    return results


def primary_scores(results: dict) -> dict[str, float]:
    """{task: accuracy in %} with the metric of the task's table column (evaluation.report: acc_norm for HellaSwag,
    ARC-c and OpenBookQA, else acc)."""
    from evaluation.report import primary_accuracy

    scores = {}
    for task, metrics in (results.get("results") or {}).items():
        metric = primary_accuracy(task)
        value = metrics.get(f"{metric},none")
        if isinstance(value, (int, float)):
            scores[task] = 100.0 * float(value)
    return scores


SWEEP_SETTINGS = ("limit", "seed", "dtype", "backend", "moba_top_k", "data_dir", "max_length", "num_fewshot")


def _same_settings(results: dict, settings: dict, tasks: list[str]) -> bool:
    """Whether a finished configuration's JSON was run with these settings. One written before they were recorded
    (2026-12-04) is judged by what lm-eval recorded itself: its limit and the tasks it scored."""
    if "sweep_settings" in results:
        return results["sweep_settings"] == settings
    scored = set(results.get("results") or {}) | set(results.get("groups") or {})
    same = (results.get("config") or {}).get("limit") == settings["limit"] and set(tasks) <= scored
    if same:
        log.info("reusing a result written before the sweep recorded its settings (same tasks and limit)")
    return same


def _model_id(name) -> str:
    """A local folder by its resolved path (./ckpt, ckpt/ and /abs/ckpt are one model), a hub name as written."""
    path = Path(str(name)).expanduser()
    return str(path.resolve()) if path.exists() else str(name)


def sweep(model_name_or_path, kinds, windows, tasks, out_dir, **kwargs) -> list[dict]:
    """Load once; evaluate every (kind, window) (full once); one JSON per configuration + summary.md in out_dir."""
    from data.shards import atomic_write_text
    from hf.attention import PrefillSettings
    from hf.patch import load_hf_model
    from model.config import ConfigError

    configs = [("full", None)] if "full" in kinds else []
    configs += [(kind, int(w)) for kind in kinds if kind != "full" for w in windows]
    for kind, window in configs:  # a bad kind or window fails now, not after hours of scoring the ones before it
        try:
            PrefillSettings(kind=kind, window=window, moba_top_k=int(kwargs.get("moba_top_k", 2)))
        except ValueError as err:
            raise ConfigError("--kinds/--windows", f"{kind} w={window}", str(err)) from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    load_kwargs = {k: kwargs[k] for k in ("seed", "backend", "dtype", "device", "moba_top_k") if k in kwargs}
    model, tokenizer = load_hf_model(model_name_or_path, "full", None, **load_kwargs)
    # what a finished configuration's scores depend on: another value runs it again
    settings = json.loads(json.dumps({"tasks": list(tasks), **{k: kwargs.get(k) for k in SWEEP_SETTINGS}},
                                     default=str))
    shown = [t if isinstance(t, str) else t["task"] for t in tasks]  # names, also of task config dicts
    rows = []
    for kind, window in configs:
        name = kind if window is None else f"{kind}_w{window}"
        path = out / f"{name}.json"
        results = json.loads(path.read_text()) if path.exists() else None  # resumable: finished ones are kept
        if results is not None and _model_id(results.get("model")) != _model_id(model_name_or_path):  # another's
            log.info("%s: %s holds scores of %s; running it again", name, path, results.get("model"))
            results = None
        if results is not None and not _same_settings(results, settings, shown):
            log.info("%s: %s was run with other settings (%s); running it again", name, path,
                     results.get("sweep_settings"))
            results = None
        if results is None:
            from lm_eval.utils import handle_non_serializable

            results = evaluate_hf(model_name_or_path, kind, window, tasks, model=model, tokenizer=tokenizer, **kwargs)
            results["sweep_settings"] = settings
            atomic_write_text(path, json.dumps(results, indent=1, default=handle_non_serializable))
        scores = primary_scores(results)
        avg = sum(scores[t] for t in shown if t in scores) / max(1, sum(t in scores for t in shown))
        rows.append({"config": name, "kind": kind, "window": window, "scores": scores, "avg": avg})
        print(f"{name:>12}  avg {avg:6.2f}  " + "  ".join(f"{t} {scores.get(t, float('nan')):.1f}" for t in shown),
              flush=True)
    header = "| config | " + " | ".join(shown) + " | Avg |\n|---|" + "---|" * (len(shown) + 1) + "\n"
    lines = [f"| {r['config']} | " + " | ".join(f"{r['scores'].get(t, float('nan')):.1f}" for t in shown)
             + f" | {r['avg']:.1f} |" for r in rows]
    atomic_write_text(out / "summary.md", f"{model_name_or_path}, w_eff sweep (prefill pattern; decode full)\n\n"
                      + header + "\n".join(lines) + "\n")
    atomic_write_text(out / "summary.json", json.dumps(rows, indent=1))
    return rows


def _windows(text: str) -> list[int]:
    from model.config import ConfigError

    try:
        return [int(w) for w in text.split(",")]
    except ValueError:
        raise ConfigError("--windows", text, "comma-separated integers, e.g. 16,32,64") from None


def main(argv=None):
    p = argparse.ArgumentParser(description="lm-eval on a HF model with SWA / SA / MoBA at prefill (w_eff sweep)")
    p.add_argument("--model", required=True, help="hub name or local folder")
    p.add_argument("--kinds", default="full,swa,sa,moba")
    p.add_argument("--windows", default=",".join(map(str, PAPER_WINDOWS)))
    p.add_argument("--tasks", default=",".join(PAPER_TASKS))
    p.add_argument("--data_dir", default=None, help="offline task data (layout of shared/evaldata)")
    p.add_argument("--out", required=True)
    p.add_argument("--batch_size", default="8")
    p.add_argument("--limit", type=float, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", default="auto")
    p.add_argument("--max_length", type=int, default=None)
    p.add_argument("--bootstrap_iters", type=int, default=1000)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    limit = None if a.limit is None else (int(a.limit) if a.limit >= 1 else a.limit)
    batch = a.batch_size if a.batch_size.startswith("auto") else int(a.batch_size)  # HFLM's auto, auto:N
    from evaluation.runner import check_task_names
    from model.config import ConfigError

    try:
        check_task_names(a.tasks, "--tasks")  # before minutes of loading the model
        sweep(a.model, [k.strip() for k in a.kinds.split(",")], _windows(a.windows), a.tasks.split(","), a.out,
              batch_size=batch, limit=limit, device=a.device, seed=a.seed, dtype=a.dtype, backend=a.backend,
              data_dir=a.data_dir, max_length=a.max_length, bootstrap_iters=a.bootstrap_iters)
    except (OSError, ConfigError) as err:  # load_hf_model's: the model is neither local nor reachable
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main()
