"""Redraw the PNG plot and markdown tables (ratios, peak memory) of an attention benchmark CSV (e.g. one copied back from a GPU).

    python -m bench.plot_csv bench/results/attention_gpu_bf16.csv
"""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from bench.attention import report, save


def load(path: Path) -> list[dict]:
    def value(key, x):
        if key in ("n", "w"):
            return int(x)
        if key.endswith("_ms") or key == "peak_mb":
            return float(x) if x not in ("", "None") else None
        return x

    with open(path) as f:
        return [{k: value(k, x) for k, x in row.items()} for row in csv.DictReader(f)]


def main():
    if len(sys.argv) == 2 and sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    path = Path(sys.argv[1])
    rows = load(path)
    tag = path.stem.removeprefix("attention_")
    save(rows, path.parent, tag)
    table = report(rows)
    (path.parent / f"attention_{tag}.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
