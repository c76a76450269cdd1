#!/usr/bin/python
# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Stop a recorded trainer: SIGTERM, wait for its checkpoint and exit, SIGKILL after a timeout."""

from __future__ import annotations

DOCUMENTATION = r"""
module: trainer_stop
short_description: Stop a DFlash trainer gracefully
description:
  - Sends SIGTERM to the recorded trainer (only when the PID still is that trainer, with the same start
    time and boot id), then waits for its checkpoint line and its exit.
  - When it has not exited after O(timeout) seconds, sends SIGKILL and says so.
  - Where the trainer exits without a checkpoint of the stop, says that it had not started training only
    where the trainer says so itself; otherwise the step it had reached, its exit status and reason from
    its run record (or its last error line), and the newest checkpoint on disk, after which the training
    is not saved.
  - Does nothing, unchanged, when no run is recorded, the trainer has exited already, or the PID
    now belongs to another process.
options:
  pid:
    description: The recorded PID.
    type: int
  start_time:
    description: Field 22 of /proc/<pid>/stat recorded at launch.
    type: int
  boot_id:
    description: The boot id recorded at launch.
    type: str
  run:
    description: The run name the trainer's command line carries.
    type: str
  log:
    description: The run's log, scanned for the checkpoint line written after the signal.
    type: path
  runs_dir:
    description:
      - The workspace's runs directory. With it the trainer to stop is found on the target (run
        records and output locks, as C(run_probe) does), whether O(recorded) is right, stale or empty;
        the checkpoint is read from the output's checkpoint directory, not the log.
    type: path
  timeout:
    description: Seconds to wait for the exit after SIGTERM before SIGKILL.
    type: float
    default: 120
  tail_lines:
    description: How many lines of the log to return.
    type: int
    default: 20
extends_documentation_fragment:
  - dflash.ct200.trainer_record
author:
  - DFlash CT 200 team (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Stop the recorded trainer
  dflash.ct200.trainer_stop:
    recorded: "{{ trainer_run }}"
    timeout: 120

- name: Stop whatever trainer of ours runs on the target
  dflash.ct200.trainer_stop:
    runs_dir: /workspace/runs
    recorded: "{{ trainer_run | default({}) }}"
"""

RETURN = r"""
state_before:
  description: What the recorded trainer was before (none, running, exited, not_ours).
  type: str
  returned: always
checkpoint:
  description:
    - The checkpoint line the trainer logged after the signal, if any; on a host of a multi-host
      run whose ranks had already begun to stop (another host was signalled first), the checkpoint
      line of that stop.
  type: str
  returned: when it was signalled
record:
  description: With O(runs_dir), the record for the controller's cache and ledger (state after the stop).
  type: dict
  returned: with O(runs_dir)
repair:
  description: With O(runs_dir), one line where the controller's cache named another run, else null.
  type: str
  returned: with O(runs_dir)
pid:
  description: The PID of the trainer that was (or would be) stopped; with O(runs_dir), the target's.
  type: int
  returned: always
log_tail:
  description: The last lines of the log after the stop.
  type: list
  elements: str
  returned: when it was signalled
killed:
  description: Whether SIGKILL was needed.
  type: bool
  returned: always
stopped_in_s:
  description: Seconds from SIGTERM to the exit.
  type: float
  returned: when it was signalled
"""

import contextlib
import os
import re
import signal
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.dflash.ct200.plugins.module_utils import trainer_record
from ansible_collections.dflash.ct200.plugins.module_utils.run_record import (
    read_record,
    utc_now,
    write_record,
)
from ansible_collections.dflash.ct200.plugins.module_utils.trainer_proc import (
    CHECKPOINT_RE,
    PROGRESS_RE,
    last_matching,
    newest_checkpoint,
    probe,
    reconcile,
    tail,
    target_runs,
)

POLL_S = 0.2
KILL_WAIT_S = 10.0
STOP_START_RE = re.compile(r"^signal \S+.*: checkpointing and exiting")
# The trainer's own word that a stop found nothing to checkpoint (trainer/run/train.py, checkpoint_and_stop):
# its log line, and the end of its run record's exit reason.
NOT_STARTED_LINE = "nothing to checkpoint yet (training had not started)"
NOT_STARTED_REASON = ", before training began"
STOPPED_AT_RE = re.compile(r"^stopped at step (\d+)\b")
ERROR_LINE_RE = re.compile(r"^(error: |[A-Za-z_.]*(Error|Exception): )")
REASON_CHARS = 400


def log_size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def new_lines(path: str | None, offset: int) -> list[str]:
    if not path:
        return []
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def last_stop_lines(path: str | None) -> list[str]:
    """The log's lines from its last `signal ...: checkpointing and exiting` on (within its last 50
    lines), [] where there is none."""
    lines = tail(path, 50)
    starts = [i for i, line in enumerate(lines) if STOP_START_RE.search(line)]
    return lines[starts[-1] :] if starts else []


def stop_checkpoint_before(path: str | None) -> str | None:
    """The checkpoint line of a stop that began before our SIGTERM, or None. On several hosts the
    ranks stop together as soon as any host's torchrun is signalled, so this host may have logged
    `signal ...: checkpointing and exiting` and its checkpoint line just before its own signal."""
    return next((line for line in reversed(last_stop_lines(path)) if CHECKPOINT_RE.search(line)), None)


def lines_of_the_stop(path: str | None, offset: int) -> list[str]:
    """The log's lines since the signal, and those of a stop that began just before it (another host's
    signal, see stop_checkpoint_before)."""
    return last_stop_lines(path) + new_lines(path, offset)


def run_record_after(out: str | None, run_id: str | None) -> dict:
    """The target's record of this run as the trainer (or its supervisor) left it, {} where there is none."""
    record = read_record(out) if out and run_id else None
    return record if isinstance(record, dict) and record.get("run_id") == run_id else {}


def end_recorded(record: dict, said: list[str]) -> str:
    """The exit status and reason the run record holds; where it holds none (it still says running),
    the trainer's last error line after the signal, if any."""
    status, reason = record.get("exit_status"), record.get("exit_reason")
    if record.get("state", "running") != "running" and (status is not None or reason):
        reason = str(reason or "no reason recorded")[:REASON_CHARS]
        return f"exit status {status}: {reason}" if status is not None else reason
    error = next((line for line in reversed(said) if ERROR_LINE_RE.match(line)), None)
    if error:
        return f"its run record does not say how it ended; its log: {error[:REASON_CHARS]}"
    return "its run record and its log do not say how it ended"


def without_checkpoint(log: str | None, offset: int, out: str | None, run_id: str | None,
                       newest: tuple | None) -> str:  # fmt: skip
    """What a stop that brought no checkpoint says after `no new checkpoint`: that the trainer had not
    started training only where the trainer says so itself (its log line or its run record's reason);
    else the step it had reached, how it ended, and the newest checkpoint on disk (the training after
    it is not saved)."""
    said = lines_of_the_stop(log, offset)
    record = run_record_after(out, run_id)
    if NOT_STARTED_LINE in said or str(record.get("exit_reason", "")).endswith(NOT_STARTED_REASON):
        return " (it had not started training)"
    step = next((int(m.group(1)) for line in reversed(said) if (m := STOPPED_AT_RE.match(line))), None)
    if step is None and (progress := last_matching(log, PROGRESS_RE)):
        step = int(PROGRESS_RE.match(progress).group(1))
    where = f"at step {step}" if step is not None else "before it logged a training step,"
    text = f": the trainer ended {where} without writing one ({end_recorded(record, said)})"
    if out is None:
        return text
    if newest is None:
        return text + ("; the run has no checkpoint" + (": no step of it is saved" if step else ""))
    text += f"; the newest checkpoint is step {newest[0]} ({newest[1]})"
    return text + (": the steps after it are not saved" if step is not None and step > newest[0] else "")


def gone(module: AnsibleModule) -> bool:
    params = module.params
    return probe(params["pid"], params["start_time"], params["boot_id"], params["run"])["state"] != "running"


def wait_gone(module: AnsibleModule, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if gone(module):
            return True
        time.sleep(POLL_S)
    return gone(module)


def newest_written(out: str | None) -> tuple | None:
    """The newest checkpoint (step, path) and its file's identity. A stop that comes at a step the
    trainer has just checkpointed writes that step's file again (a new file at the same path): only
    the file's identity tells the stop's checkpoint from the one before."""
    newest = newest_checkpoint(out)
    if newest is None:
        return None
    try:
        stat = os.stat(newest[1])
    except OSError:
        return (*newest, None, None)
    return (*newest, stat.st_ino, stat.st_mtime_ns)


def note_stopped(out: str | None, run_id: str | None, killed: bool, checkpointed: bool = True) -> None:
    """The target's record of a trainer that has exited says so. The trainer notes its own end;
    where it could not (its record was lost when it ended, and rebuilt from its lock just after),
    the record would say running for good, so the stop notes the end itself. Without a checkpoint
    of the stop, nothing tells that the trainer ended cleanly: its exit status is unknown."""
    record = read_record(out) if out and run_id else None
    if record is None or record.get("run_id") != run_id or record.get("state", "running") != "running":
        return
    if killed:  # the signal as the exit status, as for a crash (docs/OPERATING.md)
        record.update(exit_status=-signal.SIGKILL, exit_reason="killed by the stop (SIGKILL)")
    elif checkpointed:
        record.update(exit_status=0, exit_reason="stopped on SIGTERM (its end noted by the stop)")
    else:
        reason = "stopped on SIGTERM without a checkpoint, exit status unknown (its end noted by the stop)"
        record.update(exit_status=None, exit_reason=reason)
    record.update(state="stopped", ended_at=utc_now())
    with contextlib.suppress(OSError):  # the controller's record and the ledger still say stopped
        write_record(out, record)


def find_on_target(module: AnsibleModule) -> dict:
    """Which trainer to stop: the live run on the target (records and locks) wins over the cache."""
    params = module.params
    found = reconcile(params["recorded"], target_runs(params["runs_dir"]))
    record = found["record"] or {}
    params.update(
        pid=record.get("pid"),
        start_time=record.get("start_time"),
        boot_id=record.get("boot_id"),
        run=record.get("run"),
        log=record.get("log") or params["log"],
    )
    return found


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "pid": {"type": "int"},
            "start_time": {"type": "int"},
            "boot_id": {"type": "str"},
            "run": {"type": "str"},
            "log": {"type": "path"},
            "timeout": {"type": "float", "default": 120},
            "tail_lines": {"type": "int", "default": 20},
            "runs_dir": {"type": "path"},
            **trainer_record.argument_spec(),
        },
        supports_check_mode=True,
    )
    trainer_record.identity(module)
    params = module.params
    found = {"run": None, "record": None, "repair": None}
    if params["runs_dir"]:
        found = find_on_target(module)
    before = probe(params["pid"], params["start_time"], params["boot_id"], params["run"])
    result = {"state_before": before["state"], "killed": False, "pid": params["pid"]}
    if params["runs_dir"]:
        result.update(record=found["record"], repair=found["repair"])
    if before["state"] != "running":
        reasons = {
            "none": "no run is recorded for this host",
            "exited": "the recorded trainer has exited already",
            "not_ours": "the recorded PID now belongs to another process; it is left alone",
        }
        module.exit_json(changed=False, msg=reasons[before["state"]], **result)
    if module.check_mode:
        module.exit_json(changed=True, msg=f"would send SIGTERM to PID {params['pid']}", **result)

    offset = log_size(params["log"])
    out = (found["record"] or {}).get("out")
    newest_before = newest_written(out)
    started = time.monotonic()
    os.kill(params["pid"], signal.SIGTERM)
    exited = wait_gone(module, params["timeout"])
    if not exited and not gone(module):
        os.kill(params["pid"], signal.SIGKILL)
        result["killed"] = True
        exited = wait_gone(module, KILL_WAIT_S)
    result["stopped_in_s"] = round(time.monotonic() - started, 2)
    newest_after = newest_written(out)
    if newest_after and newest_after != newest_before:
        # The checkpoint directory is the truth; the line keeps the log's form for readers of it.
        result["checkpoint"] = f"checkpoint saved step {newest_after[0]} {newest_after[1]}"
    else:
        # A host without the run's checkpoints (not rank 0's in a multi-host run): its log says where.
        after = new_lines(params["log"], offset)
        result["checkpoint"] = next((line for line in reversed(after) if CHECKPOINT_RE.search(line)), None)
        if result["checkpoint"] is None:
            result["checkpoint"] = stop_checkpoint_before(params["log"])
    run_id = (found["record"] or {}).get("run_id")
    nothing_new = ""
    if not result["checkpoint"] and not result["killed"]:
        # Read before the stop notes an end the trainer did not note itself.
        nothing_new = without_checkpoint(params["log"], offset, out, run_id, newest_before)
    if found["record"]:
        result["record"] = {**found["record"], "state": "stopped", "killed": result["killed"]}
        if exited:
            note_stopped(out, run_id, result["killed"], checkpointed=bool(result["checkpoint"]))
    result["log_tail"] = tail(params["log"], params["tail_lines"])
    if not exited:
        module.fail_json(
            msg=f"PID {params['pid']} survived SIGKILL for {KILL_WAIT_S:.0f} s (uninterruptible sleep?)",
            changed=True,
            **result,
        )
    if result["killed"]:
        msg = (
            f"the trainer (PID {params['pid']}) did not exit within {params['timeout']:.0f} s of SIGTERM: "
            "sent SIGKILL; the last checkpoint on disk is "
            + (f"from: {result['checkpoint']}" if result["checkpoint"] else "older (none after the signal)")
        )
    elif result["checkpoint"]:
        msg = f"stopped PID {params['pid']} after SIGTERM; {result['checkpoint']}"
    else:
        msg = f"stopped PID {params['pid']} after SIGTERM; no new checkpoint{nothing_new}"
    module.exit_json(changed=True, msg=msg, **result)


if __name__ == "__main__":
    main()
