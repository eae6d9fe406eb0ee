"""Redraw the PNG plot and markdown tables (ratios, peak memory, TFLOP/s) of an attention benchmark CSV (e.g. one
copied back from a GPU).

    python -m bench.plot_csv bench/results/attention_gpu_bf16.csv
    python -m bench.plot_csv /tmp/attention_gpu_bf16_b8_h200_2026-12-04.csv --batch 8

CSVs written before 2026-12-05 do not hold the batch, heads and head dim the TFLOP/s need: --batch, --heads and
--head-dim give them (default: the benchmark's default shape, B=1 H=16 D=64); one that contradicts a CSV's own
column is refused. The CSV itself is left as it is.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from bench.attention import DEFAULT_SHAPE, report, save
from data.shards import atomic_write_text


def load(path: Path) -> list[dict]:
    def value(key, x):
        if key in ("n", "w", "batch", "heads", "head_dim"):
            return int(x)
        if key.endswith("_ms") or key == "peak_mb":
            return float(x) if x not in ("", "None") else None
        return x

    with open(path) as f:
        return [{k: value(k, x) for k, x in row.items()} for row in csv.DictReader(f)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", type=Path)
    shape = ("batch", "heads", "head_dim")
    for key in shape:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, default=None)
    args = p.parse_args()
    path = args.csv
    rows = load(path)
    for key in shape:
        given, held = getattr(args, key), {row[key] for row in rows if key in row}
        if given is not None and held and held != {given}:
            p.error(f"--{key.replace('_', '-')} {given} contradicts the CSV's own {key} column ({sorted(held)})")
        for row in rows:
            row.setdefault(key, DEFAULT_SHAPE[key] if given is None else given)
    tag = path.stem.removeprefix("attention_")
    save(rows, path.parent, tag, csv_too=False)
    table = report(rows)
    atomic_write_text(path.parent / f"attention_{tag}.md", table + "\n")
    print(table)


if __name__ == "__main__":
    main()
