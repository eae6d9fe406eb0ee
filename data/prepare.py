"""source -> tokenizer -> token shards, cached by the hash of every input that shapes the result.

The result lives in `<cache_dir>/<kind>-<hash>/`: train_000.bin ..., val.bin, tokenizer.json, meta.json. meta.json is
written last, so a folder without it is an interrupted preparation; a second run with the same inputs reuses the
folder. An interrupted one resumes after the last train shard it wrote (progress.json records the documents that
shard and the validation parts so far hold), so a preparation of billions of tokens stopped after hours loses
minutes, and its shards, validation shard and tokenizer are the same bytes as an uninterrupted one's.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data import shards, sources
from data.tokenizer import eos_id, id_bound, load_tokenizer, tokenizer_hash, train_bpe
from model.config import ConfigError
from tools.runlog import say

# 2: max_tokens is checked after every document (1 overshot by up to 256 documents); 3: a special token's text inside
# a document is text (2 turned a literal "<|endoftext|>" into an EOS, splitting the document); 4: the tokenizer is
# trained on training documents only (3 also saw the validation ones), and a loaded one neither truncates nor pads;
# 5: a loaded tokenizer's template adds nothing (4 wrote "<s> doc </s> EOS" for a "<s> $A </s>" template, so
# documents ended in two EOS and began with a BOS that evaluation, which encodes without the template, never feeds)
FORMAT_VERSION = 5


def format_version(cfg: dict) -> int:
    """The format a preparation of `cfg` writes: 4 and 5 differ only for a loaded tokenizer with a template, so the
    shards of a trained tokenizer (no template) stay 4, and so do their caches (15B tokens need no re-tokenizing)."""
    return FORMAT_VERSION if cfg["tokenizer"].get("path") else 4


@dataclass
class PreparedData:
    root: Path
    train_shards: list[Path]
    val_shard: Path
    tokenizer_path: Path
    meta: dict

    @property
    def vocab_size(self) -> int:
        return self.meta["tokenizer"]["vocab_size"]


def _plain(obj):
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(obj):
            return OmegaConf.to_container(obj, resolve=True)
    except ImportError:
        pass
    return obj


def cache_key(cfg: dict, spelled_paths: bool = False, folder_files: bool = True, python_build: bool = True) -> str:
    """The hash of what the prepared data depends on. Local files count by identity (absolute path, size, mtime, in
    order), however their paths were written, a local data=hf folder's too; `spelled_paths`: the key of caches made
    before 2026-12-02, which hashed the paths as written and the files as resolved from them; not `folder_files`:
    the key of data=hf caches made before 2026-12-04, which hashed a local folder's name only; not `python_build`: the
    key of embedded caches made before 2026-12-05, which hashed Python's major.minor only."""
    source = dict(cfg["source"])
    if source["kind"] == "files" and spelled_paths:
        source["files"] = [(f, Path(f).stat().st_size, Path(f).stat().st_mtime_ns)
                           for f in sources.resolve_files(source["paths"])]
    elif source["kind"] == "files":
        files = sources.resolve_files(source.pop("paths"))
        source["files"] = [(os.path.abspath(f), Path(f).stat().st_size, Path(f).stat().st_mtime_ns) for f in files]
    elif source["kind"] == "hf" and folder_files and (folder := _local_folder(source)):
        # a local dataset folder (or a saved script's): its files, as kind=files counts them, not only its name
        source["files"] = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in _folder_files(folder.resolve())]
    if source["kind"] == "embedded":  # the text is this Python's stdlib docstrings, which change between builds
        source["python"] = sources.embedded_identity() if python_build else list(sys.version_info[:2])
    tok = dict(cfg["tokenizer"])
    if tok.get("path"):
        tok["sha256"] = hashlib.sha256(Path(tok["path"]).read_bytes()).hexdigest()
    spec = {"source": source, "tokenizer": tok, "val_fraction": cfg["val_fraction"],
            "max_tokens": cfg.get("max_tokens"), "version": format_version(cfg)}
    if cfg.get("val_split", "index") != "index":  # keyed only when not the default: index caches keep their keys
        spec["val_split"] = cfg["val_split"]
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:16]


VAL_SPLITS = ("index", "content")  # which documents validation holds: by a hash of their index, or of their text
WINDOW_STARTS = ("any", "document")  # training and validation windows open at any token, or where a document begins
SAMPLINGS = ("shuffled", "random")  # training windows: each once per pass in a seeded order, or independent draws


def validate_data_config(cfg: dict) -> None:
    kind = cfg["source"]["kind"]
    if kind not in sources.SOURCE_KINDS:
        raise ConfigError("data.source.kind", kind, f"choose one of {sources.SOURCE_KINDS}")
    if kind == "files":
        sources.resolve_files(cfg["source"].get("paths"))
    if kind == "hf" and not cfg["source"].get("name"):
        raise ConfigError("data.source.name", None, "data.source.kind=hf needs a dataset name")
    name = str(cfg["source"].get("name") or "")
    if kind == "hf" and name.startswith(("/", "./", "../", "~")) and not os.path.exists(os.path.expanduser(name)):
        # a local dataset folder (or loading script) that is not there: not a hub name, and not a hub-access problem
        raise ConfigError("data.source.name", name, "no such folder (a local dataset folder; a hub dataset is named "
                          "<org>/<name>)")
    if cfg.get("window_start", "any") not in WINDOW_STARTS:
        raise ConfigError("data.window_start", cfg["window_start"],
                          "choose any (windows at any token) or document (windows open where a document begins)")
    if cfg.get("sampling", "shuffled") not in SAMPLINGS:
        raise ConfigError("data.sampling", cfg["sampling"], "choose shuffled (each training window once per pass "
                          "over the corpus) or random (independent draws, with replacement)")
    after = cfg.get("loss_only_after")
    if after is not None and (not isinstance(after, str) or not after):
        raise ConfigError("data.loss_only_after", after,
                          'give the text of one token, e.g. " ?" (quoted), or null to train on every token')
    if cfg.get("val_split", "index") not in VAL_SPLITS:
        raise ConfigError("data.val_split", cfg["val_split"], "choose index (a hash of each document's place in the "
                          "source) or content (a hash of its text: copies of a document stay on one side)")
    fraction = cfg["val_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction < 1:
        raise ConfigError("data.val_fraction", fraction, "a share of the documents, strictly between 0 and 1")
    for key, nullable in (("max_tokens", True), ("shard_tokens", False)):
        value = cfg.get(key, 100_000_000)
        if (value is not None or not nullable) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"data.{key}", value, "a positive number of tokens" + (
                " (or null: the whole source)" if nullable else ", e.g. 100000000"))
    chars = cfg["tokenizer"].get("train_chars", 1)  # compared with a count only: 2e7 (a float) is a number of them
    if not cfg["tokenizer"].get("path") and (isinstance(chars, bool) or not isinstance(chars, (int, float))
                                             or not chars >= 1):
        raise ConfigError("data.tokenizer.train_chars", chars, "the characters the BPE is trained on, a positive "
                          "integer, e.g. 10000000")
    vocab = cfg["tokenizer"].get("vocab_size")
    if not cfg["tokenizer"].get("path") and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 257):
        raise ConfigError("data.tokenizer.vocab_size", cfg["tokenizer"].get("vocab_size"),
                          "a byte-level BPE needs at least 257 tokens (256 bytes and the end-of-text token)")
    tok_path = cfg["tokenizer"].get("path")
    if tok_path and not Path(tok_path).is_file():
        raise ConfigError("data.tokenizer.path", tok_path, "no such tokenizer.json; set it to null to train one")


def _is_val(doc_index: int, text: str, cfg: dict) -> bool:
    """A stable hash, streaming-friendly and independent of the corpus size. data.val_split=index hashes the
    document's place in the source; content hashes its text, so every copy of a document lands on the same side
    (no duplicate leaks from train into validation) and a document keeps its side when files are added or reordered.
    """
    by_text = cfg.get("val_split", "index") == "content"
    key = text.encode("utf-8", "surrogatepass") if by_text else str(doc_index).encode()
    h = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little")
    return (h % 100_000) < cfg["val_fraction"] * 100_000


def _load_prepared(root: Path) -> PreparedData:
    meta = json.loads((root / "meta.json").read_text())
    return PreparedData(root, [root / s for s in meta["train_shards"]], root / meta["val_shard"],
                        root / "tokenizer.json", meta)


def prepare(cfg, cache_dir: str | Path, progress: bool = True) -> PreparedData:
    """The prepared shards of `cfg`, built once per cache key. Concurrent callers (every rank of a torchrun/srun
    job, or sweep jobs started side by side) wait for the one that builds them instead of all tokenizing."""
    cfg = _plain(cfg)
    validate_data_config(cfg)
    root = prepared_root(cfg, cache_dir)
    if (root / "meta.json").is_file():
        return _cached(cfg, root)
    root.parent.mkdir(parents=True, exist_ok=True)
    waiting = f"another process is preparing {root}; waiting"
    with exclusive_lock(root.parent / f".{root.name}.lock", waiting) as locked:
        if (root / "meta.json").is_file():  # built while we waited
            return _cached(cfg, root)
        try:
            with tokenizer_threads():
                return _build(cfg, root, progress, alone=bool(locked))
        except BaseException as err:
            # without a lock (or one local to a node), a builder that finished first removed the validation parts
            # this one resumed through: its folder holds the same tokens
            if isinstance(err, (shards.ShardError, FileNotFoundError)) and (root / "meta.json").is_file():
                for leftover in [root / PROGRESS, *root.glob("val_part_*.bin")]:  # what this one wrote after the
                    leftover.unlink(missing_ok=True)  # other finished: no builder reads them once meta.json is there
                return _cached(cfg, root)
            _remove_if_empty(root)
            raise


def _remove_if_empty(root: Path) -> None:
    """A preparation that stopped before writing anything (an unreadable file, an interrupt) leaves no empty cache
    folder; one with progress keeps it, for the next start to resume from. (The lock file stays: removing a lock
    another process may be waiting on would let two builders in.)"""
    try:
        root.rmdir()
    except OSError:  # not empty, or not there
        pass


# TOKENIZERS_PARALLELISM as the process started: set afterwards, it is ours (below, or train.py's), not the user's
_USER_PARALLELISM = os.environ.get("TOKENIZERS_PARALLELISM")


@contextmanager
def tokenizer_threads():
    """HF tokenizers' thread pool on while a corpus is tokenized (BPE training 0.64x, encode_batch 0.52x the time
    on 2 cores, the same tokenizer and ids: bench/tokenize.py), unless the user set TOKENIZERS_PARALLELISM. Afterwards
    the variable is set to false: DataLoader workers forked later then neither use a pool inherited across fork nor
    print tokenizers' fork warning (every job of a Hydra sweep in one process tokenizes with threads again)."""
    if _USER_PARALLELISM is not None:
        yield
        return
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _cached(cfg: dict, root: Path) -> PreparedData:
    """The shard size is no part of the cache key (the same tokens in other cuts): a changed one is said, not lost."""
    data = _load_prepared(root)
    made, asked = data.meta.get("shard_tokens"), int(cfg.get("shard_tokens", 100_000_000))
    if made is not None and made != asked:
        say(f"note: {root} holds the same tokens in shards of data.shard_tokens={made:,}, reused as they are; "
            f"delete that folder to cut them at {asked:,}")
    return data


def _local_folder(source: dict) -> Path | None:
    folder = Path(os.path.expanduser(str(source["name"])))
    return folder if folder.is_dir() else None


def _visible_in(folder: Path) -> list[Path]:
    """What `folder` holds below it, hidden paths (.git, HF's .cache) left out: they are not the dataset."""
    return [f for f in sorted(folder.rglob("*")) if not any(p.startswith(".") for p in f.relative_to(folder).parts)]


def _folder_files(folder: Path) -> list[Path]:
    return [f for f in _visible_in(folder) if f.is_file()]


def prepared_root(cfg, cache_dir: str | Path) -> Path:
    """Where prepare() keeps (or would build) the shards of `cfg`: an existing folder under the key of before
    2026-12-02 (finished, or an interrupted preparation to resume) is found too, so no corpus is tokenized again;
    so is a local data=hf folder's under the key of before 2026-12-04 (its name only) where every file of it was
    written after the folder's last change; and an embedded corpus's under the key of before 2026-12-05 (Python's
    major.minor: made by this Python unless the cache is shared between machines)."""
    cfg = _plain(cfg)
    root = Path(cache_dir) / f"{cfg['source']['kind']}-{cache_key(cfg)}"
    if cfg["source"]["kind"] == "embedded" and not _started(root):
        legacy = Path(cache_dir) / f"embedded-{cache_key(cfg, python_build=False)}"
        if _started(legacy):
            return legacy
    if cfg["source"]["kind"] == "files" and not _started(root):
        legacy = Path(cache_dir) / f"files-{cache_key(cfg, spelled_paths=True)}"
        if _started(legacy):
            return legacy
    if cfg["source"]["kind"] == "hf" and not _started(root) and (folder := _local_folder(cfg["source"])):
        legacy = Path(cache_dir) / f"hf-{cache_key(cfg, folder_files=False)}"
        if _started(legacy) and _written_after(legacy, folder):
            return legacy
    return root


def _written_after(cache: Path, folder: Path) -> bool:
    """Whether every file of `cache` is newer than every file of `folder` and every change to its listing (a folder's
    mtime moves when a file is added, removed or renamed in it, which a copy keeping old mtimes does not show)."""
    changed = max(f.stat().st_mtime_ns for f in [folder, *_visible_in(folder)])  # files and their folders
    return all(f.stat().st_mtime_ns > changed for f in cache.rglob("*") if f.is_file())


def _started(root: Path) -> bool:
    return (root / "meta.json").is_file() or (root / PROGRESS).is_file()


@contextmanager
def exclusive_lock(path: Path, waiting_message: str):
    """An flock on `path` (released by the kernel if the holder dies, so a crash never leaves it stuck). Where
    there is no flock (Windows, a file system mounted without it) it warns and goes on unlocked: the writes are
    atomic and the same bytes whoever writes them, so concurrent builders repeat work, and the caller must accept
    that another one may finish (and clean up) first. Yields whether the lock is held."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)  # NFS grants an exclusive flock only to a writer
    except (ImportError, OSError) as err:
        say(f"warning: no lock at {path} ({err}); concurrent runs may repeat this work")
        yield False
        return
    try:
        locked = True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(waiting_message)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:  # ENOLCK / EOPNOTSUPP: the file system has no flock
            say(f"warning: cannot lock {path} ({err}); concurrent runs may repeat this work")
            locked = False
        yield locked
    finally:
        os.close(fd)  # closing the descriptor releases the lock


PROGRESS = "progress.json"


def _resumable(root: Path, version: int) -> dict | None:
    """The progress of an interrupted preparation in `root` whose files are all there, else None."""
    try:
        saved = json.loads((root / PROGRESS).read_text())
        if saved.get("format_version") != version:
            return None
        if tokenizer_hash(load_tokenizer(root / "tokenizer.json")) != saved["tokenizer_hash"]:
            return None
        for name in saved["train_shards"] + saved["val_parts"]:
            shards.read_shard(root / name)  # each one whole
        return saved
    except Exception:  # none, or a file missing or unreadable: start again
        return None


def _batches(docs, max_docs: int = 256, max_chars: int = 4_000_000):
    """Lists of documents for encode_batch: up to 256 short ones, or as many long ones (books) as fill ~1M tokens, so
    a batch of books neither holds gigabytes nor leaves a resume point only every 256 of them. The cuts depend on
    the documents alone, so a resumed preparation cuts the rest as an uninterrupted one does."""
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _build(cfg: dict, root: Path, progress: bool, alone: bool = False) -> PreparedData:
    """alone: this process holds the folder's lock, so no other builder is writing there and what a killed one left
    (temporary files of up to a shard each, shards past a restart's last one) can go."""
    root.mkdir(parents=True, exist_ok=True)
    start = time.time()
    if alone:  # an hour untouched: a flock local to a node does not keep another node's builder out, whose files
        for leftover in root.glob(".*.tmp"):  # are being written; atomic_write's, of a process killed before its rename
            if start - leftover.stat().st_mtime > 3600:
                leftover.unlink(missing_ok=True)
    docs = sources.documents(cfg["source"])
    max_tokens = cfg.get("max_tokens")
    saved = _resumable(root, format_version(cfg))

    tok_cfg = cfg["tokenizer"]
    if saved:
        tok, head = load_tokenizer(root / "tokenizer.json"), []
        docs = itertools.islice(docs, saved["counts"]["documents"], None)  # the ones the saved shards hold
        say(f"resuming the data preparation in {root} after {saved['counts']['documents']:,} documents "
            f"({saved['counts']['train'] + saved['counts']['val']:,} tokens)")
    elif tok_cfg.get("path"):
        tok = load_tokenizer(tok_cfg["path"])
        head: list[str] = []
    else:  # train on the first `train_chars` characters, then keep streaming the rest of the same iterator
        head, train_texts, chars = [], [], 0
        for doc in docs:
            head.append(doc)
            if _is_val(len(head) - 1, doc, cfg):
                continue  # held out from the tokenizer too: its merges would fit the validation text
            train_texts.append(doc)
            chars += len(doc)
            if chars >= tok_cfg["train_chars"]:
                break
        if not head:
            raise ConfigError("data.source", cfg["source"], "the source yielded no text")
        tok = train_bpe(train_texts, tok_cfg["vocab_size"])
    if not saved:
        shards.atomic_write_bytes(root / "tokenizer.json", [tok.to_str().encode()])
    eos = eos_id(tok)
    tok.encode_special_tokens = True  # documents are text: EOS only where a document ends, appended below
    vocab_size = id_bound(tok)  # the largest id + 1: a foreign tokenizer's ids may skip numbers
    dtype = shards.dtype_for_vocab(vocab_size)

    shard_tokens = int(cfg.get("shard_tokens", 100_000_000))
    train_buf: list[np.ndarray] = []
    val_buf: list[np.ndarray] = []
    train_names: list[str] = list(saved["train_shards"]) if saved else []
    val_parts: list[str] = list(saved["val_parts"]) if saved else []  # validation documents up to the last shard
    counts = dict(saved["counts"]) if saved else {"train": 0, "val": 0, "documents": 0, "val_documents": 0}
    last_train = saved.get("last_train_tokens") if saved else None  # the size of the last training document

    def elapsed() -> float:  # over every attempt
        return round(time.time() - start + (saved.get("seconds", 0.0) if saved else 0.0), 1)

    def flush_train(resumable: bool = True):
        if train_buf:
            name = f"train_{len(train_names):03d}.bin"
            shards.write_shard(root / name, np.concatenate(train_buf))
            train_names.append(name)
            train_buf.clear()
            if not resumable:  # the last shard: val.bin and meta.json come next
                return
            if val_buf:
                val_parts.append(f"val_part_{len(val_parts):03d}.bin")
                shards.write_shard(root / val_parts[-1], np.concatenate(val_buf))
                val_buf.clear()
            # every document counted so far is in a written file: a preparation stopped from here resumes here
            shards.atomic_write_text(root / PROGRESS, json.dumps(
                {"format_version": format_version(cfg), "tokenizer_hash": tokenizer_hash(tok), "counts": counts,
                 "train_shards": train_names, "val_parts": val_parts, "last_train_tokens": last_train,
                 "seconds": elapsed()}))

    all_docs = _batches(itertools.chain(head, docs))
    bar = _progress_bar(progress)
    task = bar.add_task("tokenizing", total=max_tokens, completed=counts["train"] + counts["val"]) if bar else None
    pending = 0
    with bar or nullcontext():
        for batch in all_docs:
            for text, ids in zip(batch, tok.encode_batch(batch, add_special_tokens=False)):
                if max_tokens and counts["train"] + counts["val"] >= max_tokens:
                    break  # the limit holds to a document, not to a batch
                arr = np.asarray(ids.ids + [eos], dtype=dtype)
                is_val = _is_val(counts["documents"], text, cfg)
                (val_buf if is_val else train_buf).append(arr)
                last_train = last_train if is_val else arr.size
                counts["val" if is_val else "train"] += arr.size
                counts["val_documents"] += int(is_val)
                counts["documents"] += 1
                pending += arr.size
            if bar:
                bar.update(task, advance=pending, description=f"tokenizing ({counts['documents']} docs)")
                pending = 0
            if sum(a.size for a in train_buf) >= shard_tokens:
                flush_train()
            if max_tokens and counts["train"] + counts["val"] >= max_tokens:
                break
    # a tiny corpus whose hash split held out nothing: hold out its last document
    if not val_parts and not val_buf:
        last = _last_document(train_buf, train_names, root, last_train)
        if last is not None:
            say(f"data: the hash split (data.val_fraction={cfg['val_fraction']}) held out none of the "
                f"{counts['documents']} documents; validation is the last one ({last.size:,} tokens)")
            val_buf.append(last)
            counts["train"] -= last.size
            counts["val"] += last.size
            counts["val_documents"] += 1
    flush_train(resumable=False)
    val = [np.asarray(shards.read_shard(root / name)) for name in val_parts] + val_buf
    if not train_names or not val:
        (root / PROGRESS).unlink(missing_ok=True)  # a corrected config (larger data.shard_tokens) must start afresh
        if max_tokens and counts["train"] + counts["val"] >= max_tokens:  # the cap, not the corpus, stopped it
            raise ConfigError("data.max_tokens", max_tokens, f"preparation stopped after {counts['documents']} "
                              f"document(s) ({counts['train'] + counts['val']:,} tokens), too few to split into "
                              "train and validation: raise it (or null: the whole corpus)")
        if counts["documents"] == 1:  # nanoGPT's one big input.txt: the split holds out whole documents
            raise ConfigError("data.source", cfg["source"].get("paths", cfg["source"]["kind"]),
                              "one document cannot be split into train and validation, which hold out whole "
                              "documents (a .txt file is one document): give several files, or one jsonl line per "
                              "document")
        raise ConfigError("data.source", cfg["source"].get("paths", cfg["source"]["kind"]),
                          f"too little text to split into train and validation ({counts['documents']} documents)")
    share = counts["val"] / max(1, counts["train"] + counts["val"])
    if share < cfg["val_fraction"] / 2:  # whole documents are held out: a few long books make a coarse split
        say(f"warning: validation holds {counts['val_documents']} of {counts['documents']} documents, "
            f"{share:.1%} of the tokens (data.val_fraction={cfg['val_fraction']}); with few long documents "
            "every val loss comes from these, so raise data.val_fraction for a broader validation set")
    shards.write_shard(root / "val.bin", np.concatenate(val))
    meta = {
        "format_version": format_version(cfg),
        "source": cfg["source"],
        "tokenizer": {"hash": tokenizer_hash(tok), "vocab_size": vocab_size, "eos_id": eos,
                      "trained": not tok_cfg.get("path")},
        "dtype": np.dtype(dtype).name,
        "tokens": counts,
        "train_shards": train_names,
        "shard_tokens": shard_tokens,
        "val_shard": "val.bin",
        "val_fraction": cfg["val_fraction"],
        "val_split": cfg.get("val_split", "index"),
        "seconds": elapsed(),
    }
    shards.atomic_write_bytes(root / "meta.json", [json.dumps(meta, indent=2).encode()])
    for name in [PROGRESS] + val_parts:  # what a resume needed; val.bin holds the parts
        (root / name).unlink(missing_ok=True)
    if alone:  # shards an interrupted attempt wrote past this one's last (e.g. before a larger data.shard_tokens)
        for stale in set(p.name for p in root.glob("train_*.bin")) - set(train_names):
            if (root / stale).stat().st_mtime < start:  # not one another node's builder wrote meanwhile
                (root / stale).unlink(missing_ok=True)
    return _load_prepared(root)


def _last_document(train_buf: list, train_names: list, root: Path, size: int | None) -> np.ndarray | None:
    """Take the last training document (`size` tokens) back for validation, from the buffer or else from the end of
    the last written shard, which is rewritten without it; None if that would leave no training document."""
    if train_buf:
        return train_buf.pop() if len(train_buf) > 1 or train_names else None
    if not train_names or not size:  # no size: a resume point written before it was recorded
        return None
    tokens = np.array(shards.read_shard(root / train_names[-1]))  # a copy: the file is rewritten below
    cut = tokens.size - size  # by size, not at an EOS: a loaded tokenizer's template may add EOS tokens of its own
    if cut > 0 or len(train_names) > 1:  # the saved progress no longer matches the shards: a crash from here restarts
        (root / PROGRESS).unlink(missing_ok=True)
    if cut > 0:
        shards.write_shard(root / train_names[-1], tokens[:cut])
    elif len(train_names) > 1:
        (root / train_names.pop()).unlink()
    else:
        return None
    return tokens[cut:]


def _progress_bar(enabled: bool):
    if not enabled:
        return None
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("tokens"),
                    TimeElapsedColumn(), transient=True)
