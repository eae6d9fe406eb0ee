"""Offline lm-eval tasks: the official task definitions, fed from local files (layout of shared/evaldata).

For every task we convert the local files into the schema of the dataset the official lm-eval task downloads
(e.g. ARC's ``{"question", "choices": {"text", "label"}, "answerKey"}``) and write a task YAML that *includes the
official YAML of the installed lm-eval* and only swaps the data source:

    include: <site-packages>/lm_eval/tasks/arc/arc_easy.yaml
    task: arc_easy
    dataset_path: json
    dataset_kwargs: {data_files: {test: <ABSOLUTE path>/arc_easy.jsonl}}
    test_split: test

so prompts, choices, targets, process_docs/process_results and metrics are lm-eval's own. Paths are absolute
(lm-eval resolves relative data_files against the process cwd). Local layout (``data_dir``):

    wikitext-2-raw/wiki.test.raw                 wikitext         (articles, as EleutherAI/wikitext_document_level)
    lambada_openai/lambada_test.jsonl            lambada_openai   ({"text"}; last word = target)
    lambada_standard/lambada_test_plain_text.txt lambada_standard (one passage per line; or lambada_test.jsonl {"text"})
    piqa/valid.jsonl + valid-labels.lst          piqa
    hellaswag/hellaswag_val_full.txt.bz2         hellaswag        (6 lines per item; see hellaswag_docs)
    winogrande/winogrande.jsonl                  winogrande       (llm-foundry partial-scoring layout)
    arc/ARC-{Easy,Challenge}-Test.jsonl          arc_easy, arc_challenge (+ -Dev.jsonl: few-shot examples)
    boolq/val.jsonl                              boolq            (SuperGLUE layout)
    openbookqa/test.tsv (or openbook_qa.jsonl)   openbookqa
    siqa/dev.jsonl (+ dev-labels.lst)            social_iqa
    mmlu/test/<subject>_test.csv (+ dev/)        mmlu             (header, 0-3 answer; 57 subject tasks + groups)

Few-shot examples come from a non-test file when the layout has one (ARC's Dev, MMLU's dev/); a task without one
is listed in ``LocalTasks.no_fewshot`` and ``check_fewshot`` refuses ``num_fewshot > 0`` for it, since lm-eval would
otherwise draw the examples from the very split it scores.

``python -m evaluation.local_tasks --data_dir /path/to/evaldata --out /tmp/sa_tasks`` writes a task folder for
``--include_path`` of the lm-eval CLI (see evaluation/lm_eval_cli.py).
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import yaml

from data.shards import atomic_write_text

CONVERTER_VERSION = 1
SPLIT = "test"  # every converted file is exposed to lm-eval as its `test` split


def official_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


# ---------------------------------------------------------------------------------------------- readers
def _jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _labels(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def wikitext_pages(text: str) -> list[dict]:
    """wiki.*.raw -> articles, split at level-1 headings ("= Title =") like EleutherAI/wikitext_document_level."""
    pages, current = [], []
    for line in text.split("\n"):
        heading = line.replace("= = =", "===").replace("= =", "==").strip()
        if heading.startswith("= ") and heading.endswith(" ="):
            if "\n".join(current).strip():
                pages.append("\n".join(current))
            current = []
        current.append(line)
    if "\n".join(current).strip():
        pages.append("\n".join(current))
    return [{"page": page} for page in pages]


_LAST_FRAGMENT = re.compile(r"(?:^|(?<=[.!?]) )([a-z][^.!?]*)$")


def hellaswag_docs(path: Path) -> list[dict]:
    """The 6-line bz2 layout -> Rowan/hellaswag rows, for lm-eval's own hellaswag process_docs.

    The file keeps "<activity_label>: <ctx>" with ctx = ctx_a + " " + ctx_b already joined. lm-eval builds
    ``activity_label + ": " + ctx_a + " " + ctx_b.capitalize()``, so we split ctx_b back off: the trailing sentence
    fragment that starts lower-case (ActivityNet items: "... on a roof. he"); otherwise ctx_b = "" (WikiHow items).
    That split is a heuristic: the only known deviation from the official prompts (see evaluation/README.md).
    """
    with bz2.open(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    docs = []
    for start in range(0, len(lines) - 5, 6):
        head, label, *endings = lines[start: start + 6]
        activity_label, _, ctx = head.partition(": ")
        match = _LAST_FRAGMENT.search(ctx)
        ctx_a, ctx_b = (ctx[: match.start(1)].rstrip(), match.group(1)) if match else (ctx, "")
        docs.append({"ind": start // 6, "activity_label": activity_label, "ctx_a": ctx_a, "ctx_b": ctx_b,
                     "ctx": ctx, "endings": endings, "label": str(int(label))})
    return docs


def winogrande_docs(rows: Iterable[dict]) -> list[dict]:
    """llm-foundry {"context_options", "continuation", "gold"} -> allenai/winogrande {"sentence", "option1/2",
    "answer"}.

    lm-eval scores ``sentence[:blank] + option`` followed by ``" " + sentence[blank + 1:].strip()``; the two contexts
    are exactly llm-foundry's context_options, so we cut them at their common prefix (backed off to a word start).
    """
    docs = []
    for row in rows:
        first, second = row["context_options"]
        cut = 0
        while cut < min(len(first), len(second)) and first[cut] == second[cut]:
            cut += 1
        cut = first.rfind(" ", 0, cut) + 1  # the blank starts a word
        prefix = first[:cut]
        docs.append({"sentence": f"{prefix}_ {row['continuation'].strip()}", "option1": first[cut:],
                     "option2": second[cut:], "answer": str(int(row["gold"]) + 1)})
    return docs


def arc_docs(rows: Iterable[dict]) -> list[dict]:
    return [{"id": r["id"], "question": r["question"]["stem"],
             "choices": {"text": [c["text"] for c in r["question"]["choices"]],
                         "label": [c["label"] for c in r["question"]["choices"]]},
             "answerKey": r["answerKey"]} for r in rows]


def openbookqa_docs(folder: Path) -> list[dict]:
    tsv = folder / "test.tsv"
    if tsv.is_file():
        docs = []
        with open(tsv, encoding="utf-8", newline="") as f:
            for row in csv.DictReader(f, delimiter="\t"):
                parts = re.split(r"\s*\(([A-Z])\)\s", " " + row["Choices"])
                labels, texts = parts[1::2], [t.strip() for t in parts[2::2]]
                docs.append({"id": row["ID"], "question_stem": row["Question Stem"],
                             "choices": {"text": texts, "label": labels}, "answerKey": row["Answer Key"]})
        return docs
    return [{"id": str(i), "question_stem": r["query"],
             "choices": {"text": list(r["choices"]), "label": list("ABCDEFGH"[: len(r["choices"])])},
             "answerKey": "ABCDEFGH"[int(r["gold"])]} for i, r in enumerate(_jsonl(folder / "openbook_qa.jsonl"))]


def siqa_docs(folder: Path) -> list[dict]:
    rows = _jsonl(folder / "dev.jsonl")
    labels_file = folder / "dev-labels.lst"
    labels = _labels(labels_file) if labels_file.is_file() else [str(r["options"].index(r["answer"]) + 1) for r in rows]
    if len(labels) != len(rows):
        raise ValueError(f"{labels_file}: {len(labels)} labels for {len(rows)} items")
    return [{"context": r["context"], "question": r["question"], "answerA": r["options"][0],
             "answerB": r["options"][1], "answerC": r["options"][2], "label": str(int(lab))}
            for r, lab in zip(rows, labels)]


def piqa_docs(folder: Path) -> list[dict]:
    rows, labels = _jsonl(folder / "valid.jsonl"), _labels(folder / "valid-labels.lst")
    if len(labels) != len(rows):
        raise ValueError(f"{folder}: {len(labels)} labels for {len(rows)} items")
    return [{"goal": r["goal"], "sol1": r["sol1"], "sol2": r["sol2"], "label": int(lab)}
            for r, lab in zip(rows, labels)]


def boolq_docs(path: Path) -> list[dict]:
    def as_int(label) -> int:
        return int(label) if not isinstance(label, str) else {"true": 1, "false": 0}[label.strip().lower()]

    return [{"question": r["question"], "passage": r["passage"], "idx": int(r.get("idx", i)),
             "label": as_int(r["label"])} for i, r in enumerate(_jsonl(path))]


def lambada_standard_docs(folder: Path) -> list[dict]:
    plain = folder / "lambada_test_plain_text.txt"
    if plain.is_file():
        return [{"text": line.strip(), "domain": None} for line in plain.read_text(encoding="utf-8").splitlines()
                if line.strip()]
    return [{"text": r["text"], "domain": r.get("domain")} for r in _jsonl(folder / "lambada_test.jsonl")]


def mmlu_rows(path: Path, subject: str) -> list[dict]:
    with open(path, encoding="utf-8", newline="") as f:
        return [{"question": r["question"], "subject": subject,
                 "choices": [r["choice0"], r["choice1"], r["choice2"], r["choice3"]], "answer": int(r["answer"])}
                for r in csv.DictReader(f)]


# ---------------------------------------------------------------------------------------------- task specs
@dataclass
class Spec:
    official: str  # YAML under lm_eval/tasks whose prompts and metrics we use
    sources: tuple[str, ...]  # files under data_dir; the first existing alternative group wins
    docs: Callable[[Path], list[dict]]
    alternatives: tuple[tuple[str, ...], ...] = field(default_factory=tuple)
    optional: tuple[str, ...] = ()  # files `docs` also reads when present: part of the cache fingerprint
    fewshot: tuple[str, Callable[[Path], list[dict]]] | None = None  # a non-test file and its converter

    def source_files(self, data_dir: Path) -> list[Path] | None:
        for group in (self.sources, *self.alternatives):
            paths = [data_dir / p for p in group]
            if all(p.is_file() for p in paths):
                return paths
        return None


SPECS: dict[str, Spec] = {
    "wikitext": Spec("wikitext/wikitext.yaml", ("wikitext-2-raw/wiki.test.raw",),
                     lambda d: wikitext_pages((d / "wikitext-2-raw/wiki.test.raw").read_text(encoding="utf-8"))),
    "lambada_openai": Spec("lambada/lambada_openai.yaml", ("lambada_openai/lambada_test.jsonl",),
                           lambda d: [{"text": r["text"]} for r in _jsonl(d / "lambada_openai/lambada_test.jsonl")]),
    "lambada_standard": Spec("lambada/lambada_standard.yaml", ("lambada_standard/lambada_test_plain_text.txt",),
                             lambda d: lambada_standard_docs(d / "lambada_standard"),
                             alternatives=(("lambada_standard/lambada_test.jsonl",),)),
    "piqa": Spec("piqa/piqa.yaml", ("piqa/valid.jsonl", "piqa/valid-labels.lst"), lambda d: piqa_docs(d / "piqa")),
    "hellaswag": Spec("hellaswag/hellaswag.yaml", ("hellaswag/hellaswag_val_full.txt.bz2",),
                      lambda d: hellaswag_docs(d / "hellaswag/hellaswag_val_full.txt.bz2")),
    "winogrande": Spec("winogrande/default.yaml", ("winogrande/winogrande.jsonl",),
                       lambda d: winogrande_docs(_jsonl(d / "winogrande/winogrande.jsonl"))),
    "arc_easy": Spec("arc/arc_easy.yaml", ("arc/ARC-Easy-Test.jsonl",),
                     lambda d: arc_docs(_jsonl(d / "arc/ARC-Easy-Test.jsonl")),
                     fewshot=("arc/ARC-Easy-Dev.jsonl", lambda p: arc_docs(_jsonl(p)))),
    "arc_challenge": Spec("arc/arc_challenge.yaml", ("arc/ARC-Challenge-Test.jsonl",),
                          lambda d: arc_docs(_jsonl(d / "arc/ARC-Challenge-Test.jsonl")),
                          fewshot=("arc/ARC-Challenge-Dev.jsonl", lambda p: arc_docs(_jsonl(p)))),
    "boolq": Spec("super_glue/boolq/default.yaml", ("boolq/val.jsonl",), lambda d: boolq_docs(d / "boolq/val.jsonl")),
    "openbookqa": Spec("openbookqa/openbookqa.yaml", ("openbookqa/test.tsv",),
                       lambda d: openbookqa_docs(d / "openbookqa"), alternatives=(("openbookqa/openbook_qa.jsonl",),)),
    "social_iqa": Spec("siqa/siqa.yaml", ("siqa/dev.jsonl",), lambda d: siqa_docs(d / "siqa"),
                       optional=("siqa/dev-labels.lst",)),
}
KNOWN_TASKS = (*SPECS, "mmlu")


@dataclass
class LocalTasks:
    task_dir: Path
    available: dict[str, Path]  # task (or group) name -> its YAML
    missing: dict[str, str]  # task name -> why it is not available locally
    notes: list[str]
    no_fewshot: list[str] = field(default_factory=list)  # local task / group names without a non-test split


def check_fewshot(local: LocalTasks, tasks: Iterable[str], num_fewshot: int | None, key: str) -> None:
    """Refuse few-shot prompts for local tasks that have only their test split: lm-eval would fill the prompt
    with questions of the very split it scores."""
    from model.config import ConfigError

    shots, refused = int(num_fewshot or 0), [t for t in tasks if t in local.no_fewshot]
    if shots > 0 and refused:
        raise ConfigError(key, shots, f"local task(s) {', '.join(refused)} have no non-test split to draw "
                          "few-shot examples from (only ARC's *-Dev.jsonl and MMLU's dev/ are such files); "
                          "use 0 shots, or the hub tasks (no data_dir)")


def _write_jsonl(path: Path, docs: list[dict]):
    """Atomic write; an unchanged file is left alone (its mtime keys the HF datasets cache)."""
    text = "".join(json.dumps(doc, ensure_ascii=False) + "\n" for doc in docs)
    if path.is_file() and path.read_text(encoding="utf-8") == text:
        return
    atomic_write_text(path, text)


def _write_yaml(path: Path, config: dict):
    atomic_write_text(path, yaml.safe_dump(config, sort_keys=False, allow_unicode=True))


def _task_yaml(name: str, official: Path, data_files: dict[str, str], cache_dir: Path | None, **extra) -> dict:
    kwargs = {"data_files": data_files}
    if cache_dir is not None:
        kwargs["cache_dir"] = str(cache_dir)
    return {"include": str(official), "task": name, "dataset_path": "json", "dataset_name": None,
            "dataset_kwargs": kwargs, "training_split": None, "validation_split": None, "test_split": SPLIT,
            "fewshot_split": None, **extra}


def _write_mmlu(data_dir: Path, task_dir: Path, cache_dir: Path | None) -> tuple[Path | None, str, list[str]]:
    official_dir = official_tasks_dir() / "mmlu" / "default"
    test_dir, dev_dir = data_dir / "mmlu" / "test", data_dir / "mmlu" / "dev"
    subjects = sorted(p.name.removeprefix("mmlu_").removesuffix(".yaml") for p in official_dir.glob("mmlu_*.yaml"))
    present = [s for s in subjects if (test_dir / f"{s}_test.csv").is_file()]
    if not present:
        return None, f"no {test_dir}/<subject>_test.csv", []
    out = task_dir / "mmlu"
    out.mkdir(parents=True, exist_ok=True)
    tags: dict[str, list[str]] = {}
    no_fewshot: list[str] = []
    for subject in present:
        data = task_dir / "data" / "mmlu" / f"{subject}.jsonl"
        _write_jsonl(data, mmlu_rows(test_dir / f"{subject}_test.csv", subject))
        files = {SPLIT: str(data)}
        extra = {}
        dev = dev_dir / f"{subject}_dev.csv"
        if dev.is_file():  # the official 5-shot exemplars (first_n of dev) stay usable with --num_fewshot 5
            dev_data = task_dir / "data" / "mmlu" / f"{subject}.dev.jsonl"
            _write_jsonl(dev_data, mmlu_rows(dev, subject))
            files["dev"] = str(dev_data)
            extra["fewshot_split"] = "dev"
        official = official_dir / f"mmlu_{subject}.yaml"
        config = _task_yaml(f"mmlu_{subject}", official, files, cache_dir)
        config.update(extra)
        _write_yaml(out / f"mmlu_{subject}.yaml", config)
        tag = yaml.safe_load(official.read_text())["tag"]
        tags.setdefault(tag, []).append(subject)
        if "fewshot_split" not in extra:
            no_fewshot += [f"mmlu_{subject}", tag]
    groups, group_files = [], set()
    for group_file in sorted(official_dir.glob("_mmlu_*.yaml")):
        group = yaml.safe_load(group_file.read_text())
        group["task"] = [t for t in group["task"] if t in tags]
        if group["task"]:
            _write_yaml(out / group_file.name, group)
            group_files.add(group_file.name)
            groups.append(group["group"])
            if set(group["task"]) & set(no_fewshot):
                no_fewshot.append(group["group"])
    top = yaml.safe_load((official_dir / "_mmlu.yaml").read_text())
    top["task"] = [g for g in top["task"] if g in groups]
    _write_yaml(out / "_mmlu.yaml", top)
    written = {f"mmlu_{s}.yaml" for s in present} | group_files | {"_mmlu.yaml"}
    for stale in out.glob("*.yaml"):  # an earlier call's subject whose file is gone; removed after the writes, so a
        if stale.name not in written:  # concurrent evaluation never finds the set incomplete
            stale.unlink(missing_ok=True)
    note = "" if len(present) == len(subjects) else f"mmlu: {len(present)}/{len(subjects)} subjects found in {test_dir}"
    return out / "_mmlu.yaml", note, [*dict.fromkeys(no_fewshot), *(["mmlu"] if no_fewshot else [])]


def _fingerprint(data_dir: Path, files: list[Path]) -> str:
    h = hashlib.sha1(f"{CONVERTER_VERSION}|{data_dir.resolve()}|{official_tasks_dir()}".encode())
    for path in sorted(files):
        stat = path.stat()
        h.update(f"|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _forget(task_dir: Path, name: str):
    """Remove what an earlier call wrote for a task whose local files are gone: task_dir is on lm-eval's include
    path whenever any local task is, and a stale YAML there would shadow the hub task with the old data."""
    if name == "mmlu":
        for folder in (task_dir / "mmlu", task_dir / "data" / "mmlu"):
            shutil.rmtree(folder, ignore_errors=True)
        return
    (task_dir / f"{name}.yaml").unlink(missing_ok=True)
    for suffix in (".jsonl", ".dev.jsonl", ".fingerprint"):
        (task_dir / "data" / f"{name}{suffix}").unlink(missing_ok=True)


def write_local_tasks(data_dir: str | Path, tasks: Iterable[str], task_dir: str | Path,
                      cache_dir: str | Path | None = None) -> LocalTasks:
    """Convert the local files of `tasks`, write their YAMLs under `task_dir` (data reused while sources are unchanged).

    cache_dir: HF datasets cache for the converted files (None: the user's default HF cache).
    """
    data_dir, task_dir = Path(data_dir).resolve(), Path(task_dir).resolve()
    cache_dir = Path(cache_dir).resolve() if cache_dir is not None else None
    task_dir.mkdir(parents=True, exist_ok=True)
    official = official_tasks_dir()
    result = LocalTasks(task_dir, {}, {}, [])
    for name in tasks:
        if name == "mmlu":
            yaml_path, note, no_fewshot = _write_mmlu(data_dir, task_dir, cache_dir)
            if yaml_path is None:
                result.missing[name] = note
                _forget(task_dir, name)
            else:
                result.available[name] = yaml_path
                result.no_fewshot += no_fewshot
                if note:
                    result.notes.append(note)
            continue
        spec = SPECS.get(name)
        if spec is None:
            raise ValueError(f"no local definition for task {name!r}; local tasks: {', '.join(KNOWN_TASKS)}")
        sources = spec.source_files(data_dir)
        if sources is None:
            wanted = " or ".join("+".join(group) for group in (spec.sources, *spec.alternatives))
            result.missing[name] = f"no {wanted} under {data_dir}"
            _forget(task_dir, name)
            continue
        data, dev = task_dir / "data" / f"{name}.jsonl", task_dir / "data" / f"{name}.dev.jsonl"
        fewshot = data_dir / spec.fewshot[0] if spec.fewshot else None
        fewshot = fewshot if fewshot is not None and fewshot.is_file() else None
        optional = [p for p in (data_dir / f for f in spec.optional) if p.is_file()]
        stamp = data.with_suffix(".fingerprint")
        fingerprint = _fingerprint(data_dir, sources + optional + ([fewshot] if fewshot else []))
        if not (data.is_file() and stamp.is_file() and stamp.read_text() == fingerprint
                and (fewshot is None or dev.is_file())):
            docs = spec.docs(data_dir)
            if not docs:
                result.missing[name] = f"{', '.join(map(str, sources))} holds no examples"
                _forget(task_dir, name)
                continue
            _write_jsonl(data, docs)
            if fewshot is not None:
                _write_jsonl(dev, spec.fewshot[1](fewshot))
            atomic_write_text(stamp, fingerprint)
        files, extra = {SPLIT: str(data)}, {}
        if fewshot is not None:  # the official tasks sample from `train`, which the local layout does not have
            files["dev"], extra["fewshot_split"] = str(dev), "dev"
        else:
            result.no_fewshot.append(name)
        yaml_path = task_dir / f"{name}.yaml"
        _write_yaml(yaml_path, _task_yaml(name, official / spec.official, files, cache_dir, **extra))
        result.available[name] = yaml_path
    return result


def main(argv: list[str] | None = None):
    import argparse

    parser = argparse.ArgumentParser(description="Write lm-eval task YAMLs for local evaluation data "
                                                 "(use the folder with --include_path).")
    parser.add_argument("--data_dir", required=True, help="folder in the layout of shared/evaldata")
    parser.add_argument("--out", required=True, help="folder to write the task YAMLs and converted data into")
    parser.add_argument("--tasks", default=",".join(KNOWN_TASKS), help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    found = write_local_tasks(args.data_dir, [t for t in args.tasks.split(",") if t], args.out)
    for name, path in found.available.items():
        print(f"{name}: {path}")
    for name, why in found.missing.items():
        print(f"{name}: skipped ({why})")
    for note in found.notes:
        print(note)


if __name__ == "__main__":
    main()
