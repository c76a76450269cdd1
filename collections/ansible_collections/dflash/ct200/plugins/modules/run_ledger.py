#!/usr/bin/python
# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Documentation of the run_ledger action (it runs on the controller; see plugins/action/run_ledger.py)."""

from __future__ import annotations

DOCUMENTATION = r"""
module: run_ledger
short_description: Append or update a run record in the controller's run ledger
description:
  - The run ledger is a JSON-lines file on the controller (C(.state/runs.jsonl)), one record per
    launch, keyed by C(run_id).
  - Always runs on the controller, whatever the target (an action plugin; it never runs a
    module on the target). Writes atomically (temporary file, rename) under an exclusive lock.
  - Appends O(record), or replaces the line with the same C(run_id) where it differs. Lines it
    cannot parse are kept as they are. Supports check mode.
options:
  path:
    description: The ledger file on the controller.
    type: path
    required: true
  record:
    description: The run record; needs C(run_id).
    type: dict
    required: true
  update:
    description: Only set the keys of O(record) in the existing line of its C(run_id) (under the
      lock, so a concurrent change of other keys is kept); append nothing when there is none.
    type: bool
    default: false
author:
  - DFlash CT 200 team (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Append the run to the ledger
  dflash.ct200.run_ledger:
    path: "{{ playbook_dir }}/../.state/runs.jsonl"
    record: "{{ trainer_run }}"
"""

RETURN = r"""
record:
  description: The record as written (plain JSON types).
  type: dict
  returned: success
path:
  description: The ledger's absolute path.
  type: str
  returned: success
"""
