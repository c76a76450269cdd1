"""Preparing a run's data through the real playbooks (playbooks/regen.yml via dflashctl) on the local
default inventory: started detached and recorded like a launch, status says `regenerating` with its
progress while the target regenerates, and the history names what was regenerated."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import make_controller, stop_leftovers

from dflashctl import PlaybookFailed

pytestmark = pytest.mark.slow


def test_regen_is_recorded_like_a_launch_and_status_shows_the_stage(state_dir: Path) -> None:
    ctl = make_controller(state_dir, workspace_trainer_set=["data.regen_progress_every_s=0.5"])
    try:
        record = ctl.regen("eager")
        assert record["run"] == "eager" and record["pid"] > 0
        seen = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            status = ctl.status()
            seen.append((status["state"], status.get("stage"), status["last_progress"]))
            if status["state"] != "running":
                break
        assert any(
            stage == "regenerating" and (progress or "").startswith("regen: ") for _, stage, progress in seen
        ), seen
        assert status["state"] == "exited" and status["exit_status"] == 0, status
        assert status["exit_reason"].startswith("data ready: 600 conversations"), status
        (row,) = ctl.runs(run="eager")
        assert row["state"] == "finished"
        assert "regenerated 600 conversations" in row["exit_reason"], row
        assert row["step"] is None  # nothing was trained
        # An output that holds checkpoints: preparing the data leaves them alone, nothing to refuse.
        checkpoint = Path(record["out"]) / "checkpoints" / "step_00000004.pt"
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
        checkpoint.write_bytes(b"a checkpoint")
        again = ctl.regen("eager")
        assert again["run_id"] != record["run_id"] and checkpoint.read_bytes() == b"a checkpoint"
    finally:
        stop_leftovers(ctl, state_dir)


def test_a_regen_that_cannot_start_fails_with_the_trainer_s_own_error(state_dir: Path) -> None:
    """Bad input the target refuses (a data file without its target model): ./dev.sh regen fails
    naming it, as a launch does, instead of returning 0 and leaving the failure for status to tell."""
    data = state_dir.parent / "chat.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
    )
    ctl = make_controller(state_dir, dflash_machine={"data": {"train_file": str(data)}})
    try:
        with pytest.raises(PlaybookFailed) as failure:
            ctl.regen("eager")
        message = str(failure.value)
        assert "exit status: 2 (bad input: data.train_file is set but model.target_path is not" in message, (
            message
        )
    finally:
        stop_leftovers(ctl, state_dir)
