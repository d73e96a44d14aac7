"""One progress bar for long sweeps (bench, eval), visible in a terminal *and* in a log file.

tqdm hides itself when stderr is not a TTY, which left an hour-long ``trtkv eval`` under ``nohup`` with
no sign of life; there we print a plain line at most once a minute instead of a redrawn bar.
"""
from __future__ import annotations

import sys


class _LogLines:
    """A file for tqdm that turns its carriage-return redraws into one line per update."""

    def write(self, s: str) -> None:
        s = s.replace("\r", "").strip()
        if s:
            sys.stderr.write(s + "\n")

    def flush(self) -> None:
        sys.stderr.flush()


def progress_bar(total: int, desc: str, unit: str, progress: bool | None = None, log_interval_s: float = 60.0):
    """``progress`` True/False forces the bar on/off; None: a bar on a TTY, a line per minute otherwise."""
    from tqdm import tqdm

    if progress is False:
        return tqdm(total=total, disable=True)
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True)
    return tqdm(total=total, desc=desc, unit=unit, file=_LogLines(), ncols=100, ascii=True,
                mininterval=log_interval_s, maxinterval=log_interval_s * 10)
