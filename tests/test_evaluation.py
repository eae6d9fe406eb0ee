"""Evaluation through lm-evaluation-harness: the "sa-lm" model, the offline task definitions, suites and CLIs.

Everything runs offline on a tiny SA checkpoint trained here (max_seq_len 64, window 8, so long inputs and SA
permutations are exercised). Evaluation data are synthetic fixtures written by these tests in the layout of
shared/evaldata (no evaluation-set text lives in the repository); when shared/evaldata exists, the task definitions
are also run on the first 20 examples of the real files.
"""

from __future__ import annotations

import bz2
import csv
import datetime
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT

REAL_EVALDATA = ROOT.parent / "shared" / "evaldata"
ALL_TASKS = ["wikitext", "lambada_openai", "lambada_standard", "piqa", "hellaswag", "winogrande", "arc_easy",
             "arc_challenge", "boolq", "openbookqa", "social_iqa", "mmlu"]


# ---------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny model's small matmuls run several times faster on one thread, above all on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def loaded(tiny_ckpt):
    from model.checkpoint import load_checkpoint

    return load_checkpoint(tiny_ckpt)


@pytest.fixture(scope="session")
def salm(loaded):
    from evaluation.lm import SALM

    return SALM(loaded=loaded, batch_size=3, device="cpu")


class Words:
    """Synthetic text from the words of Python's own pydoc pages (never evaluation-set text)."""

    def __init__(self, seed: int = 0):
        from pydoc_data.topics import topics

        self.words = sorted(set(re.findall(r"[a-z]{3,10}", " ".join(topics.values()))))
        self.rng = random.Random(seed)

    def word(self) -> str:
        return self.rng.choice(self.words)

    def sentence(self, n: int = 8) -> str:
        text = " ".join(self.word() for _ in range(n))
        return text[0].upper() + text[1:] + "."

    def passage(self, sentences: int = 3) -> str:
        return " ".join(self.sentence(self.rng.randint(4, 12)) for _ in range(sentences))


def make_truth(n: int = 6, seed: int = 0) -> dict[str, list[dict]]:
    """Documents in the schema of the HF datasets the official lm-eval tasks load (the ground truth)."""
    w = Words(seed)
    rng = w.rng
    truth: dict[str, list[dict]] = {}
    truth["lambada_openai"] = [{"text": w.passage(2) + " " + w.word()} for _ in range(n)]
    truth["lambada_standard"] = [{"text": w.passage(2) + " " + w.word(), "domain": None} for _ in range(n)]
    truth["piqa"] = [{"goal": w.sentence(6), "sol1": w.sentence(9), "sol2": w.sentence(9), "label": i % 2}
                     for i in range(n)]
    hella = []
    for i in range(n):
        if i % 3 == 2:  # WikiHow-like: tags, no ctx_b
            ctx_a, ctx_b = f"[header] How to {w.word()} a {w.word()} [title] {w.sentence(5)}", ""
        else:  # ActivityNet-like: ctx_b is the lower-case start of the next sentence
            ctx_a, ctx_b = w.passage(2), f"the {w.word()}"
        hella.append({"ind": i, "activity_label": w.word().capitalize() + " " + w.word(), "ctx_a": ctx_a,
                      "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}".strip(),
                      "endings": [w.sentence(5)[:-1].lower() + "." for _ in range(4)], "label": str(i % 4)})
    truth["hellaswag"] = hella
    truth["winogrande"] = []
    for i in range(n):
        name1, name2 = w.word().capitalize(), w.word().capitalize()
        truth["winogrande"].append({"sentence": f"{name1} {w.sentence(4)[:-1].lower()} than {name2} so _ "
                                                f"{w.sentence(5)[:-1].lower()}.", "option1": name1,
                                    "option2": name2, "answer": str(1 + i % 2)})
    for task in ("arc_easy", "arc_challenge"):
        docs = []
        for i in range(n):
            k = 5 if i == 1 else 4
            labels = [str(j + 1) for j in range(k)] if i == 2 else list("ABCDE"[:k])
            docs.append({"id": f"{task}-{i}", "question": w.sentence(7)[:-1] + "?",
                         "choices": {"text": [w.sentence(3)[:-1] for _ in range(k)], "label": labels},
                         "answerKey": labels[i % k]})
        truth[task] = docs
    truth["boolq"] = [{"question": w.sentence(6)[:-1].lower(), "passage": f"{w.word().capitalize()} -- {w.passage(2)}",
                       "idx": i, "label": i % 2} for i in range(n)]
    truth["openbookqa"] = [{"id": f"{i}-{rng.randint(1, 999)}", "question_stem": w.sentence(7)[:-1],
                            "choices": {"text": [" ".join(w.word() for _ in range(3)) for _ in range(4)],
                                        "label": list("ABCD")}, "answerKey": "ABCD"[i % 4]} for i in range(n)]
    truth["social_iqa"] = [{"context": w.passage(1), "question": f"What will {w.word()} want to do next?",
                            "answerA": w.sentence(3)[:-1], "answerB": w.sentence(3)[:-1],
                            "answerC": w.sentence(3)[:-1], "label": str(1 + i % 3)} for i in range(n)]
    truth["mmlu"] = [{"question": w.sentence(8)[:-1] + "?", "subject": subject,
                      "choices": [w.sentence(3)[:-1] for _ in range(4)], "answer": i % 4}
                     for subject in ("anatomy", "high_school_physics") for i in range(n)]
    return truth


def wiki_articles(n: int, seed: int = 1) -> list[list[str]]:
    """Articles as wiki.test.raw lines: title, sections, tokenized-style punctuation (" , ", " @-@ ")."""
    w = Words(seed)
    articles = []
    for _ in range(n):
        lines = [f" = {w.word().capitalize()} {w.word().capitalize()} = ", " "]
        for section in range(2):
            text = f" {w.sentence(6)[:-1]} , {w.word()} @-@ {w.word()} {w.sentence(5)[:-1].lower()} . "
            lines += [text, " "]
            if section == 0:
                lines += [f" = = {w.word().capitalize()} = = ", " "]
        articles.append(lines)
    return articles


def arc_rows(docs: list[dict]) -> list[dict]:
    """allenai/ai2_arc documents in the ARC-V1 jsonl layout of shared/evaldata/arc."""
    return [{"id": d["id"], "question": {"stem": d["question"], "choices": [
        {"text": t, "label": lab} for t, lab in zip(d["choices"]["text"], d["choices"]["label"])]},
        "answerKey": d["answerKey"]} for d in docs]


def write_evaldata(folder: Path, truth: dict[str, list[dict]], articles: list[list[str]]) -> Path:
    """The truth documents written in the local formats of shared/evaldata (see its README / SOURCE.md files)."""
    folder.mkdir(parents=True, exist_ok=True)

    def jsonl(path: Path, rows):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def lines(path: Path, values):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{v}\n" for v in values))

    lines(folder / "wikitext-2-raw" / "wiki.test.raw", [" "] + [line for a in articles for line in a])
    jsonl(folder / "lambada_openai" / "lambada_test.jsonl", [{"text": d["text"]} for d in truth["lambada_openai"]])
    lines(folder / "lambada_standard" / "lambada_test_plain_text.txt", [d["text"] for d in truth["lambada_standard"]])
    jsonl(folder / "piqa" / "valid.jsonl", [{k: d[k] for k in ("goal", "sol1", "sol2")} for d in truth["piqa"]])
    lines(folder / "piqa" / "valid-labels.lst", [d["label"] for d in truth["piqa"]])
    (folder / "hellaswag").mkdir(exist_ok=True)
    with bz2.open(folder / "hellaswag" / "hellaswag_val_full.txt.bz2", "wt") as f:
        for d in truth["hellaswag"]:
            f.write("\n".join([f"{d['activity_label']}: {d['ctx']}", d["label"], *d["endings"]]) + "\n")
    wino = []
    for d in truth["winogrande"]:
        blank = d["sentence"].index("_")
        wino.append({"context_options": [d["sentence"][:blank] + d["option1"], d["sentence"][:blank] + d["option2"]],
                     "continuation": d["sentence"][blank + 1:].strip(), "gold": int(d["answer"]) - 1})
    jsonl(folder / "winogrande" / "winogrande.jsonl", wino)
    lines(folder / "winogrande" / "dev-labels.lst", [d["answer"] for d in truth["winogrande"]])
    for task, name in (("arc_easy", "ARC-Easy-Test.jsonl"), ("arc_challenge", "ARC-Challenge-Test.jsonl")):
        jsonl(folder / "arc" / name, arc_rows(truth[task]))
    jsonl(folder / "boolq" / "val.jsonl", [{"question": d["question"], "passage": d["passage"], "idx": d["idx"],
                                            "label": "true" if d["label"] else "false"} for d in truth["boolq"]])
    (folder / "openbookqa").mkdir(exist_ok=True)
    with open(folder / "openbookqa" / "test.tsv", "w", newline="") as f:
        out = csv.writer(f, delimiter="\t", lineterminator="\n")
        out.writerow(["ID", "Question Stem", "Choices", "Complete Question", "Answer Key"])
        for d in truth["openbookqa"]:
            choices = " ".join(f"({lab}) {t}" for lab, t in zip(d["choices"]["label"], d["choices"]["text"]))
            out.writerow([d["id"], d["question_stem"], choices, f"{d['question_stem']} {choices}", d["answerKey"]])
    jsonl(folder / "siqa" / "dev.jsonl", [{"context": d["context"], "question": d["question"],
                                           "options": [d["answerA"], d["answerB"], d["answerC"]],
                                           "answer": d["answer" + "ABC"[int(d["label"]) - 1]],
                                           "metadata": {"task": "socialiqa"}} for d in truth["social_iqa"]])
    lines(folder / "siqa" / "dev-labels.lst", [d["label"] for d in truth["social_iqa"]])
    for subject in sorted({d["subject"] for d in truth["mmlu"]}):
        for split in ("test", "dev"):
            path = folder / "mmlu" / split / f"{subject}_{split}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            rows = [d for d in truth["mmlu"] if d["subject"] == subject][: None if split == "test" else 5]
            with open(path, "w", newline="") as f:
                out = csv.writer(f)
                out.writerow(["question", "choice0", "choice1", "choice2", "choice3", "answer"])
                out.writerows([[d["question"], *d["choices"], d["answer"]] for d in rows])
    return folder


@pytest.fixture(scope="session")
def evaldata(tmp_path_factory):
    truth = make_truth()
    articles = wiki_articles(4)
    return write_evaldata(tmp_path_factory.mktemp("evaldata"), truth, articles), truth, articles


# ---------------------------------------------------------------------------------------------- direct reference
def direct_score(model, seq: list[int], n_scored: int) -> tuple[float, bool]:
    """log p(last n_scored tokens of seq | the tokens before them): one unpadded forward pass, no batching."""
    with torch.no_grad():
        logits = model(torch.tensor([seq[:-1]]))[0].float()
    rows = torch.log_softmax(logits[len(seq) - 1 - n_scored:], dim=-1)
    target = torch.tensor(seq[-n_scored:])
    return rows.gather(1, target[:, None]).sum().item(), bool((rows.argmax(-1) == target).all())


def direct_loglikelihood(loaded, context: str, continuation: str) -> tuple[float, bool]:
    tok, L = loaded.tokenizer, loaded.model.cfg.max_seq_len
    if context:
        n_spaces = len(context) - len(context.rstrip())  # trailing spaces belong to the continuation
        context, continuation = context[: len(context) - n_spaces], context[len(context) - n_spaces:] + continuation
        ctx = tok.encode(context).ids
        whole = tok.encode(context + continuation).ids
        assert whole[: len(ctx)] == ctx, "test strings must tokenize with a clean boundary"
        cont = whole[len(ctx):]
        ctx = ctx or [loaded.eos_id]  # a context of spaces only encodes to nothing: conditioned on EOS
    else:
        ctx, cont = [loaded.eos_id], tok.encode(continuation).ids
    total, greedy = 0.0, True
    for start in range(0, len(cont), L):  # continuation pieces of at most L tokens (one piece unless very long)
        piece = cont[start: start + L]
        lp, g = direct_score(loaded.model, (ctx + cont[: start + len(piece)])[-(L + 1):], len(piece))
        total, greedy = total + lp, greedy and g
    return total, greedy


def direct_rolling(loaded, text: str) -> float:
    """Sum of log p over the whole text, EOS first, in disjoint chunks of L scored tokens, each chunk read with a
    full window of L inputs where the text allows it (lm-eval's rolling windows with context_len=1)."""
    L = loaded.model.cfg.max_seq_len
    full = [loaded.eos_id] + loaded.tokenizer.encode(text).ids
    n, total = len(full) - 1, 0.0
    for start in range(0, n, L):
        end = min(start + L, n)  # score full[start + 1 : end + 1]
        total += direct_score(loaded.model, full[max(0, end - L): end + 1], end - start)[0]
    return total


def requests(kind: str, args: list[tuple]):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=0) for a in args]


# ---------------------------------------------------------------------------------------------- the model class
def test_table_shows_extra_tasks_as_percent_only_when_they_are_accuracies():
    from evaluation.report import markdown_table

    combined = {"boolq": {"acc": {"value": 0.625, "std": 0.0}},
                "my_ppl_task": {"word_perplexity": {"value": 31.5, "std": 0.0}},
                "lambada_openai": {"acc": {"value": 0.25, "std": 0.0}}}
    row = markdown_table([("sa", combined, None)], 1, ["lambada_openai", "boolq", "my_ppl_task"]).splitlines()[-1]
    assert "| 25.0 |" in row and "| 31.50 |" in row  # LAMBADA acc in %, the extra perplexity as is


def test_a_table_row_shows_accuracies_and_their_spread_in_percent_and_averages_the_accuracy_columns():
    """The paper's row: perplexities as they are, accuracies and their seed spread in %, Avg the mean of the accuracy
    columns only (in %, its spread too), and an Avg over fewer accuracy columns than the table shows says so."""
    from evaluation.report import avg_accuracy, markdown_table

    per_task = {"wikitext": {"word_perplexity": {"value": 31.25, "std": 1.5}},
                "lambada_openai": {"perplexity": {"value": 12.5, "std": 0.25}, "acc": {"value": 0.3, "std": 0.02}},
                "piqa": {"acc": {"value": 0.625, "std": 0.01}, "acc_norm": {"value": 0.9, "std": 0.0}},
                "hellaswag": {"acc_norm": {"value": 0.275, "std": 0.005}, "acc": {"value": 0.99, "std": 0.0}}}
    avg, used = avg_accuracy(per_task)
    assert used == ["lambada_openai/acc", "piqa/acc", "hellaswag/acc_norm"] and avg == pytest.approx(0.4)
    tasks = ["wikitext", "lambada_openai", "piqa", "hellaswag"]
    lines = markdown_table([("sa (w=8)", per_task, {"value": avg, "std": 0.015, "tasks": used})], 2, tasks).splitlines()
    assert lines[0] == "| Model | Wiki ppl ↓ | LMB ppl ↓ | LMB acc ↑ | PIQA (acc) | Hella (acc_norm) | Avg ↑ |"
    assert lines[2] == "| sa (w=8) | 31.25 ± 1.50 | 12.50 ± 0.25 | 30.0 ± 2.0 | 62.5 ± 1.0 | 27.5 ± 0.5 | 40.0 ± 1.5 |"
    fewer = markdown_table([("sa", per_task, {"value": avg, "std": 0.0, "tasks": used[:2]})], 1, tasks).splitlines()
    assert fewer[2] == "| sa | 31.25 | 12.50 | 30.0 | 62.5 | 27.5 | 40.0 (2/3 tasks) |"


def test_a_loaded_tokenizer_reads_special_token_text_as_text(loaded):
    """As data.prepare encoded the training documents: a literal "<|endoftext|>" in a prompt is not the EOS."""
    from data.tokenizer import EOS

    ids = loaded.tokenizer.encode(f"the end {EOS} here").ids
    assert loaded.eos_id not in ids and EOS in loaded.tokenizer.decode(ids)


def test_sa_lm_is_registered_with_lm_eval():
    import evaluation.lm
    from lm_eval.api.registry import get_model

    assert get_model("sa-lm") is evaluation.lm.SALM
    assert get_model("dummy").__name__ == "DummyLM", "lm-eval's own models stay registered"


def test_loglikelihood_matches_direct_computation(salm, loaded):
    w = Words(3)
    long_context = " ".join(w.word() for _ in range(80))  # > 64 tokens: truncated from the left
    pairs = [("The value of the attribute is", " returned"),
             ("", "An empty context is replaced by the end-of-text token."),
             ("Trailing spaces move to the continuation ", "here"),
             ("  ", "Only spaces came before this"),  # no context token left: EOS, not the row's last slot
             (long_context, " and then"),
             (w.sentence(5), " " + w.sentence(4)),
             ("A", " " + " ".join(w.word() for _ in range(70))),  # continuation longer than the context window
             (w.passage(1), " x")]
    got = salm.loglikelihood(requests("loglikelihood", pairs))  # batch_size=3: padded batches of mixed lengths
    assert len(salm.tok_encode(long_context)) > loaded.model.cfg.max_seq_len
    for (context, continuation), (logprob, greedy) in zip(pairs, got):
        want, want_greedy = direct_loglikelihood(loaded, context, continuation)
        assert logprob == pytest.approx(want, abs=2e-4, rel=1e-5), (context[:30], continuation[:30])
        assert greedy == want_greedy
        assert logprob < 0


def test_one_token_choices_share_one_forward_and_match_direct_computation(salm, loaded, monkeypatch):
    """Multiple choice with one-token answers (MMLU, BoolQ): identical model inputs run once, scores stay exact."""
    singles = [c for c in (" x", " a", " the", " of", " is", " to", " in", " and") if len(salm.tok_encode(c)) == 1]
    assert len(singles) >= 3
    context = Words(4).sentence(6)
    pairs = [(context, c) for c in singles[:3]] + [(context, " " + Words(5).sentence(3))]
    rows_run = []
    real = salm.model.hidden_states
    monkeypatch.setattr(salm.model, "hidden_states", lambda t, n=None: rows_run.append(t.shape[0]) or real(t, n))
    got = salm.loglikelihood(requests("loglikelihood", pairs))
    assert sum(rows_run) == 2, "three one-token choices share one row, the multi-token one gets its own"
    for (ctx, cont), (logprob, greedy) in zip(pairs, got):
        want, want_greedy = direct_loglikelihood(loaded, ctx, cont)
        assert logprob == pytest.approx(want, abs=2e-4, rel=1e-5)
        assert greedy == want_greedy
    assert len({round(lp, 6) for lp, _ in got[:3]}) == 3, "different answers, different scores"


def test_a_context_is_counted_cut_from_the_first_token_it_loses(loaded):
    """A context of max_length tokens before a one-token continuation fits (the model reads max_length tokens); one
    token more is cut. Both sides of the edge, for continuations of two tokens and of more than max_length (scored
    in pieces of max_length, the first one conditioned on the context)."""
    from evaluation.lm import SALM

    lm = SALM(loaded=loaded, batch_size=2, device="cpu", max_length=8)
    for context, continuation, cut in ((8, 1, 0), (9, 1, 1), (7, 2, 0), (8, 2, 1), (1, 12, 0), (2, 12, 1)):
        lm.requests_scored = lm.contexts_cut = 0
        lm._loglikelihood_tokens([(("c", "x"), list(range(5, 5 + context)), list(range(40, 40 + continuation)))])
        assert (lm.requests_scored, lm.contexts_cut) == (1, cut), (context, continuation)


def test_a_continuation_in_pieces_is_greedy_only_if_every_piece_is_and_batches_run_longest_first(loaded,
                                                                                                    monkeypatch):
    """is_greedy of a continuation longer than max_length ANDs over its pieces (a greedy last piece does not make a
    non-greedy first one greedy); unique inputs run longest first, and results come back in request order."""
    from evaluation.lm import SALM

    lm = SALM(loaded=loaded, batch_size=1, device="cpu", max_length=2)
    context = [7]
    t0 = (int(lm._last_logits([context]).argmax()) + 1) % loaded.model.cfg.vocab_size  # not the greedy token
    t1 = 9
    t2 = int(lm._last_logits([[t0, t1]]).argmax())  # the greedy token after the last piece's input
    (_, whole), (_, last_alone) = lm._loglikelihood_tokens([(("c", "y"), context, [t0, t1, t2]),
                                                            (("c", "x"), [t0, t1], [t2])])
    assert last_alone and not whole
    widths = []
    real = lm.model.hidden_states
    monkeypatch.setattr(lm.model, "hidden_states", lambda t, n=None: widths.append(t.shape[1]) or real(t, n))
    lm = SALM(loaded=loaded, batch_size=1, device="cpu")
    reqs = [(("c", str(n)), list(range(5, 5 + n)), [40]) for n in (3, 10, 6)]
    got = lm._loglikelihood_tokens(reqs)
    assert widths == [10, 6, 3]
    assert [g for g, _ in got] == [lm._loglikelihood_tokens([r])[0][0] for r in reqs]  # in request order


def test_seeds_combine_into_their_mean_spread_and_mean_stderr():
    import statistics

    from evaluation.report import combine_seeds

    runs = [{"lambada_openai": {"acc": {"value": 0.2, "stderr": 0.01}, "perplexity": {"value": 9.0, "stderr": None}}},
            {"lambada_openai": {"acc": {"value": 0.4, "stderr": 0.03}, "perplexity": {"value": 7.0, "stderr": None}}},
            {"lambada_openai": {"acc": {"value": 0.3, "stderr": 0.02}}}]  # a metric one seed lacks
    combined = combine_seeds(runs)["lambada_openai"]
    assert combined["acc"]["value"] == pytest.approx(0.3) and combined["acc"]["stderr"] == pytest.approx(0.02)
    assert combined["acc"]["std"] == pytest.approx(statistics.stdev([0.2, 0.4, 0.3]))
    assert combined["perplexity"] == {"value": 8.0, "std": pytest.approx(2 ** 0.5), "stderr": None,
                                      "per_seed": [9.0, 7.0]}
    assert combine_seeds(runs[:1])["lambada_openai"]["acc"]["std"] == 0.0


def test_scores_do_not_depend_on_batching(loaded):
    from evaluation.lm import SALM

    pairs = [(Words(s).passage(1), " " + Words(s + 9).word()) for s in range(5)]
    one = SALM(loaded=loaded, batch_size=1, device="cpu").loglikelihood(requests("loglikelihood", pairs))
    five = SALM(loaded=loaded, batch_size=5, device="cpu").loglikelihood(requests("loglikelihood", pairs))
    for (a, _), (b, _) in zip(one, five):
        assert a == pytest.approx(b, abs=1e-4)


def test_half_precision_runs_under_autocast_and_leaves_the_model_in_fp32(loaded):
    """dtype=bfloat16 evaluates as bf16-mixed training ran (fp32 weights, autocast), and never casts the caller's
    model."""
    from evaluation.lm import SALM

    pairs = [(Words(s).passage(1), " " + Words(s + 3).word()) for s in range(3)]
    fp32 = SALM(loaded=loaded, batch_size=3, device="cpu").loglikelihood(requests("loglikelihood", pairs))
    bf16 = SALM(loaded=loaded, batch_size=3, device="cpu", dtype="bfloat16").loglikelihood(
        requests("loglikelihood", pairs))
    assert all(p.dtype == torch.float32 for p in loaded.model.parameters())
    for (a, _), (b, _) in zip(fp32, bf16):
        assert b == pytest.approx(a, rel=0.05) and b != a  # close, and not the fp32 numbers: autocast ran


def test_rolling_loglikelihood_matches_direct_computation(salm, loaded):
    w = Words(4)
    texts = [w.passage(12), w.sentence(3), w.passage(5)]  # several windows, one window, a few
    assert len(salm.tok_encode(texts[0])) > 3 * loaded.model.cfg.max_seq_len
    salm.requests_scored = salm.contexts_cut = 0
    got = salm.loglikelihood_rolling(requests("loglikelihood_rolling", [(t,) for t in texts]))
    for text, logprob in zip(texts, got):
        assert logprob == pytest.approx(direct_rolling(loaded, text), abs=5e-4, rel=1e-5)
    # its windows are never cut, and are not requests: a suite with WikiText reported "5 of 792 requests cut"
    assert salm.requests_scored == salm.contexts_cut == 0


def test_generate_until_is_greedy_and_stops(salm, loaded):
    args = [("The value of the", {"until": ["\n"], "max_gen_toks": 6}),
            ("Return the", {"until": [" the"], "max_gen_toks": 20, "do_sample": False}),
            ("Return the", {"until": ["", " the"], "max_gen_toks": 20})]  # "" would match any text: ignored
    args.append(("It was a long time ago, in the first of the", {"until": [], "max_gen_toks": 4}))  # the longest
    out = salm.generate_until(requests("generate_until", args))
    assert len(out) == 4 and all(isinstance(o, str) for o in out)
    assert " the" not in out[1] and out[2] == out[1]

    def greedy(prompt: str, until: list[str], most: int) -> str:
        """The prompt's greedy continuation alone, token by token (a batch of prompts of other lengths pads them)."""
        ids, gen = loaded.tokenizer.encode(prompt).ids, []
        for _ in range(most):
            with torch.no_grad():
                token = int(loaded.model(torch.tensor([ids + gen]))[0, -1].argmax())
            if token == loaded.eos_id:
                break
            gen.append(token)
            if any(stop and stop in loaded.tokenizer.decode(gen) for stop in until):
                break
        text = loaded.tokenizer.decode(gen)
        for stop in filter(None, until):
            text = text.split(stop)[0]
        return text

    for got, (prompt, kwargs) in zip(out, args):  # every request, not only the longest: each read its own last token
        assert got == greedy(prompt, kwargs["until"], kwargs["max_gen_toks"]), prompt


def test_generate_until_reads_lm_evals_length_aliases(salm):
    """A task's max_new_tokens was ignored: sa-lm generated up to 256 tokens where HFLM stops at N."""
    lengths = [{"max_gen_toks": 3}, {"max_new_tokens": 3}, {"max_tokens": 3}, {"max_completion_tokens": 3},
               {"max_gen_toks": 3, "max_new_tokens": 50}, {"max_gen_toks": 50}]  # lm-eval's priority: max_gen_toks
    out = salm.generate_until(requests("generate_until", [("The value of the", {"until": [], **n}) for n in lengths]))
    assert out[0] and out[1:5] == [out[0]] * 4
    assert out[5].startswith(out[0]) and out[5] != out[0]


def test_model_args_from_the_lm_eval_command_line(tiny_ckpt):
    from lm_eval.api.registry import get_model

    lm = get_model("sa-lm").create_from_arg_string(f"checkpoint={tiny_ckpt.parent.parent},window=4,eval_seed=7",
                                                   {"batch_size": 2, "device": "cuda"})
    assert lm.model.attn_cfg.window == 4 and lm.eval_seed == 7 and lm.batch_size == 2
    assert str(lm.device) == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="max_length"):
        get_model("sa-lm").create_from_arg_string(f"checkpoint={tiny_ckpt},max_length=0")
    longer = get_model("sa-lm").create_from_arg_string(f"checkpoint={tiny_ckpt},max_length=1000")
    assert longer.max_length == longer.model.cfg.max_seq_len == 1000  # past the trained context: RoPE extrapolates
    assert longer.loaded.identity()["trained_context"] == lm.loaded.identity()["trained_context"] < 1000


# ---------------------------------------------------------------------------------------------- local tasks
def test_wikitext_pages_split_like_document_level_wikitext(evaldata):
    from evaluation.local_tasks import wikitext_pages

    folder, _, articles = evaldata
    pages = [d["page"] for d in wikitext_pages((folder / "wikitext-2-raw" / "wiki.test.raw").read_text())]
    want = ["\n".join(a) for a in articles[:-1]] + ["\n".join(articles[-1] + [""])]
    assert pages == want


def _requests_of(task) -> list[tuple]:
    task.build_all_requests(limit=None, rank=0, world_size=1)
    return [(inst.doc_id, inst.idx, inst.args, str(task.doc_to_target(inst.doc))) for inst in task.instances]


def _official_task(task: str, docs: list[dict], folder: Path, tm):
    """The official lm-eval task (its own YAML, functions and all) reading the truth documents."""
    from lm_eval.tasks._yaml_loader import load_yaml

    from evaluation.local_tasks import SPECS, official_tasks_dir

    official = (official_tasks_dir() / "mmlu" / "default" / f"{task}.yaml" if task.startswith("mmlu_")
                else official_tasks_dir() / SPECS[task].official)
    path = folder / f"{task}.jsonl"
    path.write_text("".join(json.dumps(d) + "\n" for d in docs))
    config = load_yaml(official)
    config.update(task=f"official_{task}", dataset_path="json", dataset_name=None, training_split=None,
                  validation_split=None, test_split="test", fewshot_split=None,
                  dataset_kwargs={"data_files": {"test": str(path)}, "cache_dir": str(folder / "hf")})
    config.pop("tag", None)
    return tm.load([config])["tasks"][f"official_{task}"]


def test_local_tasks_build_the_official_requests(evaldata, tmp_path):
    """Local files -> our converters -> lm-eval requests == the official task config on the original documents."""
    from lm_eval.tasks import TaskManager

    from evaluation.local_tasks import write_local_tasks

    folder, truth, _ = evaldata
    local = write_local_tasks(folder, ALL_TASKS, tmp_path / "tasks", cache_dir=tmp_path / "hf")
    assert not local.missing and set(local.available) == set(ALL_TASKS)
    assert local.notes == ["mmlu: 2/57 subjects found in " + str(folder.resolve() / "mmlu" / "test")]
    tm = TaskManager(include_path=str(local.task_dir), include_defaults=False)
    loaded = tm.load([t for t in ALL_TASKS if t not in ("wikitext", "mmlu")] + ["mmlu_anatomy"])["tasks"]
    official_tm = TaskManager(include_defaults=False)
    for task, ours in loaded.items():
        docs = truth["mmlu"][:6] if task == "mmlu_anatomy" else truth[task]
        official = _official_task(task, docs, tmp_path, official_tm)
        assert _requests_of(ours) == _requests_of(official), task
        assert len(ours.eval_docs) == len(docs)


def test_every_local_task_scores_a_few_examples(salm, evaldata, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from evaluation.local_tasks import write_local_tasks
    from evaluation.report import METRICS, extract

    folder, _, _ = evaldata
    local = write_local_tasks(folder, ALL_TASKS, tmp_path / "tasks", cache_dir=tmp_path / "hf")
    tm = TaskManager(include_path=str(local.task_dir), include_defaults=False)
    results = lm_eval.simple_evaluate(model=salm, tasks=ALL_TASKS, task_manager=tm, limit=3, bootstrap_iters=0)
    got = extract(results, ALL_TASKS)
    for task in ALL_TASKS:
        for metric in METRICS[task]:
            value = got[task][metric]["value"]
            assert value is not None and math.isfinite(value), (task, metric)
            if metric.startswith("acc"):
                assert 0.0 <= value <= 1.0
    assert results["n-samples"]["piqa"]["effective"] == 3


def test_local_few_shot_examples_come_from_a_dev_file_never_from_the_test_split(evaldata, tmp_path):
    from lm_eval.tasks import TaskManager

    from evaluation.local_tasks import write_local_tasks

    folder = shutil.copytree(evaldata[0], tmp_path / "evaldata")
    dev = make_truth(seed=9)["arc_easy"]
    (folder / "arc" / "ARC-Easy-Dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in arc_rows(dev)))
    local = write_local_tasks(folder, ["arc_easy", "arc_challenge", "piqa"], tmp_path / "tasks",
                              cache_dir=tmp_path / "hf")
    task = TaskManager(include_path=str(local.task_dir), include_defaults=False).load(["arc_easy"])["tasks"]["arc_easy"]
    task.set_config(key="num_fewshot", value=3)
    task.build_all_requests(limit=None, rank=0, world_size=1)
    dev_questions = {d["question"] for d in dev}
    for inst in task.instances:
        *shots, _ = inst.args[0].split("\n\n")  # "Question: <q>\nAnswer: <a>" blocks, then the scored question
        assert len(shots) == 3 and {shot.split("\n")[0].removeprefix("Question: ") for shot in shots} <= dev_questions
    assert local.no_fewshot == ["arc_challenge", "piqa"]  # no ARC-Challenge-Dev.jsonl here


def test_siqa_conversion_follows_its_labels_file(evaldata, tmp_path):
    import shutil

    from evaluation.local_tasks import write_local_tasks

    folder = tmp_path / "evaldata"
    shutil.copytree(evaldata[0] / "siqa", folder / "siqa")
    labels = folder / "siqa" / "dev-labels.lst"

    def converted() -> list[str]:
        local = write_local_tasks(folder, ["social_iqa"], tmp_path / "tasks")
        return [json.loads(line)["label"] for line in (local.task_dir / "data" / "social_iqa.jsonl").open()]

    before = converted()
    after = [str(1 + int(label) % 3) for label in before]
    mtime = labels.stat().st_mtime_ns + 10**9  # a later edit, whatever the granularity of the file clock
    labels.write_text("".join(f"{label}\n" for label in after))  # same size: only the mtime tells
    os.utime(labels, ns=(mtime, mtime))
    assert converted() == after != before


def test_the_alternative_local_layouts_convert_to_the_same_documents(evaldata, tmp_path):
    """shared/evaldata's other layouts: OpenBookQA as llm-foundry's openbook_qa.jsonl ({"query", "choices", "gold"}
    with gold 0-based, answerKey a letter), SIQA without dev-labels.lst (the label is the 1-based index of the answer
    text among the options), LAMBADA standard as lambada_test.jsonl. Each must give the documents of the main layout
    (an off-by-one label scores every item against the wrong choice, silently)."""
    from evaluation.local_tasks import write_local_tasks

    _, truth, _ = evaldata
    folder = tmp_path / "evaldata"
    for sub in ("openbookqa", "siqa", "lambada_standard"):
        (folder / sub).mkdir(parents=True)
    obqa = [{"query": d["question_stem"], "choices": d["choices"]["text"], "gold": "ABCD".index(d["answerKey"])}
            for d in truth["openbookqa"]]
    (folder / "openbookqa" / "openbook_qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in obqa))
    siqa = [{"context": d["context"], "question": d["question"], "options": [d["answerA"], d["answerB"], d["answerC"]],
             "answer": d["answer" + "ABC"[int(d["label"]) - 1]]} for d in truth["social_iqa"]]
    (folder / "siqa" / "dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in siqa))
    lambada = [{"text": d["text"]} for d in truth["lambada_standard"]]
    (folder / "lambada_standard" / "lambada_test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lambada))
    tasks = ["openbookqa", "social_iqa", "lambada_standard"]
    local = write_local_tasks(folder, tasks, tmp_path / "tasks")
    assert set(local.available) == set(tasks), local.missing
    got = {t: [json.loads(line) for line in (local.task_dir / "data" / f"{t}.jsonl").open()] for t in tasks}
    assert [{k: v for k, v in d.items() if k != "id"} for d in got["openbookqa"]] == [
        {k: v for k, v in d.items() if k != "id"} for d in truth["openbookqa"]]
    assert got["social_iqa"] == truth["social_iqa"]
    assert got["lambada_standard"] == truth["lambada_standard"]


@pytest.mark.parametrize("final_newline", [True, False])
def test_hellaswag_reads_every_item_whether_or_not_the_file_ends_in_a_newline(tmp_path, final_newline):
    """The bz2 layout is 6 lines per item; a file without a newline after its last ending still holds that item (a
    loop bound one line too short drops it, silently scoring one example fewer)."""
    from evaluation.local_tasks import hellaswag_docs

    truth = make_truth(n=5, seed=3)["hellaswag"]
    text = "\n".join("\n".join([f"{d['activity_label']}: {d['ctx']}", d["label"], *d["endings"]]) for d in truth)
    path = tmp_path / "hellaswag.txt.bz2"
    with bz2.open(path, "wt") as f:
        f.write(text + ("\n" if final_newline else ""))
    docs = hellaswag_docs(path)
    assert [(d["ind"], d["ctx"], d["endings"], d["label"]) for d in docs] == [
        (d["ind"], d["ctx"], d["endings"], d["label"]) for d in truth]


def test_winogrande_blanks_at_the_start_and_options_with_a_common_prefix(tmp_path):
    """lm-eval scores sentence[:blank] + option, then sentence[blank + 1:]: for every llm-foundry row that must
    rebuild its two contexts exactly, also where the blank opens the sentence (no space before it to back off to)
    and where the two options share their first letters."""
    from evaluation.local_tasks import winogrande_docs

    rows = [{"context_options": ["Jane", "James"], "continuation": "was late again.", "gold": 1},
            {"context_options": ["The cup broke the table", "The cup broke the tablet"], "continuation": "fell.",
             "gold": 0},
            {"context_options": ["Mr. Smith told Mr. Smithers", "Mr. Smith told Mr. Jones"],
             "continuation": "was wrong.", "gold": 0}]
    for row, doc in zip(rows, winogrande_docs(rows)):
        blank = doc["sentence"].index("_")
        assert [doc["sentence"][:blank] + doc[o] for o in ("option1", "option2")] == row["context_options"]
        assert doc["sentence"][blank + 1 :].strip() == row["continuation"]
        assert doc["answer"] == str(row["gold"] + 1)


def test_mmlu_without_its_dev_files_refuses_few_shot_and_with_them_allows_it(evaldata, tmp_path):
    """MMLU's few-shot exemplars come from dev/<subject>_dev.csv: with every dev file there, neither MMLU nor any of
    its subjects or groups is listed in no_fewshot; a subject whose dev file is gone lists the subject, its tag,
    the groups holding it and mmlu, and check_fewshot then refuses shots for each of those names."""
    from evaluation.local_tasks import check_fewshot, write_local_tasks
    from model.config import ConfigError

    folder = shutil.copytree(evaldata[0], tmp_path / "evaldata")
    local = write_local_tasks(folder, ["mmlu"], tmp_path / "tasks")
    assert local.no_fewshot == []
    check_fewshot(local, ["mmlu", "mmlu_anatomy"], 5, "eval.num_fewshot")
    (folder / "mmlu" / "dev" / "anatomy_dev.csv").unlink()
    local = write_local_tasks(folder, ["mmlu"], tmp_path / "tasks")
    assert "mmlu_anatomy" in local.no_fewshot and "mmlu" in local.no_fewshot
    assert "mmlu_high_school_physics" not in local.no_fewshot
    for name in ("mmlu", "mmlu_anatomy"):
        with pytest.raises(ConfigError, match="no non-test split"):
            check_fewshot(local, [name], 5, "eval.num_fewshot")
    check_fewshot(local, ["mmlu_high_school_physics"], 5, "eval.num_fewshot")
    check_fewshot(local, ["mmlu"], 0, "eval.num_fewshot")


def test_a_task_whose_local_files_are_gone_leaves_no_yaml_behind(evaldata, tmp_path):
    """The task folder is on lm-eval's include path whenever any local task is: a YAML kept from an earlier call
    would shadow the hub task with the old converted data (and be reported as the hub)."""
    import shutil

    from lm_eval.tasks import TaskManager

    from evaluation.local_tasks import write_local_tasks

    folder = shutil.copytree(evaldata[0], tmp_path / "evaldata")
    tasks = ["piqa", "arc_easy", "mmlu"]
    before = write_local_tasks(folder, tasks, tmp_path / "tasks")
    assert set(before.available) == set(tasks) and (tmp_path / "tasks" / "mmlu" / "mmlu_anatomy.yaml").is_file()
    shutil.rmtree(folder / "piqa")
    kept = sorted((folder / "mmlu" / "test").glob("*_test.csv"))
    kept[0].unlink()  # one subject of the two gone
    after = write_local_tasks(folder, tasks, tmp_path / "tasks")
    assert set(after.available) == {"arc_easy", "mmlu"} and "piqa" in after.missing
    assert not list((tmp_path / "tasks").rglob("piqa*"))
    gone = "mmlu_" + kept[0].name.removesuffix("_test.csv")
    assert not (tmp_path / "tasks" / "mmlu" / f"{gone}.yaml").is_file()
    index = TaskManager(include_path=str(after.task_dir), include_defaults=False).all_tasks
    assert "arc_easy" in index and "piqa" not in index and gone not in index
    shutil.rmtree(folder / "mmlu")
    assert "mmlu" in write_local_tasks(folder, tasks, tmp_path / "tasks").missing
    assert not (tmp_path / "tasks" / "mmlu").exists()


def _local_lm_eval(salm, folder: Path, tasks: list[str], tmp_path: Path, limit=None) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from evaluation.local_tasks import write_local_tasks

    local = write_local_tasks(folder, tasks, tmp_path / "tasks", cache_dir=tmp_path / "hf")
    tm = TaskManager(include_path=str(local.task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=salm, tasks=tasks, task_manager=tm, limit=limit, bootstrap_iters=0)


def test_wikitext_and_lambada_through_lm_eval_equal_a_direct_implementation(salm, loaded, tmp_path):
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    truth = make_truth(n=50, seed=5)
    articles = wiki_articles(50, seed=6)
    folder = write_evaldata(tmp_path / "evaldata", truth, articles)
    results = _local_lm_eval(salm, folder, ["wikitext", "lambada_openai"], tmp_path)["results"]

    pages = ["\n".join(a) for a in articles[:-1]] + ["\n".join(articles[-1] + [""])]
    logprob = sum(direct_rolling(loaded, wikitext_detokenizer({"page": p})) for p in pages)
    words = sum(len(re.split(r"\s+", p)) for p in pages)
    n_bytes = sum(len(p.encode()) for p in pages)
    wiki = results["wikitext"]
    assert wiki["word_perplexity,none"] == pytest.approx(math.exp(-logprob / words), rel=1e-4)
    assert wiki["byte_perplexity,none"] == pytest.approx(math.exp(-logprob / n_bytes), rel=1e-4)
    assert wiki["bits_per_byte,none"] == pytest.approx(-logprob / n_bytes / math.log(2), rel=1e-4)

    scores = []
    for doc in truth["lambada_openai"]:
        context, target = doc["text"].rsplit(" ", 1)
        scores.append(direct_loglikelihood(loaded, context, " " + target))
    lmb = results["lambada_openai"]
    assert lmb["perplexity,none"] == pytest.approx(math.exp(-sum(s for s, _ in scores) / len(scores)), rel=1e-4)
    assert lmb["acc,none"] == pytest.approx(sum(g for _, g in scores) / len(scores))


def head_copy(src: Path, dst: Path, n: int, mmlu_subjects: int = 3) -> Path:
    """The first n examples of every file of an evaldata folder, in the same formats (n articles of WikiText)."""
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = path.relative_to(src)
        if rel.parts[0] in ("pretrain_gutenberg", "wikitext-2") or path.suffix == ".md":
            continue
        out = dst / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        if path.name == "wiki.test.raw":
            lines, kept, articles = path.read_text(encoding="utf-8").split("\n"), [], 0
            for line in lines:
                articles += bool(re.fullmatch(r" = [^=].* = ", line))
                if articles > n:
                    break
                kept.append(line)
            out.write_text("\n".join(kept) + "\n", encoding="utf-8")
        elif path.suffix == ".bz2":
            with bz2.open(path, "rt", encoding="utf-8") as f:
                head = [next(f) for _ in range(6 * n)]
            with bz2.open(out, "wt", encoding="utf-8") as f:
                f.writelines(head)
        elif path.suffix == ".csv":
            if rel.parts[0] == "mmlu" and sorted(path.parent.iterdir()).index(path) >= mmlu_subjects:
                continue
            with open(path, encoding="utf-8", newline="") as f:
                rows = list(csv.reader(f))[: n + 1]
            with open(out, "w", encoding="utf-8", newline="") as f:
                csv.writer(f).writerows(rows)
        else:  # jsonl, lst, tsv (one example per line; tsv with a header)
            with open(path, encoding="utf-8") as f:
                head = [line for _, line in zip(range(n + (path.suffix == ".tsv")), f)]
            out.write_text("".join(head), encoding="utf-8")
    return dst


@pytest.mark.skipif(not REAL_EVALDATA.is_dir(), reason=f"{REAL_EVALDATA} not present")
def test_local_tasks_on_the_real_evaldata(loaded, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    from evaluation.lm import SALM
    from evaluation.local_tasks import SPECS, write_local_tasks
    from evaluation.report import METRICS, extract

    # Every converter reads the whole real file (the example counts of the SOURCE.md files) ...
    sizes = {"wikitext": 62, "lambada_openai": 5153, "piqa": 1838, "hellaswag": 10042, "winogrande": 1267,
             "arc_easy": 2376, "arc_challenge": 1172, "boolq": 3270, "openbookqa": 500, "social_iqa": 1954}
    for task, size in sizes.items():
        assert len(SPECS[task].docs(REAL_EVALDATA)) == size, task
    # ... and lm-eval scores the first 20 examples of each (WikiText: articles; MMLU: of 3 subjects).
    folder = head_copy(REAL_EVALDATA, tmp_path / "evaldata", 20)
    local = write_local_tasks(folder, ALL_TASKS, tmp_path / "tasks", cache_dir=tmp_path / "hf")
    present = [t for t in ALL_TASKS if t in local.available]
    assert set(ALL_TASKS) - set(present) <= {"lambada_standard"}, local.missing  # lambada_standard: not in the copy
    assert {"arc_easy", "arc_challenge", "mmlu"}.isdisjoint(local.no_fewshot)  # few-shot from ARC's Dev, MMLU's dev
    tm = TaskManager(include_path=str(local.task_dir), include_defaults=False)
    lm = SALM(loaded=loaded, batch_size=32, device="cpu")
    results = lm_eval.simple_evaluate(model=lm, tasks=present, task_manager=tm, limit=20, bootstrap_iters=0)
    got = extract(results, present)
    for task in present:
        for metric in METRICS[task]:
            assert got[task][metric]["value"] is not None and math.isfinite(got[task][metric]["value"]), task
        if task != "mmlu":
            assert results["n-samples"][task]["effective"] == 20, task
    assert results["n-samples"]["mmlu_anatomy"]["effective"] == 20


# ---------------------------------------------------------------------------------------------- suites, CLIs
def test_evaluate_checkpoint_writes_json_and_table_with_seed_spread(tiny_ckpt, evaldata, tmp_path, capsys):
    from evaluation import evaluate_checkpoint

    folder, _, _ = evaldata
    cfg = {"name": "paper", "tasks": ["wikitext", "lambada_openai", "lambada_standard", "piqa", "hellaswag"],
           "data_dir": str(folder), "limit": 4, "num_seeds": 2, "batch_size": 4, "device": "cpu",
           "task_dir": str(tmp_path / "tasks")}
    summary = evaluate_checkpoint(tiny_ckpt, cfg, {"window": 4}, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["seeds"] == [0, 1] and saved["attention"]["window"] == 4 and saved["attention"]["kind"] == "sa"
    assert saved["lm_eval_version"] and saved["dtype"] == "float32" and saved["batch_size"] == 4
    assert saved["num_fewshot"] == 0  # read from lm-eval's task configs, which say what ran
    assert saved["checkpoint"] == str(tiny_ckpt)
    # which file was scored, and at which attention it was trained: tools.runs tells stale and window-swept results
    assert saved["checkpoint_step"] == 12 and saved["checkpoint_mtime_ns"] == tiny_ckpt.stat().st_mtime_ns
    assert saved["checkpoint_attempt"] == torch.load(tiny_ckpt, weights_only=True, mmap=True)["attempt"]
    assert saved["trained_attention"] == {"kind": "sa", "window": 8, "eval_seed": 0}
    rows = {(r["task"], r["metric"]): r for r in saved["results"]}
    assert {("wikitext", "word_perplexity"), ("lambada_openai", "acc"), ("hellaswag", "acc_norm")} <= set(rows)
    assert len(rows[("lambada_openai", "perplexity")]["per_seed"]) == 2
    assert rows[("lambada_openai", "perplexity")]["std"] > 0, "SA seeds give different permutations"
    table = (tmp_path / "out" / "results.md").read_text()
    assert table.splitlines()[0].startswith("| Model | Wiki ppl ↓ | LMB ppl ↓ | LMB acc ↑ |")
    assert "Avg ↑" in table.splitlines()[0] and "±" in table
    assert "| sa (w=4) [trained sa (w=8)] |" in table  # scored at another window than it was trained with
    assert ", 0-shot, float32," in table
    assert (tmp_path / "out" / "lm_eval" / "seed1.json").is_file()
    assert summary["avg_acc"]["tasks"] == ["lambada_openai/acc", "lambada_standard/acc", "piqa/acc",
                                           "hellaswag/acc_norm"]
    assert "tasks)" not in table  # every accuracy column is in the average
    assert "eval: window 4 (trained with 8" in capsys.readouterr().err
    # again into the same folder with one seed: seed1.json of the first run went on beside a results.json of seed 0
    evaluate_checkpoint(tiny_ckpt, dict(cfg, tasks=["lambada_openai"], num_seeds=1), {"window": 4}, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out" / "lm_eval").iterdir()) == ["seed0.json"]


def test_evaluate_checkpoint_runs_the_shots_asked_for(tiny_ckpt, evaldata, tmp_path):
    from evaluation import evaluate_checkpoint
    from model.config import ConfigError

    folder = shutil.copytree(evaldata[0], tmp_path / "evaldata")
    (folder / "arc" / "ARC-Easy-Dev.jsonl").write_text("".join(json.dumps(r) + "\n" for r in
                                                             arc_rows(make_truth(seed=9)["arc_easy"])))
    cfg = {"tasks": ["arc_easy"], "data_dir": str(folder), "limit": 3, "num_fewshot": 2, "device": "cpu",
           "task_dir": str(tmp_path / "tasks")}
    summary = evaluate_checkpoint(tiny_ckpt, cfg, None, tmp_path / "out")
    raw = json.loads((tmp_path / "out" / "lm_eval" / "seed0.json").read_text())
    assert raw["configs"]["arc_easy"]["num_fewshot"] == 2 and summary["num_fewshot"] == 2  # what lm-eval ran
    assert ", 2-shot, " in summary["table"]
    # the prompts cut to the tiny model's context are counted: zero-shot fits, two shots do not
    zero = evaluate_checkpoint(tiny_ckpt, dict(cfg, num_fewshot=0), None, tmp_path / "zero")
    total = sum(len(r["choices"]["text"]) for r in make_truth()["arc_easy"][:3])  # 4 + 5 + 4
    assert zero["contexts_cut"] is None and summary["contexts_cut"] == {"requests": total, "of": total}
    assert f"Contexts cut to 64 tokens: {total} of {total} requests." in summary["table"]
    assert "(2-shot prompts lose their first examples)" in " ".join(summary["notes"])
    with pytest.raises(ConfigError, match="no non-test split") as err:  # PIQA's examples would be its test questions
        evaluate_checkpoint(tiny_ckpt, dict(cfg, tasks=["piqa"]), None, tmp_path / "refused")
    assert err.value.key == "eval.num_fewshot"


def test_unreachable_data_is_one_line_and_not_an_error(tiny_ckpt, evaldata, tmp_path, capsys):
    from evaluation import evaluate_checkpoint

    folder, _, _ = evaldata
    partial = tmp_path / "partial"
    (partial / "lambada_openai").mkdir(parents=True)
    (partial / "lambada_openai" / "lambada_test.jsonl").write_text(
        (folder / "lambada_openai" / "lambada_test.jsonl").read_text())
    cfg = {"tasks": ["lambada_openai", "lambada_standard", "piqa"], "data_dir": str(partial), "limit": 3,
           "task_dir": str(tmp_path / "tasks")}
    summary = evaluate_checkpoint(tiny_ckpt, cfg, None, tmp_path / "out")
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eval: skipping")]
    assert len(err) == 1 and "lambada_standard" in err[0] and "piqa" in err[0] and "fix:" in err[0]
    assert set(summary["skipped"]) == {"lambada_standard", "piqa"}
    assert summary["by_task"]["lambada_openai"]["acc"]["value"] is not None
    assert "(1/3 tasks)" in summary["table"]  # Avg over LAMBADA alone is not the suite's Avg: the table says so
    # No data at all: still no exception, an empty result.
    nothing = evaluate_checkpoint(tiny_ckpt, {"tasks": ["piqa"], "data_dir": None}, None, tmp_path / "none")
    assert nothing["results"] == [] and "piqa" in nothing["skipped"]


def test_wikitext_past_the_trained_context(tiny_ckpt, evaldata, tmp_path, capsys):
    from evaluation import evaluate_checkpoint

    trained = int(torch.load(tiny_ckpt, weights_only=True)["hyper_parameters"]["model"]["max_seq_len"])
    cfg = {"tasks": ["wikitext"], "data_dir": str(evaldata[0]), "limit": 2, "device": "cpu", "batch_size": 2,
           "task_dir": str(tmp_path / "tasks"), "max_length": 2 * trained}
    summary = evaluate_checkpoint(tiny_ckpt, cfg, None, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["max_length"] == 2 * trained and saved["trained_context"] == trained
    assert f"[context {2 * trained}]" in summary["table"]
    assert "Suite `custom` (wikitext) on" in summary["table"]  # the tasks that ran are named
    assert f"context {2 * trained} tokens (trained with {trained}; RoPE past it" in capsys.readouterr().err
    assert summary["by_task"]["wikitext"]["word_perplexity"]["value"] > 1


def test_a_window_that_covers_the_context_is_noted_as_full_attention(tiny_ckpt, evaldata, tmp_path, capsys):
    from evaluation import evaluate_checkpoint

    trained = int(torch.load(tiny_ckpt, weights_only=True)["hyper_parameters"]["model"]["max_seq_len"])
    cfg = {"tasks": ["wikitext"], "data_dir": str(evaldata[0]), "limit": 1, "device": "cpu", "batch_size": 2,
           "task_dir": str(tmp_path / "tasks")}
    summary = evaluate_checkpoint(tiny_ckpt, {**cfg, "num_seeds": 2}, {"window": 2 * trained - 1},
                                  tmp_path / "out")  # SA's band spans it all: any pi gives the same scores
    err = capsys.readouterr().err
    assert f"window {2 * trained - 1} at context {trained}: every query sees every earlier token, so sa scores as " \
        "full causal attention here" in err
    assert "attention kind=sa is deterministic at this window: 1 seed instead of 2" in err
    assert summary["seeds"] == [0]
    evaluate_checkpoint(tiny_ckpt, cfg, {"window": 2 * trained - 2}, tmp_path / "out2")
    assert "every query sees every earlier token" not in capsys.readouterr().err


def test_a_task_string_is_a_comma_separated_list(loaded, evaldata, tmp_path):
    """eval.tasks=lambada_openai on the command line arrives as a string, not as a list of its letters."""
    from evaluation import evaluate_checkpoint

    cfg = {"tasks": "lambada_openai, piqa", "data_dir": str(evaldata[0]), "limit": 2, "device": "cpu",
           "task_dir": str(tmp_path / "tasks")}
    summary = evaluate_checkpoint(None, cfg, None, tmp_path / "out", loaded=loaded)
    assert set(summary["by_task"]) == {"lambada_openai", "piqa"} and not summary["skipped"]


def test_a_misspelled_task_is_refused_before_the_model_loads(evaldata, tmp_path):
    from evaluation import evaluate_checkpoint
    from evaluation.runner import plan_tasks
    from model.config import ConfigError

    cfg = {"tasks": ["hellaswg", "piqa"], "data_dir": str(evaldata[0]), "task_dir": str(tmp_path / "tasks")}
    with pytest.raises(ConfigError, match=r"unknown task 'hellaswg'; did you mean 'hellaswag'\?") as err:
        evaluate_checkpoint(tmp_path / "no.ckpt", cfg, None, tmp_path / "out")  # no checkpoint: it never loads
    assert err.value.key == "eval.tasks"
    with pytest.raises(ConfigError, match=r"unknown task 'siqa'; did you mean 'social_iqa'\?"):  # evaldata's folder
        evaluate_checkpoint(tmp_path / "no.ckpt", dict(cfg, tasks=["siqa"]), None, tmp_path / "out")
    # Names that are all local ones need no index of lm-eval's ~14k tasks (~14 s).
    assert len(plan_tasks(["hellaswag", "piqa"], evaldata[0], tmp_path / "tasks").task_manager.all_tasks) < 5


def test_lm_evals_notes_on_default_metric_settings_are_quiet(evaldata, tmp_path, caplog):
    """wikitext's official YAML names its perplexities without aggregation or direction: six warnings at every
    evaluation that meant the registry's defaults; other warnings of the same logger still show."""
    import logging

    from evaluation.runner import plan_tasks

    plan_tasks(["wikitext"], evaldata[0], tmp_path / "tasks")
    task_log = logging.getLogger("lm_eval.api.task")
    with caplog.at_level(logging.WARNING, logger="lm_eval.api.task"):
        task_log.warning("[Task: wikitext] metric bits_per_byte is defined, but aggregation is not. using default")
        task_log.warning("[Task: wikitext] metric bits_per_byte is defined, but higher_is_better is not. using default")
        task_log.warning("[Task: wikitext] something else")
    assert [r.getMessage() for r in caplog.records] == ["[Task: wikitext] something else"]


def _run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
           "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_evaluate_py_on_a_run_directory(tiny_ckpt, evaldata, tmp_path):
    """Also: `attention=swa` (a preset) on an SA run trained at w=8 scored SWA at the preset's w=32; the run keeps
    its own window unless attention.window is given."""
    folder, _, _ = evaldata
    run_dir = tiny_ckpt.parent.parent
    proc = _run([str(ROOT / "evaluate.py"), f"ckpt={run_dir}", "eval=quick", f"eval.data_dir={folder}",
                 "eval.limit=3", f"paths.cache_dir={tmp_path / 'cache'}", "attention=swa", "attention.backend=torch"],
                tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| Model | Wiki ppl ↓ | LMB ppl ↓ | LMB acc ↑ |" in proc.stdout
    assert list((tmp_path / "cache" / "eval_tasks").glob("*/wikitext.yaml"))  # converted where train.py puts them
    [out] = sorted((run_dir / "eval").glob("quick-*"))
    assert re.fullmatch(r"quick-swa-[\d_-]+", out.name), out.name
    saved = json.loads((out / "results.json").read_text())
    assert saved["attention"]["backend"] == "torch" and saved["limit"] == 3
    assert saved["attention"]["kind"] == "swa" and saved["attention"]["window"] == 8
    assert (out / ".hydra" / "config.yaml").is_file()
    log = (out / "evaluate.log").read_text()  # the job's record: its notes and its table (it stayed empty)
    assert "eval: " in log and "| Model | Wiki ppl ↓ | LMB ppl ↓ | LMB acc ↑ |" in log
    # launched outside a git checkout: lm-eval's git_hash is this code's commit, and git printed no "fatal:"
    from tools.runlog import code_revision

    assert json.loads((out / "lm_eval" / "seed0.json").read_text())["git_hash"] == code_revision()
    assert "fatal:" not in proc.stderr


def test_results_of_any_checkpoint_file_go_to_its_run(tmp_path):
    from analysis.probe_eval import run_dir_of as probe_run_dir
    from evaluate import run_dir_of

    run = tmp_path / "run"
    (run / "checkpoints" / "weights").mkdir(parents=True)
    (run / "config.yaml").write_text("seed: 0\n")
    for name in ("checkpoints/last.ckpt", "checkpoints/weights/step0000004.pt"):
        (run / name).write_bytes(b"")
        assert run_dir_of(run / name) == run and probe_run_dir(run / name) == run, name
    assert run_dir_of(run) == run


def test_sample_py_prints_seeded_samples_and_writes_nothing(tiny_ckpt, tmp_path):
    args = [str(ROOT / "sample.py"), f"ckpt={tiny_ckpt.parent.parent}", "prompt=The value of", "num_samples=2",
            "max_new_tokens=12", "attention.window=4"]
    first, again = _run(args, tmp_path), _run(args, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout == again.stdout and first.stdout.count("--- sample ") == 2
    assert first.stdout.split("--- sample 2 of 2\n")[1].startswith("The value of")
    assert list(tmp_path.iterdir()) == []  # no .hydra folder, no log file
    bad = _run(args + ["top_p=1.5"], tmp_path)
    assert bad.returncode == 2 and "top_p=1.5" in bad.stderr
    from omegaconf import OmegaConf

    from model.config import ConfigError
    from sample import check_sample_config

    for temperature in ("nan", "inf"):  # nan crashed inside sampling, inf drew uniformly from the vocabulary
        cfg = OmegaConf.load(ROOT / "conf" / "sample.yaml")
        cfg.ckpt, cfg.temperature = str(tiny_ckpt), float(temperature)  # as Hydra parses temperature=nan
        with pytest.raises(ConfigError, match="temperature"):
            check_sample_config(cfg)
    for key, value, says in (("prompt", 123, "quote"), ("prompt", True, "quote"), ("device", "gpu0", "cuda:<index>"),
                             ("device", "mps", "cuda:<index>"),
                             *([("device", "cuda", "CUDA is not available")] if not torch.cuda.is_available() else [])):
        cfg = OmegaConf.load(ROOT / "conf" / "sample.yaml")  # each a TypeError or AssertionError traceback before
        cfg.ckpt, cfg[key] = str(tiny_ckpt), value
        with pytest.raises(ConfigError, match=f"{key}=.*{says}"):
            check_sample_config(cfg)
    ignored = _run(args + ["model.max_seq_len=8"], tmp_path)  # the trained context is used: say so, not ignore it
    assert ignored.returncode == 2 and "model.max_seq_len='8'" in ignored.stderr
    # a preset, as evaluate.py takes it: its kind, and the run's own window (8), not the preset's 32
    swa = _run(args[:-1] + ["attention=swa"], tmp_path)
    assert swa.returncode == 0, swa.stderr[-3000:]
    assert "note: sampling as swa (w=8); the checkpoint was trained as sa (w=8)" in swa.stderr
    assert swa.stdout.count("--- sample ") == 2


@pytest.mark.parametrize("overrides, folder", [([], "quick-{stamp}"), (["attention.window=16"], "quick-w16-{stamp}"),
                                               (["attention=sa", "attention.window=16"], "quick-sa_w16-{stamp}"),
                                               (["attention.kind=swa"], "quick-swa-{stamp}"),
                                               (["attention=full"], "quick-full-{stamp}"),
                                               (["attention=sa"], "quick-sa-{stamp}"),  # the run's own window
                                               (["out_dir=elsewhere", "attention.window=16"], "elsewhere"),
                                               (["attention=sa", "~attention.window"], "quick-sa-{stamp}"),
                                               (["model.hf={export}", "attention=sa"], "runs/eval/quick-sa-{stamp}"),
                                               (["model.hf={export}", "attention=sa", "attention.window=8"],
                                                "runs/eval/quick-sa_w8-{stamp}"),
                                               (["model.hf=org/hub-model", "attention=sa"],
                                                "runs/eval/quick-sa_w32-{stamp}")])
def test_evaluations_at_another_attention_go_to_folders_that_name_it(overrides, folder, tmp_path):
    """A run evaluated as trained and again at another window kept two <suite>-<time> folders told apart only by
    their timestamps; the attention given on the command line is now in the name (for a model.hf export, a preset's
    window is not: the export's own window is used; a hub model runs at the preset's)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    import evaluate  # noqa: F401  (registers the folder resolver)

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")
    export = tmp_path / "export"  # what hf.export writes beside the weights: the attention it was trained with
    export.mkdir()
    (export / "sa_export.json").write_text(json.dumps({"attention": {"kind": "sa", "window": 8, "eval_seed": 0}}))
    overrides = [o.format(export=export) for o in overrides]
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        model = [] if any(o.startswith("model.hf=") for o in overrides) else [f"ckpt={run}"]
        cfg = compose(config_name="evaluate", overrides=[*model, *overrides], return_hydra_config=True)
    out = Path(OmegaConf.to_container(cfg.hydra.run, resolve=True)["dir"])
    if folder == "elsewhere":
        assert out == Path("elsewhere")
        return
    if folder.startswith("runs/"):
        folder = folder.removeprefix("runs/eval/")
        assert out.parent == Path("runs") / "eval"
    else:
        assert out.parent == run / "eval"
    assert re.fullmatch(folder.format(stamp=r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d"), out.name), out.name


@pytest.mark.parametrize("preset", ["full", "swa", "sa", "gated_sa_swa", "moba"])
def test_every_attention_preset_resolves_in_the_evaluate_config(preset):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        cfg = compose(config_name="evaluate", overrides=[f"attention={preset}", "ckpt=x.ckpt"])
    assert OmegaConf.to_container(cfg.attention, resolve=True)["kind"] == preset


def test_gates_asked_of_an_ungated_checkpoint_are_a_config_error(tiny_ckpt):
    from model.checkpoint import load_checkpoint
    from model.config import ConfigError

    with pytest.raises(ConfigError, match="was trained as 'sa' and has no gates") as err:
        load_checkpoint(tiny_ckpt, {"kind": "gated_sa_swa"})
    assert err.value.key == "attention.kind"


def test_a_full_attention_model_run_windowed_needs_a_window(tiny_ckpt, tmp_path):
    """A full run records its context as its window (conf/attention/full.yaml's placeholder): `attention=sa` on it
    scored SA at w = context, silently, where training-free SA asks for a window of its own."""
    from evaluate import exported_attention
    from hf.export import export
    from model.checkpoint import load_checkpoint
    from model.config import ConfigError

    ckpt = torch.load(tiny_ckpt, map_location="cpu", weights_only=True)
    ckpt["hyper_parameters"]["attention"].update(kind="full", window=ckpt["hyper_parameters"]["model"]["max_seq_len"])
    torch.save(ckpt, tmp_path / "full.ckpt")
    for kind in ("sa", "swa"):
        with pytest.raises(ConfigError, match="trained with full attention.*attention.window=<w>") as err:
            load_checkpoint(tmp_path / "full.ckpt", {"kind": kind})
        assert err.value.key == "attention.window"
    assert load_checkpoint(tmp_path / "full.ckpt", {"kind": "sa", "window": 8}).model.attn_cfg.window == 8
    assert load_checkpoint(tmp_path / "full.ckpt").model.attn_cfg.kind == "full"
    out = export(tmp_path / "full.ckpt", tmp_path / "export")
    preset = {"kind": "sa", "window": 32, "backend": "auto", "eval_seed": 0}  # what `attention=sa` composes
    with pytest.raises(ConfigError, match="trained with full attention"):
        exported_attention(str(out), preset, given={"kind"})
    assert exported_attention(str(out), preset, given={"kind", "window"})["window"] == 32
    # and the other way round: a window alone (or with attention=full) would score full attention under a w64 label
    for attention in ({"window": 64}, {"kind": "full", "window": 64}):
        with pytest.raises(ConfigError, match="which has no window: give attention=swa or attention=sa") as err:
            load_checkpoint(tmp_path / "full.ckpt", attention)
        assert err.value.key == "attention.window" and "=64:" in str(err.value)
    with pytest.raises(ConfigError, match="runs full attention"):  # an SA model asked for full attention at a window
        load_checkpoint(tiny_ckpt, {"kind": "full", "window": 64})
    # a tool scoring several runs with one window (analysis.position_loss): the full-attention baseline stays full
    assert load_checkpoint(tmp_path / "full.ckpt", {"window": 64}, window_if_banded=True).model.attn_cfg.kind == "full"
    assert load_checkpoint(tiny_ckpt, {"window": 6}, window_if_banded=True).model.attn_cfg.window == 6
    assert load_checkpoint(tiny_ckpt, {"kind": "full"}).model.attn_cfg.kind == "full"
    with pytest.raises(ConfigError, match="which has no window"):
        exported_attention(str(out), {"window": 64, "backend": "auto"}, given={"window"})


def test_evaluate_py_reports_a_missing_checkpoint(tmp_path):
    proc = _run([str(ROOT / "evaluate.py"), f"ckpt={tmp_path / 'nope'}", f"out_dir={tmp_path / 'o'}"], tmp_path)
    assert proc.returncode == 2 and "error: no checkpoint" in proc.stderr
    assert not (tmp_path / "o").exists()  # a refused launch leaves no output folder behind
    # model.max_seq_len is there for attention=full's placeholder only: a context given there was ignored silently
    proc = _run([str(ROOT / "evaluate.py"), f"ckpt={tmp_path / 'nope'}", "model.max_seq_len=32",
                 f"out_dir={tmp_path / 'o'}"], tmp_path)
    assert proc.returncode == 2 and "model.max_seq_len='32'" in proc.stderr and "eval.max_length" in proc.stderr


def test_an_unreadable_checkpoint_is_an_error_that_names_it(tiny_ckpt, tmp_path):
    """A truncated file, another program's torch file, text: each a CheckpointError naming the file (torch's
    zip-reader traceback before), and evaluate.py exits 2 without leaving an output folder."""
    from model.checkpoint import CheckpointError, load_checkpoint, load_weights_into

    (tmp_path / "cut.ckpt").write_bytes(tiny_ckpt.read_bytes()[:20000])
    (tmp_path / "text.ckpt").write_text("not a checkpoint\n")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    torch.save({"day": datetime.date(2026, 12, 5)}, tmp_path / "pickled.pt")
    for name, says in (("cut.ckpt", "not a readable checkpoint: no torch.save archive"),
                       ("text.ckpt", "not a readable checkpoint: no torch.save archive"),
                       ("other.pt", "not a checkpoint of this codebase"),
                       ("pickled.pt", "weights_only loading refuses.*Unsupported global.*datetime.date")):
        with pytest.raises(CheckpointError, match=says) as err:
            load_checkpoint(tmp_path / name)
        assert name in str(err.value)
        with pytest.raises(CheckpointError, match=says):
            load_weights_into(load_checkpoint(tiny_ckpt).model, tmp_path / name)  # train.py's init_from
    proc = _run([str(ROOT / "evaluate.py"), f"ckpt={tmp_path / 'cut.ckpt'}", f"out_dir={tmp_path / 'o'}"], tmp_path)
    assert proc.returncode == 2 and "error:" in proc.stderr and "not a readable checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()



def test_a_checkpoint_missing_a_weight_or_holding_a_foreign_one_is_refused(tiny_ckpt, tmp_path):
    """load_checkpoint loads with strict=False (a gated checkpoint may be scored as plain SA), so it must refuse any
    other mismatch itself: a weight the file lacks would stay at its random init and the model would be scored as
    if trained, and a weight the model lacks would be dropped in silence."""
    from model.checkpoint import CheckpointError, load_checkpoint

    ckpt = torch.load(tiny_ckpt, map_location="cpu", weights_only=True)
    dropped = random.choice(sorted(k for k in ckpt["state_dict"] if k.startswith("model.blocks.")))
    lacking = {**ckpt, "state_dict": {k: v for k, v in ckpt["state_dict"].items() if k != dropped}}
    torch.save(lacking, tmp_path / "lacking.ckpt")
    with pytest.raises(CheckpointError, match=f"lacking.ckpt does not match the model: missing.*{dropped[6:]}"):
        load_checkpoint(tmp_path / "lacking.ckpt")
    extra = {**ckpt, "state_dict": {**ckpt["state_dict"], "model.blocks.0.attn.extra": torch.zeros(3)}}
    torch.save(extra, tmp_path / "extra.ckpt")
    with pytest.raises(CheckpointError, match="unexpected.*blocks.0.attn.extra"):
        load_checkpoint(tmp_path / "extra.ckpt")
    loaded = load_checkpoint(tiny_ckpt).model.state_dict()  # the whole file: every weight is the file's own
    assert all(torch.equal(loaded[k.removeprefix("model.")], v) for k, v in ckpt["state_dict"].items())

def test_a_full_model_scored_windowed_is_not_noted_as_another_window(tiny_ckpt, evaldata, tmp_path, capsys):
    """A full run's recorded window is its context (conf/attention/full.yaml's placeholder): the note said
    "window 4 (trained with 16)" of a model that never had a window."""
    from evaluation import evaluate_checkpoint

    ckpt = torch.load(tiny_ckpt, map_location="cpu", weights_only=True)
    ckpt["hyper_parameters"]["attention"].update(kind="full", window=ckpt["hyper_parameters"]["model"]["max_seq_len"])
    torch.save(ckpt, tmp_path / "full.ckpt")
    cfg = {"tasks": ["lambada_openai"], "data_dir": str(evaldata[0]), "limit": 2, "device": "cpu",
           "task_dir": str(tmp_path / "tasks")}
    evaluate_checkpoint(tmp_path / "full.ckpt", cfg, {"kind": "sa", "window": 4}, tmp_path / "out")
    err = capsys.readouterr().err
    assert "attention sa (trained as full)" in err and "(trained with" not in err


def test_evaluate_py_refuses_a_missing_data_dir_and_fails_when_nothing_ran(tiny_ckpt, tmp_path):
    proc = _run([str(ROOT / "evaluate.py"), f"ckpt={tiny_ckpt}", f"eval.data_dir={tmp_path / 'nowhere'}",
                 f"out_dir={tmp_path / 'o'}"], tmp_path)
    assert proc.returncode == 2 and "eval.data_dir" in proc.stderr and "no such folder" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()  # a folder without any task's files: every task is skipped
    proc = _run([str(ROOT / "evaluate.py"), f"ckpt={tiny_ckpt}", f"eval.data_dir={empty}", f"out_dir={tmp_path / 'o'}"],
                tmp_path)
    assert proc.returncode == 1 and "nothing was evaluated" in proc.stderr, proc.stderr[-2000:]


def test_lm_eval_cli_runs_sa_lm_on_a_local_task(tiny_ckpt, evaldata, tmp_path):
    folder, _, _ = evaldata
    # batch_size in model_args, as evaluation/README.md writes it: lm-eval adds its CLI's own batch_size too
    proc = _run(["-m", "evaluation.lm_eval_cli", "--model", "sa-lm", "--model_args",
                 f"checkpoint={tiny_ckpt},batch_size=3", "--tasks", "lambada_openai", "--data_dir", str(folder),
                 "--limit", "4", "--batch_size", "2",
                 "--output_path", str(tmp_path / "out")], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "lambada_openai" in proc.stdout and "perplexity" in proc.stdout
    [saved] = list((tmp_path / "out").rglob("results_*.json"))
    assert "acc,none" in json.loads(saved.read_text())["results"]["lambada_openai"]


def test_lm_eval_cli_gives_sa_lm_its_own_batch_size(monkeypatch):
    """Without --batch_size lm-eval's CLI passes its default of 1, which sa-lm took over its own 16."""
    import lm_eval.__main__ as lm_main

    from evaluation import lm_eval_cli

    seen = []
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # main() sets it for lm-eval's parser
    monkeypatch.setattr(lm_main, "cli_evaluate", lambda: seen.append(list(sys.argv)))
    lm_eval_cli.main(["--model", "sa-lm", "--tasks", "wikitext"])
    lm_eval_cli.main(["--model", "sa-lm", "--batch_size", "4"])
    lm_eval_cli.main(["--model", "hf", "--tasks", "wikitext"])
    assert seen[0][-2:] == ["--batch_size", "16"] and seen[1].count("--batch_size") == 1
    assert "--batch_size" not in seen[2]  # other models keep lm-eval's defaults
    from evaluation.lm_eval_cli import _needs_batch_size

    for given in (["-b8"], ["--batch", "8"], ["--batch_size=8"], ["--config", "run.yaml"]):  # argparse's spellings
        assert not _needs_batch_size(["--model", "sa-lm", *given]), given
    assert _needs_batch_size(["-M", "sa-lm", "--tasks", "wikitext"])


def test_lm_eval_cli_reads_tasks_and_shots_in_every_spelling_lm_evals_parser_takes():
    """-t=piqa, --task piqa (an abbreviation) and -f5 reached lm-eval, but the wrapper did not see them: the task was
    not written locally (it went to the hub) and the few-shot check was skipped."""
    from evaluation.lm_eval_cli import _options, _requested_tasks

    for given in (["-t=piqa,arc_easy"], ["--task", "piqa,arc_easy"], ["--tasks", "piqa", "arc_easy"],
                  ["-t", "piqa,", "arc_easy", "--limit", "2"], ["--tasks=piqa,arc_easy"]):
        assert _requested_tasks(["--model", "sa-lm", *given]) == ["piqa", "arc_easy"], given
    for given in (["-f5"], ["-f", "5"], ["--num_fewshot=5"], ["--num_few", "5"]):
        assert _options(given).num_fewshot == "5", given
    assert _options(["--include_path=/x"]).include_path == "/x" and _options([]).include_path is None


def test_lm_eval_cli_refuses_few_shot_examples_from_a_test_split(tiny_ckpt, evaldata, tmp_path, monkeypatch):
    monkeypatch.setenv("SA_CACHE_DIR", str(tmp_path / "cache"))
    proc = _run(["-m", "evaluation.lm_eval_cli", "--model", "sa-lm", "--model_args", f"checkpoint={tiny_ckpt}",
                 "--tasks", "lambada_openai,piqa", "--data_dir", str(evaldata[0]), "--num_fewshot", "2",
                 "--limit", "1", "--batch_size", "2"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "--num_fewshot=2" in proc.stderr and "lambada_openai, piqa have no non-test split" in proc.stderr


def test_scored_settings_fill_in_defaults_and_read_a_task_string_as_names():
    """results.json's eval_config: tasks as a list of names however they were written, defaults filled in, and only
    the settings scores depend on (not batch size or device)."""
    from evaluation.runner import DEFAULTS, SCORED_SETTINGS, scored_settings

    got = scored_settings({"tasks": "wikitext, piqa", "batch_size": 3, "device": "cpu", "num_fewshot": 2})
    assert list(got) == list(SCORED_SETTINGS) and "batch_size" not in got and "device" not in got
    assert got["tasks"] == ["wikitext", "piqa"] and got["num_fewshot"] == 2
    assert got["num_seeds"] == DEFAULTS["num_seeds"] and scored_settings(None)["tasks"] == DEFAULTS["tasks"]


def test_hub_tasks_are_skipped_up_front_only_where_the_hub_would_be_retried(monkeypatch):
    """Offline mode reads the local datasets cache (a cached hub task runs) and fails at once on a miss, so only a
    hub that cannot be reached without offline mode is skipped up front; behind a proxy the hub is tried."""
    import evaluation.runner as runner

    for key in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(runner, "_HUB_REACHABLE", False)
    assert runner._hub_unreachable()
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert not runner._hub_unreachable()
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy:3128")
    assert not runner._hub_unreachable()


def test_metrics_under_a_filter_and_the_shots_are_reported_as_lm_eval_ran_them():
    """A task outside the paper's columns keeps its metrics under lm-eval's filters (gsm8k: "exact_match,strict-match"
    and "exact_match,flexible-extract"; they were dropped for want of ",none"); a task's YAML may set its own shots."""
    from evaluation.report import extract, fewshot_of

    results = {"results": {
        "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.01,
                  "exact_match,flexible-extract": 0.5, "exact_match_stderr,flexible-extract": 0.02},
        "piqa": {"acc,none": 0.6, "acc_stderr,none": 0.01, "acc_norm,none": 0.7, "acc_norm_stderr,none": 0.01}},
        "configs": {"gsm8k": {"num_fewshot": 5}, "piqa": {"num_fewshot": 0}}}
    got = extract(results, ["gsm8k", "piqa"])
    assert got["gsm8k"] == {"exact_match,strict-match": {"value": 0.25, "stderr": 0.01},
                            "exact_match,flexible-extract": {"value": 0.5, "stderr": 0.02}}
    assert got["piqa"]["acc_norm"] == {"value": 0.7, "stderr": 0.01}
    assert got["piqa"]["acc"] == {"value": 0.6, "stderr": 0.01}
    from evaluation.report import primary_accuracy

    # the GLA / Mamba convention: acc_norm for HellaSwag and ARC-c, acc for PIQA and ARC-e
    assert [primary_accuracy(t) for t in ("piqa", "arc_easy", "hellaswag", "arc_challenge", "lambada_openai",
                                          "gsm8k")] == ["acc", "acc", "acc_norm", "acc_norm", "acc", "acc"]
    assert fewshot_of(results) == {"gsm8k": 5, "piqa": 0}
    assert fewshot_of({"configs": {"piqa": {"num_fewshot": 0}, "boolq": {}}}) == 0 == fewshot_of({})


@pytest.mark.parametrize(("key", "value", "hf", "ok"), [
    ("batch_size", "auto", False, False),  # a checkpoint's batches are ours: a number
    ("batch_size", "auto", True, True),  # HFLM finds one
    ("batch_size", 0, False, False),
    ("batch_size", "8", False, False),
    ("dtype", "auto", False, True),  # the model's own, as null
    ("dtype", "half", True, False),
    ("limit", 5, False, True),
    ("limit", 0, False, False),  # lm-eval: no example at all, found after the model loaded
    ("limit", 0.02, False, False),  # lm-eval: 2% of every task, where eval.limit means the first N
    ("max_length", 0, False, False),
    ("max_length", 32, True, True),
    ("num_fewshot", 0, False, True),
    ("num_fewshot", True, False, False),  # a bool is not a number of shots
    ("num_seeds", 0, False, False),
])
def test_eval_settings_are_checked_before_a_model_loads(key, value, hf, ok):
    from evaluation.runner import check_eval_config
    from model.config import ConfigError

    cfg = {"batch_size": 16, "dtype": None, key: value}
    if ok:
        check_eval_config(cfg, hf=hf)
    else:
        with pytest.raises(ConfigError, match=f"eval.{key}"):
            check_eval_config(cfg, hf=hf)
