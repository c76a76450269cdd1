"""The token store: tokenized conversations on disk as memory-mapped arrays, built once per source.

A store is a directory of three flat arrays and a manifest:

    tokens.bin    int32  every conversation's token ids, one after the other
    mask.bin      uint8  the loss mask of each token (1: supervised, the assistant's own tokens)
    offsets.bin   int64  conversation i is [offsets[i], offsets[i + 1]) of the two arrays above
    manifest.json format version, the source key, the counts, and a checksum of the three files

It is built once (in a temporary directory beside it, every file fsynced, then renamed into place,
under a lock so the processes of one host build it once) and then opened read-only with np.memmap
by every worker and rank: the pages are the kernel's page cache, shared, and a run's memory does
not grow with the data set. A store whose manifest is missing or unreadable, of an older format,
or whose files do not match its checksum is rebuilt, never half read.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .chat import ChatFormat, DataError, DiskFull, Example

STORE_FORMAT = 1
ARRAYS = {"tokens": np.int32, "mask": np.uint8, "offsets": np.int64}
CHUNK = 1 << 22  # bytes per read while checksumming


def store_key(source_key: str, chat: ChatFormat) -> str:
    """The store's name: the source (the regenerated data's key) and how turns become ids."""
    framing = [chat.start, chat.end, chat.newline, chat.header("assistant"), chat.header("user")]
    text = f"{STORE_FORMAT}|{source_key}|{framing}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


@dataclass
class TokenStore:
    """An opened store: read-only memory maps of the arrays, and the manifest's counts."""

    path: Path
    tokens: np.ndarray
    mask: np.ndarray
    offsets: np.ndarray
    manifest: dict

    @property
    def conversations(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def conversation(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        return self.tokens[start:end], self.mask[start:end]


def _checksum(directory: Path) -> str:
    return _scan(directory)["sha256"]


def _scan(directory: Path) -> dict:
    """What the arrays hold, read once: their checksum, the supervised tokens (the mask's ones),
    and from the offsets the conversations, tokens and the longest; `offsets_ok` is False where the
    offsets do not start at 0 and rise to the end of the token array."""
    digest = hashlib.sha256()
    supervised = 0
    for name in ARRAYS:
        with (directory / f"{name}.bin").open("rb") as handle:
            while block := handle.read(CHUNK):
                digest.update(block)
                if name == "mask":
                    supervised += int(np.count_nonzero(np.frombuffer(block, dtype=np.uint8)))
    offsets = np.fromfile(directory / "offsets.bin", dtype=np.int64)
    lengths = np.diff(offsets)
    tokens = (directory / "tokens.bin").stat().st_size // 4
    return {
        "sha256": digest.hexdigest(),
        "supervised_tokens": supervised,
        "conversations": len(offsets) - 1,
        "tokens": int(offsets[-1]) if len(offsets) else 0,
        "longest": int(lengths.max()) if len(lengths) else 0,
        "offsets_ok": bool(
            len(offsets) and offsets[0] == 0 and offsets[-1] == tokens and (lengths >= 0).all()
        ),
    }


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BuildStopped(Exception):
    """A stop came while the store was being built: nothing of it is kept."""


@dataclass
class BuildWatch:
    """What a long build reports and obeys: a progress line every `every_s` seconds (with an ETA
    when the number of conversations is known), and a stop checked between conversations."""

    log: Callable[[str], None]
    total: int | None = None
    should_stop: Callable[[], bool] = lambda: False
    every_s: float = 30.0

    def __post_init__(self):
        self.started = self.last = time.monotonic()

    def tick(self, done: int, tokens: int) -> None:
        if done % 256:
            return
        if self.should_stop():
            raise BuildStopped
        if time.monotonic() - self.last < self.every_s:
            return
        self.last = time.monotonic()
        rate = done / max(self.last - self.started, 1e-9)
        of = f"/{self.total:,}" if self.total else ""
        eta = f", eta {datetime.timedelta(seconds=round((self.total - done) / rate))}" if self.total else ""
        self.log(f"data: token store: {done:,}{of} conversations, {tokens:,} tokens, {rate:,.0f} conv/s{eta}")


def write_store(
    directory: Path,
    examples: Iterable[Example],
    chat: ChatFormat,
    source_key: str,
    watch: BuildWatch | None = None,
) -> dict:
    """Stream `examples` into the arrays of a new store at `directory` (which must not exist);
    memory holds one conversation and the offsets (8 bytes per conversation)."""
    directory.mkdir(parents=True)
    offsets = [0]
    supervised = 0
    with (directory / "tokens.bin").open("wb") as tokens, (directory / "mask.bin").open("wb") as mask:
        for example in examples:
            ids, loss_mask = chat.encode(example.turns)
            tokens.write(np.asarray(ids, dtype=np.int32).tobytes())
            mask.write(np.asarray(loss_mask, dtype=np.uint8).tobytes())
            offsets.append(offsets[-1] + len(ids))
            supervised += sum(loss_mask)
            if watch is not None:
                watch.tick(len(offsets) - 1, offsets[-1])
    np.asarray(offsets, dtype=np.int64).tofile(directory / "offsets.bin")
    if len(offsets) == 1:
        raise DataError("the data set has no conversation to train on")
    if watch is not None and watch.total is not None and len(offsets) - 1 != watch.total:
        # A source read short is never stored: the store would outlive the source's repair.
        given = len(offsets) - 1
        raise DataError(f"the data gave {given:,} conversations of {watch.total:,}; nothing is stored")
    lengths = np.diff(np.asarray(offsets))
    manifest = {
        "format": STORE_FORMAT,
        "source_key": source_key,
        "conversations": len(offsets) - 1,
        "tokens": offsets[-1],
        "supervised_tokens": supervised,
        "longest": int(lengths.max()),
        "sha256": _checksum(directory),
    }
    for name in ARRAYS:
        _fsync_file(directory / f"{name}.bin")
    manifest_path = directory / "manifest.json"
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    _fsync_file(manifest_path)
    return manifest


def store_built(root: Path, source_key: str, chat: ChatFormat) -> bool:
    """Whether the store of `source_key` looks built (its manifest is there): then opening it reads
    none of its source. Cheap; open_or_build checks it whole."""
    return (root / store_key(source_key, chat) / "manifest.json").is_file()


def check_store(directory: Path, verify: bool = True, total: int | None = None) -> tuple[dict | None, str]:
    """(manifest, "") for a complete store of this format (of `total` conversations, when given: a
    store built from a source read short is never used once the source is whole); (None, why)
    otherwise."""
    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except FileNotFoundError:
        return None, "it has no manifest (an interrupted build)"
    except (OSError, ValueError) as exc:
        return None, f"its manifest is unreadable ({exc})"
    if not isinstance(manifest, dict) or manifest.get("format") != STORE_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        return None, f"it has format {found!r}, this trainer reads format {STORE_FORMAT}"
    try:
        sizes = {name: (directory / f"{name}.bin").stat().st_size for name in ARRAYS}
    except OSError as exc:
        return None, f"a file is missing ({exc.filename})"
    if not all(isinstance(manifest.get(name), int) for name in ("tokens", "conversations")):
        return None, "its manifest has no counts of tokens and conversations"
    expected = {
        "tokens": manifest["tokens"] * 4,
        "mask": manifest["tokens"],
        "offsets": (manifest["conversations"] + 1) * 8,
    }
    if sizes != expected:
        return None, f"its files have sizes {sizes}, the manifest says {expected}"
    if total is not None and manifest["conversations"] != total:
        return None, f"it holds {manifest['conversations']:,} conversations, the data has {total:,}"
    if not verify:
        return manifest, ""
    found = _scan(directory)
    if found["sha256"] != manifest["sha256"]:
        return None, "its files do not match the manifest's checksum (damaged on disk)"
    if not found["offsets_ok"]:
        return None, "its offsets do not cover its tokens (damaged on disk)"
    wrong = [f"{name} {manifest.get(name)!r}, the arrays hold {found[name]}"
             for name in ("conversations", "tokens", "supervised_tokens", "longest")
             if manifest.get(name) != found[name]]  # fmt: skip
    if wrong:
        return None, f"its manifest does not match its arrays ({'; '.join(wrong)})"
    return manifest, ""


def open_store(directory: Path, manifest: dict) -> TokenStore:
    arrays = {
        name: np.memmap(directory / f"{name}.bin", dtype=dtype, mode="r") for name, dtype in ARRAYS.items()
    }
    return TokenStore(directory, arrays["tokens"], arrays["mask"], arrays["offsets"], manifest)


def open_or_build(
    root: Path,
    source_key: str,
    chat: ChatFormat,
    examples: Callable[[], Iterable[Example]],
    log: Callable[[str], None] = print,
    total: int | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> TokenStore:
    """The store of `source_key` under `root`: opened if complete and intact, else (re)built from
    `examples()` first (`total` of them, when known: the progress lines give an ETA). One process
    of a host builds; the others wait on the lock, then open it. A stop during the build
    (should_stop, checked every few seconds) raises BuildStopped and leaves nothing behind."""
    try:
        return _open_or_build(root, source_key, chat, examples, BuildWatch(log, total, should_stop))
    except OSError as exc:  # unwritable, full disk, ...: nothing half-built is left behind
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(
                f"disk full writing the token store under {root} ({exc.strerror or exc}); free space "
                "there or set data.cache_dir to a directory with room for the tokenized data"
            ) from None
        raise DataError(
            f"cannot build the token store under {root} ({exc.strerror or exc}); free space there or "
            "set data.cache_dir to a writable directory with room for the tokenized data"
        ) from None


def _open_or_build(root, source_key, chat, examples, watch: BuildWatch) -> TokenStore:
    log = watch.log
    root.mkdir(parents=True, exist_ok=True)
    key = store_key(source_key, chat)
    directory = root / key
    with (root / f"{key}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (also if this process dies)
        if directory.exists():
            manifest, why = check_store(directory, total=watch.total)
            if manifest is not None:
                return open_store(directory, manifest)
            log(f"data: token store {directory} cannot be used: {why}; rebuilding it")
            shutil.rmtree(directory)  # derived data: the source rebuilds it
        for stale in root.glob(f".{key}.building.*"):  # left by a build that was killed
            shutil.rmtree(stale, ignore_errors=True)
        started = time.monotonic()
        building = root / f".{key}.building.{os.getpid()}"
        try:
            manifest = write_store(building, examples(), chat, source_key, watch)
            os.rename(building, directory)
            _fsync_file(root)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        log(
            f"data: token store built in {time.monotonic() - started:.1f}s: {manifest['conversations']} "
            f"conversations, {manifest['tokens']} tokens, at {directory}"
        )
        return open_store(directory, manifest)
