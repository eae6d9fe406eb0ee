"""What a run says: plain lines on stderr and in the run's train.log (Hydra's job log, beside Lightning's lines),
rich console messages mirrored there as plain text, and Python warnings (ours through Lightning's rank_zero_warn,
data preparation's, the libraries') recorded there too; ours read "warning: <message>", without the file and line
Python puts before a warning. Outside a Hydra job there is no log file and only stderr is written."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def log_to_file(text: str) -> None:
    """`text` into the job's log file(s), if there are any."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(logging.LogRecord("train", logging.INFO, __file__, 0, text, None, None))


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


def _ours(filename: str) -> bool:
    """Whether a warning was raised by this project's code (Lightning's rank_zero_warn names its caller), not by a
    library installed inside the checkout (.venv)."""
    try:
        parts = Path(filename).resolve().relative_to(ROOT).parts
    except (ValueError, OSError):
        return False
    return "site-packages" not in parts and not parts[0].startswith(".")


def warnings_to_log() -> None:
    """Every warning shown from now on is also written to train.log (once per process: the hook looks up the
    current log file at each warning, so runs one after another in a process each get their own)."""
    if getattr(warnings.showwarning, "_to_run_log", False):
        return
    show, form = warnings.showwarning, warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None):
        if category is UserWarning and _ours(filename):  # a message to the user, not a place in the code
            return f"warning: {message}\n"
        return form(message, category, filename, lineno, line)

    def showwarning(message, category, filename, lineno, file=None, line=None):
        show(message, category, filename, lineno, file, line)  # (a recorder, under catch_warnings, stays one)
        ours = category is UserWarning and _ours(filename)
        log_to_file(f"warning: {message}" if ours else f"{category.__name__}: {message}")

    showwarning._to_run_log = True
    warnings.showwarning, warnings.formatwarning = showwarning, formatwarning
