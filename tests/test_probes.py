"""Synthetic long-range probes: recoverable answers, requested distances, determinism, training and evaluation."""

import json
import re

import numpy as np
import pytest

from conftest import TINY, compose_train
from model.config import ConfigError
from data.probes import CharUnits, ProbesCallback, ProbeSpec, TokenUnits, generate, make_probe, write_jsonl

PAIR = re.compile(r" (k\d+): (v\d+)\.")


@pytest.mark.parametrize("filler", ["repeat", "sentences", "pydoc", "random"])
def test_kv_answers_are_recoverable_from_the_text(filler):
    spec = ProbeSpec(task="kv", length=700, num_pairs=6, filler=filler, seed=5)
    for probe in generate(spec, 40):
        found = dict(PAIR.findall(probe.prompt))
        assert found == probe.pairs  # every pair once, nothing else looks like a pair
        key = re.search(r"value of (k\d+)\? Answer:$", probe.prompt).group(1)
        assert key == probe.key and " " + found[key] == probe.answer
        assert probe.prompt[probe.item_span[0] : probe.item_span[1]] == f" {key}: {found[key]}."
        assert probe.text == probe.prompt + probe.answer


def test_passkey_answer_is_recoverable_from_the_text():
    for probe in generate(ProbeSpec(task="passkey", length=500, filler="repeat", seed=2), 30):
        codes = set(re.findall(r"The pass key is (\d+)\.", probe.prompt))
        assert codes == {probe.answer.strip()}
        assert probe.prompt.endswith("What is the pass key? The pass key is")


def test_passkey_code_has_the_requested_digits():
    codes = {p.answer.strip() for p in generate(ProbeSpec(task="passkey", length=300, value_digits=2, seed=4), 40)}
    assert all(len(c) == 2 and c.isdigit() for c in codes) and len(codes) > 20


def test_needle_is_the_only_number_and_questions_keep_their_gap():
    spec = ProbeSpec(task="needle", length=3000, value_digits=1, question_gap=400, min_distance=2000, seed=8)
    for probe in generate(spec, 30):
        code = probe.answer.strip()
        assert re.findall(r"\d+", probe.prompt) == [code] * (probe.prompt.count(" ?") - 1) + [code]
        assert probe.prompt[probe.item_span[0] : probe.item_span[1]] == " " + code and probe.prompt.endswith(" ?")
        asked = [m.start() for m in re.finditer(r" \?", probe.prompt)]
        assert len(asked) >= 3  # the number sits 2000+ characters before the end: asked again on the way
        starts = [probe.item_span[1]] + [a + len(" ? " + code) for a in asked[:-1]]
        assert all(a - s >= 400 for s, a in zip(starts, asked))  # every question 400+ characters after the last
    once = make_probe(ProbeSpec(task="needle", length=600, value_digits=2, distance=300, seed=1), 0)
    assert once.prompt.count(" ?") == 1 and once.distance == 300 and len(once.answer.strip()) == 2


def test_needle_first_question_comes_near_and_the_rest_keep_their_gap():
    spec = ProbeSpec(task="needle", length=3000, value_digits=1, question_gap=400, first_gap=150, min_distance=2000,
                     seed=9)
    firsts = []
    for probe in generate(spec, 40):
        code = probe.answer.strip()
        asked = [m.start() for m in re.finditer(r" \?", probe.prompt)]
        firsts.append(asked[0] - probe.item_span[1])
        assert 0 <= firsts[-1] <= 150  # within the near gap (0..150 characters after the number)
        starts = [a + len(" ? " + code) for a in asked[:-1]]
        assert all(a - s >= 400 for s, a in zip(starts, asked[1:]))  # later questions keep the full gap
    assert min(firsts) < 50 < max(firsts)  # drawn across the range, not pinned to one end
    with pytest.raises(ValueError, match="first_gap"):
        ProbeSpec(task="needle", question_gap=400, first_gap=-1)


RECALL_PAIR = re.compile(r" ([a-z]+)(\d+)")


def test_recall_every_key_keeps_its_value_and_the_answer_is_its_last_value():
    spec = ProbeSpec(task="recall", length=400, num_pairs=12, key_digits=2, value_digits=2, seed=6)
    for probe in generate(spec, 30):
        body, key = probe.prompt[: -len(probe.key)], probe.key
        stream = RECALL_PAIR.findall(body)
        assert "".join(f" {k}{v}" for k, v in stream) == body  # nothing but pairs
        seen = {}
        for k, v in stream:
            assert seen.setdefault(k, v) == v == probe.pairs[" " + k]  # a key always has the same value
        assert len(seen) <= 12 and probe.prompt.endswith(key) and seen[key.strip()] == probe.answer
        assert body.count(key + probe.answer) == 1  # the queried key occurs once before the question: at the item
        assert probe.prompt[probe.item_span[0] : probe.item_span[1]] == key + probe.answer
        assert abs(len(probe.prompt) - 400) <= 5 and probe.text == probe.prompt + probe.answer


def test_recall_distances_within_one_pair_of_the_request():
    for d in (6, 50, 123, 300):
        probe = make_probe(ProbeSpec(task="recall", length=400, num_pairs=10, key_digits=2, value_digits=2,
                                     distance=d, seed=2), index=d)
        assert abs(probe.distance - d) <= 3 and probe.distance == len(probe.prompt) - probe.item_span[1]
    with pytest.raises(ValueError, match="impossible"):
        make_probe(ProbeSpec(task="recall", length=100, distance=99, key_digits=2, value_digits=2), 0)
    with pytest.raises(ValueError, match="num_pairs"):
        ProbeSpec(task="recall", key_digits=1, num_pairs=27)


@pytest.mark.parametrize("task", ["kv", "passkey", "needle"])
def test_lengths_and_distances_are_as_requested(task):
    for d in (80, 150, 333, 520):
        probe = make_probe(ProbeSpec(task=task, length=600, num_pairs=4, distance=d, seed=1), index=d)
        assert len(probe.prompt) == 600
        # measured from the value's last occurrence in the item: kv's full stop and the end of the pass-key sentence
        # come after it and hold nothing the answer needs
        assert probe.distance == d == len(probe.prompt) - probe.value_end
        assert probe.prompt[: probe.value_end].endswith(probe.answer.strip())
        assert probe.item_span[0] < probe.value_end <= probe.item_span[1]
    spec = ProbeSpec(task=task, length=800, num_pairs=4, min_distance=200, max_distance=400)
    distances = [p.distance for p in generate(spec, 60)]
    assert min(distances) >= 200 and max(distances) <= 400 and len(set(distances)) > 20
    with pytest.raises(ValueError, match="impossible"):
        make_probe(ProbeSpec(task=task, length=600, distance=599), 0)


def test_deterministic_by_seed():
    spec = ProbeSpec(task="kv", length=500, num_pairs=5, seed=11)
    first = [p.as_json() for p in generate(spec, 10)]
    assert first == [p.as_json() for p in generate(spec, 10)]
    assert first[7] == make_probe(spec, 7).as_json()  # document i does not depend on how many are drawn
    other = [p.as_json() for p in generate(ProbeSpec(task="kv", length=500, num_pairs=5, seed=12), 10)]
    assert all(a["text"] != b["text"] for a, b in zip(first, other))


def test_token_units_measure_distance_in_tokens():
    from data.tokenizer import train_bpe

    texts = [p.text for p in generate(ProbeSpec(task="kv", length=1500, num_pairs=6), 30)]
    tok = train_bpe(texts, 400)
    units = TokenUnits(tok)
    for d in (40, 90):
        probe = make_probe(ProbeSpec(task="kv", length=200, num_pairs=3, distance=d, seed=3), 0, units)
        ids = tok.encode(probe.prompt).ids
        assert abs(len(ids) - 200) <= 4 and abs(probe.distance - d) <= 4
        # the distance is re-measured on the final prompt: tokens after the needed value's last token
        assert probe.distance == units.distance(probe.prompt, probe.value_end)
        assert probe.distance > units.distance(probe.prompt, probe.item_span[1])  # the pair's full stop is nearer
    assert CharUnits().distance("abcdef", 2) == 4


def test_jsonl_is_written_once_per_parameter_set(tmp_path):
    spec = ProbeSpec(task="passkey", length=300)
    path = write_jsonl(spec, 20, tmp_path / "p.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 20 and all(r["text"] == r["prompt"] + r["answer"] for r in rows)
    mtime = path.stat().st_mtime_ns
    write_jsonl(spec, 20, path)
    assert path.stat().st_mtime_ns == mtime  # same parameters: kept (the prepared shards stay valid)
    with pytest.raises(FileExistsError):
        write_jsonl(ProbeSpec(task="passkey", length=301), 20, path)


def test_probes_train_and_evaluate_end_to_end(tmp_path, data_cache):
    """data=probes composes, its callback writes the corpus, train.py trains on it, probe_eval scores the run."""
    from analysis.probe_eval import evaluate, markdown
    from train import train

    run = tmp_path / "run"
    probes = ["data=probes", "data.probes.task=kv", "data.probes.length=180", "data.probes.num_pairs=2",
              "data.probes.num_docs=300", "data.probes.filler=repeat", "data.window_start=document"]
    cfg = compose_train(TINY + probes + ["attention=sa", "attention.window=8", "trainer.max_steps=3",
                                         "trainer.val_every_n_steps=3", "data.val_windows=2"], run, cache=data_cache)
    assert cfg.data.source.kind == "files" and cfg.data.source.paths == [cfg.data.probes.file]
    ProbesCallback().on_job_start(config=cfg)
    assert sum(1 for _ in open(cfg.data.probes.file)) == 300
    metrics = train(cfg)
    assert "val/loss" in metrics
    summary = evaluate({"ckpt": str(run), "num": 12, "batch_size": 6, "buckets": 3}, {"window": 8})
    assert summary["settings"]["task"] == "kv" and summary["settings"]["num_pairs"] == 2  # from the run's config
    acc = {r["metric"]: r for r in summary["results"]}
    assert acc["acc"]["n"] == 12 and 0.0 <= acc["acc"]["value"] <= 1.0
    assert acc["acc_beyond_swa"]["n"] + acc["acc_within_swa"]["n"] == 12
    assert sum(b["n"] for b in summary["buckets"]["kv"]) == 12
    alone = evaluate({"ckpt": str(run), "num": 12, "batch_size": 1, "buckets": 3, "task": "kv"}, {"window": 8})
    assert alone["results"] == summary["results"]  # padded batches score like single sequences
    # what differs from the run's own probes (its task, as given here, does not): another measurement, labelled apart
    assert alone["setting"] == summary["setting"] == {"num": 12, "buckets": 3}
    # seeds=3: the mean over eval permutations 0, 1, 2, each as scored alone
    three = evaluate({"ckpt": str(run), "num": 12, "batch_size": 6, "buckets": 3, "seeds": 3}, {"window": 8})
    each = [{r["metric"]: r["value"] for r in evaluate({"ckpt": str(run), "num": 12, "batch_size": 6, "buckets": 3},
                                                       {"window": 8, "eval_seed": seed})["results"]}
            for seed in range(3)]
    got = {r["metric"]: r for r in three["results"]}
    assert three["attention"]["eval_seeds"] == [0, 1, 2] and got["acc_seed_std"]["n"] == 3
    assert got["acc"]["value"] == pytest.approx(np.mean([e["acc"] for e in each]))
    assert got["acc_seed_std"]["value"] == pytest.approx(np.std([e["acc"] for e in each]))
    assert got["guess"]["value"] == each[0]["guess"]  # the prompts, and so the baseline, do not depend on the seed
    table = markdown(three)
    assert "eval seeds 0-2, mean ± std" in table and table.count(" ± ") >= 1 + len(three["buckets"]["kv"])
    recall = evaluate({"ckpt": str(run), "task": "recall", "num": 6, "num_pairs": 5, "key_digits": 1,
                       "value_digits": 2, "context": 60, "buckets": 2}, {"window": 8})
    assert sum(b["n"] for b in recall["buckets"]["recall"]) == 6  # token-unit recall prompts fit and are scored
    # the split at another window's reach (a full run's preset window is the whole context), in the same columns
    near = evaluate({"ckpt": str(run), "num": 12, "batch_size": 6, "buckets": 3, "reach_window": 2}, {"window": 8})
    assert near["swa_reach"] == 2 * 1 and near["setting"] == summary["setting"]  # TINY: 2 layers; the same columns
    assert [r["value"] for r in near["results"] if r["metric"] == "acc"] == [acc["acc"]["value"]]
    with pytest.raises(SystemExit, match="buckets=0 must be >= 1"):  # it left most prompts out of the table
        evaluate({"ckpt": str(run), "num": 12, "buckets": 0}, {"window": 8})


def test_probe_eval_refuses_a_window_that_is_not_a_number():
    from analysis.probe_eval import parse_args

    with pytest.raises(SystemExit, match="attention.window='sixty' must be an integer"):
        parse_args(["ckpt=run", "attention.window=sixty"])


def test_constant_guess_and_buckets_report_the_baseline_of_each_subset():
    from analysis.probe_eval import bucketize, constant_guess

    assert constant_guess([(5,), (7,), (5,), (9,)]) == 0.5 and constant_guess([]) == 0.0
    distances = np.array([10, 20, 30, 200, 210, 220])
    answers = [(1,), (1,), (2,), (3,), (4,), (5,)]
    correct = np.array([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=bool)  # two eval seeds
    near, far = bucketize(distances, correct, buckets=1, reach=124, answers=answers)
    assert (near["n"], near["guess"], near["beyond_swa"]) == (3, pytest.approx(2 / 3), False)
    # the sample standard deviation over seeds, as the evaluation suites and tools.compare report it
    assert near["acc"] == pytest.approx((2 / 3 + 1 / 3) / 2) and near["acc_std"] == pytest.approx((1 / 3) / 2**0.5)
    assert (far["n"], far["guess"], far["acc"], far["beyond_swa"]) == (3, pytest.approx(1 / 3), 1 / 6, True)


def test_needle_trains_on_its_answers_only(tmp_path, data_cache):
    """data.loss_only_after=" ?" trains on the needle's answers: the validation loss and accuracy are over answers."""
    from train import train

    probes = ["data=probes", "data.probes.task=needle", "data.probes.length=300", "data.probes.value_digits=1",
              "data.probes.question_gap=30", "data.probes.first_gap=10", "data.probes.min_distance=260",
              "data.probes.num_docs=200", "data.probes.filler=random",
              "data.window_start=document"]
    cfg = compose_train(TINY + probes + ["attention=sa", "attention.window=8", "trainer.max_steps=3",
                                         "trainer.val_every_n_steps=3", "data.val_windows=2",
                                         "data.loss_only_after=' ?'"], tmp_path / "run", cache=data_cache)
    assert cfg.data.loss_only_after == " ?"
    ProbesCallback().on_job_start(config=cfg)
    metrics = train(cfg)
    assert 0.0 <= float(metrics["val/answer_acc"]) <= 1.0 and float(metrics["val/loss"]) > 0
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    from model.checkpoint import load_checkpoint

    assert load_checkpoint(last).loss_only_after == " ?"  # an evaluator can see what the run was trained on
    resumed = compose_train(TINY + probes + ["trainer.max_steps=4", f"ckpt_path={last}"], tmp_path / "resumed",
                            cache=data_cache)
    with pytest.raises(ConfigError, match="trained with ' \\?'"):  # the objective cannot change on resume
        train(resumed)
    # Not one token, or a token that never occurs (" ?" through a shell without its quotes arrives as "?").
    for text, why in ((" ? ?", "exactly one token"), ("?", "never occurs")):
        cfg = compose_train(TINY + probes + ["trainer.max_steps=1", f"data.loss_only_after='{text}'"],
                            tmp_path / "bad", cache=data_cache)
        with pytest.raises(ConfigError, match=why):
            train(cfg)


def test_ranks_started_together_write_the_probes_file_once(tmp_path):
    """A second rank waits for the one writing the file and then keeps it: a rewrite would change the file's mtime,
    and with it the data cache key of the ranks that already computed theirs."""
    import shutil
    import threading

    from data.prepare import exclusive_lock

    spec = ProbeSpec(task="kv", length=200, num_pairs=2)
    written = write_jsonl(spec, 5, tmp_path / "first" / "p.jsonl")
    path = tmp_path / "p.jsonl"
    waiter = threading.Thread(target=write_jsonl, args=(spec, 5, path))
    with exclusive_lock(tmp_path / ".p.jsonl.lock", "held by the test"):  # another rank is writing the file
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not path.exists()  # it waits instead of writing too
        shutil.copy2(written.with_name("p.jsonl.spec.json"), tmp_path / "p.jsonl.spec.json")
        shutil.copy2(written, path)  # what the other rank wrote
        mtime = path.stat().st_mtime_ns
    waiter.join(timeout=60)
    assert not waiter.is_alive() and path.stat().st_mtime_ns == mtime  # found after the wait and kept


def test_probe_results_get_a_folder_of_their_own_unless_they_score_the_final_checkpoint():
    """eval/probes is the final checkpoint's at its trained attention; scoring step 280, another window or another
    eval seed wrote there too, and the run's probe columns were taken from whichever ran last."""
    from analysis.probe_eval import default_folder

    def summary(ckpt="last.ckpt", window=8, seeds=(0,)):
        return {"checkpoint": f"/r/checkpoints/{ckpt}", "trained_attention": {"kind": "sa", "window": 8},
                "attention": {"kind": "sa", "window": window, "eval_seeds": list(seeds)}}

    assert default_folder(summary()) == "probes"
    assert default_folder(summary(ckpt="step0000280.ckpt")) == "probes_step0000280"
    assert default_folder(summary(window=64, seeds=(0, 1, 2))) == "probes_window64_3seeds"
    assert default_folder(summary(seeds=(5,))) == "probes_seed5"  # attention.eval_seed=5 replaced seed 0's result
    assert default_folder(summary(seeds=(5, 6, 7))) == "probes_seed5_3seeds"
    trained_at_5 = summary(seeds=(5,))
    trained_at_5["trained_attention"]["eval_seed"] = 5
    assert default_folder(trained_at_5) == "probes"
    swa = summary()
    swa["attention"] = {"kind": "swa", "window": 8, "eval_seeds": [5]}  # draws no permutation: the seed is no matter
    swa["trained_attention"]["kind"] = "swa"
    assert default_folder(swa) == "probes"
    shorter = {**summary(), "setting": {"context": 200}}  # another probe length: another measurement
    assert default_folder(shorter).startswith("probes_") and default_folder(shorter) != default_folder(summary())


def test_token_units_and_probe_examples_ignore_a_template():
    """A "<s> $A </s>" template's tokens have offsets (0, 0): counted, they shifted every cut and distance by one,
    and the appended EOS landed in the prompt. Units and examples are those of the same tokenizer without it."""
    import copy

    from tokenizers import processors

    from analysis.probe_eval import build_examples
    from data.tokenizer import EOS, train_bpe

    texts = [p.text for p in generate(ProbeSpec(task="kv", length=1500, num_pairs=6), 30)]
    plain = train_bpe(texts, 400)
    plain.add_special_tokens(["<s>"])
    templated = copy.deepcopy(plain)
    templated.post_processor = processors.TemplateProcessing(
        single=f"<s> $A {EOS}", special_tokens=[(t, plain.token_to_id(t)) for t in ("<s>", EOS)])
    assert len(templated.encode("a b").ids) == len(plain.encode("a b").ids) + 2  # the template is on
    spec = ProbeSpec(task="kv", length=200, num_pairs=3, distance=60, seed=3)
    probes = [make_probe(spec, 0, TokenUnits(tok)) for tok in (plain, templated)]
    assert probes[0] == probes[1]
    text = probes[0].prompt
    for units in (TokenUnits(plain), TokenUnits(templated)):
        assert units.count(text) == len(plain.encode(text).ids)
        assert units.cut(text, 10) == TokenUnits(plain).cut(text, 10) != text
        assert units.distance(text, probes[0].value_end) == probes[0].distance
    examples = [build_examples(tok, "kv", 3, 256, seed=1, num_pairs=3, filler="sentences")
                for tok in (plain, templated)]
    assert examples[0] == examples[1] and len(examples[0]) == 3
    # the distance reaches the value's first token (a multi-token value's last one left SWA's reach m - 1 too short)
    assert any(len(answer) > 1 for _, answer, _ in examples[0])
    for prompt, answer, distance in examples[0]:
        m = len(answer)
        first = max(i for i in range(len(prompt) - m + 1) if prompt[i:i + m] == answer)  # the value, in the prompt
        assert distance == len(prompt) - 1 - first, (distance, len(prompt), first)


@pytest.mark.parametrize("task", ["kv", "passkey", "needle"])
def test_the_largest_distance_that_fits_can_be_drawn(task):
    """The needed item at the very start of the prompt: asked for exactly, and drawn when it is the only choice left
    (the range's upper end is included)."""
    most = max(d for d in range(0, 301) if _fits(ProbeSpec(task=task, length=300, distance=d)))
    assert make_probe(ProbeSpec(task=task, length=300, distance=most), 0).distance == most
    drawn = {make_probe(ProbeSpec(task=task, length=300, min_distance=most, seed=s), 0).distance for s in range(3)}
    assert drawn == {most}
    with pytest.raises(ValueError, match="impossible"):
        make_probe(ProbeSpec(task=task, length=300, distance=most + 1), 0)


def _fits(spec) -> bool:
    try:
        make_probe(spec, 0)
    except ValueError:
        return False
    return True

