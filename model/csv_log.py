"""The run's metrics.csv, kept across resumes.

Lightning's CSVLogger deletes metrics.csv when it finds one in its folder, so `resume=auto` in the same run directory
threw away everything the first attempt logged. Here a resumed run appends to the file instead: it then holds the
run's whole history, and readers (tools/runs.py) see the steps go back where a resume restarted from an earlier
checkpoint and drop what the abandoned attempt logged after it.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


def _header_for_appending(path: Path) -> list[str]:
    """The columns of an earlier attempt's file, made safe to append to: a torn last row (the process was killed
    mid-write) is cut off, and a header out of Lightning's sorted order is rewritten sorted (the writer sorts its
    columns before every write). A file without a header is renamed metrics.unreadable.csv."""
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1]
    rows = list(csv.reader(io.StringIO(complete)))
    if not rows or not any(rows[0]):
        path.replace(path.with_name("metrics.unreadable.csv"))
        return []
    header = rows[0]
    if complete != text or header != sorted(header):
        _write_rows(path, sorted(header), list(csv.DictReader(io.StringIO(complete))))
    return sorted(header)


def _write_rows(path: Path, fieldnames: list[str], records: list[dict]) -> None:
    """The whole file anew, atomically: a kill mid-write leaves the old file, not a truncated history."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(records)
    os.replace(tmp, path)


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        # Lightning's version deletes the file. Start from its header instead, so that appended rows line up with the
        # old columns and a new metric rewrites the file with every column (old rows kept).
        path = Path(self.metrics_file_path)
        if path.is_file() and path.stat().st_size:
            self.metrics_keys = _header_for_appending(path)

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        # a new column (the eval/* scores at the end of every run, say) rewrites every row: Lightning's version
        # truncates the file first, so a kill or a full disk then lost the run's whole history
        path = Path(self.metrics_file_path)
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            records = list(reader)
        try:
            _write_rows(path, fieldnames, records)
        except BaseException:
            self.metrics_keys = list(reader.fieldnames or [])  # the file's columns: the next save rewrites again
            raise


class RunCSVLogger(CSVLogger):
    """CSVLogger writing <save_dir>/metrics.csv, appending to the file an earlier attempt of the run left there
    (train.py moves an unrelated earlier run's files aside before a fresh run starts)."""

    def __init__(self, save_dir: str | Path):
        super().__init__(save_dir=str(save_dir), name="", version="")

    def log_metrics(self, metrics, step=None) -> None:
        # no "epoch" column: Lightning's loop epoch counts fit calls here (a run is one epoch, a resume starts the
        # next), not passes over the data, which the column's name suggests
        super().log_metrics({k: v for k, v in metrics.items() if k != "epoch"}, step)

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
