"""Atomic, verified checkpoints.

File layout: a magic line, the SHA-256 of the payload, its length, then the payload (torch.save of
a dict). Written to a temporary file in the same directory, fsync'ed, then os.replace'd into place
and the directory fsync'ed: a kill -9 at any moment leaves either no new checkpoint or a complete
one. Loading verifies the magic, the length and the checksum before unpickling (weights_only).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path
from typing import Any

import torch

MAGIC = b"DFLASH-CKPT 1\n"
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


def save_checkpoint(directory: Path, step: int, state: dict[str, Any]) -> Path:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    header = MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + str(len(payload)).encode() + b"\n"
    final = checkpoint_path(directory, step)
    tmp = directory / f".{final.name}.{os.getpid()}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as handle:
            handle.write(header)
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        tmp.unlink(missing_ok=True)  # never leave a partial file
        raise CheckpointWriteError(directory, step, exc) from None
    return final


def read_checkpoint_bytes(path: Path) -> bytes:
    """The whole file as it is on disk (header and payload), unverified."""
    try:
        return path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: {exc}") from None


def split_checkpoint(raw: bytes, origin: object) -> tuple[str, bytes]:
    """(the SHA-256 hex digest the header names, the payload), both verified: magic, length, checksum."""
    if not raw.startswith(MAGIC):
        raise CheckpointError(f"checkpoint {origin} is not a trainer checkpoint (bad header)")
    try:
        digest, length, payload = raw[len(MAGIC) :].split(b"\n", 2)
        expected_length = int(length)
    except ValueError:
        raise CheckpointError(f"checkpoint {origin} has a damaged header") from None
    if len(payload) != expected_length:
        raise CheckpointError(
            f"checkpoint {origin} is truncated ({len(payload)} of {expected_length} payload bytes)"
        )
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CheckpointError(f"checkpoint {origin} fails its checksum (corrupt)")
    return digest.decode(), payload


def checkpoint_from_bytes(raw: bytes, origin: object, digest: str | None = None) -> dict[str, Any]:
    """The state in a checkpoint's bytes (read from a file or received from another rank), verified;
    `digest`: the payload SHA-256 it must have (the header's is checked against the payload anyway)."""
    found, payload = split_checkpoint(raw, origin)
    if digest is not None and found != digest:
        raise CheckpointError(
            f"checkpoint {origin} is another checkpoint (SHA-256 {found}, expected {digest})"
        )
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)


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
