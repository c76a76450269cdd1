"""torch's own warnings in the run's log: each said once, its repeats counted.

torch logs through its own handlers (stderr, which is the run's log). Some warnings come once per
guard or per graph: a data stage that loads kept compiled traces (`caching_precompile`) printed 715
lines of `CLOSURE_MATCH guard on ... is dropped with caching_precompile=True` out of 732. A filter
on those handlers lets the first record of each message through, marked, and counts the others;
at exit one line says how many were left out.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import threading
from collections import Counter

MARK = " (repeats of this torch warning are counted, not shown)"


class RepeatedWarnings(logging.Filter):
    """The first record of each (logger, level, message template) passes; the others are counted."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        decided = getattr(record, "dflash_first", None)
        if decided is not None:  # the same record at another of torch's handlers
            return decided
        key = (record.name, record.levelno, str(record.msg))
        with self.lock:
            self.counts[key] += 1
            first = self.counts[key] == 1
        record.dflash_first = first
        if first and record.levelno >= logging.WARNING and isinstance(record.msg, str):
            record.msg += MARK
        return first

    def left_out(self) -> int:
        with self.lock:
            return sum(count - 1 for count in self.counts.values())

    def summary(self) -> str | None:
        with self.lock:
            repeated = sum(1 for count in self.counts.values() if count > 1)
        left = self.left_out()
        return f"torch: {left:,} repeats of {repeated} warning(s) left out of this log" if left else None


REPEATED = RepeatedWarnings()


def torch_handlers() -> list[logging.Handler]:
    """The stream handlers torch set up on its loggers (`torch`, `torch._dynamo`, `torch._inductor`,
    ...): what prints to the log. Any other handler (the compile cache's own) sees every record."""
    loggers = [logging.getLogger("torch")] + [
        logger
        for name, logger in list(logging.root.manager.loggerDict.items())
        if name.startswith("torch.") and isinstance(logger, logging.Logger)
    ]
    return [
        handler for logger in loggers for handler in logger.handlers if type(handler) is logging.StreamHandler
    ]


def quiet_repeated_torch_warnings() -> None:
    """Once torch is imported: its handlers say each warning once (idempotent); the count at exit."""
    import torch  # noqa: F401  (its logging set up first)

    for handler in torch_handlers():
        if REPEATED not in handler.filters:
            handler.addFilter(REPEATED)
    if not getattr(quiet_repeated_torch_warnings, "registered", False):
        quiet_repeated_torch_warnings.registered = True
        atexit.register(say_left_out)


def say_left_out() -> None:
    line = REPEATED.summary()
    if line:
        with contextlib.suppress(OSError, ValueError):  # stderr gone at exit: nothing to say it on
            print(line, file=sys.stderr, flush=True)
