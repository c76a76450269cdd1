"""Checkpoints written in the background: training waits for the host copy only, one write at a
time, and every guarantee of a checkpoint written in line still holds (sealed and hashed, pruned
only once the new one is on disk, readers' locks kept, a kill -9 or a full disk mid-write leaving
the earlier ones whole, a stop or a crash waiting for the write in flight)."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer.run import checkpoint as ckpt
from trainer.run import runrecord
from trainer.run.checkpoint import (
    CheckpointWriteError,
    CheckpointWriter,
    HostStaging,
    Written,
    list_checkpoints,
    load_checkpoint,
    recorded_digest,
    save_checkpoint,
)
from trainer.run.train import Run

from .conftest import REPO, fill_disk_when

pytestmark = pytest.mark.unit


def _live_state(value: float = 1.0) -> dict:
    """A state whose tensors are live ones, as a CPU run's drafter and optimizer hand them over."""
    return {"step": 0, "drafter": {"w": torch.full((256,), value)}, "optimizer": [torch.zeros(4)]}


@pytest.fixture
def held_writes(monkeypatch):
    """save_checkpoint waits for `release` to be set before it writes (bounded: 30 s)."""
    release = threading.Event()
    started = threading.Event()
    real = ckpt.save_checkpoint

    def held(directory, step, state):
        started.set()
        assert release.wait(30), "the test never released the write"
        return real(directory, step, state)

    monkeypatch.setattr(ckpt, "save_checkpoint", held)
    yield SimpleNamespace(release=release, started=started)
    release.set()


def test_training_waits_for_the_copy_only_and_the_file_holds_the_state_at_the_copy(tmp_path, held_writes):
    writer = CheckpointWriter(HostStaging(host_too=True), background=True)
    state = _live_state(1.0)
    writer.start(tmp_path, 5, state, time.perf_counter())
    assert held_writes.started.wait(10)
    assert writer.in_flight and writer.poll() is None, "start returned while the write goes on"
    state["drafter"]["w"].fill_(2.0)  # the next step changes the live tensors in place
    state["optimizer"][0].add_(7)
    held_writes.release.set()
    written = writer.wait()
    assert written.error is None and written.path == tmp_path / "step_00000005.pt"
    assert written.size == written.path.stat().st_size and written.paused_s >= 0 and written.write_s >= 0
    loaded = load_checkpoint(written.path)  # sealed: header, length and SHA-256 verified
    assert torch.equal(loaded["drafter"]["w"], torch.full((256,), 1.0))
    assert torch.equal(loaded["optimizer"][0], torch.zeros(4))
    assert writer.wait() is None and writer.poll() is None, "an outcome is handed over once"


def test_at_most_one_write_in_flight_and_the_next_copy_reuses_its_buffers(tmp_path, held_writes):
    staging = HostStaging(host_too=True)
    writer = CheckpointWriter(staging, background=True)
    writer.start(tmp_path, 1, _live_state(1.0), time.perf_counter())
    buffers = list(staging.buffers)
    with pytest.raises(RuntimeError, match="in flight"):
        writer.start(tmp_path, 2, _live_state(2.0), time.perf_counter())
    assert torch.equal(buffers[0], torch.full((256,), 1.0)), "the refused start left the buffers alone"
    held_writes.release.set()
    assert writer.wait().step == 1
    writer.start(tmp_path, 2, _live_state(2.0), time.perf_counter())
    assert [id(b) for b in staging.buffers] == [id(b) for b in buffers]
    assert writer.wait().step == 2
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1, 2]
    assert load_checkpoint(tmp_path / "step_00000001.pt")["drafter"]["w"].eq(1.0).all()


def test_a_host_without_room_for_the_copy_writes_before_training_goes_on(tmp_path):
    writer = CheckpointWriter(HostStaging(host_too=True, available=lambda: 100), background=True)
    writer.start(tmp_path, 3, _live_state(), time.perf_counter())
    assert writer.thread is None, "no background write of live tensors"
    written = writer.wait()
    assert written.path.is_file() and "host memory available" in written.unstaged
    assert written.paused_s >= written.write_s


def _filling_open(monkeypatch, after_bytes: int):
    """Checkpoint temporary files whose writes fail with ENOSPC past `after_bytes` (the record has room)."""
    room = {"bytes": after_bytes}
    fill_disk_when(monkeypatch, lambda data, written: written + len(data) > room["bytes"])
    return room


def test_a_full_disk_during_a_background_write_loses_that_one_and_the_next_succeeds(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, _live_state(1.0))
    room = _filling_open(monkeypatch, after_bytes=256)
    writer = CheckpointWriter(HostStaging(host_too=True), background=True)
    writer.start(tmp_path, 2, _live_state(2.0), time.perf_counter())
    lost = writer.wait()
    assert lost.path is None and isinstance(lost.error, CheckpointWriteError)
    assert "No space left on device" in str(lost.error) and "step_00000001.pt (step 1)" in str(lost.error)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001.pt"], "no partial file"
    room["bytes"] = 1 << 30  # space freed
    writer.start(tmp_path, 3, _live_state(3.0), time.perf_counter())
    assert writer.wait().error is None
    assert load_checkpoint(tmp_path / "step_00000003.pt")["drafter"]["w"].eq(3.0).all()
    assert load_checkpoint(tmp_path / "step_00000001.pt")["drafter"]["w"][0] == 1.0


def test_a_fault_of_the_writer_is_raised_to_the_caller(tmp_path, monkeypatch):
    def broken(directory, step, state):
        raise ValueError("not picklable")

    monkeypatch.setattr(ckpt, "save_checkpoint", broken)
    writer = CheckpointWriter(HostStaging(host_too=True), background=True)
    writer.start(tmp_path, 1, _live_state(), time.perf_counter())
    with pytest.raises(ValueError, match="not picklable"):
        writer.wait()
    assert writer.wait() is None


KILLED_MID_WRITE = """
import sys, time, torch
from pathlib import Path
from trainer.run import checkpoint as ckpt
from trainer.run import runrecord
directory = Path(sys.argv[1])
ckpt.save_checkpoint(directory, 1, {"w": torch.full((1 << 20,), 1.0)})
real_write = ckpt.HashingWriter.write
def slow_write(self, data):
    print("writing", flush=True)
    time.sleep(0.05)
    return real_write(self, data)
ckpt.HashingWriter.write = slow_write
writer = ckpt.CheckpointWriter(ckpt.HostStaging(host_too=True), background=True)
writer.start(directory, 2, {"w": torch.full((1 << 20,), 2.0)}, time.perf_counter())
time.sleep(60)
"""


def test_a_kill_9_during_a_background_write_leaves_the_earlier_checkpoints_whole(tmp_path):
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout.readline().strip() == "writing"
        assert list(tmp_path.glob(".step_00000002.pt.*.tmp")), "killed while the temporary file is written"
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    assert torch.equal(load_checkpoint(tmp_path / "step_00000001.pt")["w"], torch.full((1 << 20,), 1.0))
    save_checkpoint(tmp_path, 3, {"w": torch.zeros(1)})  # the next write clears the dead one's file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001.pt", "step_00000003.pt"]


class _Lines:
    def __init__(self):
        self.lines: list[str] = []

    def line(self, text: str) -> None:
        self.lines.append(text)


def _run(out_dir: Path, keep: int, writer: CheckpointWriter) -> SimpleNamespace:
    """What Run's checkpoint reporting uses, on one process."""
    run = SimpleNamespace(
        out=_Lines(), out_dir=out_dir, world=SimpleNamespace(is_lead=True, world_size=1),
        cfg=SimpleNamespace(train=SimpleNamespace(keep_checkpoints=keep)), writer=writer, announcement=None,
        writer_process=None,
    )  # fmt: skip
    for name in ("report", "keep_checkpoints", "close_checkpoints", "collect_checkpoint"):
        setattr(run, name, getattr(Run, name).__get__(run))
    return run


def test_older_checkpoints_are_pruned_only_once_the_new_one_is_on_disk_and_never_while_read(
    tmp_path, held_writes
):
    directory = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(directory, step, _live_state(float(step)))
    run = _run(tmp_path, keep=1, writer=CheckpointWriter(HostStaging(host_too=True), background=True))
    run.writer.start(directory, 3, _live_state(3.0), time.perf_counter())
    run.collect_checkpoint()
    assert [step for step, _ in list_checkpoints(directory)] == [1, 2], "nothing pruned while in flight"
    with (directory / "step_00000001.pt").open("rb") as reading:
        fcntl.flock(reading, fcntl.LOCK_SH)  # a resume or an export reads step 1
        held_writes.release.set()
        run.writer.thread.join(30)
        run.collect_checkpoint()
        assert [step for step, _ in list_checkpoints(directory)] == [1, 3], "the one being read stays"
    assert run.out.lines[0] == f"checkpoint saved step 3 {directory / 'step_00000003.pt'}"
    assert run.out.lines[1].startswith("checkpoint step 3: training paused ")
    assert " GiB written in " in run.out.lines[1]
    assert run.out.lines[1].endswith("kept steps 1, 3; removed steps 2")
    assert recorded_digest(directory / "step_00000003.pt") is not None


def test_a_lost_background_write_prunes_nothing_and_says_training_goes_on(tmp_path, monkeypatch):
    directory = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(directory, step, _live_state(float(step)))
    runrecord.write_record(tmp_path, {"pid": os.getpid(), "state": "running"})
    room = _filling_open(monkeypatch, after_bytes=256)
    run = _run(tmp_path, keep=1, writer=CheckpointWriter(HostStaging(host_too=True), background=True))
    run.writer.start(directory, 3, _live_state(3.0), time.perf_counter())
    run.report(run.writer.wait())
    assert [step for step, _ in list_checkpoints(directory)] == [1, 2]
    assert run.out.lines[-1].startswith("checkpoint step 3 not saved: cannot save the checkpoint of step 3")
    assert "No space left on device" in run.out.lines[-1]
    assert run.out.lines[-1].endswith("training goes on, and the next checkpoint tries again")
    lost = runrecord.read_record(tmp_path)["checkpoint_lost"]
    assert lost["step"] == 3 and "No space left on device" in lost["reason"]
    room["bytes"] = 1 << 30  # space freed: the next checkpoint is written, and the record says so
    run.writer.start(directory, 4, _live_state(4.0), time.perf_counter())
    run.report(run.writer.wait())
    assert [step for step, _ in list_checkpoints(directory)] == [4]
    record = runrecord.read_record(tmp_path)
    assert record["checkpoint_lost"] is None
    assert record["last_checkpoint"] == str(directory / "step_00000004.pt")


def test_a_lost_write_at_a_stop_or_the_end_ends_the_run_with_its_error(tmp_path):
    error = CheckpointWriteError(tmp_path, 9, OSError(errno.ENOSPC, "No space left on device"))
    run = _run(tmp_path, keep=1, writer=CheckpointWriter(HostStaging(), background=True))
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        run.report(Written(9, None, 0, 0.1, 0.2, error), final=True)


def test_a_crash_waits_for_the_write_in_flight_and_says_it_is_saved(tmp_path, held_writes):
    directory = tmp_path / "checkpoints"
    run = _run(tmp_path, keep=0, writer=CheckpointWriter(HostStaging(host_too=True), background=True))
    run.writer.start(directory, 4, _live_state(4.0), time.perf_counter())
    threading.Timer(0.3, held_writes.release.set).start()
    run.close_checkpoints()  # the run raised: its way out
    assert not run.writer.in_flight
    assert run.out.lines[0] == f"checkpoint saved step 4 {directory / 'step_00000004.pt'}"
    assert load_checkpoint(directory / "step_00000004.pt")["drafter"]["w"][0] == 4.0


def test_with_async_checkpoints_off_the_write_is_done_when_start_returns(tmp_path):
    writer = CheckpointWriter(HostStaging(host_too=False), background=False)
    writer.start(tmp_path, 6, _live_state(6.0), time.perf_counter())
    assert writer.thread is None and (tmp_path / "step_00000006.pt").is_file()
    written = writer.wait()
    assert written.unstaged is None and written.paused_s >= written.write_s > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
def test_a_background_write_of_device_tensors_holds_them_as_they_were_at_the_copy(tmp_path, held_writes):
    """On a GPU: the copy into pinned buffers is complete when start returns, the next steps' kernels
    change the device tensors, the file holds the copy; the next checkpoint reuses the buffers."""
    weights = torch.full((1 << 20,), 1.0, device="cuda")
    state = {"drafter": {"w": weights}, "optimizer": {"step": torch.tensor(3.0)}}
    staging = HostStaging(host_too=True)
    writer = CheckpointWriter(staging, background=True)
    writer.start(tmp_path, 1, state, time.perf_counter())
    assert staging.buffers[0].is_pinned() and writer.in_flight
    weights.mul_(5.0)  # queued on the device right after the copy
    state["optimizer"]["step"].add_(1)
    torch.cuda.synchronize()
    held_writes.release.set()
    written = writer.wait()
    loaded = load_checkpoint(written.path)
    assert loaded["drafter"]["w"].eq(1.0).all() and loaded["optimizer"]["step"] == 3.0
    buffers = [id(buffer) for buffer in staging.buffers]
    writer.start(tmp_path, 2, state, time.perf_counter())
    assert writer.wait().error is None and [id(buffer) for buffer in staging.buffers] == buffers
    assert load_checkpoint(tmp_path / "step_00000002.pt")["drafter"]["w"].eq(5.0).all()


def test_a_stop_waits_for_the_write_in_flight_then_writes_its_own(tmp_path, held_writes, monkeypatch):
    """Run.save at a stop (final): the write before it ends on disk and is reported first, then the
    stop's own checkpoint is written before save returns; the live state changed in between."""
    from trainer.run import train as train_module

    live = _live_state(0.0)
    monkeypatch.setattr(train_module, "checkpoint_state", lambda step, *_args: {**live, "step": step})
    run = _run(tmp_path, keep=0, writer=CheckpointWriter(HostStaging(host_too=True), background=True))
    run.world = SimpleNamespace(is_lead=True, world_size=1, any=lambda flag: flag)
    run.models = SimpleNamespace(replicas=[SimpleNamespace(params=[live["drafter"]["w"]])])
    run.cfg = SimpleNamespace(train=SimpleNamespace(keep_checkpoints=0, async_checkpoints=True))
    run.topology = run.loader = run.stretches = None
    run.tau0, run.tau0_step = None, 0
    for name in ("save", "save_final", "announce"):
        setattr(run, name, getattr(Run, name).__get__(run))
    live["drafter"]["w"].fill_(3.0)
    run.save(3)
    assert run.writer.in_flight and run.out.lines == []
    live["drafter"]["w"].fill_(4.0)  # the next step trains on
    threading.Timer(0.3, held_writes.release.set).start()
    run.save_final(4)
    assert not run.writer.in_flight
    saved = [line for line in run.out.lines if line.startswith("checkpoint saved step ")]
    assert [line.split()[3] for line in saved] == ["3", "4"]
    directory = tmp_path / "checkpoints"
    assert load_checkpoint(directory / "step_00000003.pt")["drafter"]["w"].eq(3.0).all()
    assert load_checkpoint(directory / "step_00000004.pt")["drafter"]["w"].eq(4.0).all()
    # the stop's pause names the wait for step 3's write apart from its own copy
    costs = {line.split()[2].rstrip(":"): line for line in run.out.lines if "training paused" in line}
    assert "waiting" not in costs["3"]
    pattern = r"training paused ([\d.]+) s \(([\d.]+) s of it waiting for step 3's write to end"
    waited = re.search(pattern, costs["4"])
    assert waited and 0.2 <= float(waited.group(2)) <= float(waited.group(1)), costs["4"]
