"""dflash.ct200.trainer_stop: SIGTERM to the recorded trainer only when it still is that trainer,
its checkpoint line, SIGKILL after the timeout; nothing done for no run, an ended run or a PID that
now belongs to another process; the trainer found on the target when the cache is empty. Real
processes: the stand-in trainer of tests/unit/standin.py, killed by PID at the end of every test."""

from __future__ import annotations

import errno
import json

import pytest
from ansible_collections.dflash.ct200.plugins.module_utils.run_record import read_record
from ansible_collections.dflash.ct200.plugins.modules import trainer_start, trainer_stop

from tests.unit.standin import (
    Started,
    alive,
    gone_within,
    kill_and_reap,
    logged_within,
    not_the_trainer,
    workspace,
)


@pytest.fixture
def trainer(tmp_path, run_module):
    """start(*args, out=None, until="step 1/10 ") -> trainer_start's result for a stand-in trainer that
    has logged `until` (a step, by default)."""
    script = workspace(tmp_path / "ws")
    log = tmp_path / "train.log"
    with Started() as started:

        def start(*args: str, out=None, until: str = "step 1/10 ") -> dict:
            params = {"script": str(script), "log": str(log), "run": "nographs"}
            if out:
                params["out"] = str(out)
                args = (*args, "--out", str(out))
            result = run_module(trainer_start.main, {**params, "args": list(args)})
            started.add(result.result)
            assert not result.failed, result.result["msg"]
            assert logged_within(log, until, 10)
            return result.result

        yield start


def recorded(started: dict, log) -> dict:
    return {key: started[key] for key in ("pid", "start_time", "boot_id")} | {
        "run": "nographs",
        "log": str(log),
    }


def test_sigterm_stops_the_trainer_after_its_checkpoint(tmp_path, run_module, trainer) -> None:
    log = tmp_path / "train.log"
    started = trainer(out=tmp_path / "runs" / "nographs")
    result = run_module(trainer_stop.main, recorded(started, log))
    assert not result.failed, result.result["msg"]
    assert result.result["changed"] is True and result.result["state_before"] == "running"
    assert result.result["killed"] is False and result.result["pid"] == started["pid"]
    # The module counts a process whose memory is released as gone (it is exiting): allow the rest.
    assert gone_within(started["pid"], 5)
    checkpoint = result.result["checkpoint"]
    assert checkpoint.startswith("checkpoint saved step ") and "step_000000" in checkpoint
    assert result.result["msg"] == f"stopped PID {started['pid']} after SIGTERM; {checkpoint}"
    assert result.result["log_tail"][-1].startswith("stopped at step ")
    assert 0 <= result.result["stopped_in_s"] < 10


def test_a_trainer_ignoring_sigterm_is_killed_after_the_timeout(tmp_path, run_module, trainer) -> None:
    log = tmp_path / "train.log"
    started = trainer("--behave", "ignore-term")
    result = run_module(trainer_stop.main, {**recorded(started, log), "timeout": 0.5})
    assert not result.failed, result.result["msg"]
    assert result.result["killed"] is True and gone_within(started["pid"], 5)
    assert result.result["stopped_in_s"] >= 0.5
    assert (
        f"the trainer (PID {started['pid']}) did not exit within 0 s of SIGTERM: sent SIGKILL"
        in (result.result["msg"])
    )
    assert result.result["checkpoint"] is None


def test_check_mode_says_what_it_would_do_and_signals_nothing(tmp_path, run_module, trainer) -> None:
    started = trainer()
    result = run_module(trainer_stop.main, recorded(started, tmp_path / "train.log"), check_mode=True)
    assert not result.failed and result.result["changed"] is True
    assert result.result["msg"] == f"would send SIGTERM to PID {started['pid']}"
    assert alive(started["pid"])


def test_nothing_recorded_or_an_ended_trainer_is_left_unchanged(tmp_path, run_module, trainer) -> None:
    nothing = run_module(trainer_stop.main, {})
    assert not nothing.failed and nothing.result["changed"] is False
    assert nothing.result["state_before"] == "none"
    assert nothing.result["msg"] == "no run is recorded for this host"
    started = trainer()
    kill_and_reap(started["pid"])
    ended = run_module(trainer_stop.main, recorded(started, tmp_path / "train.log"))
    assert ended.result["changed"] is False and ended.result["state_before"] == "exited"
    assert ended.result["msg"] == "the recorded trainer has exited already"


def test_a_pid_that_now_belongs_to_another_process_is_left_alone(tmp_path, run_module) -> None:
    script = not_the_trainer(tmp_path / "other")
    with Started() as started:
        other = run_module(
            trainer_start.main,
            {"script": str(script), "log": str(tmp_path / "other.log"), "run": "nographs", "settle": 0.2},
        )
        pid = started.add(other.result)
        assert other.failed and pid
        result = run_module(trainer_stop.main, {"pid": pid, "run": "nographs", "timeout": 1})
        assert result.result["changed"] is False and result.result["state_before"] == "not_ours"
        assert result.result["msg"] == "the recorded PID now belongs to another process; it is left alone"
        assert alive(pid)


def test_with_the_cache_lost_the_trainer_is_found_on_the_target_and_its_record_closed(
    tmp_path, run_module, trainer
) -> None:
    runs = tmp_path / "runs"
    started = trainer(out=runs / "nographs")
    result = run_module(
        trainer_stop.main, {"runs_dir": str(runs), "recorded": {}, "log": str(tmp_path / "train.log")}
    )
    assert not result.failed, result.result["msg"]
    assert result.result["pid"] == started["pid"] and gone_within(started["pid"], 5)
    assert result.result["repair"].startswith("the controller's cache had no run; the target holds run ")
    record = result.result["record"]
    assert (
        record["run_id"] == started["run_id"] and record["state"] == "stopped" and record["killed"] is False
    )
    # The checkpoint comes from the output's checkpoint directory, in the log's form.
    assert result.result["checkpoint"].startswith("checkpoint saved step ")
    assert str(runs / "nographs" / "checkpoints") in result.result["checkpoint"]
    assert read_record(runs / "nographs")["state"] == "stopped"


def test_a_stop_right_after_a_checkpoint_names_the_one_it_rewrote_with_the_log_gone(
    tmp_path, run_module, trainer
) -> None:
    """A stop that lands on a step the trainer has just checkpointed writes that step's file again, at
    the same path: the stop still names it from the checkpoint directory, without the log."""
    runs = tmp_path / "runs"
    started = trainer("--behave", "checkpoint-every-step", out=runs / "nographs")
    log = tmp_path / "train.log"
    log.unlink()
    result = run_module(trainer_stop.main, {"runs_dir": str(runs), "recorded": {}, "log": str(log)})
    assert not result.failed, result.result["msg"]
    assert gone_within(started["pid"], 5)
    checkpoint = result.result["checkpoint"]
    assert checkpoint is not None and checkpoint.startswith("checkpoint saved step "), result.result["msg"]
    step = int(checkpoint.split()[3])
    assert checkpoint.endswith(str(runs / "nographs" / "checkpoints" / f"step_{step:08d}.pt"))
    assert result.result["msg"] == f"stopped PID {started['pid']} after SIGTERM; {checkpoint}"


def test_bad_input_is_refused_by_name_and_signals_nothing(tmp_path, run_module, trainer) -> None:
    started = trainer()
    result = run_module(trainer_stop.main, {**recorded(started, tmp_path / "train.log"), "timeout": "later"})
    assert result.failed and "timeout" in result.result["msg"]
    assert alive(started["pid"])


def test_a_trainer_that_could_not_note_its_end_has_it_noted_by_the_stop(
    tmp_path, run_module, trainer
) -> None:
    """A trainer killed after the timeout never notes its end in its record (nor one whose record
    was lost as it ended, then rebuilt from its lock): the stop notes it, so the target's record
    does not say running for good."""
    runs = tmp_path / "runs"
    started = trainer("--behave", "ignore-term", out=runs / "nographs")
    assert read_record(runs / "nographs")["state"] == "running"
    result = run_module(
        trainer_stop.main,
        {"runs_dir": str(runs), "recorded": {}, "log": str(tmp_path / "train.log"), "timeout": 0.5},
    )
    assert not result.failed, result.result["msg"]
    assert result.result["killed"] is True and gone_within(started["pid"], 5)
    record = read_record(runs / "nographs")
    assert record["run_id"] == started["run_id"] and record["state"] == "stopped", record
    assert record["exit_status"] == -9 and record["exit_reason"] == "killed by the stop (SIGKILL)"


def test_a_full_disk_at_the_stop_s_note_still_stops_and_reports_stopped(
    tmp_path, run_module, trainer, monkeypatch
) -> None:
    """The target's record cannot be written (a full disk): the trainer is stopped all the same, and
    the controller's record (its cache, the ledger) says stopped."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    runs = tmp_path / "runs"
    started = trainer("--behave", "ignore-term", out=runs / "nographs")
    monkeypatch.setattr(trainer_stop, "write_record", full)
    result = run_module(
        trainer_stop.main,
        {"runs_dir": str(runs), "recorded": {}, "log": str(tmp_path / "train.log"), "timeout": 0.5},
    )
    assert not result.failed, result.result["msg"]
    assert result.result["killed"] is True and gone_within(started["pid"], 5)
    assert result.result["record"]["state"] == "stopped" and result.result["record"]["killed"] is True
    assert read_record(runs / "nographs")["state"] == "running"  # what the target could keep


def test_a_record_with_wrong_types_is_repaired_from_the_lock_and_the_trainer_stopped(
    tmp_path, run_module, trainer
) -> None:
    """run.json overwritten with wrong types while the run trains (state 5, pid "abc"): the stop
    finds the trainer through the output's lock, stops it, and the record says stopped."""
    runs = tmp_path / "runs"
    started = trainer("--behave", "ignore-term", out=runs / "nographs")
    record = read_record(runs / "nographs")
    (runs / "nographs" / "run.json").write_text(json.dumps({**record, "state": 5, "pid": "abc"}))
    result = run_module(
        trainer_stop.main,
        {
            "runs_dir": str(runs),
            "recorded": started["record"],
            "log": str(tmp_path / "train.log"),
            "timeout": 0.5,
        },
    )
    assert not result.failed, result.result["msg"]
    assert result.result["state_before"] == "running" and result.result["pid"] == started["pid"]
    assert gone_within(started["pid"], 5)
    after = read_record(runs / "nographs")
    assert (
        after["state"] == "stopped" and after["pid"] == started["pid"] and after["run_id"] == record["run_id"]
    )


def stop_at_target(run_module, runs, log) -> dict:
    result = run_module(trainer_stop.main, {"runs_dir": str(runs), "recorded": {}, "log": str(log)})
    assert not result.failed, result.result["msg"]
    assert result.result["killed"] is False and result.result["checkpoint"] is None
    return result.result


def test_a_stop_before_the_first_step_says_it_had_not_started_training_as_the_trainer_does(
    tmp_path, run_module, trainer
) -> None:
    runs = tmp_path / "runs"
    started = trainer("--first-step-after", "30", out=runs / "nographs", until="stand-in trainer")
    result = stop_at_target(run_module, runs, tmp_path / "train.log")
    assert gone_within(started["pid"], 5)
    said = f"stopped PID {started['pid']} after SIGTERM; no new checkpoint (it had not started training)"
    assert result["msg"] == said
    assert read_record(runs / "nographs")["exit_reason"] == "stopped at step 0, before training began"


def test_a_resumed_run_stopped_before_training_says_so_from_its_record_alone(tmp_path) -> None:
    """The record's `..., before training began` is the trainer's own word too, with no line to go by:
    a resume stopped while it compiled has trained no step of its own, its checkpoint holds step 4."""
    out, log = tmp_path / "nographs", tmp_path / "train.log"
    out.mkdir()
    log.write_text("step 4/24 loss 9.0 lr 6.00e-04 tok/s 100\n")  # the launch before, in the same log
    reason = "stopped at step 4, before training began"
    (out / "run.json").write_text(json.dumps({"run_id": "r-1", "state": "stopped", "exit_reason": reason}))
    said = trainer_stop.without_checkpoint(str(log), log.stat().st_size, str(out), "r-1", None)
    assert said == " (it had not started training)"
    (out / "run.json").write_text(json.dumps({"run_id": "r-0", "state": "stopped", "exit_reason": reason}))
    said = trainer_stop.without_checkpoint(str(log), log.stat().st_size, str(out), "r-1", None)
    assert said.startswith(": the trainer ended at step 4 without writing one"), "another run's record"


def test_a_checkpoint_write_that_fails_at_the_stop_is_said_with_its_step_and_error(
    tmp_path, run_module, trainer
) -> None:
    """The stop's checkpoint cannot be written (a full disk): the trainer logs no checkpoint line and
    exits 1. The stop names the step it had reached, the record's exit status and reason, and that
    nothing of the run is saved; never that it had not started training."""
    runs = tmp_path / "runs"
    started = trainer("--behave", "write-fails-at-stop", out=runs / "nographs")
    result = stop_at_target(run_module, runs, tmp_path / "train.log")
    assert gone_within(started["pid"], 5)
    msg = result["msg"]
    assert "not started training" not in msg
    step = int(msg.split("the trainer ended at step ", 1)[1].split()[0])
    assert step >= 1 and read_record(runs / "nographs")["checkpoint_lost"]["step"] == step
    assert msg.startswith(
        f"stopped PID {started['pid']} after SIGTERM; no new checkpoint: the trainer ended at step {step} "
        "without writing one (exit status 1: stopped by SIGTERM, then exit status 1: cannot save the "
        f"checkpoint of step {step} in {runs / 'nographs' / 'checkpoints'}: No space left on device;"
    ), msg
    assert msg.endswith("; the run has no checkpoint: no step of it is saved"), msg


def test_a_trainer_killed_while_it_writes_the_stop_s_checkpoint_is_said_killed_after_the_newest_one(
    tmp_path, run_module, trainer
) -> None:
    """Killed while it writes (the OOM killer): no checkpoint line, the record says how (its supervisor
    wrote it), and the stop names the newest checkpoint on disk, after which the training is lost."""
    runs = tmp_path / "runs"
    out = runs / "nographs"
    started = trainer("--behave", "killed-at-stop", out=out)
    older = out / "checkpoints" / "step_00000000.pt"  # one from before (a resume's, say)
    older.parent.mkdir()
    older.write_bytes(b"checkpoint")
    result = stop_at_target(run_module, runs, tmp_path / "train.log")
    assert gone_within(started["pid"], 5)
    msg = result["msg"]
    step = int(msg.split("the trainer ended at step ", 1)[1].split()[0])
    assert msg == (
        f"stopped PID {started['pid']} after SIGTERM; no new checkpoint: the trainer ended at step {step} "
        "without writing one (exit status -9: stopped by SIGTERM, then killed by SIGKILL); the newest "
        f"checkpoint is step 0 ({older}): the steps after it are not saved"
    )
    assert read_record(out)["exit_status"] == -9  # the stop leaves the trainer's own end as it is


def test_a_trainer_that_dies_at_the_stop_without_a_record_has_its_log_said_and_no_clean_end_noted(
    tmp_path, run_module, trainer
) -> None:
    """A crash at the stop that closes no record: the stop says so with the log's error line, and the
    end it notes in the record has no exit status (nothing says it ended cleanly)."""
    runs = tmp_path / "runs"
    started = trainer("--behave", "dies-at-stop-unrecorded", out=runs / "nographs")
    result = stop_at_target(run_module, runs, tmp_path / "train.log")
    assert gone_within(started["pid"], 5)
    msg = result["msg"]
    assert "the trainer ended at step " in msg and "not started training" not in msg
    assert msg.split(" without writing one ", 1)[1] == (
        "(its run record does not say how it ended; its log: RuntimeError: CUDA error: an illegal memory "
        "access was encountered); the run has no checkpoint: no step of it is saved"
    )
    record = read_record(runs / "nographs")
    assert record["state"] == "stopped" and record["exit_status"] is None
    assert record["exit_reason"].startswith("stopped on SIGTERM without a checkpoint, exit status unknown")


def test_without_the_run_s_record_the_step_comes_from_the_log(tmp_path) -> None:
    """A stop given the PID alone (no runs_dir): the log's last progress line gives the step; the
    newest checkpoint is not known there, so nothing is said of it."""
    log = tmp_path / "train.log"
    log.write_text(
        "step 1/24 loss 11.0 lr 6.00e-04 tok/s 100\nstep 4/24 loss 9.0 lr 6.00e-04 tok/s 100\n"
        "signal SIGTERM: checkpointing and exiting\n"
    )
    said = trainer_stop.without_checkpoint(str(log), 0, None, None, None)
    assert said == (
        ": the trainer ended at step 4 without writing one "
        "(its run record and its log do not say how it ended)"
    )
