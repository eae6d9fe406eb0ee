"""What a run says: plain lines on stderr and in the run's train.log (Hydra's job log, beside Lightning's lines),
rich console messages mirrored there as plain text, and Python warnings (ours through Lightning's rank_zero_warn,
data preparation's, the libraries') recorded there too. Outside a Hydra job there is no log file and only stderr
is written."""

from __future__ import annotations

import logging
import sys
import warnings


def log_to_file(text: str) -> None:
    """`text` into the job's log file(s), if there are any."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(logging.LogRecord("train", logging.INFO, __file__, 0, text, None, None))


def code_revision() -> str:
    """This code's git commit ("<sha> (dirty)" with uncommitted changes; "unknown" outside a git checkout)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
        return rev.stdout.strip() + (" (dirty)" if dirty.stdout.strip() else "") if rev.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def only_launch_files(run_dir, log_name: str, log_empty: bool = False) -> bool:
    """Whether Hydra's output folder holds only what it writes at every launch (.hydra/ and the job log, empty if
    `log_empty`): a folder this launch made, or one no run used."""
    from pathlib import Path

    run_dir, log = Path(run_dir), Path(run_dir) / log_name
    return log.is_file() and not (log_empty and log.stat().st_size) and all(
        entry.name in (".hydra", log_name) for entry in run_dir.iterdir())


def remove_refused_launch(run_dir, log_name: str, within=None) -> None:
    """Remove the output folder of a launch refused before it ran (when it holds no more than the launch wrote):
    no folder of a run that never was. The error was on stderr. Then the folders that leaves empty below `within`
    (runs/ of train.py: its runs/train/ after a first launch); `within` stays, as do the launch directory and its
    parents."""
    import os
    import shutil
    from pathlib import Path

    run_dir = Path(run_dir)
    if not only_launch_files(run_dir, log_name):
        return
    logging.shutdown()  # the job log's handler closed before its file goes
    # what the launch wrote, then the folder if that leaves it empty: a folder made beforehand (hydra.run.dir=. or a
    # scheduler's job folder) is the launch directory, or someone's, and stays
    shutil.rmtree(run_dir / ".hydra", ignore_errors=True)
    (run_dir / log_name).unlink(missing_ok=True)
    # removed as written, not resolved: rmdir refuses a link (a run folder or runs/ that points to other storage);
    # compared resolved, so that no spelling of the launch directory or of a parent of it is removed
    here = Path(os.getcwd()).resolve()
    folder = Path(os.path.abspath(run_dir))
    top = Path(os.path.abspath(within)) if within is not None else None
    first = True
    while first or (top is not None and top in folder.parents):
        if folder.resolve() == here or folder.resolve() in here.parents:
            return
        try:
            folder.rmdir()
        except OSError:  # not empty after all, or a link
            return
        folder, first = folder.parent, False


def say(text: str) -> None:
    """A plain line on stderr and in train.log."""
    print(text, file=sys.stderr, flush=True)
    log_to_file(text)


class RunConsole:
    """Rich on stderr, and the same message as plain text in train.log: the run's record of what it said."""

    def __init__(self, console):
        self.console = console

    def print(self, message, markup: bool = True, **kwargs):
        self.console.print(message, markup=markup, **kwargs)
        if isinstance(message, str):
            from rich.text import Text

            log_to_file(Text.from_markup(message).plain if markup else message)


def warnings_to_log() -> None:
    """Every warning shown from now on is also written to train.log (once per process: the hook looks up the
    current log file at each warning, so runs one after another in a process each get their own)."""
    if getattr(warnings.showwarning, "_to_run_log", False):
        return
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        show(message, category, filename, lineno, file, line)
        log_to_file(f"{category.__name__}: {message}")

    showwarning._to_run_log = True
    warnings.showwarning = showwarning
