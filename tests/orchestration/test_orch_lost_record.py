"""The lock is the last word on what runs: with the run record (<out>/run.json), the fact cache and
the ledger all lost, status still reports the live trainer (its record rebuilt from the process
that holds the output's lock), a relaunch is refused naming it with a hint that works, and stop
ends it. Real playbooks (dflashctl over ansible-runner), the real trainer on CPU."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from conftest import ENDLESS_TINY_RUN, is_our_trainer, ledger, make_controller, stop_leftovers

from dflashctl import PlaybookFailed


@pytest.mark.slow
def test_a_trainer_whose_record_is_lost_is_found_by_its_lock_and_stopped(state_dir: Path) -> None:
    ctl = make_controller(state_dir, workspace_trainer_set=ENDLESS_TINY_RUN)
    record: dict = {}
    try:
        record = ctl.launch("nographs")
        out = Path(record["out"])
        (out / "run.json").unlink()
        shutil.rmtree(state_dir / "facts")
        (state_dir / "runs.jsonl").unlink()

        status = ctl.status()
        assert status["state"] == "running" and status["pid"] == record["pid"]
        assert status["run_id"] == record["run_id"], "the run id comes back from the trainer's environment"
        assert "cache and ledger repaired" in status["repaired"]
        rebuilt = json.loads((out / "run.json").read_text())
        assert rebuilt["pid"] == record["pid"] and rebuilt["start_time"] == record["start_time"]
        assert rebuilt["log"] == record["log"] and rebuilt["steps"] == 100000 and "rebuilt" in rebuilt
        assert [line["run_id"] for line in ledger(state_dir)] == [record["run_id"]]

        with pytest.raises(PlaybookFailed, match=f"as PID {record['pid']} .*stop it first"):
            ctl.launch("nographs")

        # The record lost again, and the cache: the hint's stop still finds the trainer and ends it.
        (out / "run.json").unlink()
        shutil.rmtree(state_dir / "facts")
        stopped = ctl.stop()
        assert stopped["state_before"] == "running"
        assert stopped["checkpoint"].startswith("checkpoint saved step ")
        assert not is_our_trainer(record)
        assert json.loads((out / "run.json").read_text())["state"] == "stopped"
    finally:
        stop_leftovers(ctl, state_dir)
        if record and is_our_trainer(record):  # the ledger that stop_leftovers reads was lost
            os.kill(record["pid"], signal.SIGKILL)
