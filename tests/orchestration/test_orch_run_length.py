"""A run is as long as it was started: stopped and resumed with `-e resume=true` alone, it continues
to the steps it was launched with (not the profile's), and the refusals of a plain launch say the
true state. Real playbooks (dflashctl over ansible-runner), the real trainer on CPU."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from conftest import TINY_RUN, make_controller, stop_leftovers

from dflashctl import PlaybookFailed

# The tiny CPU run with a checkpoint every other step.
TINY = [*TINY_RUN, "train.checkpoint_every=2"]
LONG = 100000  # far more than the profile's steps: the run never finishes in the test


def run_record(state_dir: Path) -> dict:
    path = state_dir / "workspace" / "runs" / "nographs" / "run.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def wait_for(predicate, timeout: float = 300, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.slow
def test_resume_continues_to_the_steps_the_run_was_started_with(state_dir: Path) -> None:
    ctl = make_controller(state_dir, workspace_trainer_set=TINY, run_wait_enabled=False)
    try:
        first = ctl.launch("nographs", steps=LONG)
        wait_for(lambda: (run_record(state_dir).get("last_step") or 0) >= 2, what="a checkpoint")
        stopped = ctl.stop()
        assert stopped["state_before"] == "running"
        step = run_record(state_dir)["last_step"]

        # A plain launch is refused as what the run is: stopped at `step` of LONG, not "finished".
        with pytest.raises(PlaybookFailed) as again:
            ctl.launch("nographs")
        message = str(again.value)
        assert "has finished" not in message
        assert f"step {step} of {LONG}" in message and f"Continue it to step {LONG}" in message
        assert "-e resume=true" in message

        # The hint's way (-e resume=true alone) goes on to LONG, not to the profile's 150.
        resumed = ctl.launch("nographs", resume=True)
        assert resumed["run_id"] != first["run_id"]
        wait_for(lambda: run_record(state_dir).get("run_id") == resumed["run_id"], what="the new record")
        assert run_record(state_dir)["steps"] == LONG
        log = Path(resumed["log"])
        wait_for(lambda: f"/{LONG} loss" in log.read_text(), what="a progress line of the resumed run")
        assert "resumed from" in log.read_text()

        # An export of the live run says that the run goes on.
        exported = ctl.export()
        assert exported["live"] is True and "is still training" in exported["note"]
        assert "the run goes on" in exported["note"]
        assert exported["dest"].endswith(f"/exports/{resumed['run_id']}/step_{exported['step']}")
        assert ctl.stop()["state_before"] == "running"
    finally:
        stop_leftovers(ctl, state_dir)
