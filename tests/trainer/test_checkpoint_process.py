"""Checkpoints written by a process of their own (train.checkpoint_writer=process): the host copy in
one shared memory file, the writer process saving it as a thread would (sealed, hashed, atomic), and
every fault of that process said as a lost checkpoint, the earlier ones whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.run.checkpoint import CheckpointWriteError, CheckpointWriter, list_checkpoints, load_checkpoint
from trainer.run.checkpoint_process import SharedStaging, WriterProcess, layout

from .conftest import REPO

pytestmark = pytest.mark.unit


def _state(value: float, elements: int = 256) -> dict:
    """Live tensors of several dtypes and shapes, and what a checkpoint holds beside them."""
    return {
        "step": 3,
        "drafter": {
            "w": torch.full((elements,), value),
            "half": torch.full((3, 5), value, dtype=torch.bfloat16),
        },
        "optimizer": [torch.arange(7, dtype=torch.int64), torch.tensor(value), torch.empty(0)],
        "rng": (torch.ByteTensor([1, 2, 3]), "kept as it is", None),
    }


def _equal(loaded, state) -> bool:
    if isinstance(state, torch.Tensor):
        return loaded.dtype == state.dtype and torch.equal(loaded, state)
    if isinstance(state, dict):
        return loaded.keys() == state.keys() and all(_equal(loaded[k], state[k]) for k in state)
    if isinstance(state, (list, tuple)):
        return type(loaded) is type(state) and all(map(_equal, loaded, state))
    return loaded == state


@pytest.fixture
def process_writer():
    staging = SharedStaging(host_too=True)
    process = WriterProcess(staging)
    writer = CheckpointWriter(staging, background=True, save=process.save)
    yield writer, process, staging
    writer.wait()
    process.stop()
    staging.release()


def _wait_until(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.001)
    return False


def test_slots_start_on_pages_and_hold_each_tensor():
    slots, size = layout(
        [
            (torch.Size([3]), torch.float32),
            (torch.Size([0]), torch.int64),
            (torch.Size([2, 2048]), torch.bfloat16),
        ]
    )
    assert [slot.offset for slot in slots] == [0, 4096, 8192]
    assert size == 8192 + 8192 and slots[2].nbytes == 8192


def test_the_writer_process_saves_the_copy_bit_for_bit_and_the_state_may_change_meanwhile(
    tmp_path, process_writer
):
    writer, process, _ = process_writer
    state = _state(1.5)
    expected = _state(1.5)
    writer.start(tmp_path, 5, state, time.perf_counter())
    state["drafter"]["w"].fill_(9.0)  # training goes on and changes the live tensors in place
    written = writer.wait()
    assert written.error is None and written.path == tmp_path / "step_00000005.pt"
    assert written.size == written.path.stat().st_size
    assert _equal(load_checkpoint(written.path), expected)  # sealed: length and digest verified
    first = process.process.pid
    writer.start(tmp_path, 6, _state(2.5), time.perf_counter())
    assert _equal(load_checkpoint(writer.wait().path), _state(2.5))
    assert process.process.pid == first, "one process writes every checkpoint"
    assert [step for step, _ in list_checkpoints(tmp_path)] == [5, 6]


def test_the_process_is_started_once_the_copy_s_memory_is_ready(tmp_path, process_writer):
    _, process, staging = process_writer
    staging.prepare(_state(1.0))
    staging.preparing.join()
    assert staging.fd is not None and process.process is not None and process.process.poll() is None
    assert process.generation == staging.generation == 1


def test_the_first_checkpoint_copies_into_the_prepared_file_and_sends_the_few_small_tensors_after_it(
    tmp_path, process_writer
):
    """prepare() lays the file out for the drafter's and the optimizer's tensors; the checkpoint's
    state has a few small ones after them (random states): the file is kept, not laid out anew
    (pinning it again cost the first checkpoint of a process seconds at the recipe's shape)."""
    writer, _, staging = process_writer
    state = _state(4.0)
    staging.prepare({"drafter": state["drafter"], "optimizer": state["optimizer"]})
    staging.preparing.join()
    assert staging.generation == 1 and len(staging.buffers) == 5
    writer.start(tmp_path, 7, state, time.perf_counter())
    written = writer.wait()
    assert staging.generation == 1, "the prepared file was kept"
    assert _equal(load_checkpoint(written.path), _state(4.0))
    big_after = {**state, "rng": (torch.zeros(17 << 20, dtype=torch.uint8), "kept as it is", None)}  # 17 MiB
    writer.start(tmp_path, 8, big_after, time.perf_counter())
    assert writer.wait().error is None and staging.generation == 1, "up to 64 MiB after the slots go by value"
    bigger = {**state, "rng": (torch.zeros(65 << 20, dtype=torch.uint8), "kept as it is", None)}
    writer.start(tmp_path, 9, bigger, time.perf_counter())
    assert writer.wait().error is None and staging.generation == 2, "more is laid out anew"
    assert _equal(load_checkpoint(tmp_path / "step_00000009.pt"), bigger)


def test_a_writer_process_killed_mid_write_loses_that_checkpoint_only_and_the_next_starts_anew(
    tmp_path, process_writer
):
    writer, process, _ = process_writer
    big = 32 << 20  # 128 MiB: a write that lasts
    writer.start(tmp_path, 1, _state(1.0, big), time.perf_counter())
    assert writer.wait().error is None
    dead = process.process.pid
    os.kill(dead, signal.SIGSTOP)
    writer.start(tmp_path, 2, _state(2.0, big), time.perf_counter())
    os.kill(dead, signal.SIGCONT)
    partial = lambda: list(tmp_path.glob(".step_00000002.pt.*.tmp"))  # noqa: E731
    assert _wait_until(partial), "the write began"
    os.kill(dead, signal.SIGKILL)
    lost = writer.wait()
    assert lost.path is None and isinstance(lost.error, CheckpointWriteError)
    assert "writer process ended (killed by signal 9) during this write" in str(lost.error)
    assert "step_00000001.pt (step 1)" in str(lost.error), "the last intact checkpoint is named"
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    assert _equal(load_checkpoint(tmp_path / "step_00000001.pt"), _state(1.0, big))
    writer.start(tmp_path, 3, _state(3.0, big), time.perf_counter())
    assert writer.wait().error is None and process.process.pid != dead
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001.pt", "step_00000003.pt"]


def test_a_full_disk_in_the_writer_process_is_said_and_the_next_write_succeeds(tiny_disk, process_writer):
    writer, _, _ = process_writer
    writer.start(tiny_disk, 1, _state(1.0), time.perf_counter())
    assert writer.wait().error is None
    writer.start(tiny_disk, 2, _state(2.0, elements=1 << 20), time.perf_counter())  # 4 MiB: no room
    lost = writer.wait()
    assert isinstance(lost.error, CheckpointWriteError) and lost.error.cause.errno == 28
    assert "No space left on device" in str(lost.error) and "step_00000001.pt (step 1)" in str(lost.error)
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["step_00000001.pt"], "no partial file"
    writer.start(tiny_disk, 3, _state(3.0), time.perf_counter())
    assert writer.wait().error is None, "the same process writes the next one"
    assert _equal(load_checkpoint(tiny_disk / "step_00000003.pt"), _state(3.0))


TRAINER_KILLED = """
import sys, time, torch
from pathlib import Path
from trainer.run.checkpoint import CheckpointWriter
from trainer.run.checkpoint_process import SharedStaging, WriterProcess
directory = Path(sys.argv[1])
staging = SharedStaging(host_too=True)
process = WriterProcess(staging)
writer = CheckpointWriter(staging, background=True, save=process.save)
writer.start(directory, 1, {"w": torch.full((1 << 20,), 1.0)}, time.perf_counter())
writer.wait()
print(process.process.pid, flush=True)
writer.start(directory, 2, {"w": torch.full((64 << 20,), 2.0)}, time.perf_counter())
time.sleep(60)
"""


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status


def test_a_trainer_killed_mid_write_takes_its_writer_process_along_and_leaves_the_earlier_checkpoints_whole(
    tmp_path,
):
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER_KILLED, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(trainer.stdout.readline())
        assert _wait_until(lambda: list(tmp_path.glob(".step_00000002.pt.*.tmp"))), "the write began"
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
        assert _wait_until(lambda: _gone(child), 10), "the writer process ended with the trainer"
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1]
    assert torch.equal(load_checkpoint(tmp_path / "step_00000001.pt")["w"], torch.full((1 << 20,), 1.0))


STOPPED_GROUP = """
import signal, sys, time, torch
from pathlib import Path
from trainer.run.checkpoint import CheckpointWriter
from trainer.run.checkpoint_process import SharedStaging, WriterProcess
directory = Path(sys.argv[1])
stopping = []
signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
staging = SharedStaging(host_too=True)
process = WriterProcess(staging)
writer = CheckpointWriter(staging, background=True, save=process.save)
writer.start(directory, 1, {"w": torch.full((32 << 20,), 1.0)}, time.perf_counter())
print("writing", flush=True)
deadline = time.monotonic() + 60
while not stopping and time.monotonic() < deadline:
    time.sleep(0.01)
written = writer.wait()
writer.start(directory, 2, {"w": torch.full((16,), 2.0)}, time.perf_counter())
print(written.path, writer.wait().path, flush=True)
process.stop()
"""


def test_a_stop_sent_to_the_whole_process_group_leaves_the_write_in_flight_and_the_stop_s_own_to_the_trainer(
    tmp_path,
):
    """Ctrl-C or a SIGTERM to the group reaches the writer process too: it goes on, and the trainer
    (which waits for the write in flight at a stop) has its stop's checkpoint written after it."""
    trainer = subprocess.Popen(
        [sys.executable, "-c", STOPPED_GROUP, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert trainer.stdout.readline().strip() == "writing"
        assert _wait_until(lambda: list(tmp_path.glob(".step_00000001.pt.*.tmp"))), "the write began"
        os.killpg(trainer.pid, signal.SIGTERM)
        assert trainer.stdout.readline().split() == [str(tmp_path / f"step_0000000{n}.pt") for n in (1, 2)]
        assert trainer.wait(timeout=30) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert torch.equal(load_checkpoint(tmp_path / "step_00000001.pt")["w"], torch.full((32 << 20,), 1.0))
