"""The run's truth on the target: the output lock and the run record (no torch, standard library only).

One trainer per output directory, provably: starting a run takes an exclusive ``flock`` on
``<parent>/.<name>.lock``, a sibling of the output directory ``<parent>/<name>`` (a sibling, so
that moving the output aside for a fresh start happens under the same lock). The lock's file
description is inherited across ``exec``, so it is held exactly as long as the process that took
it lives: ``python -m trainer.launch`` execs the trainer or torchrun, which keeps it. A second start
on the same output fails at once, naming the PID that holds it (the lock file holds that PID; the
kernel's ``/proc/locks`` tells whether the lock is held without taking it).

The run record is ``<out>/run.json``, written atomically (temporary file, fsync, rename) by
``trainer.launch`` before it execs, so it exists before anything is reported to the controller:

    {"format": 1, "run": "nographs", "run_id": "nographs-20261130T101500Z-4242", "pid": 4242,
     "start_time": 123456, "boot_id": "...", "host": "ct200", "out": "...", "log": "...",
     "started_at": "2026-11-30T10:15:00Z", "steps": 300, "resume": false, "cmdline": [...],
     "state": "running", "restarts": [], "metrics_from": 0}

``metrics_from`` is the size of ``<out>/metrics.jsonl`` when this start began: the rows after it
are this start's (a resume appends to the run's file).

The process that ends the run adds ``state`` (finished, stopped, failed: bad input, crashed),
``exit_status``, ``exit_reason``, ``ended_at``, ``last_step`` and ``last_checkpoint``. A record
still saying ``running`` whose PID is gone (or is another process) was killed. ``pid`` is always the
process that holds the lock (the one to signal); a process that supervises restarts may be that PID
and append to ``restarts`` with :func:`update_record`.

The Ansible modules read the same format through ``dflash.ct200.plugins.module_utils.run_record``,
an identical copy of this file (modules run on the target without the trainer package, and a
collection cannot link outside itself); tests/trainer/test_runrecord.py keeps the two identical.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import sys
import time
from pathlib import Path

RECORD_NAME = "run.json"
RECORD_FORMAT = 1
CHECKPOINT_NAME_RE = re.compile(r"^step_(\d{8})\.pt$")
# The environment variable through which a starter hands its locked file descriptor to
# trainer.launch (it then keeps that lock instead of taking its own).
LOCK_FD_ENV = "DFLASH_OUT_LOCK_FD"


class OutputBusy(Exception):
    """Another live process holds the output's lock."""

    def __init__(self, out: Path, pid: int | None, record: dict | None):
        self.out, self.pid, self.record = out, pid, record
        who = f"PID {pid}" if pid else "another process"
        what = ""
        if record and record.get("pid") == pid:
            what = f" (run {record.get('run')}, {record.get('run_id')}, started {record.get('started_at')})"
        super().__init__(
            f"output {out} is in use by {who}{what}: one trainer per output. Stop that run first "
            "(./dev.sh stop), or watch it (./dev.sh status)"
        )


def lock_path(out: Path | str) -> Path:
    out = Path(out)
    return out.parent / f".{out.name}.lock"


def record_path(out: Path | str) -> Path:
    return Path(out) / RECORD_NAME


def boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
        return handle.read().strip()


def proc_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot), or None where the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_record(out: Path | str) -> dict | None:
    """The run record of an output, or None where there is none (or it cannot be parsed: a record
    is only ever replaced whole, so an unreadable one was not written by us)."""
    try:
        data = json.loads(record_path(out).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# The documented states of a run (docs/OPERATING.md, "End states and exit statuses"): the only ones
# a record, the ledger or a view may hold.
RUN_STATES = ("running", "finished", "stopped", "failed", "crashed")
# The type of each field a record may hold; null is allowed where the field is not known.
FIELD_TYPES = {
    "format": int, "run": str, "run_id": str, "pid": int, "start_time": int, "boot_id": str,
    "host": str, "out": str, "log": str, "started_at": str, "steps": int, "topology": str,
    "resume": bool, "cmdline": list, "state": str, "restarts": list, "stretches": list,
    "exit_status": int, "exit_reason": str, "ended_at": str, "last_step": int,
    "last_checkpoint": str, "stage": str, "regen": dict, "metrics_from": int,
}  # fmt: skip
REQUIRED_FIELDS = ("run_id", "pid", "state")


def record_problems(record: dict) -> dict[str, str]:
    """The damaged fields of a run record, each with what is wrong in words (`state: 5 is not a
    documented state`); empty for a sound record. A field of the wrong type makes the whole record
    untrustworthy: its readers would take a dead run for a live one or the other way round."""
    problems = {}
    for key, kind in FIELD_TYPES.items():
        value = record.get(key)
        if value is None:
            if key in REQUIRED_FIELDS and key in record:
                problems[key] = f"{key}: null"
            continue
        wrong = not isinstance(value, kind) or (kind is int and isinstance(value, bool))
        if wrong or (key == "pid" and value <= 0):
            problems[key] = f"{key}: {value!r} is not {'a' if kind is not int else 'an'} {kind.__name__}"
    state = record.get("state")
    if "state" not in problems and state is not None and state not in RUN_STATES:
        problems["state"] = f"state: {state!r} is not one of {', '.join(RUN_STATES)}"
    return problems


def sound_fields(record: dict) -> dict:
    """The fields of a record that are not damaged (record_problems), to keep in its repair."""
    damaged = record_problems(record)
    return {key: value for key, value in record.items() if key not in damaged}


_SAID_REPAIRED: set[str] = set()


def own_record(out: Path | str, owners: tuple[int, ...]) -> dict | None:
    """The record of the run whose recorded PID is one of `owners` (this process, or its parent),
    or None where the record is another run's or there is none. A damaged record (wrong types,
    record_problems) is rebuilt whole from what this process knows where the output's lock holder
    is one of `owners`: the lock holder's PID and start time, the boot, the run id in this
    process's environment, and every sound field. Said once on stderr (the run's log)."""
    record = read_record(out)
    if record is None:
        return None
    problems = record_problems(record)
    if not problems:
        return record if record.get("pid") in owners else None
    holder = lock_holder(out)
    if not holder or holder not in owners:
        return None
    repaired = sound_fields(record)
    run_id = repaired.get("run_id") or os.environ.get("DFLASH_RUN_ID") or new_run_id(Path(out).name, holder)
    repaired.update(
        format=RECORD_FORMAT,
        pid=holder,
        start_time=proc_start_time(holder),
        boot_id=boot_id(),
        out=str(out),
        run=repaired.get("run") or Path(out).name,
        run_id=run_id,
        state=repaired.get("state") or "running",
    )
    if str(out) not in _SAID_REPAIRED:
        _SAID_REPAIRED.add(str(out))
        with contextlib.suppress(OSError):  # the trainer's stderr is its log (a module's is never read)
            sys.stderr.write(
                f"run record: {record_path(out)} was damaged ({'; '.join(problems.values())}); "
                "rewritten whole from what this process knows\n"
            )
            sys.stderr.flush()
    return repaired


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


RESERVE_NAME = ".run.json.reserve"
RESERVE_BYTES = 256 * 1024
"""Disk space kept for the record's last words: a run that fills its disk still records how it ended."""


def reserve_space(out: Path | str) -> None:
    """Keep RESERVE_BYTES of real blocks in <out>/.run.json.reserve (written, not sparse), freed by
    write_record when the disk is full. Best effort: a disk already full reserves nothing."""
    path = Path(out) / RESERVE_NAME
    try:
        with path.open("wb") as handle:
            handle.write(b"\0" * RESERVE_BYTES)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:
        with contextlib.suppress(OSError):
            path.unlink()


def write_record(out: Path | str, record: dict) -> Path:
    """Write the record atomically; on a full disk, free the reserved space and write it again."""
    try:
        return _write_record(out, record)
    except OSError as exc:
        reserve = Path(out) / RESERVE_NAME
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not reserve.exists():
            raise
        reserve.unlink()
        return _write_record(out, record)


def _write_record(out: Path | str, record: dict) -> Path:
    """Write the record atomically: temporary file in the same directory, fsync, rename."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    final = record_path(out)
    tmp = out / f".{RECORD_NAME}.{os.getpid()}.tmp"
    try:
        with tmp.open("w", encoding="utf-8") as handle:
            handle.write(json.dumps(record, indent=1, sort_keys=True) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    _fsync_dir(out)
    return final


def update_record(out: Path | str, run_id: str | None = None, **fields) -> dict | None:
    """Merge fields into the record (of `run_id` when given); None where there is no such record."""
    record = read_record(out)
    if record is None or (run_id is not None and record.get("run_id") != run_id):
        return None
    record.update(fields)
    write_record(out, record)
    return record


def _locks_on(path: Path) -> list[int] | None:
    """PIDs the kernel lists as holding a lock on `path` (/proc/locks), or None where unreadable."""
    try:
        info = path.stat()
        lines = Path("/proc/locks").read_text(encoding="ascii", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    except OSError:
        return None
    key = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    exact, same_inode = [], []
    for line in lines:
        parts = line.split()
        if "->" in parts or len(parts) < 6 or not parts[4].isdigit():
            continue  # a waiter, not a holder
        if parts[5] == key:
            exact.append(int(parts[4]))
        elif parts[5].rsplit(":", 1)[-1] == str(info.st_ino):
            # overlayfs and btrfs subvolumes: stat's device is not the one the kernel lists.
            same_inode.append(int(parts[4]))
    return exact or same_inode


def lock_holder(out: Path | str) -> int | None:
    """The PID holding the output's lock, without taking it; None where nobody holds it. The PID
    written in the lock file wins (the kernel lists the process that took the lock, which may be a
    starter that handed it on through exec or inheritance); 0 where held by an unknown process."""
    path = lock_path(out)
    holders = _locks_on(path)
    if holders is None:
        # No /proc/locks: probe with a shared lock for an instant.
        try:
            with path.open("r") as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except BlockingIOError:
                    holders = [0]
                else:
                    holders = []
        except OSError:
            return None
    if not holders:
        return None
    try:
        written = int(path.read_text(encoding="ascii").strip() or 0)
    except (OSError, ValueError):
        written = 0
    if written and proc_start_time(written) is not None:
        return written
    return next((pid for pid in holders if pid and proc_start_time(pid) is not None), 0)


def acquire_lock(out: Path | str, inherited_fd: int | None = None) -> int:
    """Take the output's exclusive lock (or keep the one a starter handed over in `inherited_fd`);
    write this process's PID into the lock file; return the file descriptor, inheritable, to keep
    open (across exec) for as long as the run lives. Raises OutputBusy, naming the holder."""
    path = lock_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = None
    if inherited_fd is not None:
        try:
            same = os.fstat(inherited_fd).st_ino == path.stat().st_ino
        except OSError:
            same = False
        if same:
            fd = inherited_fd
    if fd is None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    try:
        # A no-op where the description already holds it (handed over by the starter).
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = lock_holder(out)
        raise OutputBusy(Path(out), holder, read_record(out)) from None
    write_lock_pid(fd, os.getpid())
    os.set_inheritable(fd, True)
    return fd


def write_lock_pid(fd: int, pid: int) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{pid}\n".encode(), 0)


def new_run_id(run: str, pid: int) -> str:
    return f"{run}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{pid}"


def move_aside(out: Path | str) -> Path | None:
    """Move an earlier output out of the way (never delete): <out>.<UTC time>[-N]; None where absent."""
    out = Path(out)
    if not out.exists():
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    kept = out.with_name(f"{out.name}.{stamp}")
    suffix = 1
    while kept.exists():
        kept = out.with_name(f"{out.name}.{stamp}-{suffix}")
        suffix += 1
    os.rename(out, kept)
    return kept


def checkpoints(out: Path | str) -> list[tuple[int, Path]]:
    """Complete checkpoint files of an output (step, path), oldest first."""
    directory = Path(out) / "checkpoints"
    try:
        entries = list(directory.iterdir())
    except OSError:
        return []
    found = [(int(m.group(1)), p) for p in entries if (m := CHECKPOINT_NAME_RE.match(p.name)) and p.is_file()]
    return sorted(found)


def tail_lines(path: Path | str, max_bytes: int) -> list[str]:
    """The lines of a file's last max_bytes (the first one may be cut). Raises OSError."""
    with Path(path).open("rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - max_bytes))
        return handle.read().decode("utf-8", "replace").splitlines()


def jsonl_rows(path: Path | str, max_bytes: int | None = None) -> list[dict]:
    """The JSON objects of a JSON-lines file, oldest first; [] where it cannot be read. With
    max_bytes, those of its last max_bytes only. A line being written, or cut by a kill or by
    the tail, is skipped: the rows around it still count."""
    try:
        if max_bytes:
            lines = tail_lines(path, max_bytes)
        else:
            lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def last_metrics(out: Path | str) -> dict:
    """The latest train and eval rows of <out>/metrics.jsonl: {"train": row|None, "eval": row|None}."""
    found: dict = {"train": None, "eval": None}
    for row in reversed(jsonl_rows(Path(out) / "metrics.jsonl", 256 * 1024)):
        kind = row.get("kind")
        if kind in found and found[kind] is None:
            found[kind] = row
    return found


def note(out: Path | str, **fields) -> None:
    """Add fields to the record of the run this process belongs to (the recorded PID is this
    process, or its parent: torchrun for a rank); a record of another run is left alone. Never
    fails the run: the record is a report, the checkpoints are the state. A damaged record is
    rewritten whole (own_record)."""
    record = own_record(out, (os.getpid(), os.getppid()))
    if record is None:
        return
    record.update(fields)
    with contextlib.suppress(OSError):
        write_record(out, record)
