"""Callback: after the play recap, a one-screen summary of what a playbook did to a run."""

from __future__ import annotations

DOCUMENTATION = r"""
name: run_summary
type: aggregate
short_description: Print the run summary after the recap
description:
  - Prints the lines a play stored with C(ansible.builtin.set_stats) under C(dflash_summary)
    (run, PID, log, how to follow it), after the default callback's recap.
requirements:
  - enabled in ansible.cfg (callbacks_enabled)
author:
  - DFlash CT 200 team
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
