"""Recovery in the threaded topology: trainer.launch execs the supervisor, which restarts a crashed
trainer with --resume, never restarts a stopped one, and gives up after recover_max_restarts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.run.events import read_events

from .conftest import REPO, run_trainer

pytestmark = pytest.mark.slow

FAST = ["--set", "train.eval_prompts=4", "--set", "train.eval_max_new_tokens=12"]


def common(cache_dir: Path, steps: int = 16) -> list[str]:
    return [
        "--run",
        "eager",
        "--steps",
        str(steps),
        "--seed",
        "5",
        "--set",
        f"data.cache_dir={cache_dir}",
        "--set",
        "train.log_every=1",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.checkpoint_every=4",
        *FAST,
    ]


def launch(log: Path, max_restarts: int, args: list[str]) -> subprocess.Popen:
    """python -m trainer.launch --max-restarts N -- ARGS, in its own session, output to log."""
    with log.open("ab") as handle:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainer.launch",
                f"--max-restarts={max_restarts}",
                "--restart-backoff-s=0.2",
                "--",
                *args,
            ],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def wait_for(condition, timeout: float, what: str, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if row["kind"] == "train"}


def finish(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=30)



def run_events(out: Path) -> list[str]:
    """The run's lifecycle events, without the regeneration's: a worker whose embedded cache is
    fresh regenerates first (its `regen` events), one whose cache an earlier test filled does not."""
    return [e["event"] for e in read_events(out) if e["event"] != "regen"]

def test_a_killed_trainer_restarts_and_its_losses_continue_exactly(tmp_path, cache_dir):
    straight = tmp_path / "straight"
    result = run_trainer(*common(cache_dir), "--out", str(straight))
    assert result.returncode == 0, result.stderr

    out = tmp_path / "recovered"
    log = tmp_path / "recovered.log"
    supervisor = launch(log, 2, [*common(cache_dir), "--out", str(out)])
    try:
        # Past a checkpoint (step 4, on disk: written in the background, it may land a few steps
        # later) and a little further, then SIGKILL the trainer itself.
        saved = out / "checkpoints" / "step_00000004.pt"
        wait_for(
            lambda: (out / "metrics.jsonl").exists() and len(losses(out)) >= 6 and saved.exists(),
            240, "step 6 and the checkpoint of step 4", supervisor,
        )  # fmt: skip
        (trainer,) = children(supervisor.pid)
        killed_at = max(losses(out))
        subprocess.run(["kill", "-KILL", str(trainer)], check=True)
        assert supervisor.wait(timeout=300) == 0, log.read_text()
    finally:
        finish(supervisor)
    text = log.read_text()
    assert "restart 1/2 with --resume" in text
    assert f"resumed from {out / 'checkpoints'}" in text
    assert losses(out) == losses(straight)  # every step's loss as in the run that was never killed
    assert killed_at < 16
    events = [e for e in read_events(out) if e["event"] != "regen"]
    assert [e["event"] for e in events] == ["start", "crash", "restart", "finish"]
    crash = events[1]
    assert crash["exit_status"] == -signal.SIGKILL and crash["reason"] == "killed by SIGKILL"
    assert crash["step"] is not None and crash["step"] >= 6
    assert events[-1]["restarts"] == 1 and events[-1]["step"] == 16
    assert all(e["pid"] == supervisor.pid for e in events)


def test_a_stopped_run_is_not_restarted(tmp_path, cache_dir):
    out = tmp_path / "stopped"
    log = tmp_path / "stopped.log"
    supervisor = launch(log, 3, [*common(cache_dir, steps=400), "--out", str(out)])
    try:
        wait_for(
            lambda: (out / "metrics.jsonl").exists() and len(losses(out)) >= 2, 240, "step 2", supervisor
        )
        (trainer,) = children(supervisor.pid)
        supervisor.send_signal(signal.SIGTERM)  # what stop.yml does to the recorded PID
        assert supervisor.wait(timeout=120) == 0, log.read_text()
    finally:
        finish(supervisor)
    assert not Path(f"/proc/{trainer}").exists()
    text = log.read_text()
    assert "signal SIGTERM: checkpointing and exiting" in text and "with --resume" not in text
    assert text.count("run eager: topology threaded") == 1
    assert run_events(out) == ["start", "stop"]
    assert read_events(out)[-1]["text"].endswith("stopped by SIGTERM")


def test_more_crashes_than_allowed_end_failed_with_the_reason(tmp_path, cache_dir):
    out = tmp_path / "crashing"
    log = tmp_path / "crashing.log"
    supervisor = launch(log, 1, [*common(cache_dir, steps=400), "--out", str(out)])
    killed: list[int] = []
    try:
        for _ in range(2):
            trainer = wait_for(
                lambda: [pid for pid in children(supervisor.pid) if pid not in killed],
                60,
                "a trainer",
                supervisor,
            )[0]
            subprocess.run(["kill", "-KILL", str(trainer)], check=True)
            killed.append(trainer)
        assert supervisor.wait(timeout=60) == 1, log.read_text()
    finally:
        finish(supervisor)
    events = read_events(out)
    assert [e["event"] for e in events] == ["start", "crash", "restart", "crash", "failed"]
    reason = events[-1]["reason"]
    assert reason == (
        "crashed 2 time(s), more than recover_max_restarts=1 allows; last: killed by SIGKILL"
    ), reason
    assert f"supervise: failed: {reason}" in log.read_text()


def test_bad_input_is_not_restarted(tmp_path):
    out = tmp_path / "bad"
    log = tmp_path / "bad.log"
    supervisor = launch(
        log, 3, ["--run", "eager", "--out", str(out), "--set", "data.train_file=/nonexistent.jsonl"]
    )
    try:
        assert supervisor.wait(timeout=120) == 2, log.read_text()
    finally:
        finish(supervisor)
    events = read_events(out)
    assert [e["event"] for e in events] == ["start", "failed"]
    assert events[-1]["exit_status"] == 2 and events[-1]["reason"].startswith("bad input: ")
    assert "with --resume" not in log.read_text()
    # Where this start's metrics rows begin (none before it): the history tells its figures by it.
    assert json.loads((out / "run.json").read_text())["metrics_from"] == 0


def test_the_supervisor_refuses_bad_options(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.launch",
            "--max-restarts=-1",
            "--",
            "--run",
            "eager",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "must not be negative" in result.stderr


def test_a_stop_during_the_backoff_is_for_good(tmp_path, cache_dir):
    out = tmp_path / "out"
    log = tmp_path / "run.log"
    with log.open("ab") as handle:
        supervisor = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trainer.launch",
                "--max-restarts=3",
                "--restart-backoff-s=60",
                "--",
                *common(cache_dir, steps=400),
                "--out",
                str(out),
            ],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        (trainer,) = wait_for(lambda: children(supervisor.pid), 60, "the trainer", supervisor)
        subprocess.run(["kill", "-KILL", str(trainer)], check=True)
        wait_for(lambda: "restart 1/3 with --resume in 60s" in log.read_text(), 30, "the backoff", supervisor)
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=15) == 0, log.read_text()
    finally:
        finish(supervisor)
    assert run_events(out) == ["start", "crash", "stop"]
    assert read_events(out)[-1]["text"].endswith("stopped by SIGTERM before restarting")


@pytest.mark.parametrize("delay_s", [0.0, 0.3], ids=["the-first-instant", "before-the-trainer-is-up"])
def test_a_stop_at_any_moment_of_the_start_closes_the_run_record(tmp_path, cache_dir, delay_s):
    """A SIGTERM to the recorded PID as soon as the record names it (the launch has not even exec'd
    the supervisor yet), or while the trainer is still importing: the run ends stopped, exit 0, and
    its record says so (not `running` forever)."""
    out = tmp_path / "early"
    log = tmp_path / "early.log"
    supervisor = launch(log, 3, [*common(cache_dir, steps=400), "--out", str(out)])
    try:
        deadline = time.monotonic() + 60
        while not (out / "run.json").exists() and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(delay_s)
        supervisor.send_signal(signal.SIGTERM)
        status = supervisor.wait(timeout=120)
    finally:
        finish(supervisor)
    record = json.loads((out / "run.json").read_text())
    assert status == 0, log.read_text()
    assert (record["state"], record["exit_status"]) == ("stopped", 0), record
    assert record["exit_reason"].startswith("stopped by SIGTERM") and record["ended_at"]
    assert run_events(out) == ["start", "stop"]
