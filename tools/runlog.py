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
