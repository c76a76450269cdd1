"""Checkpoints written by a process of their own (train.checkpoint_writer=process).

A write on a thread of the trainer shares the trainer's interpreter: torch.save's pickling and the
zip records hold its GIL, and the training loop, which launches the kernels, waits for it now and
then. Here the host copy lives in one anonymous shared file (memfd: not bound by /dev/shm's size),
mapped by the trainer, which copies the state into it (pinned on a GPU: cudaHostRegister), and by a
writer process started once, which never touches a GPU. For each checkpoint the trainer sends the
state's structure, its tensors named by their place in the shared file, and the writer process
saves it with save_checkpoint (sealed, hashed, fsync'ed, renamed) and answers with the file's path
or the error. The trainer's thread that waits for the answer holds no GIL while it waits.

The writer process ends with the trainer (it watches its parent): a trainer killed mid-write
leaves the temporary file, which the next write removes, and the earlier checkpoints whole. A
writer process that dies mid-write loses that checkpoint only (said as a full disk is); the next
checkpoint starts another.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import pickle
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import CheckpointWriteError, HostStaging, map_device_tensors, save_checkpoint

ALIGN = 4096  # each tensor's bytes start on a page: pinning and the DMA copies work in pages
LENGTH = struct.Struct("<Q")
# A state's tensors past the shared file's slots that go to the writer process in its message
# (pickled) rather than get the file laid out anew: a few small ones (random states, the loader's).
BY_VALUE_BYTES = 64 << 20


@dataclass(frozen=True)
class Slot:
    """A tensor's place in the shared file."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class InShared:
    """In a state sent to the writer process: the tensor at this slot of the shared file."""

    index: int


def layout(like: list[tuple[torch.Size, torch.dtype]]) -> tuple[list[Slot], int]:
    """Slots for tensors of these shapes and dtypes, one after the other on page boundaries; the size."""
    slots, offset = [], 0
    for shape, dtype in like:
        slot = Slot(offset, tuple(shape), dtype)
        slots.append(slot)
        offset += -(-max(slot.nbytes, 1) // ALIGN) * ALIGN
    return slots, max(offset, ALIGN)


def views(memory: mmap.mmap, slots: list[Slot]) -> list[torch.Tensor]:
    """A tensor over each slot of the mapped file (no copy)."""
    out = []
    for slot in slots:
        if slot.nbytes:
            flat = torch.frombuffer(memory, dtype=torch.uint8, count=slot.nbytes, offset=slot.offset)
        else:
            flat = torch.empty(0, dtype=torch.uint8)
        out.append(flat.view(slot.dtype).view(slot.shape))
    return out


class SharedStaging(HostStaging):
    """HostStaging whose buffers are slots of one memfd that a writer process maps too."""

    def __init__(self, pin: bool = True, available=None, host_too: bool = True):
        super().__init__(pin, available, host_too)
        self.fd: int | None = None
        self.memory: mmap.mmap | None = None
        self.slots: list[Slot] = []
        self.registered: int | None = None  # the address cudaHostRegister pinned
        self.generation = 0  # of the shared file: a new one (a new layout) needs a new writer process
        self.after_allocate: Callable[[], None] | None = None  # the writer process's start, say

    def _allocate(self, like: list) -> None:
        try:
            self._share([(shape, dtype) for shape, dtype, _pin in like], any(pin for *_, pin in like))
        except (OSError, RuntimeError, MemoryError, ValueError):
            self.release()  # to_host allocates (or declines) as without it
            return
        if self.after_allocate is not None:
            self.after_allocate()  # the writer process imports torch while training goes on

    def _share(self, like: list[tuple[torch.Size, torch.dtype]], pin: bool) -> None:
        self.release()
        slots, size = layout(like)
        fd = os.memfd_create("dflash-checkpoint", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            memory = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            raise
        self.fd, self.memory, self.slots = fd, memory, slots
        self.generation += 1
        buffers = views(memory, slots)
        if pin and torch.cuda.is_available():
            address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
            refused = int(torch.cuda.cudart().cudaHostRegister(address, size, 1))  # 1: every CUDA context
            if refused:
                raise RuntimeError(f"cudaHostRegister refused the shared memory (cudaError {refused})")
            self.registered = address
        self.buffers = buffers

    def copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors copied: those the shared file has slots for (prepare's: the drafter's and the
        optimizer's) into their slots, the few small ones after them (random states, the loader's)
        into plain host memory, which goes to the writer process in its message. A state whose
        tensors the file does not lead with, or with more than BY_VALUE_BYTES after them (a sharded
        optimizer's state, gathered at each checkpoint), gets a file of its own layout anew: pinning
        it took 5.9-8.0 s of the first checkpoint of a process at the recipe's shape on one H100."""
        like = [(tensor.shape, tensor.dtype) for tensor in tensors]
        held = [(buffer.shape, buffer.dtype) for buffer in self.buffers]
        after = tensors[len(held) :]
        by_value = sum(tensor.numel() * tensor.element_size() for tensor in after)
        if not held or held != like[: len(held)] or by_value > BY_VALUE_BYTES:
            self._share(like, self.pin and any(tensor.device.type == "cuda" for tensor in tensors))
            held, after = like, []
        return super().copy(tensors[: len(held)]) + [tensor.detach().to("cpu", copy=True) for tensor in after]

    def index_of(self, tensor: torch.Tensor) -> int | None:
        for index, buffer in enumerate(self.buffers):
            if buffer is tensor:
                return index
        return None

    def release(self) -> None:
        self.buffers = []
        if self.registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self.registered)
            self.registered = None
        if self.memory is not None:
            with contextlib.suppress(BufferError):  # a tensor over it still lives: the mapping goes with it
                self.memory.close()
            self.memory = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class WriterProcess:
    """The writer process and its pipes; `save` has save_checkpoint's signature and outcome."""

    def __init__(self, staging: SharedStaging):
        self.staging = staging
        self.process: subprocess.Popen | None = None
        self.generation = 0  # of the shared file the running process maps
        staging.after_allocate = self.start

    def start(self) -> None:
        """Start the process for the staging's current file (once; again after a death or a new file)."""
        running = self.process is not None and self.process.poll() is None
        if running and self.generation == self.staging.generation:
            return
        self.stop()
        assert self.staging.fd is not None
        root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "trainer.run.checkpoint_process", str(self.staging.fd), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(self.staging.fd,),
            env=env,
            cwd=root,
        )
        self.generation = self.staging.generation

    def save(self, directory: Path, step: int, state: Any) -> Path:
        self.start()
        assert self.process is not None and self.process.stdin and self.process.stdout
        sent = map_device_tensors(state, self._in_shared, host_too=True)
        job = pickle.dumps((str(directory), step, self.staging.slots, sent), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.process.stdin.write(LENGTH.pack(len(job)) + job)
            self.process.stdin.flush()
            answer = read_message(self.process.stdout)
        except (OSError, EOFError):
            answer = None
        if answer is None:
            code = self.process.wait()
            self.process = None
            why = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
            lost = OSError(f"the checkpoint writer process ended ({why}) during this write")
            way_out = "The next checkpoint starts another writer process"
            raise CheckpointWriteError(directory, step, lost, way_out)
        kind, value = answer
        if kind == "saved":
            return Path(value)
        if kind == "write error":
            number, text, filename = value
            raise CheckpointWriteError(directory, step, OSError(number, text, filename))
        raise RuntimeError(f"the checkpoint writer process failed: {value}")

    def _in_shared(self, tensor: torch.Tensor) -> Any:
        index = self.staging.index_of(tensor)
        return InShared(index) if index is not None else tensor

    def stop(self) -> None:
        """End the process (after its write: a write in flight is waited for by the caller first)."""
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.stdin:
            process.stdin.close()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout:
            process.stdout.close()


def read_message(stream) -> Any:
    head = stream.read(LENGTH.size)
    if len(head) < LENGTH.size:
        return None
    (length,) = LENGTH.unpack(head)
    body = stream.read(length)
    if len(body) < length:
        return None
    return pickle.loads(body)


def write_message(stream, message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(LENGTH.pack(len(body)) + body)
    stream.flush()


def die_with_parent(parent: int, every_s: float = 0.2) -> None:
    """End this process within `every_s` of the trainer that started it (a kill -9 included), in
    the middle of a write too: its temporary file is left for the next write to remove. (Not
    PR_SET_PDEATHSIG: that fires when the trainer's thread that started it ends.)"""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve(fd: int, parent: int) -> None:
    """The writer process: one job at a time from stdin, each answer on stdout."""
    die_with_parent(parent)
    # A stop sent to the whole process group (Ctrl-C, a SIGTERM to the group) is the trainer's to
    # handle: it waits for the write in flight, then has its own checkpoint written.
    for stop in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(stop, signal.SIG_IGN)
    size = os.fstat(fd).st_size
    memory = mmap.mmap(fd, size)
    tensors: dict[tuple, list[torch.Tensor]] = {}
    jobs, answers = sys.stdin.buffer, sys.stdout.buffer
    while (job := read_message(jobs)) is not None:
        directory, step, slots, sent = job
        key = tuple(slots)
        if key not in tensors:
            tensors = {key: views(memory, slots)}
        shared = tensors[key]
        state = rebuild(sent, shared)
        try:
            answer = ("saved", str(save_checkpoint(Path(directory), step, state)))
        except CheckpointWriteError as exc:
            cause = exc.cause
            answer = ("write error", (cause.errno, cause.strerror or str(cause), cause.filename))
        except Exception as exc:  # the trainer raises it as the writer's fault
            answer = ("fault", f"{type(exc).__name__}: {exc}")
        del state
        write_message(answers, answer)


def rebuild(value: Any, shared: list[torch.Tensor]) -> Any:
    if isinstance(value, InShared):
        return shared[value.index]
    if isinstance(value, dict):
        return {key: rebuild(item, shared) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [rebuild(item, shared) for item in value]
        return type(value)(items) if isinstance(value, list) else tuple(items)
    return value


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]) or len(sys.argv) != 3:
        # Not a command for people: the trainer starts it (train.checkpoint_writer=process).
        print(f"usage: python -m trainer.run.checkpoint_process SHARED_FD TRAINER_PID\n\n{__doc__}")
        sys.exit(0 if {"-h", "--help"} & set(sys.argv[1:]) else 2)
    # The module by its name, not as __main__: the jobs' InShared are of its classes.
    from trainer.run.checkpoint_process import serve as serve_jobs

    serve_jobs(int(sys.argv[1]), int(sys.argv[2]))
