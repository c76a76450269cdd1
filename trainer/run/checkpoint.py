"""Atomic, verified checkpoints.

File layout (format 2): the payload (torch.save of a dict, a zip archive) as it is, then a seal
of a fixed size: a magic line, the payload's digest, its length and the piece size. The digest is
the SHA-256 of the pieces' SHA-256 digests, the payload cut into pieces of PIECE_BYTES: the pieces
are hashed on as many threads as the host has cores, so that verifying a checkpoint of the Qwen3-8B
recipe's shape (11.7 GiB) takes about what reading it takes, where one SHA-256 stream took 10.7 s
on one H100 machine. With the seal at the end the payload starts the file, and torch.load maps it
(mmap) instead of copying it into fresh memory (8.5 s at that shape).

Written to a temporary file in the same directory, fsync'ed, then os.replace'd into place and the
directory fsync'ed: a kill -9 at any moment leaves either no new checkpoint or a complete one.
Loading verifies the seal, the length and the digest before it hands the state over (weights_only).
Files of format 1 (a header before the payload, one SHA-256 over it) are still read.

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

SEAL_MAGIC = b"DFLASH-CKPT 2\n"
LEGACY_MAGIC = b"DFLASH-CKPT 1\n"  # format 1: a header before the payload, one SHA-256 over it
DIGITS = 20  # the length and the piece size, zero-padded: the seal (and format 1's header) has a fixed size
SEAL_BYTES = len(SEAL_MAGIC) + 65 + 2 * (DIGITS + 1)
LEGACY_HEADER_BYTES = len(LEGACY_MAGIC) + 65 + DIGITS + 1
PIECE_BYTES = 16 << 20
# Beside a background write training keeps the other cores; the write is bound by the disk and
# torch.save's copying (11.7 GiB in 25 s on one H100 machine), which two threads hashing outpace.
WRITE_HASH_THREADS = 2
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


FULL_DISK_WAY_OUT = "Free space there and resume (-e resume=true)"


class CheckpointWriteError(Exception):
    """A checkpoint could not be written (a full disk, say); no partial file is left behind."""

    def __init__(self, directory: Path, step: int, cause: OSError, way_out: str = FULL_DISK_WAY_OUT):
        self.directory, self.step, self.cause = directory, step, cause
        intact = list_checkpoints(directory)
        last = f"{intact[-1][1]} (step {intact[-1][0]})" if intact else "none"
        super().__init__(
            f"cannot save the checkpoint of step {step} in {directory}: {cause.strerror or cause}; "
            f"the last intact checkpoint is {last}. {way_out}"
        )


def piece_digest(data) -> bytes:
    return hashlib.sha256(data).digest()


def digest_of_pieces(digests: list[bytes]) -> str:
    """The payload's digest: the SHA-256 of its pieces' SHA-256 digests, in order."""
    return hashlib.sha256(b"".join(digests)).hexdigest()


def hash_threads() -> int:
    """Threads that hash a checkpoint being read: the cores this process may use, at most 16."""
    return max(1, min(16, len(os.sched_getaffinity(0))))


def pieces_digest(length: int, piece: int, read: Callable[[int, int], Any], threads: int) -> str:
    """The digest of a payload of `length` bytes, each piece's bytes from read(offset, size), the
    pieces read and hashed on `threads` threads (file reads and SHA-256 both let go of the GIL)."""
    with ThreadPoolExecutor(threads, thread_name_prefix="checkpoint-hash") as pool:
        offsets = range(0, length, piece)
        digests = pool.map(lambda at: piece_digest(read(at, min(piece, length - at))), offsets)
        return digest_of_pieces(list(digests))


class HashingWriter:
    """A file for torch.save: every byte written goes to the file and into its piece's SHA-256. The
    whole pieces of a large write (a tensor's storage) are hashed on the pool's threads while this
    one writes it to the file (both let go of the GIL); a piece's first or last part and the small
    records (zip entries, the pickled structure) are hashed in line."""

    def __init__(self, handle, hasher: ThreadPoolExecutor | None, piece: int):
        self.handle, self.hasher, self.piece = handle, hasher, piece
        self.length = 0
        self.digests: list = []  # each whole piece's digest, or the future computing it
        self.current, self.filled = hashlib.sha256(), 0  # the piece being filled
        self.error: OSError | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        pending = []
        position = 0
        while position < len(view):
            part = view[position : position + self.piece - self.filled]
            position += len(part)
            if self.hasher is not None and self.filled == 0 and len(part) == self.piece:
                pending.append(self.hasher.submit(piece_digest, part))
                self.digests.append(pending[-1])
                continue
            self.current.update(part)
            self.filled += len(part)
            if self.filled == self.piece:
                self.digests.append(self.current.digest())
                self.current, self.filled = hashlib.sha256(), 0
        self.length += len(view)
        try:
            return self.handle.write(data)
        except OSError as exc:  # torch's zip writer hides it behind its own RuntimeError
            self.error = exc
            raise
        finally:
            for hashed in pending:
                hashed.result()  # the buffer is torch's again once write returns

    def flush(self) -> None:
        self.handle.flush()

    def hexdigest(self) -> str:
        """The digest of everything written (digest_of_pieces)."""
        digests = [item if isinstance(item, bytes) else item.result() for item in self.digests]
        if self.filled:
            digests.append(self.current.digest())
        return digest_of_pieces(digests)


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


def seal_of(digest: str, length: int, piece: int) -> bytes:
    return b"".join(
        (SEAL_MAGIC, digest.encode(), b"\n", str(length).zfill(DIGITS).encode(), b"\n",
         str(piece).zfill(DIGITS).encode(), b"\n")
    )  # fmt: skip


def save_checkpoint(directory: Path, step: int, state: dict[str, Any]) -> Path:
    final = checkpoint_path(directory, step)
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        remove_partial_writes(directory)
        with (
            tmp.open("wb") as handle,
            ThreadPoolExecutor(max(1, WRITE_HASH_THREADS), thread_name_prefix="checkpoint-hash") as hasher,
        ):
            writer = HashingWriter(handle, hasher if WRITE_HASH_THREADS else None, PIECE_BYTES)
            try:
                torch.save(state, writer)
            except RuntimeError:
                if writer.error is None:
                    raise
                raise writer.error from None  # a full disk, say: the write's own error
            handle.write(seal_of(writer.hexdigest(), writer.length, writer.piece))
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

    def __init__(
        self,
        staging: HostStaging,
        background: bool = True,
        save: Callable[[Path, int, Any], Path] | None = None,
    ):
        # save: how a staged copy is written (a writer process's); save_checkpoint here by default
        self.staging, self.background, self.save = staging, background, save
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
            # the live state (no room for a copy) is this process's to write
            save = save_checkpoint if unstaged else self.save
            self._write(directory, step, host, 0.0, unstaged, waited, save)
            self.outcome.paused_s = time.perf_counter() - began
            return
        paused = time.perf_counter() - began
        # Not a daemon: an interpreter leaving by any path waits for the write rather than cut it.
        self.thread = threading.Thread(
            target=self._write, args=(directory, step, host, paused, None, waited), name="checkpoint-writer"
        )
        self.thread.start()

    def _write(self, directory: Path, step: int, state: Any, paused: float, unstaged: str | None = None,
               waited: tuple[float, int | None] = (0.0, None), save: Callable | None = None):  # fmt: skip
        began = time.perf_counter()
        try:
            path = (save or self.save or save_checkpoint)(directory, step, state)
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
    gigabytes at a real shape), and a pruned one whose removal a killed trainer did not finish: the
    output's lock lets one trainer write here, so any such file is another, dead process's."""
    for leftover in [*directory.glob(".step_*.tmp"), *directory.glob(f".step_*{PRUNED_SUFFIX}")]:
        leftover.unlink(missing_ok=True)


def fsync_directory(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


PRUNED_SUFFIX = ".removed"
"""A pruned checkpoint's name until its file is freed (`.step_00000008.pt.removed`): no checkpoint."""


def prune_checkpoints(directory: Path, keep: int, protected: set[int]) -> list[int]:
    """Remove all but the newest `keep` checkpoints and the `protected` steps (0: keep all); a file
    that a reader holds (its shared lock) stays until a later call. Returns the steps removed.

    The caller waits only for each file's rename to a name that is no checkpoint's: freeing the
    blocks of a 12 GB file (its unlink) goes on in the background (free_in_background)."""
    found = list_checkpoints(directory)
    if keep < 1 or len(found) <= keep:
        return []
    removed, renamed = [], []
    for step, path in found[:-keep]:
        if step in protected:
            continue
        pruned = directory / f".{path.name}{PRUNED_SUFFIX}"
        try:
            with path.open("rb") as handle:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.replace(path, pruned)
        except (BlockingIOError, FileNotFoundError):
            continue  # being read now, or gone already
        removed.append(step)
        renamed.append(pruned)
    if removed:
        fsync_directory(directory)
        free_in_background(renamed)
    return removed


_FREEING: list[threading.Thread] = []


def free_in_background(paths: list[Path]) -> None:
    """Unlink pruned checkpoints on a thread of their own. Not a daemon: a trainer that exits waits
    for it. One that is killed first leaves the files under their pruned names, which the next
    checkpoint's write removes (remove_partial_writes); a lost unlink leaves no checkpoint behind."""
    thread = threading.Thread(target=_unlink_all, args=(paths,), name="checkpoint-freeing")
    _FREEING[:] = [t for t in _FREEING if t.is_alive()] + [thread]
    thread.start()


def _unlink_all(paths: list[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def wait_for_freeing() -> None:
    """Wait for the unlinks prune_checkpoints started (tests, and what needs the space now)."""
    for thread in list(_FREEING):
        thread.join()


def read_checkpoint_bytes(path: Path) -> bytes:
    """The whole file as it is on disk (header and payload), unverified; read under a shared lock,
    so that `prune_checkpoints` leaves it alone meanwhile."""
    try:
        with path.open("rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
            return handle.read()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc}") from None


@dataclass(frozen=True)
class Seal:
    """What a checkpoint file says of its payload: the digest, the length, where it starts, and
    the piece size it was hashed in (0: format 1, one SHA-256 stream)."""

    digest: str
    length: int
    start: int
    piece: int


def read_seal(head: bytes, tail: bytes, size: int, origin: object) -> Seal:
    """The seal of a checkpoint file of `size` bytes, from its first and last SEAL_BYTES bytes (or
    all of it, if shorter): format 2's at the end, or format 1's header at the start."""
    if head.startswith(LEGACY_MAGIC):
        fields = head[len(LEGACY_MAGIC) : LEGACY_HEADER_BYTES].split(b"\n", 2)
        # the payload after the length's line (early files did not pad the length)
        start, piece = len(LEGACY_MAGIC) + sum(len(field) + 1 for field in fields[:2]), 0
    else:
        at = tail.rfind(SEAL_MAGIC)
        if at < 0:
            raise CheckpointError(
                f"checkpoint {origin} has no seal at its end: it is truncated, or not a checkpoint "
                "this trainer wrote"
            )
        if len(tail) - at != SEAL_BYTES:
            raise CheckpointError(f"checkpoint {origin} is truncated (its seal is cut short)")
        fields, start, piece = tail[at + len(SEAL_MAGIC) :].split(b"\n"), 0, None
    try:
        digest = fields[0].decode()
        length = int(fields[1])
        piece = int(fields[2]) if piece is None else piece
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or length < 0 or piece < (0 if start else 1):
            raise ValueError
    except (ValueError, IndexError, UnicodeDecodeError):
        raise CheckpointError(f"checkpoint {origin} has a damaged seal") from None
    found = size - start - (0 if start else SEAL_BYTES)
    if found != length:
        raise CheckpointError(f"checkpoint {origin} is truncated ({found} of {length} payload bytes)")
    return Seal(digest, length, start, piece)


def seal_in(raw: bytes, origin: object) -> Seal:
    return read_seal(raw[:SEAL_BYTES], raw[-SEAL_BYTES:], len(raw), origin)


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
    `digest`: the payload digest it must have (the seal's is checked against the payload anyway)."""
    return verified_checkpoint(raw, origin, digest)[1]


def verified_checkpoint(raw: bytes, origin: object, digest: str | None = None) -> tuple[str, dict[str, Any]]:
    """(the payload's digest, the state): the whole file's bytes verified, then unpacked; the state
    is handed over only once the digest matches."""
    seal = seal_in(raw, origin)
    expect_digest(seal, digest, origin)
    payload = memoryview(raw)[seal.start : seal.start + seal.length]
    if seal.piece == 0:
        return seal.digest, legacy_unpacked(payload, seal.digest, origin)
    found = pieces_digest(seal.length, seal.piece, lambda at, size: payload[at : at + size], hash_threads())
    if found != seal.digest:
        raise corrupt(origin)
    with ViewReader(payload) as reader:
        return seal.digest, torch.load(reader, map_location="cpu", weights_only=True)


def expect_digest(seal: Seal, digest: str | None, origin: object) -> None:
    if digest is not None and seal.digest != digest:
        raise CheckpointError(
            f"checkpoint {origin} is another checkpoint (digest {seal.digest}, expected {digest})"
        )


def legacy_unpacked(payload: memoryview, digest: str, origin: object) -> dict[str, Any]:
    """A format 1 payload's state: its one SHA-256 stream computed on a thread of its own while it
    is unpacked (unpacking damaged bytes is safe: weights_only, tensors and plain values, no code),
    what they gave dropped unless the hash matches."""
    with ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash") as hashing:
        hashed = hashing.submit(lambda: hashlib.sha256(payload).hexdigest())
        try:
            with ViewReader(payload) as reader:
                state = torch.load(reader, map_location="cpu", weights_only=True)
        except Exception:
            if hashed.result() != digest:
                raise corrupt(origin) from None
            raise
        if hashed.result() != digest:
            del state
            raise corrupt(origin)
    return state


@dataclass
class Loaded:
    """A checkpoint file read and verified: its digest, its state, and what that cost."""

    digest: str
    state: dict[str, Any]
    size: int
    verify_s: float  # format 2: read and hashed on `threads` threads; format 1: read
    unpack_s: float  # format 2: mapped; format 1: hashed beside the unpacking
    threads: int = 1
    legacy: bool = False

    def cost(self) -> str:
        size = f"{self.size / 2**30:.2f} GiB"
        if self.legacy:
            return (
                f"{size} read from disk in {self.verify_s:.1f} s, checksummed and unpacked side by side "
                f"in {self.unpack_s:.1f} s (format 1)"
            )
        return (
            f"{size} read and checksummed in {self.verify_s:.1f} s on {self.threads} threads, mapped "
            f"in {self.unpack_s:.1f} s"
        )


def read_verified(path: Path, digest: str | None = None) -> Loaded:
    """A checkpoint file's state, verified, read under a shared lock (prune_checkpoints leaves the
    file alone meanwhile). Format 2: the pieces read and hashed on several threads, then the payload
    mapped (torch.load's mmap: the tensors are the file's pages, which the hashing just read, not
    copies of them). `digest`: the payload digest it must have."""
    try:
        with path.open("rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
            began = time.perf_counter()
            descriptor, size = handle.fileno(), os.fstat(handle.fileno()).st_size
            seal = read_seal(*ends_of(descriptor, size), size, path)
            expect_digest(seal, digest, path)
            if seal.piece == 0:
                raw = handle.read()
                read = time.perf_counter()
                _, state = verified_checkpoint(raw, path)
                return Loaded(seal.digest, state, size, read - began, time.perf_counter() - read, legacy=True)
            threads = hash_threads()
            found = pieces_digest(
                seal.length, seal.piece, lambda at, count: read_exactly(descriptor, at, count, path), threads
            )
            if found != seal.digest:
                raise corrupt(path)
            hashed = time.perf_counter()
            # Through the open descriptor, not the name: the file hashed is the file mapped, even
            # where a checkpoint of the same step replaced it meanwhile (a run resumed before it).
            mapped = f"/proc/self/fd/{descriptor}"
            state = torch.load(mapped, mmap=True, map_location="cpu", weights_only=True)
            return Loaded(seal.digest, state, size, hashed - began, time.perf_counter() - hashed, threads)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc}") from None


def ends_of(descriptor: int, size: int) -> tuple[bytes, bytes]:
    """A file's first and last SEAL_BYTES bytes (where a seal or a format 1 header is)."""
    return os.pread(descriptor, SEAL_BYTES, 0), os.pread(descriptor, SEAL_BYTES, max(0, size - SEAL_BYTES))


def read_exactly(descriptor: int, offset: int, count: int, path: Path) -> bytes:
    data = os.pread(descriptor, count, offset)
    if len(data) != count:  # the file shrank since its seal was read: not a file this trainer changes
        raise CheckpointError(f"checkpoint {path} is truncated (it changed while it was read)")
    return data


def load_checkpoint(path: Path) -> dict[str, Any]:
    return read_verified(path).state


def recorded_digest(path: Path) -> str | None:
    """The payload digest a checkpoint file's seal names (the seal alone is read, not verified
    against the payload), or None where the file is missing or has no seal."""
    try:
        with path.open("rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            return read_seal(*ends_of(handle.fileno(), size), size, path).digest
    except (OSError, CheckpointError):
        return None
