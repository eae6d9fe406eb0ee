"""The run's metrics.csv, kept across resumes.

Lightning's CSVLogger deletes metrics.csv when it finds one in its folder, so `resume=auto` in the same run directory
threw away everything the first attempt logged. Here a resumed run appends to the file instead: it then holds the
run's whole history, and readers (tools/runs.py) see the steps go back where a resume restarted from an earlier
checkpoint and drop what the abandoned attempt logged after it. A fresh run into a folder that already has a
metrics.csv moves that file aside (metrics.previous-<k>.csv) rather than deleting it.
"""

from __future__ import annotations

import csv
from pathlib import Path

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter


class _AppendingWriter(ExperimentWriter):
    def _check_log_dir_exists(self) -> None:
        # Lightning's version deletes the file. Start from its header instead, so that appended rows line up with the
        # old columns and a new metric rewrites the file with every column (old rows kept).
        path = Path(self.metrics_file_path)
        if path.is_file() and path.stat().st_size:
            with open(path, newline="") as f:
                self.metrics_keys = list(next(csv.reader(f), []))


class RunCSVLogger(CSVLogger):
    """CSVLogger writing <save_dir>/metrics.csv; `resuming=True` appends to an existing file."""

    def __init__(self, save_dir: str | Path, resuming: bool):
        super().__init__(save_dir=str(save_dir), name="", version="")
        self._resuming = resuming

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            metrics = Path(self.log_dir) / ExperimentWriter.NAME_METRICS_FILE
            if not self._resuming and metrics.is_file():
                k = 1
                while (aside := metrics.with_name(f"metrics.previous-{k}.csv")).exists():
                    k += 1
                metrics.rename(aside)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment
