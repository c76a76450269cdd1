"""Test-only: record which conversations every global batch of a run holds, and stop a run after a
given step, in every Python process started with this directory on PYTHONPATH (the trainer, and
torchrun's ranks, which in-process patching cannot reach).

DFLASH_TEST_BATCH_TRACE=<file>: the lead process (RANK 0, or no RANK: the threaded topology)
appends one JSON line per batch the loader hands out: {"pid", "conversations": [[ids of row 1],
...]}, the token store's conversation indices of the rows the loader picked (its `assemble` call,
so a batch that runs into the next epoch is recorded as it was drawn).
DFLASH_TEST_STOP_AFTER=<n>: SIGTERM to this process right after its n-th batch (an operator's stop;
every rank of a process run gets it, so all stop after the same step).
"""

from __future__ import annotations

import json
import os
import signal


def traced(assemble, trace_file: str | None, stop_after: int):
    """trainer.data.rows.assemble, recording each batch's conversations and stopping after `stop_after`."""
    drawn = []

    def wrapper(train_set, rows):
        batch = assemble(train_set, rows)
        drawn.append(len(rows))
        if trace_file and os.environ.get("RANK", "0") == "0":
            offsets, pieces = train_set.row_offsets, train_set.pieces
            conversations = [[int(c) for c in pieces[offsets[r] : offsets[r + 1]]] for r in rows]
            with open(trace_file, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"pid": os.getpid(), "conversations": conversations}) + "\n")
        if stop_after and len(drawn) == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)
        return batch

    return wrapper


if os.environ.get("DFLASH_TEST_BATCH_TRACE") or os.environ.get("DFLASH_TEST_STOP_AFTER"):
    from trainer.data import rows as _rows

    _rows.assemble = traced(
        _rows.assemble,
        os.environ.get("DFLASH_TEST_BATCH_TRACE"),
        int(os.environ.get("DFLASH_TEST_STOP_AFTER") or 0),
    )
