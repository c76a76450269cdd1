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
requirements:
  - enabled in ansible.cfg (callbacks_enabled)
author:
  - DFlash CT 200 team (!UNKNOWN)
"""

from ansible.plugins.callback import CallbackBase


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "dflash.ct200.run_summary"
    CALLBACK_NEEDS_ENABLED = True

    def v2_playbook_on_stats(self, stats):
        custom = getattr(stats, "custom", {}) or {}
        lines = (custom.get("_run") or {}).get("dflash_summary")
        if not lines:
            return
        width = min(100, max(len(str(line)) for line in lines) + 2)
        self._display.display("-" * width)
        for line in lines:
            self._display.display(" " + str(line))
        self._display.display("-" * width)
