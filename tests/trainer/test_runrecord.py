"""The output lock and the run record (trainer/run/runrecord.py, trainer.launch), and what the trainer
leaves on a full disk: one line, exit status 1, no partial file."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.run import runrecord
from trainer.run.checkpoint import CheckpointWriteError, save_checkpoint

from .conftest import REPO, run_trainer

HOLD = (
    "import sys, time; sys.path.insert(0, {repo!r}); from trainer.run import runrecord; "
    "runrecord.acquire_lock({out!r}); print('held', flush=True); time.sleep(60)"
)


def hold_lock(out: Path) -> subprocess.Popen:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(repo=str(REPO), out=str(out))], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_the_modules_read_the_record_with_the_same_code() -> None:
    """The Ansible modules cannot import the trainer package on the target: they carry a copy."""
    copy = REPO / "collections/ansible_collections/dflash/ct200/plugins/module_utils/run_record.py"
    assert copy.read_text() == Path(runrecord.__file__).read_text(), "change runrecord.py and its copy"


def test_second_start_on_an_output_fails_naming_the_holder(tmp_path: Path) -> None:
    out = tmp_path / "runs" / "nographs"
    holder = hold_lock(out)
    try:
        assert runrecord.lock_holder(out) == holder.pid
        with pytest.raises(runrecord.OutputBusy, match=f"in use by PID {holder.pid}"):
            runrecord.acquire_lock(out)
        launched = subprocess.run(
            [sys.executable, "-m", "trainer.launch", "--", "--run", "eager", "--out", str(out)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert launched.returncode == 2
        assert f"error: output {out} is in use by PID {holder.pid}" in launched.stderr
        assert not (out / "run.json").exists(), "the refused start records nothing"
    finally:
        holder.kill()
        holder.wait()
    # The lock dies with its holder, whatever killed it.
    assert runrecord.lock_holder(out) is None
    fd = runrecord.acquire_lock(out)
    assert runrecord.lock_holder(out) == os.getpid()
    os.close(fd)


def test_record_is_replaced_whole_and_only_by_its_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    runrecord.write_record(out, {"run_id": "a", "pid": os.getpid(), "state": "running"})
    runrecord.note(out, state="finished", last_step=4)
    assert runrecord.read_record(out) == {
        "run_id": "a",
        "pid": os.getpid(),
        "state": "finished",
        "last_step": 4,
    }
    runrecord.write_record(out, {"run_id": "b", "pid": 1, "state": "running"})
    runrecord.note(out, state="finished")
    assert runrecord.read_record(out)["state"] == "running", "another run's record is left alone"
    assert sorted(p.name for p in out.iterdir()) == ["run.json"], "no temporary file left"
    (out / "run.json").write_text("{not json")
    assert runrecord.read_record(out) is None


def test_a_damaged_record_is_rewritten_whole_by_its_run_and_said_once(tmp_path: Path, capsys) -> None:
    """A record with wrong types written during the run (state 5, pid "abc"): the run that holds the
    output's lock rewrites it whole from what it knows on its next note, and says so once."""
    out = tmp_path / "runs" / "nographs"
    fd = runrecord.acquire_lock(out)
    try:
        started = "2026-12-06T04:00:00Z"
        damaged = {"run_id": "nographs-1", "pid": "abc", "state": 5, "steps": 40, "started_at": started}
        runrecord.write_record(out, damaged)
        assert set(runrecord.record_problems(runrecord.read_record(out))) == {"pid", "state"}
        runrecord.note(out, last_step=4)
        runrecord.note(out, last_step=8)
        record = runrecord.read_record(out)
        assert runrecord.record_problems(record) == {}
        assert record["pid"] == os.getpid() and record["start_time"] == runrecord.proc_start_time(os.getpid())
        assert record["state"] == "running" and record["run_id"] == "nographs-1" and record["last_step"] == 8
        assert record["steps"] == 40 and record["started_at"] == started, "sound fields are kept"
        said = capsys.readouterr().err
        assert said.count("was damaged (pid: 'abc' is not an int; state: 5 is not a str)") == 1, said
    finally:
        os.close(fd)
    # Without the lock (another process's run, or none), a damaged record is not this process's to rewrite.
    runrecord.write_record(out, {"run_id": "nographs-2", "pid": "abc", "state": 5})
    runrecord.note(out, state="finished")
    assert runrecord.read_record(out)["state"] == 5


def test_fresh_start_moves_the_output_aside(tmp_path: Path) -> None:
    out = tmp_path / "nographs"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step_00000004.pt").write_bytes(b"x")
    kept = runrecord.move_aside(out)
    assert (
        kept.name.startswith("nographs.") and (kept / "checkpoints" / "step_00000004.pt").read_bytes() == b"x"
    )
    assert not out.exists()
    assert runrecord.move_aside(out) is None


def test_failed_save_leaves_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    directory = tmp_path / "checkpoints"
    intact = save_checkpoint(directory, 2, {"step": 2, "w": torch.zeros(10)})

    def full(_fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointWriteError) as failure:
        save_checkpoint(directory, 4, {"step": 4, "w": torch.zeros(10)})
    message = str(failure.value)
    assert f"step 4 in {directory}: No space left on device" in message
    assert f"the last intact checkpoint is {intact} (step 2)" in message
    assert [p.name for p in directory.iterdir()] == ["step_00000002.pt"]


def test_launch_records_the_run_and_clears_a_killed_saves_leftovers(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "out"
    leftover = out / "checkpoints" / ".step_00000002.pt.4242.tmp"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half a checkpoint")
    log = tmp_path / "train.log"
    args = [
        "--run",
        "eager",
        "--out",
        str(out),
        "--set",
        "parallel.devices=cpu",
        "--set",
        "train.steps=100000",
    ]
    args += ["--set", f"data.cache_dir={cache_dir}", "--set", "data.regenerate=false"]
    with log.open("wb") as handle:
        trainer = subprocess.Popen(
            [sys.executable, "-m", "trainer.launch", "--", *args],
            cwd=REPO,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while runrecord.read_record(out) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        record = runrecord.read_record(out)
        assert record["pid"] == trainer.pid and record["run"] == "eager" and record["state"] == "running"
        assert record["log"] == str(log) and record["out"] == str(out) and record["steps"] == 100000
        assert record["start_time"] == runrecord.proc_start_time(trainer.pid)
        assert not leftover.exists()
        assert f"removed {leftover}" in log.read_text()
        assert runrecord.lock_holder(out) == trainer.pid, "the trainer holds the lock after the exec"
    finally:
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
    assert runrecord.lock_holder(out) is None


@pytest.fixture
def small_disk(tmp_path: Path):
    """A disk of 3 MiB: room at the start for one checkpoint of the embedded default's run (1.38 MB,
    with the margin the trainer asks for: 2.4 MB), and then for two, not three."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.slow
def test_full_disk_ends_with_one_line_and_no_partial_file(small_disk: Path, cache_dir: Path) -> None:
    out = small_disk / "out"
    result = run_trainer(
        "--run",
        "eager",
        "--out",
        str(out),
        "--set",
        "parallel.devices=cpu",
        "--set",
        f"data.cache_dir={cache_dir}",
        "--set",
        "data.regenerate=false",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.eval_prompts=1",
        "--set",
        "train.eval_max_new_tokens=2",
        "--set",
        "train.checkpoint_every=2",
        "--steps",
        "8",
    )
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    # Steps 2 and 4 fill the disk; step 6's write (in the background) loses that checkpoint only,
    # said once; training goes on, and the last step's, which the run's end waits for, ends the run.
    lost = f"cannot save the checkpoint of step 6 in {out / 'checkpoints'}: No space left on device"
    said = [line for line in (result.stdout + result.stderr).splitlines() if lost in line]
    assert len(said) == 1 and "training goes on, and the next checkpoint tries again" in said[0], said
    assert (
        f"cannot save the checkpoint of step 8 in {out / 'checkpoints'}: No space left on device" in errors[0]
    )
    assert f"the last intact checkpoint is {out / 'checkpoints' / 'step_00000004.pt'} (step 4)" in errors[0]
    leftovers = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert leftovers == ["step_00000002.pt", "step_00000004.pt"], "no partial checkpoint file"
    assert all(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()), "whole rows"


@pytest.mark.unit
def test_the_record_says_how_a_run_ended_on_a_full_disk(tiny_disk: Path) -> None:
    out = tiny_disk / "runs" / "nographs"
    runrecord.write_record(out, {"run_id": "r-1", "pid": os.getpid(), "state": "running"})
    runrecord.reserve_space(out)
    with pytest.raises(OSError) as full, (tiny_disk / "filler").open("wb") as filler:
        for _ in range(4096):  # bounded: 4096 x 4 KiB is more than the disk
            filler.write(b"x" * 4096)
            filler.flush()
    assert full.value.errno == errno.ENOSPC
    runrecord.note(out, state="crashed", exit_status=1, exit_reason="disk full writing the checkpoint")
    record = runrecord.read_record(out)
    assert record["state"] == "crashed" and record["exit_status"] == 1, "the record was not stuck at running"
    assert not (out / runrecord.RESERVE_NAME).exists(), "the reserve was spent on it"


@pytest.mark.unit
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_launch_s_help_exits_0_and_names_its_options(flag, capsys):
    from trainer.launch import parse_args

    with pytest.raises(SystemExit) as ended:
        parse_args([flag])
    assert ended.value.code == 0
    assert "--max-restarts" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"^usage: python -m trainer\.launch "):
        parse_args(["--dry-run"])  # without `--`: the usage, exit status 1
