# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action: append or update a run record in the controller's JSON-lines run ledger."""

from __future__ import annotations

import os

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.dflash.ct200.plugins.plugin_utils import ledger


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
        record = ledger.plain(record)
        try:
            changed = ledger.write(path, record, self._task.check_mode, bool(args.get("update", False)))
        except ledger.LedgerError as exc:
            raise AnsibleActionFail(str(exc)) from None
        result.update(changed=changed, record=record, path=path)
        return result
