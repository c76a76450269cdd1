# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The trainer record as modules take it: whole, as the option ``recorded`` (documented once in the
doc fragment dflash.ct200.trainer_record).

The record is the run record of the target (``<out>/run.json``, see module_utils/run_record.py) as
the controller keeps it (host fact ``trainer_run``, one line of the ledger). A module needs only
its identity fields to find the trainer again: the PID, with its start time and the boot id (so a
reused PID or a reboot is never taken for the trainer), the run name its command line carries and
its log. :func:`identity` reads them from the record, checked and converted, and lets a module's
own options of the same names (kept from the time they were passed one by one) win over it."""

from __future__ import annotations

from ansible.module_utils.common.validation import check_type_int, check_type_path, check_type_str

OPTION = "recorded"

# The fields a module reads from the record, and how each is checked.
IDENTITY_FIELDS = {
    "pid": check_type_int,
    "start_time": check_type_int,
    "boot_id": check_type_str,
    "run": check_type_str,
    "log": check_type_path,
}


def argument_spec() -> dict:
    """The option every module that needs the trainer record takes (see the doc fragment)."""
    return {OPTION: {"type": "dict"}}


def record_identity(record: dict | None) -> dict:
    """The identity fields of a record, checked: {pid, start_time, boot_id, run, log}, None where
    absent or empty. Raises ValueError naming the field and what is wrong with it."""
    record = record or {}
    found = {}
    for field, check in IDENTITY_FIELDS.items():
        value = record.get(field)
        if value is None or value == "":
            found[field] = None
            continue
        try:
            found[field] = check(value)
        except TypeError as exc:
            raise ValueError(f"{OPTION}.{field} is {value!r}: {exc}") from None
    return found


def identity(module) -> dict:
    """Fill the module's pid, start_time, boot_id, run and log from O(recorded) where the module was
    not given them one by one; return the identity. Fails the module, naming the field, on a record
    whose identity fields have the wrong type."""
    params = module.params
    try:
        found = record_identity(params.get(OPTION))
    except ValueError as exc:
        module.fail_json(
            msg=f"{exc}. Pass the trainer record whole, as the launch cached it (host fact trainer_run)."
        )
    for field, value in found.items():
        if params.get(field) is None:
            params[field] = value
    return {field: params.get(field) for field in IDENTITY_FIELDS}
