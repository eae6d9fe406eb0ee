"""Data: sources -> tokenizer -> shards round trip, cache reuse, refusal of corrupt shards, deterministic windows."""

import gzip
import json
import os
import stat
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from data import shards
from data.datamodule import FixedWindows, TrainWindows
from data.prepare import prepare
from data.sources import embedded_documents, file_documents
from data.tokenizer import load_tokenizer
from model.config import ConfigError


def data_cfg(paths, vocab=300, **kw):
    cfg = {"source": {"kind": "files", "paths": [str(p) for p in paths], "text_field": "text", "streaming": True},
           "tokenizer": {"path": None, "vocab_size": vocab, "train_chars": 10**7}, "val_fraction": 0.1,
           "max_tokens": None, "shard_tokens": 10**8}
    cfg.update(kw)
    return cfg


def test_shard_round_trip_and_header(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 60000, 1001).astype(np.uint16)
    shards.write_shard(tmp_path / "a.bin", tokens)
    np.testing.assert_array_equal(shards.read_shard(tmp_path / "a.bin"), tokens)
    big = np.array([0, 70000, 2**31], dtype=np.uint32)
    shards.write_shard(tmp_path / "b.bin", big)
    np.testing.assert_array_equal(shards.read_shard(tmp_path / "b.bin"), big)
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary files


def test_atomic_writes_follow_the_umask(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        shards.atomic_write_text(tmp_path / "results.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "results.json").read_text() == "{}"
    assert (tmp_path / "results.json").stat().st_mode & 0o777 == 0o644  # not mkstemp's 0600
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]  # no temporary left behind


def test_a_write_that_fails_midway_leaves_the_previous_file_whole(tmp_path):
    """What shards, meta.json, progress.json and results.json rely on: a crash (here an error) mid-write never
    leaves half a file where the old one was."""
    path = tmp_path / "meta.json"
    shards.atomic_write_text(path, "old")

    def torn(f):
        f.write(b"new, half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        shards.atomic_write(path, torn)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["meta.json"]


def test_truncated_or_foreign_shard_is_refused(tmp_path):
    shards.write_shard(tmp_path / "a.bin", np.arange(100, dtype=np.uint16))
    raw = (tmp_path / "a.bin").read_bytes()
    (tmp_path / "cut.bin").write_bytes(raw[:-10])
    with pytest.raises(shards.ShardError, match="truncated"):
        shards.read_shard(tmp_path / "cut.bin")
    (tmp_path / "foreign.bin").write_bytes(b"PK\x03\x04" + raw[4:])
    with pytest.raises(shards.ShardError, match="magic"):
        shards.read_shard(tmp_path / "foreign.bin")



def test_the_shard_format_is_a_little_endian_header_then_the_raw_tokens(tmp_path):
    """The on-disk format of the module docstring, byte by byte: magic, uint32 version 1, uint32 dtype code (1 =
    uint16, 2 = uint32), uint64 token count, all little-endian, zero-padded to 64 bytes, then the tokens. Prepared
    data caches outlive the code that wrote them: a reordered struct, another byte order or renumbered dtype codes
    would still round-trip in a test of write-then-read, yet refuse (or misread) every shard already on disk."""
    rng = np.random.default_rng()
    for code, dtype in ((1, np.uint16), (2, np.uint32)):
        tokens = rng.integers(0, np.iinfo(dtype).max, int(rng.integers(1, 500)), dtype=np.int64).astype(dtype)
        header = (b"SALMTOK\x00" + (1).to_bytes(4, "little") + code.to_bytes(4, "little")
                  + tokens.size.to_bytes(8, "little")).ljust(64, b"\x00")
        raw = header + tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
        shards.write_shard(tmp_path / f"ours{code}.bin", tokens)
        assert (tmp_path / f"ours{code}.bin").read_bytes() == raw
        (tmp_path / f"theirs{code}.bin").write_bytes(raw)  # a shard an earlier version prepared
        got = shards.read_shard(tmp_path / f"theirs{code}.bin")
        assert got.dtype == dtype and np.array_equal(got, tokens)


def test_a_shard_whose_header_disagrees_with_the_file_is_refused(tmp_path):
    """read_shard checks that the size matches the header exactly and that version and dtype code are known: a file
    longer than its header says (bytes appended to it, a header rewritten short) or of another format version is
    not silently read as a prefix of itself."""
    tokens = np.random.default_rng().integers(0, 60000, 100).astype(np.uint16)
    shards.write_shard(tmp_path / "a.bin", tokens)
    raw = (tmp_path / "a.bin").read_bytes()
    (tmp_path / "long.bin").write_bytes(raw + raw[64:70])
    with pytest.raises(shards.ShardError, match="truncated or corrupt"):
        shards.read_shard(tmp_path / "long.bin")
    for at, value, what in ((8, 2, "version 2"), (12, 3, "dtype code 3")):
        (tmp_path / "other.bin").write_bytes(raw[:at] + value.to_bytes(4, "little") + raw[at + 4:])
        with pytest.raises(shards.ShardError, match=what):
            shards.read_shard(tmp_path / "other.bin")


def test_an_atomic_write_is_on_disk_before_the_rename(tmp_path, monkeypatch):
    """Atomic means durable too: the temporary file is fsynced with all its bytes (flushed from Python's buffer
    first) before it replaces the target, so a power loss after the rename cannot leave a shard or results.json that
    exists but is empty. fsync is spied on here: the size it syncs and whether the target exists yet."""
    real_fsync, synced = os.fsync, []
    target = tmp_path / "results.json"
    text = "x" * int(np.random.default_rng().integers(10, 4000))  # under Python's write buffer

    def spy(fd):
        info = os.fstat(fd)
        synced.append(("folder" if stat.S_ISDIR(info.st_mode) else info.st_size, target.exists()))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    shards.atomic_write_text(target, text)
    # then the folder, so that the rename itself survives a power loss
    assert synced == [(len(text), False), ("folder", True)] and target.read_text() == text


def test_an_interrupted_preparation_resumes_after_its_last_shard(tmp_path, monkeypatch, capsys):
    """The source fails at document 600 of 700: the next prepare() resumes after the last train shard (documents
    0-511, tokenized in batches of 256) with the saved tokenizer, and ends with the same bytes as an uninterrupted
    preparation."""
    from pydoc_data.topics import topics

    from data import sources
    from data.prepare import prepared_root

    paragraphs = [p for _, page in sorted(topics.items()) for p in page.split("\n\n") if len(p) > 80][:700]
    assert len(paragraphs) == 700
    corpus = tmp_path / "paragraphs.jsonl"
    corpus.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))
    cfg = data_cfg([corpus], shard_tokens=2000)
    cfg["tokenizer"]["train_chars"] = 20_000  # trained on the first documents; the rest stream after it
    whole = prepare(cfg, tmp_path / "whole", progress=False)
    real = sources.documents

    def failing(source):
        for i, doc in enumerate(real(source)):
            if i == 600:
                raise ConnectionError("the stream dropped")
            yield doc

    monkeypatch.setattr(sources, "documents", failing)
    with pytest.raises(ConnectionError):
        prepare(cfg, tmp_path / "cut", progress=False)
    root = prepared_root(cfg, tmp_path / "cut")
    saved = json.loads((root / "progress.json").read_text())
    assert saved["counts"]["documents"] == 512 and saved["train_shards"] == ["train_000.bin", "train_001.bin"]
    assert saved["val_parts"] == ["val_part_000.bin", "val_part_001.bin"]  # the held-out documents so far
    assert not (root / "meta.json").exists()
    # what a killed builder leaves: a temporary file not yet renamed (up to a shard each, and one per kill), and a
    # shard past this attempt's last (an earlier attempt with smaller data.shard_tokens)
    (root / ".train_002.bin.k1ll3d.tmp").write_bytes(b"\0" * 4096)
    os.utime(root / ".train_002.bin.k1ll3d.tmp", (time.time() - 7200,) * 2)
    (root / ".train_003.bin.wr1t1ng.tmp").write_bytes(b"\0")  # fresh: maybe another node's builder, kept
    shards.write_shard(root / "train_009.bin", np.arange(10, dtype=np.uint16))
    monkeypatch.setattr(sources, "documents", real)
    capsys.readouterr()
    resumed = prepare(cfg, tmp_path / "cut", progress=False)
    err = capsys.readouterr().err
    assert "resuming the data preparation" in err and "after 512 documents" in err
    assert [p.name for p in resumed.train_shards] == [p.name for p in whole.train_shards]
    for ours, theirs in zip(resumed.train_shards + [resumed.val_shard, resumed.tokenizer_path],
                            whole.train_shards + [whole.val_shard, whole.tokenizer_path]):
        assert ours.read_bytes() == theirs.read_bytes(), ours.name
    assert resumed.meta["tokens"] == whole.meta["tokens"]
    assert resumed.meta["seconds"] >= saved["seconds"]  # the time of both attempts
    (root / ".train_003.bin.wr1t1ng.tmp").unlink()
    assert sorted(p.name for p in root.iterdir()) == sorted(p.name for p in whole.root.iterdir())  # nothing left


@pytest.mark.parametrize(("documents", "train_shards", "how"), [
    (300, 2, "trained"),  # the last shard holds 44 documents
    (257, 1, "trained"),  # the last shard holds only the last document: it goes
    (300, 2, "template"),  # a loaded tokenizer whose template ends every encoding with EOS (the template is not used)
    (256, 1, "resumed"),  # the source fails after the shard of all 256: the resume finds only the saved progress
])
def test_small_shards_that_took_every_document_give_the_last_one_back_for_validation(tmp_path, monkeypatch, documents,
                                                                                      train_shards, how):
    """No document falls in the validation split and small shards wrote every one before the end (a shard per batch
    of 256 documents): the last document is taken back from the last shard. Together the files hold the same tokens
    as with one large shard, and validation the same document."""
    from tokenizers import processors

    from data import sources
    from data.prepare import prepared_root
    from data.tokenizer import train_bpe

    texts = [f"document {i}: " + "some words " * (5 + i % 7) for i in range(documents)]
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    cfg = data_cfg([path], val_fraction=1e-9)
    if how == "template":
        tok = train_bpe(texts, 300)
        eos = tok.token_to_id("<|endoftext|>")
        tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                           special_tokens=[("<|endoftext|>", eos)])
        tok.save(str(tmp_path / "tokenizer.json"))
        cfg["tokenizer"] = dict(cfg["tokenizer"], path=str(tmp_path / "tokenizer.json"))
    if how == "resumed":
        cfg["tokenizer"]["train_chars"] = 2000  # trained on the first documents, not the whole (failing) stream
        real = sources.documents

        def failing(source):
            yield from real(source)
            raise ConnectionError("the stream dropped after its last document")

        monkeypatch.setattr(sources, "documents", failing)
        with pytest.raises(ConnectionError):
            prepare(dict(cfg, shard_tokens=10), tmp_path / "small", progress=False)
        monkeypatch.setattr(sources, "documents", real)
        saved = json.loads((prepared_root(cfg, tmp_path / "small") / "progress.json").read_text())
        assert saved["counts"]["documents"] == 256 and saved["last_train_tokens"] > 1
    small = prepare(dict(cfg, shard_tokens=10), tmp_path / "small", progress=False)
    large = prepare(dict(cfg, shard_tokens=10**8), tmp_path / "large", progress=False)
    assert len(small.train_shards) == train_shards and len(large.train_shards) == 1
    assert small.meta["tokens"] == large.meta["tokens"] and small.meta["tokens"]["val_documents"] == 1

    def tokens(prepared):
        return np.concatenate([np.asarray(shards.read_shard(p)) for p in prepared.train_shards + [prepared.val_shard]])

    np.testing.assert_array_equal(tokens(small), tokens(large))
    np.testing.assert_array_equal(shards.read_shard(small.val_shard), shards.read_shard(large.val_shard))
    assert sorted(p.name for p in small.root.iterdir()) == sorted(
        ["meta.json", "tokenizer.json", "val.bin"] + [p.name for p in small.train_shards])  # no resume files left


def test_a_preparation_that_fails_for_too_little_text_leaves_no_progress(tmp_path):
    """One document cannot be split into train and validation. The preparation fails after writing a shard and a
    resume point, and removes the resume point: a corrected source then starts afresh instead of resuming into the
    same failure."""
    from data.prepare import prepared_root

    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"text": "a single document of a few words " * 20}) + "\n")
    cfg = data_cfg([path], shard_tokens=10)
    with pytest.raises(ConfigError, match="one document cannot be split"):  # nanoGPT's one input.txt too
        prepare(cfg, tmp_path / "cache", progress=False)
    root = prepared_root(cfg, tmp_path / "cache")
    assert (root / "train_000.bin").exists() and not (root / "progress.json").exists()


def test_a_max_tokens_cap_that_leaves_too_little_text_names_the_cap(tmp_path):
    """Enough documents, but data.max_tokens stops after the first: the error names the cap, not the corpus."""
    path = tmp_path / "five.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} of a few words " * 40}) + "\n" for i in range(5)))
    with pytest.raises(ConfigError, match=r"data.max_tokens=10: preparation stopped after 1 document\(s\)") as err:
        prepare(data_cfg([path], max_tokens=10), tmp_path / "cache", progress=False)
    assert err.value.key == "data.max_tokens"
    assert prepare(data_cfg([path]), tmp_path / "cache", progress=False).meta["tokens"]["train"] > 0  # uncapped: fine


def test_long_documents_are_tokenized_in_smaller_batches():
    from data.prepare import _batches

    short = [[len(b) for b in _batches(["x" * 10] * 600)]]
    assert short == [[256, 256, 88]]
    books = [len(b) for b in _batches(["x" * 1_500_000] * 10)]  # ~4M characters a batch
    assert books == [3, 3, 3, 1]


def test_max_tokens_stops_within_one_document_of_the_limit(tmp_path, corpus_file):
    """max_tokens holds to a document: the corpus (400 documents) is cut after the document that reaches it."""
    prepared = prepare(data_cfg([corpus_file], max_tokens=3000), tmp_path, progress=False)
    counts = prepared.meta["tokens"]
    longest = max(len(json.loads(line)["text"]) for line in corpus_file.read_text().splitlines())
    assert 3000 <= counts["train"] + counts["val"] < 3000 + longest + 1  # at most one document past the limit
    assert counts["documents"] < 256  # a batch of 256 documents would overshoot far more


def test_local_file_formats(tmp_path):
    (tmp_path / "a.txt").write_text("first document\nwith two lines")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "second"}) + "\n" + json.dumps({"text": "third"}) + "\n")
    import zstandard

    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "fourth"}\n'))  # SlimPajama's
    docs = list(file_documents([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl.gz"), str(tmp_path / "c.jsonl.zst")]))
    assert docs == ["first document\nwith two lines", "second", "third", "fourth"]
    (tmp_path / "e.jsonl.lz4").write_bytes(b"")
    with pytest.raises(ConfigError, match="optionally compressed"):
        list(file_documents([str(tmp_path / "e.jsonl.lz4")]))
    with pytest.raises(ConfigError, match="data.source.paths"):
        list(file_documents([str(tmp_path / "missing*.jsonl")]))


def test_a_cache_cut_at_another_shard_size_is_reused_and_says_so(tmp_path, capsys):
    (tmp_path / "corpus").mkdir()
    for i in range(8):
        (tmp_path / "corpus" / f"{i}.txt").write_text(f"document {i}: " + "some words to tokenize " * 50)
    first = prepare(data_cfg([tmp_path / "corpus"], shard_tokens=1000), tmp_path / "cache", progress=False)
    assert first.meta["shard_tokens"] == 1000
    capsys.readouterr()
    again = prepare(data_cfg([tmp_path / "corpus"], shard_tokens=1000), tmp_path / "cache", progress=False)
    assert again.root == first.root and "shard_tokens" not in capsys.readouterr().err
    other = prepare(data_cfg([tmp_path / "corpus"], shard_tokens=500), tmp_path / "cache", progress=False)
    assert other.root == first.root and "data.shard_tokens=1,000" in capsys.readouterr().err


@pytest.mark.parametrize("streaming", [True, False])
def test_empty_files_hold_no_documents(tmp_path, streaming):
    """A zero-byte or blank file among the inputs (a shard still being written, a filtered-out split) is skipped:
    the json loader raised StopIteration on it, which surfaced as "generator raised StopIteration"."""
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "first"}) + "\n")
    (tmp_path / "b.jsonl").write_bytes(b"")
    (tmp_path / "c.jsonl").write_text("\n\n")
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write("")
    (tmp_path / "e.parquet").write_bytes(b"")
    (tmp_path / "f.txt").write_bytes(b"")
    (tmp_path / "g.jsonl").write_text(json.dumps({"text": "last"}) + "\n")
    assert list(file_documents([str(tmp_path)], streaming=streaming)) == ["first", "last"]
    only_empty = tmp_path / "none"
    only_empty.mkdir()
    (only_empty / "b.jsonl").write_bytes(b"")
    with pytest.raises(ConfigError, match="yielded no text"):
        prepare(data_cfg([only_empty]), tmp_path / "prep", progress=False)


@pytest.mark.parametrize("streaming", [True, False])
def test_a_file_the_loaders_cannot_read_is_named(tmp_path, streaming):
    """datasets' own errors (a Latin-1 byte in txt, a broken json line, a truncated gzip) name no file, and
    consecutive txt files are read in one call: the error names the file and says what to do."""
    from data.sources import DataSourceError

    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "b.txt").write_bytes("caf\u00e9 au lait".encode("latin-1"))
    (tmp_path / "c.txt").write_text("fine too")
    with pytest.raises(DataSourceError, match="UTF-8") as err:
        list(file_documents([str(tmp_path / n) for n in ("a.txt", "b.txt", "c.txt")], streaming=streaming))
    assert str(tmp_path / "b.txt") in str(err.value) and "a.txt" not in str(err.value)
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "ok"}) + "\n{broken\n")
    with pytest.raises(DataSourceError, match="d.jsonl"):
        list(file_documents([str(tmp_path / "d.jsonl")], streaming=streaming))
    (tmp_path / "e.txt.gz").write_bytes(gzip.compress(b"a whole document " * 50)[:40])
    with pytest.raises(DataSourceError, match="e.txt.gz.*complete"):
        list(file_documents([str(tmp_path / "e.txt.gz")], streaming=streaming))
    # through prepare: the error, and no empty cache folder of a preparation that wrote nothing
    with pytest.raises(DataSourceError, match="d.jsonl"):
        prepare(data_cfg([tmp_path / "d.jsonl"]), tmp_path / "prep", progress=False)
    assert [p.name for p in (tmp_path / "prep").iterdir() if not p.name.endswith(".lock")] == []


def test_a_glob_takes_files_only(tmp_path):
    (tmp_path / "a.txt").write_text("a document")
    (tmp_path / "x.txt").mkdir()  # a folder whose name matches the glob
    from data.sources import resolve_files

    assert resolve_files([str(tmp_path / "*.txt")]) == [str(tmp_path / "a.txt")]


def test_a_file_named_by_two_paths_is_read_once(tmp_path):
    """paths=[corpus/, corpus/*.jsonl] read c.jsonl twice: each held-out document entered training as its copy."""
    from data.sources import resolve_files

    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "a document"}) + "\n")
    (tmp_path / "b.txt").write_text("another")
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "c.jsonl")
    got = resolve_files([str(tmp_path / "*.jsonl"), str(tmp_path), str(tmp_path / "c.jsonl")])
    assert got == [str(tmp_path / "c.jsonl"), str(tmp_path / "b.txt")]  # the first naming; the link is the same file


def test_a_hub_dataset_without_the_text_field_names_the_key(monkeypatch):
    import datasets

    from data.sources import hub_documents

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: [{"content": "some text"}])
    with pytest.raises(ConfigError, match="data.source.text_field") as err:
        list(hub_documents("some/corpus", None, "train", "text"))
    assert "content" in str(err.value)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: (_ for _ in ()).throw(ValueError()))
    with pytest.raises(Exception, match="could not open the HuggingFace dataset"):  # an empty message, no IndexError
        list(hub_documents("some/corpus", None, "train", "text"))


def test_a_hub_dataset_without_that_split_or_config_names_the_key(tmp_path):
    """A local dataset folder read as data=hf: a wrong split was blamed on hub access ("this machine may have no hub
    access"); it names data.source.split (or .config) with datasets' own list of what there is."""
    from data.sources import hub_documents

    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "train.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3)))
    with pytest.raises(ConfigError, match=r"data.source.split='validation'.*Available splits: \['train'\]") as err:
        list(hub_documents(str(tmp_path / "corpus"), None, "validation", "text"))
    assert err.value.key == "data.source.split"
    with pytest.raises(ConfigError, match="data.source.config='nope'"):
        list(hub_documents(str(tmp_path / "corpus"), "nope", "train", "text"))
    assert list(hub_documents(str(tmp_path / "corpus"), None, "train", "text")) == ["doc 0", "doc 1", "doc 2"]


def test_a_text_field_that_is_not_text_is_refused_and_null_rows_are_counted(tmp_path):
    """A list of strings was joined without a separator (the tokenizer read it as a pair), a number failed with a
    bare TypeError; rows whose field is null (later rows naming their text otherwise) vanished without a word."""
    from data.sources import file_documents

    for value, kind in (([" first part", "second part"], "list"), (7, "int")):
        path = tmp_path / f"{kind}.jsonl"
        path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
        with pytest.raises(ConfigError, match=f"holds {kind} values in .*{kind}.jsonl \\(row 2\\), not text") as err:
            list(file_documents([str(path)]))
        assert err.value.key == "data.source.text_field"
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(json.dumps({"text": f"doc {i}"} if i % 2 else {"content": f"doc {i}"}) + "\n"
                             for i in range(6)))
    for streaming in (True, False):
        with pytest.warns(UserWarning, match=r"3 of 6 rows of .*mixed.jsonl have no 'text' \(null\)"):
            assert list(file_documents([str(mixed)], streaming=streaming)) == ["doc 1", "doc 3", "doc 5"]


def test_special_token_text_inside_a_document_stays_text(tmp_path):
    """A document quoting "<|endoftext|>" (code, web text about tokenizers) keeps it as text: one EOS per document,
    at its end, so window_start=document still finds the documents where they begin."""
    from data.tokenizer import EOS, eos_id

    docs = [f"plain document number {i} about cats and dogs" for i in range(40)]
    docs[7] = f"a tokenizer marks the end with {EOS} and then goes on"
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepared = prepare(data_cfg([path], vocab=280), tmp_path / "cache", progress=False)
    eos = eos_id(load_tokenizer(prepared.tokenizer_path))
    tokens = np.concatenate([shards.read_shard(p) for p in prepared.train_shards + [prepared.val_shard]])
    assert int((tokens == eos).sum()) == prepared.meta["tokens"]["documents"] == len(docs)


def test_embedded_corpus_is_english_prose():
    docs = []
    for doc in embedded_documents():
        docs.append(doc)
        if len(docs) == 20:
            break
    text = " ".join(docs)
    assert len(text) > 20_000 and " the " in text


def test_prepare_round_trip_and_cache(tmp_path, corpus_file):
    cfg = data_cfg([corpus_file])
    first = prepare(cfg, tmp_path / "cache", progress=False)
    tok = load_tokenizer(first.tokenizer_path)
    assert tok.get_vocab_size() == 300 == first.vocab_size
    train = np.concatenate([shards.read_shard(p) for p in first.train_shards])
    val = shards.read_shard(first.val_shard)
    assert train.dtype == np.uint16 and train.size == first.meta["tokens"]["train"] and val.size > 0
    eos = first.meta["tokenizer"]["eos_id"]
    # Decoding the first training document gives back the first non-held-out document of the corpus.
    first_doc = tok.decode(train[: int(np.argmax(train == eos))].tolist())
    corpus = [json.loads(line)["text"] for line in corpus_file.read_text().splitlines()]
    assert first_doc in corpus
    mtime = (first.root / "meta.json").stat().st_mtime_ns
    again = prepare(cfg, tmp_path / "cache", progress=False)
    assert again.root == first.root and (again.root / "meta.json").stat().st_mtime_ns == mtime  # reused
    for spelling in (corpus_file.parent, corpus_file.parent / "*.jsonl"):  # the same files, named otherwise
        assert prepare(data_cfg([spelling]), tmp_path / "cache", progress=False).root == first.root, spelling
    from data.prepare import cache_key

    legacy = tmp_path / "cache" / f"files-{cache_key(cfg, spelled_paths=True)}"  # the key before 2026-12-02
    first.root.rename(legacy)
    found = prepare(cfg, tmp_path / "cache", progress=False)
    assert found.root == legacy and (legacy / "meta.json").stat().st_mtime_ns == mtime  # found, not tokenized again
    other = prepare(data_cfg([corpus_file], vocab=320), tmp_path / "cache", progress=False)
    assert other.root != first.root  # another input hash, another folder


def test_concurrent_prepare_waits_for_the_one_that_builds(tmp_path, corpus_file):
    import threading

    from data.prepare import cache_key, exclusive_lock

    cfg = data_cfg([corpus_file])
    root = tmp_path / "cache" / f"files-{cache_key(cfg)}"
    root.parent.mkdir(parents=True)
    results = []
    with exclusive_lock(root.parent / f".{root.name}.lock", "held by the test"):  # another rank is building
        waiter = threading.Thread(target=lambda: results.append(prepare(cfg, tmp_path / "cache", progress=False)))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and not root.exists()  # it waits instead of tokenizing too
    waiter.join(timeout=120)
    assert not waiter.is_alive() and results[0].root == root and (root / "meta.json").is_file()


def test_without_flock_a_builder_overtaken_by_another_returns_its_data(tmp_path, corpus_file, monkeypatch):
    """Where the file system has no flock, two builders of one folder run side by side; the one that finishes first
    removes the validation parts the other resumes through. The late one must return the finished data, not fail."""
    from contextlib import contextmanager

    import data.prepare as prep

    @contextmanager
    def no_flock(path, waiting_message):  # what exclusive_lock yields where flock fails with ENOLCK / EOPNOTSUPP
        yield

    monkeypatch.setattr(prep, "exclusive_lock", no_flock)
    cfg = data_cfg([corpus_file], tokenizer={"path": None, "vocab_size": 300, "train_chars": 20_000},
                   shard_tokens=2_000)
    real_write, overtaken = shards.write_shard, []

    def write_shard(path, tokens):
        real_write(path, tokens)
        if Path(path).name.startswith("val_part_") and not overtaken:  # the late builder is mid-way
            overtaken.append(None)
            overtaken[0] = prepare(cfg, tmp_path, progress=False)  # the other one runs to the end meanwhile

    monkeypatch.setattr(prep.shards, "write_shard", write_shard)
    late = prepare(cfg, tmp_path, progress=False)
    assert overtaken and late.root == overtaken[0].root and late.meta["tokens"] == overtaken[0].meta["tokens"]
    np.testing.assert_array_equal(shards.read_shard(late.val_shard), shards.read_shard(overtaken[0].val_shard))
    assert sorted(p.name for p in late.root.iterdir()) == ["meta.json", "tokenizer.json", "train_000.bin", "val.bin"]


def test_windows_are_deterministic_by_seed_index_rank(tmp_path, corpus_file):
    prepared = prepare(data_cfg([corpus_file]), tmp_path, progress=False)
    ds = TrainWindows(prepared.train_shards, seq_len=32, batch_size=4, seed=0, rank=0, length=100)
    assert ds[5].shape == (4, 33)
    assert (ds[5] == TrainWindows(prepared.train_shards, 32, 4, 0, 0, 100)[5]).all()
    assert not (ds[5] == ds[6]).all()
    assert not (ds[5] == TrainWindows(prepared.train_shards, 32, 4, 0, 1, 100)[5]).all()
    size = shards.read_shard(prepared.val_shard).size
    val = FixedWindows(prepared.val_shard, seq_len=32, max_windows=3)
    every = FixedWindows(prepared.val_shard, seq_len=32, max_windows=10**6)
    assert len(every) == (size - 1) // 32 > 3 and (every[1][0] == every[0][-1])  # consecutive: a shared boundary
    picked = [i * len(every) // 3 for i in range(3)]
    assert len(val) == 3 and all((val[i] == every[j]).all() for i, j in enumerate(picked))  # spread over the shard
    # a split shorter than one window: a ConfigError (train.py prints one line), not a traceback naming no key
    train_size = sum(shards.read_shard(p).size for p in prepared.train_shards)
    with pytest.raises(ConfigError, match="data.seq_len=.*validation shard .*raise data.val_fraction") as err:
        FixedWindows(prepared.val_shard, seq_len=size, max_windows=3)
    assert err.value.key == "data.seq_len"
    with pytest.raises(ConfigError, match=f"training shards \\({train_size:,} tokens\\) hold no window"):
        TrainWindows(prepared.train_shards, seq_len=train_size, batch_size=4, seed=0, rank=0, length=100)


def test_every_grid_phase_a_shards_slack_allows_is_drawn(tmp_path):
    """The phase of a shard's window grid is drawn from 0 to its slack, both ends included (the slack's last token
    would otherwise never start a pass's grid), and the shard dtype holds ids up to 65535 in 16 bits."""
    path = tmp_path / "s.bin"
    shards.write_shard(path, np.arange(1, 1 + 3 * 32 + 1 + 3, dtype=np.uint16))  # 3 windows of 32, slack 3
    ds = TrainWindows([path], 32, 1, seed=0, rank=0, length=10)
    assert ds.slack.tolist() == [3]
    assert {int(ds._order(p)[2][0]) for p in range(200)} == {0, 1, 2, 3}
    assert shards.dtype_for_vocab(1 << 16) is np.uint16 and shards.dtype_for_vocab((1 << 16) + 1) is np.uint32

@pytest.mark.parametrize("start", ["any", "document"])
def test_shuffled_windows_take_each_window_once_per_pass(tmp_path, start):
    """Over the ranks and steps of a pass every window is drawn once (no gaps, no repeats); the next pass draws them
    in another order and, for start="any", on a shifted grid. sampling="random" repeats windows within a pass."""
    rng = np.random.default_rng(0)
    eos, paths = 0, []
    for s, length in enumerate((1000, 257, 77)):  # the last shard holds 2 windows of 33 and 10 tokens to spare
        tokens = rng.integers(1, 500, length)
        tokens[rng.choice(length, length // 20, replace=False)] = eos
        paths.append(tmp_path / f"s{s}.bin")
        shards.write_shard(paths[-1], tokens.astype(np.uint16))
    data = [np.asarray(shards.read_shard(p)) for p in paths]
    seq, batch, world = 32, 3, 2

    def rows(ds_per_rank, micro_batches):  # (shard, offset) of every row of micro-batches 0.., in sample order
        found = []
        for i in range(micro_batches):
            for ds in ds_per_rank:
                for row in ds[i].numpy():
                    hits = [(s, o) for s in range(len(data)) for o in range(data[s].size - seq)
                            if (data[s][o : o + seq + 1] == row).all()]
                    assert len(hits) == 1
                    found.append(hits[0])
        return found

    kw = dict(start=start, eos_id=eos)
    ranks = [TrainWindows(paths, seq, batch, seed=1, rank=r, length=10**6, world=world, **kw) for r in range(world)]
    total = int(ranks[0].cum[-1])
    assert total == (sum((d.size - 1) // seq for d in data) if start == "any" else
                     sum(len(o) for o in ranks[0].offsets))
    steps = -(-2 * total // (world * batch)) + 1  # a little more than two passes
    drawn = rows(ranks, steps)
    first, second = drawn[:total], drawn[total: 2 * total]
    assert len(set(first)) == total and len(set(second)) == total  # each window once per pass
    assert first != second  # another order ...
    if start == "any":  # ... on a grid whose phase moved in some shard (a shard's offsets keep one residue)
        assert {(s, o % seq) for s, o in first} != {(s, o % seq) for s, o in second}
        assert len({o % seq for s, o in first if s == 0}) == 1
    # sample t of the run is the same, whatever the world size that reads it
    alone = TrainWindows(paths, seq, world * batch, seed=1, rank=0, length=10**6, **kw)
    assert rows([alone], steps) == drawn
    # init_from: an offset of k samples continues the stream k samples on
    later = TrainWindows(paths, seq, batch, seed=1, rank=0, length=10**6, offset=5 * world * batch, **kw)
    assert (later[0] == ranks[0][5]).all()
    random = TrainWindows(paths, seq, batch, seed=1, rank=0, length=10**6, sampling="random", **kw)
    drawn = rows([random], -(-total // batch))
    if start == "document":
        assert len(set(drawn)) < total  # with replacement: repeats within a pass' worth, and gaps
    else:
        assert len({o % seq for s, o in drawn if s == 0}) > 1  # any offset, off a grid
    with pytest.raises(ValueError, match="sampling"):
        TrainWindows(paths, seq, batch, 0, 0, 10, sampling="epoch", **kw)


def test_a_document_start_counts_only_with_a_whole_window_after_it():
    """seq_len + 1 tokens from the start on: the start that leaves exactly that many counts, one later does not."""
    from data.datamodule import document_starts

    seq_len, eos = 4, 0
    tokens = np.array([7, 7, eos, 7, 7, eos, 7, eos, 7])  # documents start at 0, 3, 6 and 8; 9 tokens
    assert document_starts(tokens, eos, seq_len).tolist() == [0, 3]  # from 3, 5 tokens are left; from 6, 3
    assert document_starts(tokens[:8], eos, seq_len).tolist() == [0, 3]  # from 3, exactly 5 are left
    assert document_starts(tokens[:7], eos, seq_len).tolist() == [0]  # from 3, 4: one token short
    assert document_starts(tokens[:7], eos, 3).tolist() == [0, 3]
    assert all(start + seq_len + 1 <= tokens.size for start in document_starts(tokens, eos, seq_len))


def test_document_windows_open_where_a_document_begins(tmp_path):
    # Documents of random lengths (one shorter than a window, one longer) separated by eos=0, in two shards.
    rng = np.random.default_rng(1)
    eos, paths, starts = 0, [], set()
    for s in range(2):
        tokens = []
        for length in rng.integers(5, 60, 12):
            starts.add((s, len(tokens)))
            tokens += list(rng.integers(1, 500, length)) + [eos]
        paths.append(tmp_path / f"s{s}.bin")
        shards.write_shard(paths[-1], np.array(tokens, dtype=np.uint16))
    ds = TrainWindows(paths, seq_len=24, batch_size=16, seed=3, rank=0, length=50, start="document", eos_id=eos)
    data = [shards.read_shard(p) for p in paths]
    seen = set()
    for i in range(50):
        for row in ds[i].numpy():
            hits = [(s, o) for s, o in starts
                    if o + 25 <= data[s].size and (data[s][o : o + 25] == row).all()]
            assert hits, "a window that does not open at a document start"
            seen.update(hits)
    assert len(seen) > 10  # many different documents are drawn, from both shards
    assert {s for s, _ in seen} == {0, 1}
    val = FixedWindows(paths[0], seq_len=24, max_windows=100, start="document", eos_id=eos)
    opened = [o for row in val.windows.numpy() for s, o in starts
              if s == 0 and o + 25 <= data[0].size and (data[0][o : o + 25] == row).all()]
    assert len(opened) == len(val) >= 3  # every validation window opens at a document start ...
    assert all(b - a >= 24 for a, b in zip(opened, opened[1:]))  # ... after the previous one ends
    assert len(FixedWindows(paths[0], seq_len=24, max_windows=2, start="document", eos_id=eos)) == 2
    with pytest.raises(ValueError, match="eos_id"):
        FixedWindows(paths[0], 24, 4, start="document")
    with pytest.raises(ValueError, match="eos_id"):
        TrainWindows(paths, 24, 4, 0, 0, 10, start="document")
    with pytest.raises(ValueError, match="window start"):
        TrainWindows(paths, 24, 4, 0, 0, 10, start="middle")


def test_document_validation_windows_take_a_start_where_the_last_window_ends(tmp_path):
    """A validation window opens at the first document start from the last window's final token on: that token is
    then the next window's first input, as with consecutive windows of start="any". Documents of exactly seq_len
    tokens (their eos included) thus give one window each; a start at the last window's final token skipped as taken
    would drop every other document from the validation set."""
    rng = np.random.default_rng(2)
    seq_len, eos, n_docs = 8, 0, 12
    tokens = np.concatenate([np.append(rng.integers(1, 500, seq_len - 1), eos) for _ in range(n_docs)])
    path = tmp_path / "val.bin"
    shards.write_shard(path, tokens.astype(np.uint16))
    val = FixedWindows(path, seq_len=seq_len, max_windows=100, start="document", eos_id=eos)
    # the last document start with a whole window after it: n_docs - 2 (the final one has only seq_len tokens left)
    want = [tokens[o : o + seq_len + 1] for o in range(0, (n_docs - 1) * seq_len, seq_len)]
    assert len(val) == n_docs - 1
    assert all((row.numpy() == w).all() for row, w in zip(val.windows, want))


@pytest.mark.parametrize("rank,world,step,accumulate", [(0, 1, 0, 1), (1, 2, 3, 2), (0, 2, 2, 3)])
def test_the_training_loader_reads_this_ranks_micro_batches_from_the_trainers_step(tmp_path, rank, world, step,
                                                                                 accumulate):
    """TokenDataModule's loader, under a trainer at global step s with accumulation a on rank r of w: micro-batches
    s * a, s * a + 1, ... of TrainWindows for (rank r, world w), each once; a rank or world read from the wrong
    attribute (or the step without the accumulation) replays or skips batches, or every rank reads the same ones."""
    from types import SimpleNamespace

    from data.datamodule import TokenDataModule

    rng = np.random.default_rng(rank * 10 + world)
    paths = []
    for s, length in enumerate((700, 300)):
        paths.append(tmp_path / f"s{s}.bin")
        shards.write_shard(paths[-1], rng.integers(1, 500, length).astype(np.uint16))
    total = 12
    dm = TokenDataModule(paths, paths[0], seq_len=16, batch_size=2, seed=4, total_micro_batches=total)
    dm.trainer = SimpleNamespace(global_rank=rank, world_size=world, global_step=step,
                                 accumulate_grad_batches=accumulate)
    batches = list(dm.train_dataloader())
    want = TrainWindows(paths, 16, 2, seed=4, rank=rank, length=total, world=world)
    assert len(batches) == total - step * accumulate
    for i, batch in enumerate(batches, start=step * accumulate):
        assert torch.equal(batch, want[i]), i
    assert not torch.equal(batches[0], batches[1])
    if world > 1:  # another rank reads other windows
        other = TrainWindows(paths, 16, 2, seed=4, rank=1 - rank, length=total, world=world)
        assert not torch.equal(batches[0], other[step * accumulate])


def test_existing_tokenizer_is_loaded(tmp_path, corpus_file):
    first = prepare(data_cfg([corpus_file]), tmp_path / "a", progress=False)
    cfg = data_cfg([corpus_file])
    cfg["tokenizer"]["path"] = str(first.tokenizer_path)
    second = prepare(cfg, tmp_path / "b", progress=False)
    assert not second.meta["tokenizer"]["trained"]
    assert second.meta["tokenizer"]["hash"] == first.meta["tokenizer"]["hash"]


def test_json_files_with_different_fields_are_read_together_in_order(tmp_path):
    """The advertised mixture: probe documents (text + metadata fields) next to books (text + title), and txt."""
    from data.probes import ProbeSpec, write_jsonl

    probes = write_jsonl(ProbeSpec(task="kv", length=200, num_pairs=2), 3, tmp_path / "probes.jsonl")
    with gzip.open(tmp_path / "books.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "a book", "title": "T", "year": 1900}) + "\n")
    (tmp_path / "a.txt").write_text("a text file")
    files = [tmp_path / "a.txt", probes, tmp_path / "books.jsonl.gz"]
    probe_texts = [json.loads(line)["text"] for line in probes.read_text().splitlines()]
    for streaming in (True, False):
        docs = list(file_documents([str(p) for p in files], streaming=streaming))
        assert docs == ["a text file"] + probe_texts + ["a book"]  # the order of the paths
    # books whose text is in another field, next to txt files (whose one column is their text): refused before
    (tmp_path / "other.jsonl").write_text(json.dumps({"content": "another book"}) + "\n")
    mixed = [str(tmp_path / "a.txt"), str(tmp_path / "other.jsonl")]
    assert list(file_documents(mixed, text_field="content")) == ["a text file", "another book"]


def test_a_file_name_with_glob_characters_is_that_file(tmp_path):
    from data.sources import resolve_files

    (tmp_path / "notes[1].txt").write_text("the bracketed one")
    (tmp_path / "notes1.txt").write_text("what the glob notes[1].txt matches")
    (tmp_path / "q?.jsonl").write_text(json.dumps({"text": "the questioned one"}) + "\n")
    (tmp_path / "qa.jsonl").write_text(json.dumps({"text": "what the glob q?.jsonl matches"}) + "\n")
    (tmp_path / "set[1]").mkdir()
    (tmp_path / "set[1]" / "a.txt").write_text("inside a bracketed folder")
    named = [str(tmp_path / "notes[1].txt"), str(tmp_path / "q?.jsonl"), str(tmp_path / "set[1]")]
    assert resolve_files(named) == named[:2] + [str(tmp_path / "set[1]" / "a.txt")]
    assert list(file_documents(named)) == ["the bracketed one", "the questioned one", "inside a bracketed folder"]
    assert resolve_files([str(tmp_path / "notes?.txt")]) == [str(tmp_path / "notes1.txt")]  # a pattern still globs


def _tokens_by_document(paths, eos):
    tokens = np.concatenate([np.asarray(shards.read_shard(p)) for p in paths]).tolist()
    docs, start = [], 0
    for i, t in enumerate(tokens):
        if t == eos:
            docs.append(tokens[start:i])
            start = i + 1
    return docs


def test_a_loaded_tokenizer_neither_truncates_nor_pads(tmp_path, corpus_file):
    from tokenizers import Tokenizer

    from data.tokenizer import EOS

    first = prepare(data_cfg([corpus_file]), tmp_path / "a", progress=False)
    tok = Tokenizer.from_file(str(first.tokenizer_path))
    tok.enable_truncation(max_length=16)  # as a tokenizer.json saved from a training setup may come
    tok.enable_padding(length=64, pad_id=first.meta["tokenizer"]["eos_id"], pad_token=EOS)
    tok.save(str(tmp_path / "truncating.json"))
    cfg = data_cfg([corpus_file])
    cfg["tokenizer"]["path"] = str(tmp_path / "truncating.json")
    second = prepare(cfg, tmp_path / "b", progress=False)
    assert second.meta["tokens"] == first.meta["tokens"]
    eos = first.meta["tokenizer"]["eos_id"]
    assert _tokens_by_document(second.train_shards, eos) == _tokens_by_document(first.train_shards, eos)
    assert load_tokenizer(tmp_path / "truncating.json").truncation is None


def test_a_loaded_tokenizers_template_adds_nothing_to_the_documents(tmp_path):
    """A Llama-style "<s> $A </s>" template would begin every document with a BOS and end it with two EOS (the
    template's and ours); evaluation encodes without the template, so the model would train on a layout it is never
    shown. The shards hold each document's plain tokens and one EOS, as with the same tokenizer without a template."""
    from tokenizers import processors

    from data.tokenizer import EOS, train_bpe

    docs = [f"a document number {i} about cats and dogs" for i in range(60)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = train_bpe(docs, 280)
    tok.add_special_tokens(["<s>"])
    tok.save(str(tmp_path / "plain.json"))
    ids = {t: tok.token_to_id(t) for t in ("<s>", EOS)}
    tok.post_processor = processors.TemplateProcessing(single=f"<s> $A {EOS}", special_tokens=list(ids.items()))
    tok.save(str(tmp_path / "template.json"))
    assert tok.encode(docs[0]).ids[0] == ids["<s>"]  # the template is on

    def prepared(name):
        cfg = data_cfg([path])
        cfg["tokenizer"] = dict(cfg["tokenizer"], path=str(tmp_path / name))
        return prepare(cfg, tmp_path / name.removesuffix(".json"), progress=False)

    with_template, without = prepared("template.json"), prepared("plain.json")
    for a, b in zip(with_template.train_shards + [with_template.val_shard], without.train_shards + [without.val_shard]):
        np.testing.assert_array_equal(shards.read_shard(a), shards.read_shard(b))
    tokens = np.asarray(shards.read_shard(with_template.train_shards[0]))
    assert ids["<s>"] not in tokens and not np.any((tokens[1:] == ids[EOS]) & (tokens[:-1] == ids[EOS]))
    assert with_template.meta["tokens"]["train"] + with_template.meta["tokens"]["val"] == sum(
        len(tok.encode(d, add_special_tokens=False).ids) + 1 for d in docs)


def test_the_saved_tokenizer_encodes_documents_as_the_shards_hold_them(tmp_path):
    """tokenizer.json (saved in checkpoints, loaded by train.py and analysis) reads a literal "<|endoftext|>" as
    text, as the shards do: every document encodes to exactly its tokens in the shards."""
    from data.prepare import _is_val
    from data.tokenizer import EOS, eos_id

    docs = [f"plain document number {i} about cats and dogs" for i in range(40)]
    docs[7] = f"a tokenizer marks the end with {EOS} and then goes on"
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepared = prepare(data_cfg([path], vocab=280), tmp_path / "cache", progress=False)
    tok = load_tokenizer(prepared.tokenizer_path)
    eos = eos_id(tok)
    assert eos not in tok.encode(docs[7]).ids
    train = [tok.encode(d).ids for i, d in enumerate(docs) if not _is_val(i, d, {"val_fraction": 0.1})]
    val = [tok.encode(d).ids for i, d in enumerate(docs) if _is_val(i, d, {"val_fraction": 0.1})]
    assert _tokens_by_document(prepared.train_shards, eos) == train
    assert _tokens_by_document([prepared.val_shard], eos) == val


def _split_texts(prepared):
    """The texts of the training and the validation documents of a preparation, as sets."""
    from data.tokenizer import eos_id

    tok = load_tokenizer(prepared.tokenizer_path)
    eos = eos_id(tok)
    return [{tok.decode(ids) for ids in _tokens_by_document(paths, eos)}
            for paths in (prepared.train_shards, [prepared.val_shard])]


def test_val_split_content_keeps_every_copy_of_a_document_on_one_side(tmp_path):
    """A web corpus repeats documents: split by index, copies of one document land in both train and validation,
    and its val loss measures recall. data.val_split=content hashes the text: every copy lands on one side."""
    docs = [f"document {i} says the {'cat' if i % 2 else 'dog'} sat on mat number {i * 7}" for i in range(40)]
    corpus = docs + docs[:20]  # the first 20 documents twice
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus))
    by_index = _split_texts(prepare(data_cfg([path], vocab=280, val_fraction=0.3), tmp_path / "a", progress=False))
    assert by_index[0] & by_index[1]  # the default split leaks copies into both sides
    by_text = _split_texts(prepare(data_cfg([path], vocab=280, val_fraction=0.3, val_split="content"),
                                   tmp_path / "b", progress=False))
    assert by_text[1] and not by_text[0] & by_text[1] and by_text[0] | by_text[1] == set(docs)


def test_val_split_content_keeps_the_held_out_documents_when_a_file_is_added_first(tmp_path):
    """Files are read in order: a file added before the others shifts every document's index, so an index split held
    out other documents (training under init_from on the grown corpus saw the old validation). By content, the old
    documents keep their side."""
    old, new = tmp_path / "b.jsonl", tmp_path / "a.jsonl"
    old.write_text("".join(json.dumps({"text": f"old text {i} about the river and the hill {i}"}) + "\n"
                           for i in range(40)))
    new.write_text("".join(json.dumps({"text": f"new text {i} about the sea"}) + "\n" for i in range(7)))
    splits = {}
    for split in ("index", "content"):
        before = _split_texts(prepare(data_cfg([old], vocab=280, val_fraction=0.3, val_split=split),
                                      tmp_path / f"{split}1", progress=False))
        after = _split_texts(prepare(data_cfg([new, old], vocab=280, val_fraction=0.3, val_split=split),
                                     tmp_path / f"{split}2", progress=False))
        splits[split] = before[1], {t for t in after[1] if t.startswith("old")}
    assert splits["index"][0] != splits["index"][1]
    assert splits["content"][0] == splits["content"][1] and splits["content"][0]


def test_val_split_is_checked_and_only_content_changes_the_cache_key(tmp_path):
    from data.prepare import cache_key, validate_data_config

    path = tmp_path / "c.txt"
    path.write_text("text")
    cfg = data_cfg([path])
    assert cache_key(cfg) == cache_key({**cfg, "val_split": "index"}) != cache_key({**cfg, "val_split": "content"})
    with pytest.raises(ConfigError, match="data.val_split"):
        validate_data_config({**cfg, "val_split": "hash"})


def test_cache_key_follows_what_the_shards_depend_on(tmp_path):
    """A new val_fraction, max_tokens cap, vocabulary, tokenizer file content or corpus file (size or mtime) gets its
    own cache; how windows are drawn later and the shard size do not (they are read after preparation)."""
    import os

    from data.prepare import cache_key

    path = tmp_path / "c.txt"
    path.write_text("text")
    cfg = data_cfg([path])
    key = cache_key(cfg)
    bigger_vocab = {"tokenizer": {**cfg["tokenizer"], "vocab_size": 320}}
    for changed in ({"val_fraction": 0.2}, {"max_tokens": 1000}, bigger_vocab):
        assert cache_key({**cfg, **changed}) != key, changed
    assert cache_key({**cfg, "window_start": "document", "sampling": "random", "shard_tokens": 10**6}) == key
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    loaded = {**cfg, "tokenizer": {**cfg["tokenizer"], "path": str(tok)}}
    before = cache_key(loaded)
    tok.write_text('{"other": 1}')
    assert cache_key(loaded) != before
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same size, touched
    assert cache_key(cfg) != key


def test_single_token_id_ignores_the_post_processor():
    """A Llama-style template ("<s> $A") adds a token to every encoding; one token of text is still one token."""
    from tokenizers import processors

    from data.tokenizer import single_token_id, train_bpe

    tok = train_bpe([f"is it {i} ? yes it is {i} ?" for i in range(50)], vocab_size=300)
    tok.add_special_tokens(["<s>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert len(tok.encode(" ?").ids) == 2  # the template is on
    assert single_token_id(tok, " ?") == tok.token_to_id("Ġ?") is not None
    assert single_token_id(tok, " ? ?") is None


def test_cache_key_covers_the_python_version_and_the_hub_revision(monkeypatch, tmp_path):
    """The embedded corpus is this Python's stdlib; a hub dataset is pinned by its revision, which reaches the hub."""
    import sys

    import datasets
    from omegaconf import OmegaConf

    from conftest import compose_train
    from data.prepare import cache_key
    from data.sources import documents

    cfg = {"source": {"kind": "embedded"}, "tokenizer": {"path": None, "vocab_size": 300, "train_chars": 10**7},
           "val_fraction": 0.05}
    from data import sources

    here = cache_key(cfg)
    # another patch release or build of the same 3.x (3.11.2 and 3.11.7 differ in pydoc pages and docstrings)
    monkeypatch.setattr(sys, "version", sys.version.replace(".", ".9", 1) + " (another build)")
    sources.embedded_identity.cache_clear()
    other_python = cache_key(cfg)
    monkeypatch.undo()
    sources.embedded_identity.cache_clear()
    assert other_python != here == cache_key(cfg)
    # a cache under the key of before (major.minor) is found, so the default corpus is not tokenized again
    from data.prepare import prepared_root

    legacy = tmp_path / "cache" / f"embedded-{cache_key(cfg, python_build=False)}"
    assert prepared_root(cfg, tmp_path / "cache") == tmp_path / "cache" / f"embedded-{here}"
    legacy.mkdir(parents=True)
    (legacy / "meta.json").write_text("{}")
    assert prepared_root(cfg, tmp_path / "cache") == legacy

    hub = OmegaConf.to_container(compose_train(["data=slimpajama"], tmp_path / "run").data.source)
    assert "revision" in hub and hub["revision"] is None
    seen = {}
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: seen.update(k) or [{"text": "some text"}])
    assert list(documents({**hub, "revision": "abc123"})) == ["some text"] and seen["revision"] == "abc123"
    assert cache_key({**cfg, "source": {**hub, "revision": "abc123"}}) != cache_key({**cfg, "source": hub})


def test_cache_key_covers_the_files_of_a_local_hf_dataset_folder(tmp_path):
    """data=hf with a local folder hashed only the folder's name: new documents in it reused the old shards."""
    import os

    from data.prepare import cache_key

    folder = tmp_path / "my_dataset"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps({"text": "a document"}) + "\n")
    cfg = {"source": {"kind": "hf", "name": str(folder), "config": None, "split": "train", "revision": None},
           "tokenizer": {"path": None, "vocab_size": 300, "train_chars": 10**7}, "val_fraction": 0.05}
    before = cache_key(cfg)
    assert cache_key(cfg) == before
    (folder / "train.jsonl").write_text(json.dumps({"text": "other documents, more of them"}) + "\n")
    os.utime(folder / "train.jsonl", ns=(1, 1))
    assert cache_key(cfg) != before
    hub = {**cfg, "source": {**cfg["source"], "name": "cerebras/SlimPajama-627B"}}
    assert cache_key(hub) == cache_key(hub)  # a hub name: no folder to read
    # a cache made under the key of before (the folder's name only) is found where it is newer than every file
    from data.prepare import prepared_root

    legacy = tmp_path / "cache" / f"hf-{cache_key(cfg, folder_files=False)}"
    legacy.mkdir(parents=True)
    (legacy / "meta.json").write_text("{}")
    assert prepared_root(cfg, tmp_path / "cache") == legacy
    os.utime(legacy / "meta.json", ns=(0, 0))  # older than the folder's file: prepared from other documents
    assert prepared_root(cfg, tmp_path / "cache") == tmp_path / "cache" / f"hf-{cache_key(cfg)}"
    # a file copied in with its old mtime (cp -p, rsync -a, tar) moves only the folder's: that counts too
    os.utime(folder, ns=(1, 1))
    os.utime(legacy / "meta.json", ns=(2, 2))
    assert prepared_root(cfg, tmp_path / "cache") == legacy
    (folder / "more.jsonl").write_text(json.dumps({"text": "a document copied in"}) + "\n")
    os.utime(folder / "more.jsonl", ns=(1, 1))
    assert prepared_root(cfg, tmp_path / "cache") == tmp_path / "cache" / f"hf-{cache_key(cfg)}"
    (folder / "more.jsonl").unlink()
    os.utime(folder, ns=(1, 1))
    (folder / ".cache").mkdir()  # hidden folders (.git, HF's .cache) are not the dataset's: they change nothing
    os.utime(folder, ns=(1, 1))
    assert prepared_root(cfg, tmp_path / "cache") == legacy


def test_a_local_hf_dataset_folder_may_be_named_from_home(tmp_path, monkeypatch):
    """data.source.name=~/corpus reaches Python unexpanded (Hydra leaves it): datasets would look it up on the hub."""
    from data.sources import hub_documents

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "train.jsonl").write_text(json.dumps({"text": "a document from home"}) + "\n")
    assert list(hub_documents("~/corpus", None, "train", "text")) == ["a document from home"]


def test_a_local_hf_dataset_folder_that_is_not_there_is_named_as_such(tmp_path):
    """It was "could not open the HuggingFace dataset ... no hub access": the wrong advice for a mistyped path."""
    from data.prepare import validate_data_config
    from model.config import ConfigError

    cfg = {"val_fraction": 0.05, "tokenizer": {"path": None, "vocab_size": 300, "train_chars": 1000}}
    for name in (str(tmp_path / "nowhere"), "./nowhere", "~/nowhere-at-all"):
        with pytest.raises(ConfigError, match="data.source.name.*no such folder"):
            validate_data_config({**cfg, "source": {"kind": "hf", "name": name}})
    validate_data_config({**cfg, "source": {"kind": "hf", "name": str(tmp_path)}})  # there: fine
    validate_data_config({**cfg, "source": {"kind": "hf", "name": "cerebras/SlimPajama-627B"}})  # a hub name


def test_a_folder_of_files_leaves_out_what_is_not_corpus(tmp_path, capsys):
    from data.sources import resolve_files

    for name in ("a.jsonl", "README.txt", "LICENSE", "notes.md", "MANIFEST.tsv", "p.jsonl.spec.json", ".hidden.txt"):
        (tmp_path / name).write_text(json.dumps({"text": "x"}) + "\n")
    assert resolve_files([str(tmp_path)]) == [str(tmp_path / "a.jsonl")]
    assert resolve_files([str(tmp_path)]) == [str(tmp_path / "a.jsonl")]
    said = capsys.readouterr().err
    assert said.count("left out of") == 1 and "README.txt" in said and "p.jsonl.spec.json" in said  # said once
    assert resolve_files([str(tmp_path / "README.txt")]) == [str(tmp_path / "README.txt")]  # named, it is read


def test_the_validation_split_is_the_same_in_every_version():
    """Which documents are held out is part of every prepared cache and every run's validation loss: pinned, so a
    change of the hash (its end of the range, its key) shows here instead of as silently other val losses."""
    from data.prepare import _is_val

    assert [i for i in range(200) if _is_val(i, "", {"val_fraction": 0.1})] == [
        6, 38, 41, 46, 57, 59, 61, 82, 88, 94, 104, 110, 151, 159, 195]
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    held = [w for w in words if _is_val(0, w, {"val_fraction": 0.2, "val_split": "content"})]
    assert held == ["alpha", "epsilon", "eta"]


def test_the_tokenizer_is_trained_on_training_documents_only(tmp_path):
    """A word only the validation documents hold gets no token of its own: the tokenizer never saw it."""
    from data.prepare import _is_val

    by_index = {"val_fraction": 0.1}  # the default data.val_split=index: the text does not count
    docs = [" zqxjv" * 60 if _is_val(i, "", by_index) else f"plain document number {i} about cats and dogs"
            for i in range(60)]
    assert any(_is_val(i, "", by_index) for i in range(60))
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepared = prepare(data_cfg([path], vocab=300), tmp_path / "cache", progress=False)
    vocab = load_tokenizer(prepared.tokenizer_path).get_vocab()
    assert not [t for t in vocab if "zq" in t or "xj" in t or "jv" in t]


def test_a_validation_split_far_below_val_fraction_is_warned_about(tmp_path, capsys):
    """Whole documents are held out: 43 Gutenberg books at val_fraction 0.05 gave one book, 1.6% of the tokens."""
    from data.prepare import _is_val

    # the hash split holds out none: the last one is moved
    assert not any(_is_val(i, "", {"val_fraction": 0.1}) for i in range(6))
    for name, long_first, warned in (("skewed", 400, True), ("even", 20, False)):
        docs = [f"document {i} " + "words and more words " * (long_first if i == 0 else 20) for i in range(6)]
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        prepared = prepare(data_cfg([path]), tmp_path / name, progress=False)
        assert prepared.meta["tokens"]["val_documents"] == 1
        err = capsys.readouterr().err
        assert ("validation holds 1 of 6 documents" in err) == warned, name
        assert "held out none of the 6 documents; validation is the last one" in err  # said, even when not skewed


def test_a_corpus_is_tokenized_with_threads_and_they_are_off_afterwards(tmp_path, corpus_file, monkeypatch):
    import os

    import data.prepare as prepare_module

    seen = []
    real_train_bpe = prepare_module.train_bpe

    def recording_train_bpe(*args, **kwargs):
        seen.append(os.environ.get("TOKENIZERS_PARALLELISM"))
        return real_train_bpe(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "train_bpe", recording_train_bpe)
    monkeypatch.setattr(prepare_module, "_USER_PARALLELISM", None)  # as if the process had started without it
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # set since by this code (a sweep's earlier job)
    threaded = prepare(data_cfg([corpus_file]), tmp_path / "threaded", progress=False)
    assert seen == ["true"] and os.environ["TOKENIZERS_PARALLELISM"] == "false"
    # the user's setting wins, and the threads change neither the tokenizer nor the ids
    monkeypatch.setattr(prepare_module, "_USER_PARALLELISM", "false")
    single = prepare(data_cfg([corpus_file]), tmp_path / "single", progress=False)
    assert seen == ["true", "false"]
    assert threaded.tokenizer_path.read_text() == single.tokenizer_path.read_text()
    assert all(np.array_equal(shards.read_shard(a), shards.read_shard(b))
               for a, b in zip(threaded.train_shards + [threaded.val_shard], single.train_shards + [single.val_shard]))


def test_a_tokenizer_whose_ids_skip_numbers_gets_shards_wide_enough(tmp_path):
    """get_vocab_size counts tokens: a tokenizer.json of 4 tokens with ids up to 70000 got uint16 shards (numpy 2:
    an OverflowError naming no file; numpy 1: ids wrapped in silence) and meta.vocab_size 4 for train.py's check."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, "low": 5, "high": 70000}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(["low", "high"][(i + j) % 2] for j in range(5 + i))})
                              + "\n" for i in range(40)))
    data = prepare(data_cfg([corpus], tokenizer={"path": str(tmp_path / "tokenizer.json")}, val_fraction=0.2),
                   tmp_path / "cache", progress=False)
    assert data.vocab_size == 70001 and data.meta["dtype"] == "uint32"
    tokens = np.concatenate([shards.read_shard(p) for p in data.train_shards + [data.val_shard]])
    assert set(tokens.tolist()) == {0, 5, 70000}


def test_the_umask_is_read_without_being_set(tmp_path, monkeypatch):
    """Setting the umask to 0 to read it back made files other threads created meanwhile world-writable."""
    import os

    calls = []
    real = os.umask
    monkeypatch.setattr(os, "umask", lambda mask: calls.append(mask) or real(mask))
    old = real(0o027)
    try:
        assert shards._umask() == 0o027
        shards.atomic_write_text(tmp_path / "r.json", "{}")
    finally:
        real(old)
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o640
    assert calls == [] or not Path("/proc/self/status").is_file()


@pytest.mark.parametrize("streaming", [True, False])
def test_parquet_json_bz2_and_xz_files_are_read_by_their_own_loaders(tmp_path, streaming):
    """The other advertised formats: parquet (read as json it is unreadable), a .json file holding one JSON array (read
    as text it is one document of JSON), .bz2 and .xz compression (named in the error message and the docs). An empty
    text field is no document (it made a document of one EOS)."""
    import bz2
    import lzma

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["from parquet", ""], "id": [1, 2]}), tmp_path / "a.parquet")
    (tmp_path / "b.json").write_text(json.dumps([{"text": "from a json array"}, {"text": "its second row"}]))
    (tmp_path / "c.jsonl.bz2").write_bytes(bz2.compress(b'{"text": "from bz2"}\n{"text": ""}\n'))
    (tmp_path / "d.txt.xz").write_bytes(lzma.compress("from xz\nthe same document".encode()))
    docs = list(file_documents([str(tmp_path / n) for n in ("a.parquet", "b.json", "c.jsonl.bz2", "d.txt.xz")],
                               streaming=streaming))
    assert docs == ["from parquet", "from a json array", "its second row", "from bz2", "from xz\nthe same document"]


def test_a_trained_tokenizer_round_trips_any_text_and_finds_each_kind_of_eos():
    """Without the byte alphabet, bytes absent from the training text (accents, CJK, emoji) were dropped in silence;
    with add_prefix_space a document's first word gained a space (decode no longer gave the text back). A foreign
    tokenizer's end-of-text token is any of the known spellings, ours first when it has several."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    from data.tokenizer import EOS, EOS_FALLBACKS, eos_id, train_bpe

    tok = train_bpe([f"plain ascii document number {i} about cats and dogs" for i in range(30)], vocab_size=300)
    for text in ("plain words", "café, naïve – 日本語 ✓", "  two leading spaces\tand a tab\n"):
        assert tok.decode(tok.encode(text).ids) == text
    assert not tok.encode("plain").tokens[0].startswith("Ġ")
    assert eos_id(tok) == tok.token_to_id(EOS)
    for name in EOS_FALLBACKS:
        assert eos_id(Tokenizer(WordLevel({"a": 0, "[UNK]": 1, name: 7}, unk_token="[UNK]"))) == 7
    both = Tokenizer(WordLevel({"a": 0, "</s>": 1, "<eos>": 2, EOS: 3}, unk_token="a"))
    assert eos_id(both) == 3
