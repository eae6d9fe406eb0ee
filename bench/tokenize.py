"""Data preparation's tokenization with and without HF tokenizers' threads, side by side in one process.

    python -m bench.tokenize                                  # the embedded corpus (ships with Python)
    python -m bench.tokenize --files '/data/books/*.jsonl.gz' --docs 60

Times BPE training and encode_batch (data/prepare.py's two steps) with TOKENIZERS_PARALLELISM=false and true
(tokenizers reads the variable at every call), in alternating order over --rounds (off on, on off, ...: neither
side always runs first, warm), keeps each side's fastest, and checks that every run gives the same tokenizer and ids.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import time


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", default=None, help="txt / jsonl / parquet files or a glob (default: embedded corpus)")
    p.add_argument("--docs", type=int, default=None, help="the first N documents only")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--rounds", type=int, default=2, help="runs of each side, alternating which goes first")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    from data.sources import embedded_documents, file_documents
    from data.tokenizer import train_bpe

    docs = list(itertools.islice(file_documents(args.files.split(",")) if args.files else embedded_documents(),
                                 args.docs))  # the first N read, not the whole corpus read and then cut
    print(f"{len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f}M characters, {os.cpu_count()} CPUs")
    runs = {"false": [], "true": []}
    for r in range(args.rounds):
        for threads in ("false", "true") if r % 2 == 0 else ("true", "false"):
            os.environ["TOKENIZERS_PARALLELISM"] = threads
            tok, train_s = timed(lambda: train_bpe(docs, args.vocab))
            ids, encode_s = timed(lambda: [e.ids for e in tok.encode_batch(docs)])
            digest = hashlib.sha256((tok.to_str() + repr(ids)).encode()).hexdigest()[:12]
            runs[threads].append((train_s, encode_s, digest))
    digests = {digest for side in runs.values() for _, _, digest in side}
    rows = {threads: (min(t for t, _, _ in side), min(e for _, e, _ in side), "/".join(sorted({d for _, _, d in side})))
            for threads, side in runs.items()}
    print("\n| threads | BPE training s | encode_batch s | tokenizer + ids |\n|---|---|---|---|")
    for threads, (train_s, encode_s, digest) in rows.items():
        print(f"| {'on' if threads == 'true' else 'off'} | {train_s:.2f} | {encode_s:.2f} | {digest} |")
    (t0, e0, _), (t1, e1, _) = rows["false"], rows["true"]
    print(f"\nthreads on / off (fastest of {args.rounds}): training {t1 / t0:.2f}, encoding {e1 / e0:.2f}; "
          f"same result: {len(digests) == 1}")


if __name__ == "__main__":
    main()
