"""Where text comes from: the embedded corpus, local files, or a HuggingFace hub dataset.

Every source yields documents (strings). The embedded corpus needs no download at all: it is the English prose
that ships with every Python installation (the standard library's docstrings and the pydoc topic pages),
extracted at prepare time, so `python train.py` works offline on a fresh machine.
"""

from __future__ import annotations

import ast
import functools
import glob
import hashlib
import itertools
import os
import sys
import sysconfig
import warnings
from pathlib import Path
from typing import Iterator

from model.config import ConfigError

SOURCE_KINDS = ("embedded", "files", "hf")


class DataSourceError(RuntimeError):
    """The configured text source cannot be read; the message says how to fix it."""
_FILE_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# what datasets (fsspec) decompresses on the fly; .zst through the zstandard package, a dependency since
# SlimPajama ships as .jsonl.zst
_COMPRESSIONS = (".gz", ".zst", ".bz2", ".xz")


def _stdlib_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(stdlib.rglob("*.py")) if "site-packages" not in p.parts]


@functools.lru_cache(maxsize=1)
def embedded_identity() -> str:
    """A hash of what the embedded corpus is read from (the exact Python build, its pydoc topics, the names and
    sizes of its stdlib files): ~0.3 s, where reading the corpus itself takes seconds. Patch releases regenerate
    the topics and change docstrings, so major.minor alone named different corpora alike."""
    from pydoc_data.topics import topics

    h = hashlib.sha256(sys.version.encode())
    for name in sorted(topics):
        h.update(f"\0{name}\0{topics[name]}".encode())
    for path in _stdlib_files():
        h.update(f"\0{path.name}\0{path.stat().st_size}".encode())
    return h.hexdigest()[:16]


def embedded_documents(min_chars: int = 200) -> Iterator[str]:
    """pydoc topics, then module/class/function docstrings of the stdlib, parsed with ast (nothing is imported)."""
    from pydoc_data.topics import topics

    for name in sorted(topics):
        if len(topics[name]) >= min_chars:
            yield topics[name]
    for path in _stdlib_files():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 40:
                    parts.append(doc)
        text = "\n\n".join(parts)
        if len(text) >= min_chars:
            yield text


def _builder(path: str) -> str:
    name = next((path[: -len(c)] for c in _COMPRESSIONS if path.endswith(c)), path)
    for ext, builder in _FILE_BUILDERS.items():
        if name.endswith(ext):
            return builder
    raise ConfigError("data.source.paths", path, f"unsupported file type; use one of {sorted(_FILE_BUILDERS)} "
                      f"(optionally compressed: {', '.join(_COMPRESSIONS)})")


_SAID: set[str] = set()


def _say_once(text: str) -> None:
    """resolve_files runs for the cache key, the checks and the reading: one note per process, not three."""
    if text not in _SAID:
        from tools.runlog import say

        _SAID.add(text)
        say(text)


def _not_a_corpus_file(path: Path) -> bool:
    """What a folder holds beside its corpus: hidden files, docs and licences, the probes' parameter sidecars."""
    name = path.name.lower()
    return (name.startswith(".") or path.suffix in {".md", ".tsv"} or name.endswith(".spec.json")
            or name.split(".")[0] in {"readme", "license", "licence", "copying", "notice", "manifest"})


def resolve_files(paths) -> list[str]:
    """Expand globs and folders into a sorted list of files, each once (a file that two paths name, e.g. a folder
    and a glob in it, would be read twice, and its held-out documents would enter training through the second
    copy); missing files are a config error."""
    if isinstance(paths, str):
        paths = [paths]
    files: list[str] = []
    for pattern in paths or []:
        pattern = os.path.expanduser(str(pattern))
        if os.path.isfile(pattern):  # as named: "notes[1].txt" is a file, not the glob that matches notes1.txt
            matches = [pattern]
        elif os.path.isdir(pattern):
            matches = sorted(p for p in glob.glob(os.path.join(glob.escape(pattern), "**", "*"), recursive=True)
                             if os.path.isfile(p))
            left_out = {p for p in matches if _not_a_corpus_file(Path(p))}
            matches = [p for p in matches if p not in left_out]
            if any(not Path(p).name.startswith(".") for p in left_out):  # hidden files go unsaid
                names = ", ".join(sorted(os.path.relpath(p, pattern) for p in left_out))
                _say_once(f"data: left out of {pattern}: {names} (docs, licences, hidden files, probe sidecars); "
                          "name a file in data.source.paths to read it")
        else:
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))  # not folders
        if not matches:
            raise ConfigError("data.source.paths", pattern, "no such file; give existing files, folders or globs")
        files.extend(matches)
    seen: set[str] = set()
    files = [f for f in files if not (os.path.realpath(f) in seen or seen.add(os.path.realpath(f)))]
    if not files:
        raise ConfigError("data.source.paths", paths, "data.source.kind=files needs at least one path")
    for f in files:
        _builder(f)
    return files


def _loads(files: list[str]):
    """(builder, files) for each load_dataset call, in file order. One call per json / parquet file: a call fixes the
    columns from its first file and refuses a later file with other fields (probes mixed with books). Consecutive
    txt files share one call (their one column is always "text"), as a folder of thousands of one-document files
    would otherwise spend more time opening loaders than tokenizing."""
    for builder, run in itertools.groupby(files, key=_builder):
        run = list(run)
        if builder == "text":
            yield builder, run
        else:
            yield from ((builder, [f]) for f in run)


def file_documents(paths, text_field: str = "text", streaming: bool = True) -> Iterator[str]:
    """Local txt / jsonl / json / parquet files (gzip, zstd, bz2 or xz compressed too) through `datasets`' own
    loaders, in the order of resolve_files. Empty files hold no documents and are skipped; a file the loaders cannot
    read is a DataSourceError that names it (theirs name no file). A txt file's one column is its text whatever
    text_field names (the field of the json / parquet files beside it)."""
    files = [f for f in resolve_files(paths) if os.path.getsize(f) > 0]
    for builder, group in _loads(files):
        field = "text" if builder == "text" else text_field
        yield from _texts(_rows(builder, group, streaming), field, text_field, group[0])


def _texts(rows, field: str, text_field: str, where) -> Iterator[str]:
    """The documents in `field` of `rows` (from `where`). A value that is not text is refused: a list of strings was
    joined without a separator (tokenizers read it as a pair) and a number failed with no file named. Rows whose
    field is null (a json file whose later rows name their text otherwise: datasets fills them with None) are left
    out and counted, where they vanished without a word. `text_field`: the config's value, for the error."""
    rows_read = missing = 0
    for row in rows:
        rows_read += 1
        if field not in row:
            raise ConfigError("data.source.text_field", text_field, f"not a field of {where}: {sorted(row)}")
        text = row[field]
        if text is None:
            missing += 1
        elif not isinstance(text, str):
            raise ConfigError("data.source.text_field", text_field, f"holds {type(text).__name__} values in {where} "
                              f"(row {rows_read}), not text")
        elif text:
            yield text
    if missing:
        warnings.warn(f"{missing:,} of {rows_read:,} rows of {where} have no {field!r} (null) and were left out "
                      "(data.source.text_field names the text's field)", stacklevel=2)


def _rows(builder: str, group: list[str], streaming: bool) -> Iterator[dict]:
    import datasets

    kwargs = {"sample_by": "document"} if builder == "text" else {}
    try:
        # datasets globs data_files again: escaped, a file named "a[1].jsonl" is read as itself
        ds = datasets.load_dataset(builder, data_files={"train": [glob.escape(f) for f in group]}, split="train",
                                   streaming=streaming, **kwargs)
    except StopIteration:  # the json loader reads a first table to fix the columns; a blank file (compressed) has none
        return
    except MemoryError:
        raise
    except Exception as err:
        if all(_blank(f) for f in group):  # only whitespace: no documents (the non-streaming json loader refuses it)
            return
        raise _unreadable(group, err) from err
    try:
        yield from ds
    except MemoryError:
        raise
    except Exception as err:  # a decoding error surfaces while rows are read, in streaming mode
        raise _unreadable(group, err) from err


def _unreadable(group: list[str], err: Exception) -> DataSourceError:
    cause = err.__cause__ if isinstance(err.__cause__, Exception) else err  # datasets wraps the reader's error
    if len(group) > 1:  # consecutive txt files share one load: find the one that does not decode
        group = [f for f in group if not _decodes(f)] or group
    named = ", ".join(group[:3]) + (f" and {len(group) - 3} more" if len(group) > 3 else "")
    if isinstance(cause, UnicodeDecodeError):
        hint = "text must be UTF-8: re-encode the file (e.g. iconv -f latin1 -t utf-8)"
    else:
        hint = "check that the file is complete and of the type its name says"
    first_line = (str(cause).splitlines() or [""])[0][:200]
    return DataSourceError(f"could not read {named} ({type(cause).__name__}: {first_line}); {hint}, "
                           "or leave it out of data.source.paths")


def _blank(path: str) -> bool:
    import fsspec

    try:
        with fsspec.open(path, "rb", compression="infer") as f:
            while chunk := f.read(1 << 20):
                if chunk.strip():
                    return False
        return True
    except (OSError, EOFError, ValueError):
        return False


def _decodes(path: str) -> bool:
    import fsspec

    try:
        with fsspec.open(path, "rt", compression="infer", encoding="utf-8") as f:
            while f.read(1 << 20):
                pass
        return True
    except (UnicodeDecodeError, OSError, EOFError, ValueError):
        return False


def hub_documents(name: str, config: str | None, split: str, text_field: str, streaming: bool = True,
                  revision: str | None = None) -> Iterator[str]:
    import datasets

    if os.path.isdir(os.path.expanduser(name)):  # load_dataset takes "~/corpus" for a hub repo name
        name = os.path.expanduser(name)
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=streaming, revision=revision)
    except Exception as err:  # offline, unknown name, no permission: say how to use local files instead
        first_line = (str(err).splitlines() or [""])[0]
        # the dataset opened but has no such split or config ("Bad split: validation. Available splits: ['train']"):
        # the hub-access advice below would send the user the wrong way
        if isinstance(err, ValueError) and first_line.startswith(("Bad split", "BuilderConfig", "Config name")):
            key, value = ("data.source.split", split) if "split" in first_line else ("data.source.config", config)
            raise ConfigError(key, value, f"{name}: {first_line[:300]}") from err
        raise DataSourceError(
            f"could not open the HuggingFace dataset {name!r} "
            f"({type(err).__name__}: {first_line[:200]}).\n"
            "This machine may have no hub access. Point the data at local files instead, e.g.\n"
            "  python train.py ... data=files data.source.paths='[/path/to/corpus/*.jsonl.gz]' "
            "data.source.text_field=text\n"
            "(txt, jsonl/json and parquet, compressed too: .gz, .zst, .bz2, .xz), or pre-download the dataset and "
            "set HF_DATASETS_CACHE."
        ) from err
    yield from _texts(ds, text_field, text_field, name)


def documents(source) -> Iterator[str]:
    kind = source["kind"]
    if kind == "embedded":
        return embedded_documents()
    if kind == "files":
        return file_documents(source["paths"], source.get("text_field", "text"), source.get("streaming", True))
    if kind == "hf":
        return hub_documents(source["name"], source.get("config"), source.get("split", "train"),
                             source.get("text_field", "text"), source.get("streaming", True), source.get("revision"))
    raise ConfigError("data.source.kind", kind, f"choose one of {SOURCE_KINDS}")
