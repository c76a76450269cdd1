"""One vocabulary of end states and exit statuses (docs/OPERATING.md, "End states and exit statuses"):
what the run record says is what status says; a run that used up its restarts exits 1; a second
stop does not turn a clean stop into "killed by SIGTERM"; notices name the inventory's host."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ansible_collections.dflash.ct200.plugins.module_utils.trainer_proc import target_run

from trainer.run.events import EventLog, read_events
from trainer.supervise import Supervisor

pytestmark = pytest.mark.unit


def gone_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


@pytest.mark.parametrize("state", ["finished", "stopped", "failed", "crashed"])
def test_status_says_the_end_state_the_record_says(tmp_path, state) -> None:
    record = {"run_id": "r-1", "run": "r", "pid": gone_pid(), "start_time": 1, "state": state}
    (tmp_path / "run.json").write_text(json.dumps(record))
    assert target_run(tmp_path)["state"] == state  # a crash without restarts was "failed" in status


class CountingChild:
    """A child that counts the SIGTERMs it gets for a second, then exits with the count."""

    SCRIPT = (
        "import signal, time\n"
        "n = [0]\n"
        "signal.signal(signal.SIGTERM, lambda *_: n.__setitem__(0, n[0] + 1))\n"
        "print('ready', flush=True)\n"
        "end = time.monotonic() + 1.0\n"
        "while time.monotonic() < end: time.sleep(0.05)\n"
        "raise SystemExit(n[0])\n"
    )


def test_a_second_stop_is_not_forwarded_to_a_trainer_already_stopping(tmp_path) -> None:
    supervisor = Supervisor([], 0, 0.0, EventLog(tmp_path, "r", run_id="r-1", notify_url=""))
    supervisor.child = subprocess.Popen([sys.executable, "-c", CountingChild.SCRIPT], stdout=subprocess.PIPE)
    assert supervisor.child.stdout.readline() == b"ready\n"
    supervisor.on_signal(signal.SIGTERM, None)
    time.sleep(0.1)
    supervisor.on_signal(signal.SIGTERM, None)  # a second stop.yml at the same moment
    assert supervisor.child.wait(timeout=10) == 1, "the trainer got the stop once"
    assert supervisor.stop_signal == "SIGTERM"


def test_a_run_that_used_up_its_restarts_records_exit_status_1(tmp_path) -> None:
    supervisor = Supervisor([], 1, 0.0, EventLog(tmp_path, "r", run_id="r-1", notify_url=""))
    assert supervisor.give_up(-signal.SIGKILL, 2, "killed by SIGKILL") == 1
    (failed,) = read_events(tmp_path)
    assert failed["event"] == "failed" and failed["exit_status"] == 1
    assert failed["reason"].endswith("last: killed by SIGKILL")


def test_events_name_the_inventory_host_where_the_launch_gives_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_HOST", "ct200")
    row = EventLog(tmp_path, "r", run_id="r-1", notify_url="").record("start", "started")
    assert row["host"] == "ct200" and row["text"] == "r on ct200: started"
    assert json.loads((Path(tmp_path) / "events.jsonl").read_text())["host"] == "ct200"


DIVERGING_CHILD = (
    "import sys\n"
    "print('error: diverged: the loss is nan at step 4 (train.lr 0.5); the run stopped', file=sys.stderr)\n"
    "raise SystemExit(2)\n"
)
SUPERVISED = (
    "import subprocess, sys\n"
    "from pathlib import Path\n"
    "from trainer.run.events import EventLog\n"
    "from trainer.supervise import Supervisor\n"
    "s = Supervisor([], 3, 0.0, EventLog(Path(sys.argv[1]), 'r', run_id='r-1', notify_url=''))\n"
    "s.child = subprocess.Popen([sys.executable, '-c', sys.argv[2]])\n"
    "raise SystemExit(s.how_it_ended(s.wait(), 0))\n"
)


def test_a_diverged_trainer_ends_the_run_failed_with_its_reason_and_no_restart(tmp_path) -> None:
    log = tmp_path / "train.log"
    with log.open("w") as stderr:  # the supervisor reads the reason from its own stderr: the log
        code = subprocess.run(
            [sys.executable, "-c", SUPERVISED, str(tmp_path), DIVERGING_CHILD],
            stderr=stderr, cwd=Path(__file__).resolve().parents[2], timeout=60,
        ).returncode  # fmt: skip
    assert code == 2, log.read_text()
    (failed,) = read_events(tmp_path)
    assert failed["event"] == "failed" and failed["exit_status"] == 2
    assert failed["reason"] == "diverged: the loss is nan at step 4 (train.lr 0.5); the run stopped"
    assert failed["text"] == f"r on {failed['host']}: {failed['reason']}"  # the notice's line


def test_a_stop_event_gives_the_step_of_the_checkpoint_it_saved_not_the_last_logged_row(tmp_path) -> None:
    rows = [{"kind": "train", "step": step, "loss": 1.0} for step in (110, 120, 130)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    record = {"run_id": "r-1", "run": "r", "pid": gone_pid(), "state": "stopped", "last_step": 136}
    (tmp_path / "run.json").write_text(json.dumps(record))
    events = EventLog(tmp_path, "r", run_id="r-1", notify_url="")
    assert events.record("stop", "stopped by SIGTERM", exit_status=0)["step"] == 136
    (tmp_path / "run.json").write_text(json.dumps({**record, "run_id": "r-0"}))  # another launch's record
    assert events.record("stop", "stopped by SIGTERM", exit_status=0)["step"] == 130


def test_a_restart_clears_the_crashed_process_s_way_out_from_the_record(tmp_path) -> None:
    import os

    waiting = "waiting at most 15s for tracker(s) mlflow to send what is left"
    record = {"run_id": "r-1", "run": "r", "pid": os.getpid(), "state": "crashed", "exit_status": 1}
    record.update(stage="exiting", exiting=waiting)
    (tmp_path / "run.json").write_text(json.dumps(record))
    EventLog(tmp_path, "r", run_id="r-1", notify_url="").record("restart", "restarted", reason="crashed")
    after = json.loads((tmp_path / "run.json").read_text())
    assert after["state"] == "running" and "stage" not in after and "exiting" not in after


@pytest.mark.parametrize(
    ("status", "recorded"),
    [(-signal.SIGTERM, 0), (-signal.SIGINT, 0), (-signal.SIGKILL, -signal.SIGKILL), (-signal.SIGSEGV, -11)],
)
def test_a_trainer_that_died_in_a_stop_keeps_its_signal_in_the_record(tmp_path, status, recorded) -> None:
    """A trainer killed by the stop's own signal before its handlers were up stopped cleanly (exit 0);
    one killed by anything else on its way out of a stop (the OOM killer during the checkpoint's write,
    a crash) wrote no checkpoint: its record keeps that signal, never a clean 0."""
    import os

    record = {"run_id": "r-1", "run": "r", "pid": os.getpid(), "state": "running"}
    (tmp_path / "run.json").write_text(json.dumps(record))
    how = "stopped by SIGTERM" if recorded == 0 else f"stopped by SIGTERM, then killed by signal {-status}"
    EventLog(tmp_path, "r", run_id="r-1", notify_url="").record("stop", how, exit_status=status)
    after = json.loads((tmp_path / "run.json").read_text())
    assert (after["state"], after["exit_status"], after["exit_reason"]) == ("stopped", recorded, how)
