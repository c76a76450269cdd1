# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Callback: after the play recap, a one-screen summary of what a playbook did to a run."""

from __future__ import annotations

DOCUMENTATION = r"""
name: run_summary
type: aggregate
short_description: Print the run summary after the recap
description:
  - Prints the lines a play stored with C(ansible.builtin.set_stats) under C(dflash_summary)
    after the default callback's recap, between two rules as wide as the longest line (at most
    100 characters). Launch stores the run, PID, log and how to follow it; status and stop a
    block per host.
  - Prints nothing when the play stored no such lines.
  - A playbook interrupted (Ctrl-C) after it started a trainer ends without its summary; then it
    says, as it exits, that the trainer keeps running (host, PID, log) and how to watch and stop it.
requirements:
  - enabled in ansible.cfg (callbacks_enabled)
author:
  - DFlash CT 200 team (!UNKNOWN)
"""

import atexit

from ansible.plugins.callback import CallbackBase

# The task that starts a trainer, and the one that stops it (then nothing is left running).
START_ACTIONS = ("dflash.ct200.trainer_start", "trainer_start")
STOP_ACTIONS = ("dflash.ct200.trainer_stop", "trainer_stop")


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "dflash.ct200.run_summary"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.started: dict[str, dict] = {}  # host -> the trainer started there
        self.ended = False
        self.watching = False

    def v2_runner_on_ok(self, result):
        action = getattr(getattr(result, "_task", None), "action", "")
        host = result._host.get_name()
        res = result._result or {}
        if action in START_ACTIONS and res.get("pid"):
            record = res.get("record") or {}
            self.started[host] = {"run": record.get("run"), "pid": res["pid"], "log": record.get("log")}
            if not self.watching:
                # ansible-playbook ends on Ctrl-C without the stats (the summary): say it at exit.
                atexit.register(self.say_left_running)
                self.watching = True
        elif action in STOP_ACTIONS and res.get("changed"):
            self.started.pop(host, None)

    def left_running_lines(self) -> list[str]:
        """What an interrupted playbook left running, or nothing where it ended on its own."""
        if self.ended or not self.started:
            return []
        lines = ["Interrupted: the trainer started is not stopped; it keeps running:"]
        for host, run in self.started.items():
            lines.append(f"  {host}: run {run['run']} as PID {run['pid']}, log {run['log']}")
        lines.append("Watch it with ./dev.sh status; stop it with ./dev.sh stop.")
        return lines

    def say_left_running(self) -> None:
        for line in self.left_running_lines():
            self._display.display(line)

    def v2_playbook_on_stats(self, stats):
        self.ended = True
        custom = getattr(stats, "custom", {}) or {}
        lines = (custom.get("_run") or {}).get("dflash_summary")
        if not lines:
            return
        width = min(100, max(len(str(line)) for line in lines) + 2)
        self._display.display("-" * width)
        for line in lines:
            self._display.display(" " + str(line))
        self._display.display("-" * width)
