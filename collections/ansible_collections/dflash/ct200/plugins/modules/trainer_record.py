#!/usr/bin/python
# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Documentation of the trainer_record action (it runs on the controller: plugins/action)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: trainer_record
short_description: Keep a trainer record in the cached host facts and the run ledger, in one call
description:
  - Sets the host facts C(trainer_run) (the record) and C(trainer_pid) (its C(pid)), which the fact
    cache keeps between playbooks (as C(ansible.builtin.set_fact) with C(cacheable=true) does), and
    appends the record to the controller's run ledger or replaces its line (same C(run_id)), under the
    ledger's lock, written atomically.
  - Always runs on the controller, whatever the target (an action plugin; it never runs a module on the
    target). Supports check mode (the ledger is not written then).
  - Where the ledger cannot be written the task fails, naming the file and the reason, and the facts are
    left as they were; with O(fail_on_ledger_error=false) it succeeds, sets the facts and says why in
    RV(ledger_error).
options:
  record:
    description: The trainer record; needs C(run_id).
    type: dict
    required: true
  update:
    description: Fields that replace the record's own before it is kept (for example C(state=failed)).
    type: dict
    default: {}
  ledger:
    description: The run ledger on the controller (C(.state/runs.jsonl)).
    type: path
    required: true
  fail_on_ledger_error:
    description: Fail the task where the ledger cannot be written; false sets the facts regardless.
    type: bool
    default: true
author:
  - DFlash CT 200 team (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Keep the started run in the facts and the ledger
  dflash.ct200.trainer_record:
    record: "{{ trainer_start_result.record }}"
    ledger: "{{ playbook_dir }}/../.state/runs.jsonl"

- name: Mark the run failed
  dflash.ct200.trainer_record:
    record: "{{ trainer_run }}"
    update:
      state: failed
    ledger: "{{ playbook_dir }}/../.state/runs.jsonl"
"""

RETURN = r"""
record:
  description: The record as kept (with O(update) applied).
  type: dict
  returned: always
path:
  description: The ledger file.
  type: str
  returned: always
ledger_error:
  description: Why the ledger could not be written, else null.
  type: str
  returned: always
"""
