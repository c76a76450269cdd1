# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The trainer record option, documented once for every module that takes it whole."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
options:
  recorded:
    description:
      - The trainer record, whole, as the launch recorded it (the target's C(<out>/run.json), cached on
        the controller as the host fact C(trainer_run) and as a line of the run ledger); may be empty.
      - The module reads the trainer's identity from it, C(pid) with C(start_time) (field 22 of
        C(/proc/<pid>/stat)) and C(boot_id), so that a reused PID or a reboot is never taken for the
        trainer, C(run) (the run name its command line carries) and C(log); and, with a C(runs_dir) option,
        compares it with the target's own records (C(run_id), C(out)) to report where the controller's
        cache is wrong.
      - A field of the same name given as an option of its own (C(pid), C(log), ...) wins over the record's.
    type: dict
"""
