# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Action: show a run's log, and with follow=true keep showing new lines until the trainer exits.

A module cannot stream its output, so following is a loop of bounded module runs here on the
controller: each one reads the lines written since the last offset (waiting a few seconds for them
on the target), and the lines are displayed as soon as each run returns. It works over any
connection (local, ssh, proxmox_pct_remote): only the module runs on the target.
"""

from __future__ import annotations

import time

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

MODULE_OPTIONS = ("path", "lines", "max_bytes", "pid", "start_time", "boot_id", "run", "events", "recorded")


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset((*MODULE_OPTIONS, "follow", "poll_s", "max_s", "prefix"))

    def show(self, lines: list[str], prefix: str) -> None:
        for line in lines:
            display.display(f"{prefix}{line}")

    def read(self, task_vars: dict, **options) -> dict:
        result = self._execute_module(
            module_name="dflash.ct200.run_log", module_args=options, task_vars=task_vars
        )
        if result.get("failed"):
            raise AnsibleActionFail(result.get("msg", "run_log failed"))
        return result

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        args = dict(self._task.args)
        follow = bool(args.pop("follow", False))
        poll_s = float(args.pop("poll_s", 5))
        max_s = float(args.pop("max_s", 7 * 24 * 3600))
        prefix = str(args.pop("prefix", ""))
        options = {key: value for key, value in args.items() if key in MODULE_OPTIONS and value is not None}

        first = self.read(task_vars, offset=-1, **options)
        self.show(first["log_lines"], prefix)
        shown, offset, reads = len(first["log_lines"]), first["offset"], first
        deadline = time.monotonic() + max_s
        while follow and (reads["alive"] or reads.get("more")) and time.monotonic() < deadline:
            reads = self.read(task_vars, offset=offset, wait_s=poll_s, **options)
            self.show(reads["log_lines"], prefix)
            shown += len(reads["log_lines"])
            offset = reads["offset"]
        result.update(
            changed=False,
            lines_shown=shown,
            offset=offset,
            alive=reads["alive"],
            ended=reads["ended"],
            followed=follow,
            timed_out=follow and reads["alive"] and time.monotonic() >= deadline,
        )
        return result
