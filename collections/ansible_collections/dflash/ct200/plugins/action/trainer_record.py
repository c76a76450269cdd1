# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action: keep a trainer record on the controller, in one call: the cached host facts trainer_run
and trainer_pid, and the record's line in the run ledger."""

from __future__ import annotations

import os
import tempfile

from ansible import constants as C
from ansible.errors import AnsibleActionFail, AnsibleError
from ansible.plugins.action import ActionBase
from ansible_collections.dflash.ct200.plugins.plugin_utils import ledger

ARGUMENT_SPEC = {
    "record": {"type": "dict", "required": True},
    "update": {"type": "dict", "default": {}},
    "ledger": {"type": "path", "required": True},
    "fail_on_ledger_error": {"type": "bool", "default": True},
}


def facts_of(record: dict) -> dict:
    """The host facts that hold the record (the names docs/ARCHITECTURE.md gives them)."""
    return {"trainer_run": record, "trainer_pid": record.get("pid")}


def fact_cache_problem() -> str | None:
    """One line saying why the controller's fact cache cannot keep the record, or None where it can.
    Ansible only warns when it cannot write a fact, so a repair would otherwise be said as done."""
    from ansible.plugins.loader import cache_loader

    try:
        plugin = cache_loader.get(C.CACHE_PLUGIN)
    except AnsibleError as exc:
        return f"the controller's fact cache cannot be used ({exc.message.rstrip('.')})"
    directory = getattr(plugin, "_cache_dir", None)
    if not directory:
        return None  # a cache that keeps nothing on disk (memory)
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as exc:
        return f"the controller's fact cache {directory} cannot be written ({exc.strerror})"
    return None


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _requires_connection = False

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = self.validate_argument_spec(argument_spec=ARGUMENT_SPEC)[1]
        record = ledger.plain({**args["record"], **args["update"]})
        if not record.get("run_id"):
            raise AnsibleActionFail(
                "trainer_record needs a record with run_id (the record trainer_start returned, or the "
                f"target's <out>/run.json); got the fields {sorted(record) or 'none'}"
            )
        path = os.path.abspath(os.path.expanduser(args["ledger"]))
        # Facts are stored by the strategy from a successful result only (set_fact with cacheable=true
        # stores them the same way): a failed call leaves the cache as it was.
        result.update(
            record=record,
            path=path,
            ledger_error=None,
            cache_error=fact_cache_problem(),
            ansible_facts=facts_of(record),
            _ansible_facts_cacheable=True,
        )
        try:
            result["changed"] = ledger.write(path, record, self._task.check_mode)
        except ledger.LedgerError as exc:
            result.update(changed=False, ledger_error=str(exc))
            if args["fail_on_ledger_error"]:
                result.update(failed=True, msg=str(exc))
        return result
