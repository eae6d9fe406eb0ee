"""Data preparation's tokenization with and without HF tokenizers' threads, side by side in one process.

    python -m bench.tokenize                                  # the embedded corpus (ships with Python)
    python -m bench.tokenize --files '/data/books/*.jsonl.gz' --docs 60

Times BPE training and encode_batch (data/prepare.py's two steps) with TOKENIZERS_PARALLELISM=false, then true
(tokenizers reads the variable at every call), and checks that both give the same tokenizer and the same ids.
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
    args = p.parse_args()
    from data.sources import embedded_documents, file_documents
    from data.tokenizer import train_bpe

    docs = list(itertools.islice(file_documents(args.files.split(",")) if args.files else embedded_documents(),
                                 args.docs))  # the first N read, not the whole corpus read and then cut
    print(f"{len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f}M characters, {os.cpu_count()} CPUs")
    rows = {}
    for threads in ("false", "true"):
        os.environ["TOKENIZERS_PARALLELISM"] = threads
        tok, train_s = timed(lambda: train_bpe(docs, args.vocab))
        ids, encode_s = timed(lambda: [e.ids for e in tok.encode_batch(docs)])
        digest = hashlib.sha256((tok.to_str() + repr(ids)).encode()).hexdigest()[:12]
        rows[threads] = (train_s, encode_s, digest)
    print("\n| threads | BPE training s | encode_batch s | tokenizer + ids |\n|---|---|---|---|")
    for threads, (train_s, encode_s, digest) in rows.items():
        print(f"| {'on' if threads == 'true' else 'off'} | {train_s:.2f} | {encode_s:.2f} | {digest} |")
    (t0, e0, d0), (t1, e1, d1) = rows["false"], rows["true"]
    print(f"\nthreads on / off: training {t1 / t0:.2f}, encoding {e1 / e0:.2f}; same result: {d0 == d1}")


if __name__ == "__main__":
    main()
