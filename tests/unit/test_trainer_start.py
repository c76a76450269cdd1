"""dflash.ct200.trainer_start: starts run.sh detached (own session, stdin /dev/null, output to the
log), identifies the trainer by PID, start time and boot id, takes the output's lock and returns
the run record; refuses a second start and bad input before anything starts. Real processes: a
stand-in trainer (tests/unit/standin.py), killed by PID at the end of every test."""

from __future__ import annotations

import fcntl
import os
import subprocess
import threading
from pathlib import Path

from ansible_collections.dflash.ct200.plugins.module_utils.run_record import (
    lock_holder,
    lock_path,
    read_record,
)
from ansible_collections.dflash.ct200.plugins.module_utils.trainer_proc import boot_id, read_stat
from ansible_collections.dflash.ct200.plugins.modules import trainer_start

from tests.unit.standin import Started, alive, gone_within, logged_within, not_the_trainer, workspace


def start(run_module, script, log, **more):
    return run_module(trainer_start.main, {"script": str(script), "log": str(log), "run": "nographs", **more})


def test_the_trainer_starts_detached_and_is_identified(tmp_path, run_module) -> None:
    script, log = workspace(tmp_path), tmp_path / "train.log"
    with Started() as started:
        result = start(run_module, script, log)
        pid = started.add(result.result)
        assert not result.failed, result.result["msg"]
        assert result.result["changed"] is True
        assert alive(pid)
        assert os.getsid(pid) == pid, "not the leader of a session of its own"
        assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
        assert os.readlink(f"/proc/{pid}/fd/1") == os.readlink(f"/proc/{pid}/fd/2") == str(log)
        assert result.result["start_time"] == read_stat(pid)["start_time"]
        assert result.result["boot_id"] == boot_id()
        cmdline = result.result["cmdline"]
        assert cmdline[1:5] == ["-m", "trainer", "--run", "nographs"]
        assert result.result["record"] is None and result.result["kept_log"] is None
        assert logged_within(log, f"stand-in trainer, pid {pid}", 10), "its output is not in the log"


def test_an_earlier_log_is_kept_under_its_time_not_overwritten(tmp_path, run_module) -> None:
    script, log = workspace(tmp_path), tmp_path / "train.log"
    log.write_text("the previous run's last words\n")
    with Started() as started:
        result = start(run_module, script, log)
        started.add(result.result)
        assert not result.failed, result.result["msg"]
    kept = result.result["kept_log"]
    assert kept and kept.startswith(f"{log}.")
    assert Path(kept).read_text() == "the previous run's last words\n"
    assert "the previous run" not in log.read_text()


def test_with_an_output_the_lock_is_handed_on_and_the_run_record_returned(tmp_path, run_module) -> None:
    script, log, out = workspace(tmp_path), tmp_path / "train.log", tmp_path / "runs" / "nographs"
    with Started() as started:
        result = start(run_module, script, log, out=str(out), args=["--out", str(out)])
        pid = started.add(result.result)
        assert not result.failed, result.result["msg"]
        record = result.result["record"]
        assert record == read_record(out) and record["pid"] == pid
        assert result.result["run_id"] == record["run_id"] == f"nographs-test-{pid}"
        assert result.result["started_at"] == record["started_at"]
        assert lock_holder(out) == pid, "the started trainer does not hold the output's lock"


def test_a_second_start_on_a_busy_output_is_refused_naming_the_pid_and_changes_nothing(
    tmp_path, run_module
) -> None:
    script, log, out = workspace(tmp_path), tmp_path / "train.log", tmp_path / "runs" / "nographs"
    with Started() as started:
        first = start(run_module, script, log, out=str(out), args=["--out", str(out)])
        pid = started.add(first.result)
        assert not first.failed, first.result["msg"]
        log_before = log.read_text()
        second = start(run_module, script, log, out=str(out), fresh=True, args=["--out", str(out)])
        started.add({"pid": second.result.get("pid")})
        assert second.failed
        assert f"PID {pid}" in second.result["msg"] and "./dev.sh stop" in second.result["msg"]
        assert f"run nographs-test-{pid}" in second.result["msg"]
        assert second.result["holder"] == pid
        # Refused before anything moved: the output, the log and the first trainer are as they were.
        assert read_record(out)["pid"] == pid
        assert not list(out.parent.glob("nographs.*")), "the busy output was moved aside"
        assert not list(tmp_path.glob("train.log.*")), "the running trainer's log was renamed"
        assert log.read_text().startswith(log_before)
        assert alive(pid)


def test_a_start_refused_while_another_is_starting_names_that_one_s_trainer_once_written(
    tmp_path, run_module
) -> None:
    """Another start holds the lock and has not yet written its trainer's PID (the lock file it
    emptied): the refusal waits for the PID, rather than naming this process or an earlier run."""
    script, log, out = workspace(tmp_path), tmp_path / "train.log", tmp_path / "runs" / "nographs"
    out.parent.mkdir(parents=True)
    lock = lock_path(out)
    lock.write_text("999999999\n")  # an earlier run's PID, long gone
    other = subprocess.Popen(["sleep", "30"])  # the other start's trainer
    holding = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(holding, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.ftruncate(holding, 0)  # the other start, between its lock and its trainer's PID
        threading.Timer(0.5, lambda: os.pwrite(holding, f"{other.pid}\n".encode(), 0)).start()
        with Started() as started:
            second = start(run_module, script, log, out=str(out), args=["--out", str(out)])
            started.add({"pid": second.result.get("pid")})
        assert second.failed and second.result["holder"] == other.pid, second.result["msg"]
        assert f"PID {other.pid}" in second.result["msg"]
    finally:
        os.close(holding)
        other.kill()
        other.wait(10)


def test_fresh_moves_an_earlier_output_aside_and_deletes_nothing(tmp_path, run_module) -> None:
    script, log, out = workspace(tmp_path), tmp_path / "train.log", tmp_path / "runs" / "nographs"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step_00000007.pt").write_bytes(b"weights")
    with Started() as started:
        result = start(run_module, script, log, out=str(out), fresh=True, args=["--out", str(out)])
        started.add(result.result)
        assert not result.failed, result.result["msg"]
    moved = result.result["moved_aside"]
    assert moved and moved.startswith(f"{out}.")
    assert (Path(moved) / "checkpoints" / "step_00000007.pt").read_bytes() == b"weights"
    assert not (out / "checkpoints" / "step_00000007.pt").exists()


def test_a_trainer_refusing_its_input_fails_the_start_with_exit_status_2_and_its_log(
    tmp_path, run_module
) -> None:
    # With an output the module waits for the run record, which a trainer refusing its input never
    # writes: without one, a trainer that exits within milliseconds may be seen alive (run_wait then
    # reports its exit).
    script, log, out = workspace(tmp_path), tmp_path / "train.log", tmp_path / "runs" / "nographs"
    with Started() as started:
        result = start(
            run_module, script, log, out=str(out), args=["--out", str(out), "--behave", "bad-input"]
        )
        started.add(result.result)
    assert result.failed and result.result["changed"] is True
    msg = result.result["msg"]
    assert "exited; exit status: 2 (bad input: data.train_file /nonexistent/chat.jsonl" in msg
    assert f"Last lines of {log}" in msg and "error: data.train_file" in msg
    assert result.result["run_state"] == "failed", "the documented state the ledger takes"


def test_a_script_that_does_not_become_the_trainer_fails_naming_its_command_line(
    tmp_path, run_module
) -> None:
    script, log = not_the_trainer(tmp_path), tmp_path / "train.log"
    with Started() as started:
        result = start(run_module, script, log, settle=0.5)
        pid = started.add(result.result)
        assert result.failed
        assert f"started as PID {pid}" in result.result["msg"]
        assert "is not the trainer: " in result.result["msg"] and "time.sleep" in result.result["msg"]


def test_a_trainer_that_writes_no_run_record_is_stopped_and_the_start_fails(tmp_path, run_module) -> None:
    script, log, out = workspace(tmp_path), tmp_path / "train.log", tmp_path / "runs" / "nographs"
    with Started() as started:
        result = start(run_module, script, log, out=str(out), settle=1, args=["--behave", "no-record"])
        pid = started.add(result.result)
        assert result.failed
        assert "wrote no run record" in result.result["msg"] and "stopped (SIGTERM)" in result.result["msg"]
        assert gone_within(pid, 5), "the trainer without a record keeps running"


def test_a_missing_or_non_executable_script_fails_before_anything_is_created(tmp_path, run_module) -> None:
    log, out = tmp_path / "train.log", tmp_path / "runs" / "nographs"
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o640)
    for path in (script, tmp_path / "missing.sh"):
        result = start(run_module, path, log, out=str(out))
        assert result.failed
        assert f"{path} is missing or not executable: run the workspace role first" == result.result["msg"]
    assert not log.exists() and not (tmp_path / "runs").exists()


def test_check_mode_starts_nothing_and_writes_nothing(tmp_path, run_module) -> None:
    script, log, out = workspace(tmp_path), tmp_path / "train.log", tmp_path / "runs" / "nographs"
    log.write_text("kept as it is\n")
    result = run_module(
        trainer_start.main,
        {"script": str(script), "log": str(log), "run": "nographs", "out": str(out), "fresh": True},
        check_mode=True,
    )
    assert not result.failed and result.result["changed"] is True
    assert result.result["msg"].startswith("would start ")
    assert log.read_text() == "kept as it is\n"
    assert not (tmp_path / "runs").exists()


def test_bad_argument_types_are_refused_by_name(tmp_path, run_module) -> None:
    script = workspace(tmp_path)
    result = start(run_module, script, tmp_path / "train.log", settle="soon")
    assert result.failed and "settle" in result.result["msg"]
    missing = run_module(trainer_start.main, {"script": str(script), "log": str(tmp_path / "x.log")})
    assert missing.failed and "missing required arguments: run" in missing.result["msg"]
    assert not (tmp_path / "train.log").exists()
