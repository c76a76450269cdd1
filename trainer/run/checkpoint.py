"""Atomic, verified checkpoints.

File layout: a magic line, the SHA-256 of the payload, its length, then the payload (torch.save of
a dict). Written to a temporary file in the same directory, fsync'ed, then os.replace'd into place
and the directory fsync'ed: a kill -9 at any moment leaves either no new checkpoint or a complete
one. Loading verifies the magic, the length and the checksum before unpickling (weights_only).

The payload is streamed to the file as torch.save produces it, hashed on the way, and the header
(of a fixed size: the length is zero-padded) is filled in last: at the Qwen3-8B shape a checkpoint
is gigabytes, and a copy of it in memory would double both its time and the host memory it needs.

Readers hold a shared lock (flock) on the file while they read it; `prune_checkpoints` removes
only files it can lock exclusively, so a checkpoint being read by a resume or an export stays.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAGIC = b"DFLASH-CKPT 1\n"
LENGTH_DIGITS = 20  # the payload length, zero-padded, so the header's size is known before the payload
NAME_RE = re.compile(r"^step_(\d{8})\.pt$")


class CheckpointError(Exception):
    pass


def checkpoint_path(directory: Path, step: int) -> Path:
    return directory / f"step_{step:08d}.pt"


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """Complete checkpoint files (temporary files are ignored), oldest first."""
    if not directory.is_dir():
        return []
    found = []
    for item in directory.iterdir():
        match = NAME_RE.match(item.name)
        if match and item.is_file():
            found.append((int(match.group(1)), item))
    return sorted(found)


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (a full disk, say); no partial file is left behind."""

    def __init__(self, directory: Path, step: int, cause: OSError):
        self.directory, self.step, self.cause = directory, step, cause
        intact = list_checkpoints(directory)
        last = f"{intact[-1][1]} (step {intact[-1][0]})" if intact else "none"
        super().__init__(
            f"cannot save the checkpoint of step {step} in {directory}: {cause.strerror or cause}; "
            f"the last intact checkpoint is {last}. Free space there and resume (-e resume=true)"
        )


class HashingWriter:
    """A file for torch.save: every byte written goes to the file and into the SHA-256. A large
    write is hashed on a second thread while this one writes it (both let go of the GIL), so a
    checkpoint costs the longer of the two, not their sum (SHA-256 runs at 1-2 GB/s: 6-12 s of a
    12.6 GB checkpoint)."""

    OVERLAP_BYTES = 1 << 20  # smaller writes (zip records, pickled metadata) are hashed in line

    def __init__(self, handle, hasher: ThreadPoolExecutor | None = None):
        self.handle, self.sha256, self.length = handle, hashlib.sha256(), 0
        self.hasher = hasher
        self.error: OSError | None = None

    def write(self, data) -> int:
        self.length += len(data)
        hashed = None
        if self.hasher is not None and len(data) >= self.OVERLAP_BYTES:
            hashed = self.hasher.submit(self.sha256.update, data)
        else:
            self.sha256.update(data)
        try:
            return self.handle.write(data)
        except OSError as exc:  # torch's zip writer hides it behind its own RuntimeError
            self.error = exc
            raise
        finally:
            if hashed is not None:
                hashed.result()  # the buffer is torch's again once write returns

    def flush(self) -> None:
        self.handle.flush()


class HostStaging:
    """Host copies of a state's device tensors, made before torch.save and kept from one checkpoint
    to the next. torch.save copies each device tensor into fresh host memory as it writes it; one
    H200 wrote 4.29 GB of CUDA tensors so in 7.6-11.4 s, where the disk alone takes 2.0-3.5 s. Copied
    into buffers allocated once (pinned: page-locked, the copies run at the bus's rate), a later
    checkpoint pays for the disk and the hash: 5.1 s. The buffers stay allocated for the run: host
    memory the size of a checkpoint. Where the host has not twice that available (a container's
    limit, say), or pinning fails, the state is written as it is, tensor by tensor."""

    def __init__(
        self, pin: bool = True, available: Callable[[], int | None] | None = None, host_too: bool = False
    ):
        self.pin = pin
        # host_too: copy the host's tensors as well (a snapshot that training may not change while
        # a background write reads it: on the CPU the state's tensors are the live parameters)
        self.host_too = host_too
        self.available = available or available_host_memory
        self.buffers: list[torch.Tensor] = []
        self.declined: str | None = None  # why the last state was written unstaged
        self.preparing: threading.Thread | None = None

    def prepare(self, state: Any) -> None:
        """Allocate the buffers for a state's device tensors (what to_host will copy, in its order)
        on a thread of their own, so that the first checkpoint of a process pays for the copy and
        the disk only: pinning a checkpoint's worth of host memory took 5-6 s of the recipe's first
        checkpoint (11.72 GiB on one H200: 30.0 s, the next 24.4 s). Best effort: a buffer of
        another shape than the state's tensor at its place is allocated again by to_host; a
        failure leaves none."""
        tensors = device_tensors(state, self.host_too)
        if self.buffers or self.preparing is not None or not tensors or self.no_room(tensors):
            return
        like = [(tensor.shape, tensor.dtype, self.pin and tensor.device.type == "cuda") for tensor in tensors]
        self.preparing = threading.Thread(
            target=self._allocate, args=(like,), name="checkpoint-staging", daemon=True
        )
        self.preparing.start()

    def _allocate(self, like: list) -> None:
        try:
            self.buffers = [torch.empty(shape, dtype=dtype, pin_memory=pin) for shape, dtype, pin in like]
        except (RuntimeError, MemoryError):
            self.buffers = []  # to_host allocates (or declines) as without it

    def to_host(self, state: Any) -> Any:
        """`state` with every device tensor replaced by its host copy (the same nesting); `state`
        itself when the host has no room for the copy (torch.save then copies tensor by tensor)."""
        if self.preparing is not None:
            self.preparing.join()  # its buffers are this copy's
            self.preparing = None
        tensors = device_tensors(state, self.host_too)
        self.declined = self.no_room(tensors)
        if self.declined:
            self.buffers.clear()
            return state
        try:
            copies = iter(self.copy(tensors))
        except (RuntimeError, MemoryError) as exc:  # pinning refused: write without the copy
            self.buffers.clear()
            self.declined = f"the host copy failed ({str(exc).splitlines()[0]})"
            return state
        return map_device_tensors(state, lambda _tensor: next(copies), self.host_too)

    def copy(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors copied into this staging's buffers (one each, in order), complete on return."""
        copies = []
        for index, tensor in enumerate(tensors):
            copies.append(self.buffer(index, tensor))
            copies[-1].copy_(tensor, non_blocking=self.pin)
        for device in {tensor.device for tensor in tensors}:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the pinned copies were queued, not waited for
        del self.buffers[len(tensors) :]  # a state with fewer tensors than the last one (never in a run)
        return copies

    def no_room(self, tensors: list[torch.Tensor]) -> str | None:
        """Why the host cannot hold these tensors' copy beside what it has, or None. The buffers
        already held count as room; the rest must be at most half of what is available."""
        needed = sum(t.numel() * t.element_size() for t in tensors)
        held = sum(t.numel() * t.element_size() for t in self.buffers)
        available = self.available()
        if not needed or available is None or 2 * (needed - held) <= available:
            return None
        return (
            f"{needed / 2**30:.1f} GiB to copy to the host, {available / 2**30:.1f} GiB of host memory "
            "available"
        )

    def buffer(self, index: int, like: torch.Tensor) -> torch.Tensor:
        if index < len(self.buffers):
            kept = self.buffers[index]
            if kept.shape == like.shape and kept.dtype == like.dtype:
                return kept
        pin = self.pin and like.device.type == "cuda"
        fresh = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
        if index < len(self.buffers):
            self.buffers[index] = fresh
        else:
            self.buffers.append(fresh)
        return fresh


def map_device_tensors(value: Any, change: Callable[[torch.Tensor], Any], host_too: bool = False) -> Any:
    """`value` with each tensor not on the host (with `host_too`: each tensor) replaced by
    change(tensor), in order (dicts, lists and tuples rebuilt, everything else as it is)."""
    if isinstance(value, torch.Tensor):
        return change(value) if host_too or value.device.type != "cpu" else value
    if isinstance(value, dict):
        return {key: map_device_tensors(item, change, host_too) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_device_tensors(item, change, host_too) for item in value)
    return value


def device_tensors(state: Any, host_too: bool = False) -> list[torch.Tensor]:
    """The tensors of `state` not on the host (with `host_too`: all), in map_device_tensors' order."""
    found: list[torch.Tensor] = []
    map_device_tensors(state, lambda tensor: found.append(tensor) or tensor, host_too)
    return found


def available_host_memory() -> int | None:
    """Bytes this process may still take: the smaller of MemAvailable (/proc/meminfo, which lxcfs
    scales to a container's limit, as on Proxmox) and its cgroup's limit less its use; None if
    neither says."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    room = cgroup_room()
    if room is not None:
        found.append(room)
    return min(found) if found else None


def cgroup_room() -> int | None:
    """memory.max less memory.current of this process's cgroup (v2), or None where it has no limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
        own = next(line[3:] for line in lines if line.startswith("0::"))  # "/" inside a namespace
        cgroup = Path("/sys/fs/cgroup") / own.strip().lstrip("/")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((cgroup / "memory.current").read_text())
    except (OSError, ValueError, StopIteration):
        return None


def header_of(digest: str, length: int) -> bytes:
    return MAGIC + digest.encode() + b"\n" + str(length).zfill(LENGTH_DIGITS).encode() + b"\n"


def save_checkpoint(directory: Path, step: int, state: dict[str, Any]) -> Path:
    final = checkpoint_path(directory, step)
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    placeholder = header_of("0" * 64, 0)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        remove_partial_writes(directory)
        with tmp.open("wb") as handle, ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") as hasher:
            handle.write(placeholder)
            writer = HashingWriter(handle, hasher)
            try:
                torch.save(state, writer)
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None  # a full disk, say: the write's own error
            handle.seek(0)
            handle.write(header_of(writer.sha256.hexdigest(), writer.length))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
        fsync_directory(directory)
    except OSError as exc:
        tmp.unlink(missing_ok=True)  # never leave a partial file
        raise CheckpointWriteError(directory, step, exc) from None
    return final


@dataclass
class Written:
    """What became of one checkpoint: its file, or the error that lost it. paused_s: how long
    training waited for it (the wait for the write before it, the state gathered, the host copy, and
    the write itself where it was not in the background); write_s: the hashing and writing."""

    step: int
    path: Path | None
    size: int
    paused_s: float
    write_s: float
    error: CheckpointWriteError | None = None
    unstaged: str | None = None  # why it was written without a host copy, training waiting for it
    waited_s: float = 0.0  # of paused_s: the wait for the write before it to end
    waited_for: int | None = None  # that write's step


class CheckpointWriter:
    """Writes checkpoints, one at a time, on a thread of its own (`background`) or in the caller.

    `start` copies the state into the staging's host buffers (the only part training waits for)
    and hands them to the thread, which hashes and writes them (save_checkpoint: sealed, fsync'ed,
    renamed). The next checkpoint's copy goes into the same buffers, so at most one write is in
    flight: `start` refuses while one is, and the caller waits for it first (`wait`), which also
    hands over its outcome. Where the host has no room for the copy (HostStaging.declined) the
    state is the live one, and it is written before `start` returns, as without a background."""

    def __init__(self, staging: HostStaging, background: bool = True):
        self.staging, self.background = staging, background
        self.thread: threading.Thread | None = None
        self.outcome: Written | None = None
        self.failure: BaseException | None = None  # anything but a write error: a fault, raised here
        self.last_step: int | None = None  # the step of the last checkpoint started

    @property
    def in_flight(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def start(self, directory: Path, step: int, state: Any, began: float,
              waited: tuple[float, int | None] = (0.0, None)) -> None:  # fmt: skip
        """Copy `state` to the host and write it (`began`: time.perf_counter() when training stopped
        for this checkpoint; `waited`: of the time since, the seconds spent waiting for the write
        before it to end, and that write's step)."""
        if self.thread is not None or self.outcome is not None:
            raise RuntimeError("a checkpoint write is in flight or unreported: wait() for it first")
        host = self.staging.to_host(state)
        unstaged = self.staging.declined
        self.last_step = step
        if unstaged or not self.background:
            self._write(directory, step, host, 0.0, unstaged, waited)
            self.outcome.paused_s = time.perf_counter() - began
            return
        paused = time.perf_counter() - began
        # Not a daemon: an interpreter leaving by any path waits for the write rather than cut it.
        self.thread = threading.Thread(
            target=self._write, args=(directory, step, host, paused, None, waited), name="checkpoint-writer"
        )
        self.thread.start()

    def _write(self, directory: Path, step: int, state: Any, paused: float, unstaged: str | None = None,
               waited: tuple[float, int | None] = (0.0, None)):  # fmt: skip
        began = time.perf_counter()
        try:
            path = save_checkpoint(directory, step, state)
            outcome = Written(step, path, path.stat().st_size, paused, time.perf_counter() - began,
                              unstaged=unstaged)  # fmt: skip
        except CheckpointWriteError as exc:
            outcome = Written(step, None, 0, paused, time.perf_counter() - began, exc, unstaged)
        except BaseException as exc:  # a fault of the writer's own: the caller's to raise
            self.failure = exc
            outcome = Written(step, None, 0, paused, time.perf_counter() - began)
        outcome.waited_s, outcome.waited_for = waited
        self.outcome = outcome

    def poll(self) -> Written | None:
        """The outcome of the write in flight if it has ended (once), else None; never waits."""
        if self.in_flight:
            return None
        return self.wait()

    def wait(self) -> Written | None:
        """Wait for the write in flight (if any) and hand over its outcome (once); a fault of the
        writer is raised here."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        outcome, self.outcome = self.outcome, None
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure
        return outcome


def remove_partial_writes(directory: Path) -> None:
    """A checkpoint a killed trainer was writing (a kill -9 mid-write leaves its temporary file,
    gigabytes at a real shape): the output's lock lets one trainer write here, so any such file is
    another, dead process's."""
    for leftover in directory.glob(".step_*.tmp"):
        leftover.unlink(missing_ok=True)


def fsync_directory(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def prune_checkpoints(directory: Path, keep: int, protected: set[int]) -> list[int]:
    """Remove all but the newest `keep` checkpoints and the `protected` steps (0: keep all); a file
    that a reader holds (its shared lock) stays until a later call. Returns the steps removed."""
    found = list_checkpoints(directory)
    if keep < 1 or len(found) <= keep:
        return []
    removed = []
    for step, path in found[:-keep]:
        if step in protected:
            continue
        try:
            with path.open("rb") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                path.unlink()
        except (BlockingIOError, FileNotFoundError):
            continue  # being read now, or gone already
        removed.append(step)
    if removed:
        fsync_directory(directory)
    return removed


def read_checkpoint_bytes(path: Path) -> bytes:
    """The whole file as it is on disk (header and payload), unverified; read under a shared lock,
    so that `prune_checkpoints` leaves it alone meanwhile."""
    try:
        with path.open("rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
            return handle.read()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc}") from None


HEADER_MAX = len(MAGIC) + 64 + 1 + LENGTH_DIGITS + 1


def split_checkpoint(raw: bytes, origin: object, checksum: bool = True) -> tuple[str, memoryview]:
    """(the SHA-256 hex digest the header names, the payload), both verified: magic, length and
    (`checksum`) the payload's SHA-256. The payload is a view into `raw`, not a copy: at the Qwen3-8B
    recipe's shape each copy is 12.6 GB of host memory, on every rank that loads one."""
    if not raw.startswith(MAGIC):
        raise CheckpointError(f"checkpoint {origin} is not a trainer checkpoint (bad header)")
    try:
        digest, length, _ = raw[len(MAGIC) : HEADER_MAX].split(b"\n", 2)
        expected_length = int(length)
    except ValueError:
        raise CheckpointError(f"checkpoint {origin} has a damaged header") from None
    payload = memoryview(raw)[len(MAGIC) + len(digest) + len(length) + 2 :]
    if len(payload) != expected_length:
        raise CheckpointError(
            f"checkpoint {origin} is truncated ({len(payload)} of {expected_length} payload bytes)"
        )
    if checksum and hashlib.sha256(payload).hexdigest() != digest.decode():
        raise corrupt(origin)
    return digest.decode(), payload


def corrupt(origin: object) -> CheckpointError:
    return CheckpointError(f"checkpoint {origin} fails its checksum (corrupt)")


class ViewReader(io.RawIOBase):
    """A seekable, read-only file over a memoryview, for torch.load: io.BytesIO would copy it."""

    def __init__(self, view: memoryview):
        super().__init__()
        self.view, self.position = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: len(self.view)}[whence]
        self.position = max(0, base + offset)
        return self.position

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), len(self.view) - self.position))
        buffer[:count] = self.view[self.position : self.position + count]
        self.position += count
        return count


def checkpoint_from_bytes(raw: bytes, origin: object, digest: str | None = None) -> dict[str, Any]:
    """The state in a checkpoint's bytes (read from a file or received from another rank), verified;
    `digest`: the payload SHA-256 it must have (the header's is checked against the payload anyway)."""
    return verified_checkpoint(raw, origin, digest)[1]


def verified_checkpoint(raw: bytes, origin: object, digest: str | None = None) -> tuple[str, dict[str, Any]]:
    """(the payload's SHA-256, the state): checkpoint_from_bytes, with the digest it verified. The
    payload is hashed (6-12 s at the Qwen3-8B recipe's shape) on a thread of its own while it is
    unpacked (hashlib lets go of the GIL), and the state is handed over only once the hash matches:
    unpacking damaged bytes is safe (weights_only: tensors and plain values, no code), and what
    they gave is dropped, the error naming the checksum."""
    found, payload = split_checkpoint(raw, origin, checksum=False)
    if digest is not None and found != digest:
        raise CheckpointError(
            f"checkpoint {origin} is another checkpoint (SHA-256 {found}, expected {digest})"
        )
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") as hashing:
        hashed = hashing.submit(lambda: hashlib.sha256(payload).hexdigest())
        try:
            with ViewReader(payload) as reader:
                state = torch.load(reader, map_location="cpu", weights_only=True)
        except Exception:
            if hashed.result() != found:
                raise corrupt(origin) from None
            raise
        if hashed.result() != found:
            del state
            raise corrupt(origin)
    return found, state


def load_checkpoint(path: Path) -> dict[str, Any]:
    return checkpoint_from_bytes(read_checkpoint_bytes(path), path)


def header_digest(path: Path) -> str | None:
    """The payload SHA-256 a checkpoint file's header names (the header alone is read, not verified
    against the payload), or None where the file is missing or has no such header."""
    try:
        with path.open("rb") as handle:
            head = handle.read(len(MAGIC) + 65)
    except OSError:
        return None
    if not head.startswith(MAGIC) or not head.endswith(b"\n"):
        return None
    digest = head[len(MAGIC) : -1]
    return digest.decode() if re.fullmatch(rb"[0-9a-f]{64}", digest) else None
