"""Synthetic long-range probes: documents whose answer needs information at a controlled distance (no download).

Four tasks, each a prompt that ends in a question and an answer to predict:

  kv       key-value retrieval. Pairs like " k123: v4567." are scattered in filler text; the question at the end asks
           for the value of one key ("... Question: what is the value of k123? Answer:" -> " v4567").
  passkey  passkey retrieval. One needle (" The pass key is 4821. Remember it. 4821 is the pass key.") inside filler;
           the prompt ends "... What is the pass key? The pass key is" -> " 4821" (a code of `value_digits` digits;
           with 2 it is one token).
  needle   the one number of the document (" 47", `value_digits` digits, one token with 2) hidden in filler; the
           prompt ends with the question mark " ?" and the answer is the number. The question token occurs nowhere
           else and the number is the only digits in the text, so one attention step finds it: with
           `question_gap` > 0 a training document asks again and again, each question at least `question_gap` units
           after the previous answer, so every answer needs a look-up further back than that (set it above the SWA
           reach). With `first_gap` the first question comes 0..first_gap units after the number: near look-ups
           that any variant can answer, from which the model learns the look-up it then needs further back (without
           them even full attention did not learn the task in 1000 steps). Unlike passkey, whose question ends in
           " is" (a filler token too), the query token alone says what to look up.
  recall   multi-query associative recall, with no filler: a stream of pairs " qx47" (a key of `key_digits`
           letters, a value of `value_digits` digits; two tokens with a byte-level BPE) drawn at random from a
           document's dictionary of `num_pairs` keys, each key always with the same value. Every repeated key is a
           question whose answer is the value seen at the key's previous occurrence, so about half the tokens of a
           document test retrieval (kv and passkey have one question per document). The prompt ends with a key
           last seen at the requested distance: "... qx" -> "47".
With answers every 20-40 tokens (`question_gap`) and the loss on the answers only (`data.loss_only_after=" ?"`), a
1.1M-parameter model learns `needle` in ~200 steps on the CPU with every variant; with the loss on every token the
random filler drowns the answers' gradient and SA had not learned it after 2000 steps (RESULTS.md). The other tasks
were not learned at that budget (with the loss on every token; not tried on answers only).

Distance d = the length of the prompt AFTER the needed value (its last occurrence in the item: the queried pair's
value, the pass key's second mention, the needle), in the probe's units: characters, or tokens of a given tokenizer.
The query at the last prompt token is d positions after the value's last token, and no earlier input token carries
the value, so an SWA stack of L layers and window w can see it iff d <= L(w-1). Length n counts the whole prompt.
Every document is a pure function of (spec, seed, index): the same seed gives the same documents.

Use:
  * training data: `python train.py data=probes` (conf/data/probes.yaml) writes the documents (prompt + answer) to
    a jsonl in the cache through a Hydra callback and trains on it like any `files` corpus; or write them yourself:
    `python -m data.probes --out probes.jsonl --task kv --length 2000 --num-docs 4000` and pass it to data=files;
  * evaluation: `python -m analysis.probe_eval ckpt=<run dir>` (token units, accuracy by distance bucket).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

from data.prepare import exclusive_lock
from data.shards import atomic_write_bytes, atomic_write_text

TASKS = ("kv", "passkey", "recall", "needle")
FILLERS = ("repeat", "sentences", "pydoc", "random")

REPEAT = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
SENTENCES = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
    "The river runs past the old mill.", "A cat sleeps on the warm stone wall.", "The baker opens the shop at dawn.",
    "Rain falls softly on the roof.", "The train leaves the station on time.", "Children play in the park.",
    "The library is quiet in the morning.", "A boat drifts along the shore.", "The wind turns the windmill.",
    "Snow covers the distant hills.", "The market is busy on Saturdays.", "An owl calls from the forest.",
    "The lamp glows in the window.", "Bees move from flower to flower.", "The road winds up the mountain.",
    "Fresh bread cools on the table.", "The clock in the hall strikes noon.", "Leaves turn red in autumn.",
    "The fisherman mends his nets.", "Clouds gather over the sea.", "The garden gate creaks open.",
    "A dog waits by the door.", "The teacher writes on the board.", "Stars appear one by one.",
    "The kettle whistles in the kitchen.", "Waves break against the rocks.", "The farmer walks across the field.",
)


@dataclass
class ProbeSpec:
    task: str = "kv"
    length: int = 2000  # prompt length in units
    num_pairs: int = 8  # kv: pairs in the context (the queried one included); recall: keys in the dictionary
    distance: int | None = None  # exact distance, or None: uniform in [min_distance, max_distance]
    min_distance: int | None = None  # None: the smallest possible (the question's length)
    max_distance: int | None = None  # None: the largest possible (the item at the very start)
    filler: str = "sentences"
    seed: int = 0
    key_digits: int = 3
    value_digits: int = 4  # kv, recall: digits of a value; passkey, needle: of the code
    question_gap: int = 0  # needle: repeat the question every question_gap..2*question_gap units (0: only at the end)
    first_gap: int | None = None  # needle: the first question 0..first_gap units after the number (None: like the rest)

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"probe task must be one of {TASKS}, got {self.task!r}")
        if self.question_gap < 0:
            raise ValueError(f"question_gap must be >= 0, got {self.question_gap}")
        if self.first_gap is not None and self.first_gap < 0:
            raise ValueError(f"first_gap must be >= 0 or None, got {self.first_gap}")
        if self.filler not in FILLERS:
            raise ValueError(f"probe filler must be one of {FILLERS}, got {self.filler!r}")
        keys = 9 * 10 ** (self.key_digits - 1) if self.task == "kv" else 26 ** self.key_digits
        if self.task in ("kv", "recall") and not 1 <= self.num_pairs <= keys:
            raise ValueError(f"num_pairs={self.num_pairs} must lie in [1, {keys}] for {self.key_digits}-character keys")


@dataclass
class Probe:
    task: str
    prompt: str
    answer: str  # the text to predict after the prompt (kv, passkey: begins with a space)
    distance: int  # units of the prompt after the needed value's last token (what the answer must reach back to)
    length: int  # units of the prompt
    item_span: tuple[int, int]  # character span of the needed item (pair, pass-key sentence or needle) in the prompt
    value_end: int = 0  # character offset in the prompt just past the needed value's last occurrence in the item
    key: str | None = None  # kv, recall: the queried key
    pairs: dict[str, str] = field(default_factory=dict)  # kv, recall: every key -> value in the context
    index: int = 0
    seed: int = 0
    units: str = "chars"

    @property
    def text(self) -> str:
        """The training document: prompt and answer."""
        return self.prompt + self.answer

    def as_json(self) -> dict:
        return {"text": self.text, **{k: v for k, v in asdict(self).items()}}


class CharUnits:
    name = "chars"

    def count(self, text: str) -> int:
        return len(text)

    def cut(self, text: str, units: int) -> str:
        return text[:units]

    def distance(self, prompt: str, end: int) -> int:
        """Units of `prompt` after the one that holds character end - 1."""
        return len(prompt) - end


class TokenUnits:
    """Units = tokens of a `tokenizers.Tokenizer` (exact for the final prompt, which is re-tokenized)."""

    name = "tokens"

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def _encode(self, text: str):
        # without a template's BOS / EOS, whose offsets (0, 0) would count and cut as if they were text
        return self.tok.encode(text, add_special_tokens=False)

    def count(self, text: str) -> int:
        return len(self._encode(text).ids) if text else 0

    def cut(self, text: str, units: int) -> str:
        enc = self._encode(text)
        return text if units >= len(enc.ids) else text[: enc.offsets[units][0]]

    def distance(self, prompt: str, end: int) -> int:
        """Tokens of `prompt` after the one that holds character end - 1."""
        offsets = self._encode(prompt).offsets
        last = max(i for i, (start, _) in enumerate(offsets) if start < end)
        return len(offsets) - 1 - last


# "random" filler: syllables drawn uniformly, so nothing in the filler can be learned beyond their frequency and the
# rest of the learnable signal is the probe's answers.
SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")[:64]


def _filler_stream(kind: str, rng: np.random.Generator, min_chars: int) -> str:
    if kind == "repeat":
        return REPEAT * (min_chars // len(REPEAT) + 2)
    if kind == "random":
        return "".join(" " + SYLLABLES[i] for i in rng.integers(len(SYLLABLES), size=min_chars // 3 + 100))
    pool = SENTENCES if kind == "sentences" else _pydoc_sentences()
    parts, total = [], 0
    while total < min_chars + 200:
        s = pool[int(rng.integers(len(pool)))]
        parts.append(" " + s)
        total += len(s) + 1
    return "".join(parts)


_PYDOC: tuple[str, ...] | None = None


def _pydoc_sentences() -> tuple[str, ...]:
    """Sentences of the pydoc topic pages that ship with Python (deterministic for a Python version)."""
    global _PYDOC
    if _PYDOC is None:
        import re

        from pydoc_data.topics import topics

        text = " ".join(" ".join(topics[k].split()) for k in sorted(topics))
        sents = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text)]
        plain = re.compile(r"^[A-Z][A-Za-z ,;:'()-]*[.!?]$")  # prose only: no digits, code or tables
        _PYDOC = tuple(s for s in sents if 20 <= len(s) <= 200 and plain.match(s))
    return _PYDOC


def _split(total: int, parts: int, rng: np.random.Generator) -> list[int]:
    """`total` units cut into `parts` non-negative pieces at uniform random points."""
    cuts = np.sort(rng.integers(0, total + 1, size=parts - 1)) if parts > 1 else np.array([], dtype=np.int64)
    edges = np.concatenate([[0], cuts, [total]])
    return [int(x) for x in np.diff(edges)]


class _Filler:
    """Consumes a filler stream piece by piece, each piece exactly `n` units long. With character units a piece ends
    at a word boundary and is padded with spaces to its length; with token units it ends where the tokens run out."""

    def __init__(self, stream: str, units):
        self.stream, self.units, self.pos = stream, units, 0

    def take(self, n: int) -> str:
        if n <= 0:
            return ""
        if self.units.name == "chars":
            while self.pos + n >= len(self.stream):
                self.stream += self.stream
            piece = self.stream[self.pos : self.pos + n]
            if self.stream[self.pos + n] != " " and piece.rfind(" ") > 0:
                piece = piece[: piece.rfind(" ")]
            self.pos += len(piece)
            return piece + " " * (n - len(piece))
        piece = self.units.cut(self.stream[self.pos :], n)
        while self.units.count(piece) < n:  # the stream ran short (cannot happen with char units)
            self.stream += self.stream
            piece = self.units.cut(self.stream[self.pos :], n)
        self.pos += len(piece)
        return piece


def _draw_distance(spec: ProbeSpec, item_u: int, question_u: int, units, rng: np.random.Generator) -> int:
    """The needed value's distance: spec.distance, or uniform in [min_distance, max_distance] clipped to what fits.
    item_u: units of the item up to the value's end; question_u: units after it that the distance cannot avoid (the
    rest of the item, the question)."""
    n = spec.length
    lo = max(question_u, spec.min_distance if spec.min_distance is not None else 0)
    hi = min(n - item_u, spec.max_distance if spec.max_distance is not None else n)
    if spec.distance is not None:
        lo = hi = spec.distance
    if not question_u <= lo <= hi <= n - item_u:
        raise ValueError(f"{spec.task} probe: distance {spec.distance if spec.distance is not None else (lo, hi)} "
                         f"impossible for length {n} (after the value come {question_u} {units.name} of item and "
                         f"question, the item up to it takes {item_u})")
    return int(rng.integers(lo, hi + 1))


def make_probe(spec: ProbeSpec, index: int, units=None) -> Probe:
    """Document `index` of the family `spec` (deterministic in (spec, index))."""
    units = units or CharUnits()
    rng = np.random.default_rng([spec.seed, index, TASKS.index(spec.task)])
    if spec.task == "recall":
        return _make_recall(spec, index, units, rng)
    pairs: dict[str, str] = {}
    if spec.task == "kv":
        lo_k, lo_v = 10 ** (spec.key_digits - 1), 10 ** (spec.value_digits - 1)
        keys = rng.choice(9 * lo_k, size=spec.num_pairs, replace=False) + lo_k
        for k in keys:
            pairs[f"k{int(k)}"] = f"v{int(rng.integers(lo_v, 10 * lo_v))}"
        key = list(pairs)[int(rng.integers(len(pairs)))]
        item = f" {key}: {pairs[key]}."
        question, answer = f" Question: what is the value of {key}? Answer:", f" {pairs[key]}"
        others = [f" {k}: {v}." for k, v in pairs.items() if k != key]
    elif spec.task == "needle":
        key, code = None, str(int(rng.integers(10 ** (spec.value_digits - 1), 10 ** spec.value_digits)))
        item, question, answer = f" {code}", " ?", f" {code}"
        others = []
    else:
        key, code = None, str(int(rng.integers(10 ** (spec.value_digits - 1), 10 ** spec.value_digits)))
        item = f" The pass key is {code}. Remember it. {code} is the pass key."
        question, answer = " What is the pass key? The pass key is", f" {code}"
        others = []
    n = spec.length
    # The distance counts from the value's last occurrence in the item (" The pass key is 1234. ... 1234 is the pass
    # key." reaches back to the second 1234; " k12: v345." to v345, not to the full stop): before it, in the input,
    # no token carries the value.
    value_at = item.rindex(answer.strip()) + len(answer.strip())
    item_u, question_u, rest_u = units.count(item), units.count(question), units.count(item[value_at:])
    others_u = [units.count(o) for o in others]
    d = _draw_distance(spec, item_u - rest_u, rest_u + question_u, units, rng)
    before_u, after_u = n - item_u - (d - rest_u), d - rest_u - question_u  # filler + other pairs around the item
    # Distractor pairs go left or right of the item in proportion to the room there, if they fit.
    side = rng.random(len(others)) * max(1, before_u + after_u) < before_u
    regions = {True: [], False: []}
    for o, u, left in zip(others, others_u, side):
        regions[bool(left)].append((o, u))
    for left in (True, False):
        room = before_u if left else after_u
        while sum(u for _, u in regions[left]) > room and regions[left]:
            moved = regions[left].pop()
            other_room = after_u if left else before_u
            if sum(u for _, u in regions[not left]) + moved[1] <= other_room:
                regions[not left].append(moved)
            else:
                raise ValueError(f"kv probe: {spec.num_pairs} pairs do not fit in length {n} {units.name}; "
                                 "lower num_pairs= or raise the context length")
    filler = _Filler(_filler_stream(spec.filler, rng, units_to_chars(n, units)), units)

    def region(room: int, items: list[tuple[str, int]]) -> str:
        order = rng.permutation(len(items))
        gaps = _split(room - sum(u for _, u in items), len(items) + 1, rng)
        text = filler.take(gaps[0])
        for i, gap in zip(order, gaps[1:]):
            text += items[i][0] + filler.take(gap)
        return text

    def asked_again(room: int, gap: int, first_gap: int | None) -> str:
        """Filler with the question and its answer repeated, each at least `gap` units after the previous one
        (and at least `gap` before the final question); the first one `first_gap` or less after the number."""
        qa = question + answer
        qa_u, text, used = units.count(qa), "", 0
        step = int(rng.integers(0, first_gap + 1) if first_gap is not None else rng.integers(gap, 2 * gap + 1))
        while used + step + qa_u + gap <= room:
            text += filler.take(step) + qa
            used += step + qa_u
            step = int(rng.integers(gap, 2 * gap + 1))
        return text + filler.take(room - used)

    head = region(before_u, regions[True])
    if spec.task == "needle" and spec.question_gap > 0:
        tail = asked_again(after_u, spec.question_gap, spec.first_gap)
    else:
        tail = region(after_u, regions[False])
    prompt = head + item + tail + question
    span = (len(head), len(head) + len(item))
    return Probe(task=spec.task, prompt=prompt, answer=answer, distance=units.distance(prompt, span[0] + value_at),
                 length=units.count(prompt), item_span=span, value_end=span[0] + value_at, key=key, pairs=pairs,
                 index=index, seed=spec.seed, units=units.name)


def _make_recall(spec: ProbeSpec, index: int, units, rng: np.random.Generator) -> Probe:
    """A stream of pairs from a dictionary of `num_pairs` keys; the last pair's key was last seen `d` units earlier.

    Pairs are whole units (a pair is never cut), so length and distance come as close to the request as whole pairs
    allow (within one pair); `Probe.distance` is the exact measured one. Units add up pair by pair because the
    byte-level pre-tokenizer splits at the space that starts each word."""
    lo_v = 10 ** (spec.value_digits - 1)
    codes = rng.choice(26 ** spec.key_digits, size=spec.num_pairs, replace=False)
    keys = [" " + "".join(chr(97 + int(c) // 26 ** i % 26) for i in range(spec.key_digits)) for c in codes]
    pairs = {k: str(int(v)) for k, v in zip(keys, rng.integers(lo_v, 10 * lo_v, size=len(keys)))}
    key, others = keys[0], keys[1:]
    item = key + pairs[key]
    question, answer = key, pairs[key]
    n, item_u, question_u = spec.length, units.count(item), units.count(question)
    d = _draw_distance(spec, item_u, question_u, units, rng)
    cost: dict[str, int] = {}

    def stream(room: int, draw: list[str]) -> str:
        """Pairs drawn uniformly from `draw` until `room` units are (nearly) filled; the last pair may overshoot by
        less than half a pair, so both length and distance land within a pair of the request."""
        text, used = [], 0
        while draw:
            k = draw[int(rng.integers(len(draw)))]
            pair = k + pairs[k]
            u = cost.setdefault(pair, units.count(pair))
            if used + u - room > room - used:
                break
            text.append(pair)
            used += u
        return "".join(text)

    # the queried key appears only as the item, so its previous occurrence is exactly there
    tail = stream(d - question_u, others)
    head = stream(n - item_u - units.count(tail) - question_u, others)
    prompt = head + item + tail + question
    span = (len(head), len(head) + len(item))  # the item ends with the value
    return Probe(task=spec.task, prompt=prompt, answer=answer, distance=units.distance(prompt, span[1]),
                 length=units.count(prompt), item_span=span, value_end=span[1], key=key, pairs=pairs, index=index,
                 seed=spec.seed, units=units.name)


def units_to_chars(n: int, units) -> int:
    return n if units.name == "chars" else 8 * n  # filler stream long enough for n tokens


def generate(spec: ProbeSpec, count: int, start: int = 0, units=None) -> list[Probe]:
    return [make_probe(spec, i, units) for i in range(start, start + count)]


def write_jsonl(spec: ProbeSpec, num_docs: int, path: str | Path) -> Path:
    """Write `num_docs` documents ({"text": prompt + answer, ...metadata}) atomically, plus <path>.spec.json.
    An existing file written with the same parameters is kept; one with other parameters is an error. Ranks started
    together write it once: a rewrite would change its mtime, and with it the data cache key of the ranks that
    already computed theirs."""
    path = Path(path)
    sidecar = path.with_name(path.name + ".spec.json")
    wanted = {"spec": asdict(spec), "num_docs": num_docs, "units": "chars"}
    if spec.task in ("kv", "passkey"):  # distances count from the value since 2026-12-01 (before: from the item's end)
        wanted["distance_from"] = "value"

    def kept() -> bool:
        if not path.is_file():
            return False
        if sidecar.is_file() and json.loads(sidecar.read_text()) == wanted:
            return True
        raise FileExistsError(f"{path} exists with other (or unknown) probe parameters; delete it or choose another "
                              f"path (wanted {wanted})")

    if kept():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path.with_name(f".{path.name}.lock"), f"another process is writing {path}; waiting"):
        if kept():  # written while we waited
            return path
        atomic_write_text(sidecar, json.dumps(wanted, indent=1))
        atomic_write_bytes(path, ((json.dumps(p.as_json()) + "\n").encode() for p in generate(spec, num_docs)))
    return path


def spec_from_mapping(cfg) -> ProbeSpec:
    names = {f.name for f in fields(ProbeSpec)}
    unknown = set(cfg) - names - {"num_docs", "file"}
    if unknown:
        raise ValueError(f"unknown probe parameters {sorted(unknown)}; known: {sorted(names | {'num_docs', 'file'})}")
    return ProbeSpec(**{k: v for k, v in cfg.items() if k in names})


try:  # Hydra callback: conf/data/probes.yaml registers it as hydra.callbacks.probes
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a dependency; keep the generator importable without it
    _HydraCallback = object


class ProbesCallback(_HydraCallback):
    """Before each Hydra job: write data.probes.file from the parameters in data.probes, unless it exists.

    Hydra turns an Exception raised by a callback into a warning and starts the job anyway, so a failure here is
    printed and ends the process (SystemExit(2)) instead of training on a missing or stale file."""

    def on_job_start(self, config, **kwargs) -> None:
        from omegaconf import OmegaConf

        data = config.get("data")
        if data is None or data.get("probes") is None:
            return
        try:
            probes = OmegaConf.to_container(data.probes, resolve=True)
            num_docs, path = int(probes.pop("num_docs")), Path(str(probes.pop("file")))
            if not path.is_file():
                print(f"probes: writing {num_docs} {probes.get('task')} documents to {path}", file=sys.stderr,
                      flush=True)
            write_jsonl(spec_from_mapping(probes), num_docs, path)
        except (ValueError, OSError) as err:
            print(f"error: data.probes: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m data.probes", description="Write probe documents as jsonl.")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num-docs", type=int, default=4000)
    defaults = ProbeSpec()
    for f in fields(ProbeSpec):
        kind = str if f.name in ("task", "filler") else int
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=getattr(defaults, f.name))
    ap.add_argument("--print", type=int, default=0, help="also print this many documents")
    args = ap.parse_args(argv)
    spec = ProbeSpec(**{f.name: getattr(args, f.name) for f in fields(ProbeSpec)})
    path = write_jsonl(spec, args.num_docs, args.out)
    for probe in generate(spec, args.print):
        print(f"--- distance {probe.distance} chars, answer {probe.answer!r}\n{probe.prompt}")
    print(f"wrote {args.num_docs} documents to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
