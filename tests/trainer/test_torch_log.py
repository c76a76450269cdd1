"""torch's repeated warnings reach the run's log once, and their repeats are counted."""

from __future__ import annotations

import io
import logging
import uuid

import pytest

from trainer.model.torch_log import MARK, RepeatedWarnings, quiet_repeated_torch_warnings, torch_handlers

pytestmark = pytest.mark.unit

GUARD = "%s guard on %s is dropped with caching_precompile=True."


def test_a_repeated_torch_warning_is_shown_once_and_its_repeats_counted():
    quiet_repeated_torch_warnings()
    quiet_repeated_torch_warnings()  # twice: still one filter per handler
    handler = logging.getLogger("torch._dynamo").handlers[0]
    assert sum(isinstance(f, RepeatedWarnings) for f in handler.filters) == 1
    assert all(any(isinstance(f, RepeatedWarnings) for f in h.filters) for h in torch_handlers())
    filtered = next(f for f in handler.filters if isinstance(f, RepeatedWarnings))
    before = filtered.left_out()
    stream = io.StringIO()
    previous = handler.setStream(stream)
    try:
        # A logger of this test's own under torch._dynamo (torch's handler sees it): the filter is
        # process-wide, and an earlier test in this process may have logged torch's own guard warning.
        guards = logging.getLogger(f"torch._dynamo.guards.test{uuid.uuid4().hex}")
        for number in range(715):
            guards.warning(GUARD, "CLOSURE_MATCH", f"L['fn'].__closure__[{number}]")
        guards.warning("another warning")
    finally:
        handler.setStream(previous)
    lines = stream.getvalue().splitlines()  # torch's format: "W1206 04:30:40.958000 PID file:line] text"
    assert [line.split("] ", 1)[1] for line in lines] == [
        "CLOSURE_MATCH guard on L['fn'].__closure__[0] is dropped with caching_precompile=True." + MARK,
        "another warning" + MARK,
    ]
    assert filtered.left_out() - before == 714


def test_the_count_is_said_in_one_line():
    repeated = RepeatedWarnings()
    records = [
        logging.LogRecord("torch._dynamo.guards", logging.WARNING, "f", 1, GUARD, ("A", n), None)
        for n in range(3)
    ]
    assert [repeated.filter(record) for record in records] == [True, False, False]
    assert repeated.summary() == "torch: 2 repeats of 1 warning(s) left out of this log"
    assert RepeatedWarnings().summary() is None
