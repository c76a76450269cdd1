# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The controller's run ledger: a JSON-lines file, one record per launch keyed by run_id, written
atomically (temporary file, rename) under an exclusive lock. Used by the actions run_ledger and
trainer_record, which run on the controller."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile


class LedgerError(Exception):
    """The ledger could not be written; the message says where and why, and what still holds the run."""


def merge(lines: list[str], record: dict, update: bool = False) -> tuple[list[str], bool]:
    """Replace the line of record's run_id (or append it); report whether anything changed.
    With update, only the record's keys change in that line (and nothing is appended)."""
    encoded = json.dumps(record, sort_keys=True)
    out, found, changed = [], False, False
    for line in lines:
        try:
            existing = json.loads(line)
        except ValueError:
            out.append(line)  # never drop a line we cannot read
            continue
        if isinstance(existing, dict) and existing.get("run_id") == record["run_id"]:
            found = True
            merged = {**existing, **record} if update else record
            changed = changed or existing != merged
            out.append(json.dumps(merged, sort_keys=True) if update else encoded)
        else:
            out.append(line)
    if not found and not update:
        out.append(encoded)
        changed = True
    return out, changed


def plain(record: dict) -> dict:
    """The record as JSON will hold it (templated values and dates become plain types)."""
    return json.loads(json.dumps(record, default=str))


def write(path: str, record: dict, check_mode: bool = False, update: bool = False) -> bool:
    """Merge record into the ledger at path (with update: only its keys, into an existing line);
    return whether the ledger changed (or would, in check mode). Raises LedgerError, naming the
    file and the reason, where it cannot be read or written."""
    try:
        return _write(path, record, check_mode, update)
    except OSError as exc:
        what = exc.strerror or str(exc)
        raise LedgerError(
            f"cannot write the run ledger {path}: {what} ({exc.filename or path}); the run itself is "
            "recorded on the target (<out>/run.json), status.yml and stop.yml find it there"
        ) from None


def _write(path: str, record: dict, check_mode: bool, update: bool) -> bool:
    os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
    with open(path + ".lock", "a", encoding="utf-8") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with open(path, encoding="utf-8") as handle:
                lines = [line.rstrip("\n") for line in handle if line.strip()]
        except FileNotFoundError:
            lines = []
        merged, changed = merge(lines, record, update)
        if changed and not check_mode:
            handle_fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".runs-")
            try:
                with os.fdopen(handle_fd, "w", encoding="utf-8") as out:
                    out.write("\n".join(merged) + "\n")
            except OSError:
                os.unlink(temporary)  # a full disk leaves no partial ledger behind
                raise
            os.chmod(temporary, 0o640)
            os.replace(temporary, path)
    return changed
