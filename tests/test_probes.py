"""Synthetic long-range probes: recoverable answers, requested distances, determinism, training and evaluation."""

import json
import re

import pytest

from conftest import TINY, compose_train
from data.probes import CharUnits, ProbesCallback, ProbeSpec, TokenUnits, generate, make_probe, write_jsonl

PAIR = re.compile(r" (k\d+): (v\d+)\.")


@pytest.mark.parametrize("filler", ["repeat", "sentences", "pydoc"])
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


@pytest.mark.parametrize("task", ["kv", "passkey"])
def test_lengths_and_distances_are_as_requested(task):
    for d in (80, 150, 333, 520):
        probe = make_probe(ProbeSpec(task=task, length=600, num_pairs=4, distance=d, seed=1), index=d)
        assert len(probe.prompt) == 600
        assert probe.distance == d == len(probe.prompt) - probe.item_span[1]
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
        # the distance is re-measured on the final prompt: tokens after the needed pair's last token
        assert probe.distance == units.distance(probe.prompt, probe.item_span[1])
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
    from analysis.probe_eval import evaluate
    from train import train

    run = tmp_path / "run"
    probes = ["data=probes", "data.probes.task=kv", "data.probes.length=180", "data.probes.num_pairs=2",
              "data.probes.num_docs=300", "data.probes.filler=repeat"]
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
    alone = evaluate({"ckpt": str(run), "num": 12, "batch_size": 1, "buckets": 3}, {"window": 8})
    assert alone["results"] == summary["results"]  # padded batches score like single sequences
