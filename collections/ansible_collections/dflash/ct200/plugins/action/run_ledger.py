"""Action: append or update a run record in the controller's JSON-lines run ledger."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase


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


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self._task.args
        path = args.get("path")
        record = args.get("record")
        if not path or not isinstance(record, dict) or not record.get("run_id"):
            raise AnsibleActionFail("run_ledger needs path and a record with run_id")
        path = os.path.abspath(os.path.expanduser(str(path)))
        record = json.loads(json.dumps(record, default=str))
        try:
            changed = self._write(path, record, bool(args.get("update", False)))
        except OSError as exc:
            what = exc.strerror or str(exc)
            raise AnsibleActionFail(
                f"cannot write the run ledger {path}: {what} ({exc.filename or path}); the run itself is "
                "recorded on the target (<out>/run.json), status.yml and stop.yml find it there"
            ) from None
        result.update(changed=changed, record=record, path=path)
        return result

    def _write(self, path: str, record: dict, update: bool = False) -> bool:
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
        with open(path + ".lock", "a", encoding="utf-8") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                with open(path, encoding="utf-8") as handle:
                    lines = [line.rstrip("\n") for line in handle if line.strip()]
            except FileNotFoundError:
                lines = []
            merged, changed = merge(lines, record, update)
            if changed and not self._task.check_mode:
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
