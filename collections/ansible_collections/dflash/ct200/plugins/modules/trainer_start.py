#!/usr/bin/python
# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Start run.sh detached (its own session) and return the trainer's PID, start time and boot id."""

from __future__ import annotations

DOCUMENTATION = r"""
module: trainer_start
short_description: Start a DFlash run detached and identify its trainer process
description:
  - Starts O(script) in a new session (C(setsid)), stdin from C(/dev/null), stdout and stderr
    to O(log), so it outlives the connection that started it (unlike C(async)/C(poll 0), which
    kills the process group when its time runs out, or a plain C(nohup cmd &)).
  - C(run.sh) C(exec)s the trainer, so the started PID is the trainer's own; the module waits up
    to O(settle) seconds for that exec chain and checks C(/proc/<pid>/cmdline) runs
    C(-m trainer --run) O(run). It fails with the log's tail when the process dies or is not
    the trainer.
  - Returns the PID with its start time (field 22 of C(/proc/<pid>/stat)) and the boot id, which
    identify the trainer later even when the PID is reused.
  - No shell is involved; the script path is passed as one argument.
  - With O(out), one trainer per output. The module takes the output's exclusive lock
    (C(<parent>/.<name>.lock)) before anything else and fails at once, naming the PID, while another
    process holds it; the started script inherits the locked file descriptor (C(trainer.launch)
    keeps it across its exec), so there is no moment where the output is unlocked. With O(fresh),
    an earlier output is moved aside (C(<out>.<UTC time>)), never deleted. The module then waits
    for the run record C(<out>/run.json) that C(trainer.launch) writes and returns it, so the run is
    recorded on the target before the controller hears of it.
options:
  out:
    description: The run's output directory (the trainer's C(--out)).
    type: path
  fresh:
    description: Move an existing O(out) aside before the start (start over; nothing is deleted).
    type: bool
    default: false
  script:
    description: The run script (C(run.sh)), executable.
    type: path
    required: true
  log:
    description:
      - The log file for the trainer's stdout and stderr.
      - A log left by an earlier start is kept, renamed with the time it was last written
        (C(<log>.<YYYYmmddTHHMMSSZ>)), so a relaunch never loses the previous run's output.
    type: path
    required: true
  args:
    description: Arguments passed to O(script) (run.sh hands them to the trainer, e.g. C(--resume)).
    type: list
    elements: str
    default: []
  run:
    description: The run name the trainer's command line must carry.
    type: str
    required: true
  settle:
    description: Seconds to wait for the started process to become the trainer.
    type: float
    default: 10
  tail_lines:
    description: Lines of the log to show when the start fails.
    type: int
    default: 20
author:
  - DFlash CT 200 team (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Start run.sh detached
  dflash.ct200.trainer_start:
    script: /workspace/run.sh
    log: /workspace/train_compile_nographs.log
    run: nographs
"""

RETURN = r"""
kept_log:
  description: Where the earlier start's log was moved, if there was one.
  type: str
  returned: success
pid:
  description: The trainer's PID.
  type: int
  returned: success
start_time:
  description: Field 22 of /proc/<pid>/stat (clock ticks since boot).
  type: int
  returned: success
boot_id:
  description: The boot id.
  type: str
  returned: success
run_id:
  description: The run's id from its record (with O(out)), else null.
  type: str
  returned: success
started_at:
  description: When the run started (UTC, from its record, with O(out)), else null.
  type: str
  returned: success
record:
  description: The run record the trainer wrote on the target (C(<out>/run.json)), with O(out).
  type: dict
  returned: success
moved_aside:
  description: Where an earlier output went with O(fresh).
  type: str
  returned: success
cmdline:
  description: The trainer's command line.
  type: list
  elements: str
  returned: success
run_state:
  description:
    - How a trainer that ended during the start ended, in the documented states (its run record's
      state, one of failed, stopped, crashed, finished; else from the exit status the log tells, 1
      C(crashed), 0 C(finished), otherwise C(failed), the start having failed).
  type: str
  returned: when the trainer ended during the start
"""

import fcntl
import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.dflash.ct200.plugins.module_utils.detached import start_detached
from ansible_collections.dflash.ct200.plugins.module_utils.run_record import (
    LOCK_FD_ENV,
    lock_holder,
    lock_path,
    move_aside,
    read_record,
    write_lock_pid,
)
from ansible_collections.dflash.ct200.plugins.module_utils.trainer_proc import (
    VERDICT_LINES,
    describe_exit,
    exit_from_log,
    is_trainer_cmdline,
    probe,
    read_stat,
    tail,
    target_run,
)

POLL_S = 0.05
# How long a start refused by another start waits for that one to write its trainer's PID into the
# lock (it starts the trainer between taking the lock and writing it: milliseconds).
STARTING_WAIT_S = 10.0


def keep_earlier_log(path: str) -> str | None:
    """Rename a non-empty log of an earlier start to <path>.<its mtime, UTC>; return the new name."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return None
    if info.st_size == 0:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(info.st_mtime))
    kept = f"{path}.{stamp}"
    suffix = 1
    while os.path.exists(kept):
        kept = f"{path}.{stamp}-{suffix}"
        suffix += 1
    os.rename(path, kept)
    return kept


def take_output_lock(module: AnsibleModule) -> int:
    """The output's exclusive lock, or fail at once naming the process that holds it."""
    out = module.params["out"]
    path = lock_path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o640)
    except OSError as exc:
        module.fail_json(msg=f"cannot create the output lock {path}: {exc.strerror}; nothing was started")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = started_holder(out)
        record = read_record(out) or {}
        what = (
            f" (run {record.get('run_id')}, started {record.get('started_at')})"
            if record.get("pid") == holder
            else ""
        )
        module.fail_json(
            msg=(
                f"A trainer is already running on output {out}: PID {holder or 'unknown'}{what} "
                "holds its lock. "
                "One trainer per output: stop it first (./dev.sh stop), or watch it (./dev.sh status)."
            ),
            holder=holder,
        )
    # Emptied until the trainer's PID is written (write_lock_pid): a start refused meanwhile waits
    # for it, rather than naming an earlier run's PID or this module's process.
    os.ftruncate(fd, 0)
    return fd


def started_holder(out: str, wait_s: float = STARTING_WAIT_S) -> int | None:
    """The PID that holds the output's lock; while another start has taken the lock and not yet
    written its trainer's PID (the lock file empty), waited for, at most wait_s."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if lock_path(out).read_text(encoding="ascii").strip():
                break
        except OSError:
            break
        time.sleep(POLL_S)
    return lock_holder(out)


def recorded(out: str | None, pid: int) -> dict | None:
    """The run record trainer.launch wrote for `pid`, or None (not yet, or no output given)."""
    if not out:
        return None
    record = read_record(out)
    return record if record and record.get("pid") == pid else None


def ended_at_start(out: str | None, pid: int, log: str) -> dict:
    """How a trainer that ended during the start ended: its run record's state and reason (closed
    by target_run where it still said running), else what the log tells."""
    verdict = exit_from_log(tail(log, VERDICT_LINES))
    run = target_run(out) if out else None
    if run is not None and run["record"].get("pid") == pid and not run["live"]:
        if run.get("exit_status") is not None or verdict["exit_status"] is None:
            verdict = {"exit_status": run.get("exit_status"), "exit_reason": run.get("exit_reason")}
        return {**verdict, "run_state": run["state"]}
    # No record of its own: a crash where the log says so (exit status 1), else a start that failed.
    status = verdict["exit_status"]
    state = "finished" if status == 0 else "crashed" if status == 1 else "failed"
    return {**verdict, "run_state": state}


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "script": {"type": "path", "required": True},
            "log": {"type": "path", "required": True},
            "run": {"type": "str", "required": True},
            "settle": {"type": "float", "default": 10},
            "args": {"type": "list", "elements": "str", "default": []},
            "tail_lines": {"type": "int", "default": 20},
            "out": {"type": "path"},
            "fresh": {"type": "bool", "default": False},
        },
        supports_check_mode=True,
    )
    params = module.params
    if module.check_mode:
        # Before the script check: in check mode the workspace role has only said what it would write.
        module.exit_json(changed=True, msg=f"would start {params['script']} detached (log {params['log']})")
    if not os.access(params["script"], os.X_OK):
        module.fail_json(msg=f"{params['script']} is missing or not executable: run the workspace role first")

    lock_fd = take_output_lock(module) if params["out"] else None
    moved = move_aside(params["out"]) if params["out"] and params["fresh"] else None
    kept = keep_earlier_log(params["log"])
    env = dict(os.environ)
    if lock_fd is not None:
        env[LOCK_FD_ENV] = str(lock_fd)
    # Detached (setsid, stdin /dev/null, output to the log), which run_command cannot do: it waits.
    pid = start_detached(
        [params["script"], *params["args"]],
        params["log"],
        cwd=os.path.dirname(params["script"]) or "/",
        env=env,
        pass_fds=() if lock_fd is None else (lock_fd,),
    )
    if lock_fd is not None:
        # The started process holds the lock now (the same open file): ours can go.
        write_lock_pid(lock_fd, pid)
        os.close(lock_fd)
    deadline = time.monotonic() + params["settle"]
    current = probe(pid, None, None, None)
    # While run.sh exec's python, /proc/<pid>/cmdline may read empty or show the shell: poll. With
    # an output, until trainer.launch has written the run record too.
    while time.monotonic() < deadline and not (
        is_trainer_cmdline(current["cmdline"]) and (not params["out"] or recorded(params["out"], pid))
    ):
        stat = read_stat(pid)
        if stat is None or stat["state"] in ("Z", "X"):
            break
        time.sleep(POLL_S)
        current = probe(pid, None, None, None)
    stat = read_stat(pid)
    alive = stat is not None and stat["state"] not in ("Z", "X")
    record = recorded(params["out"], pid)
    running = alive and current["alive"] and is_trainer_cmdline(current["cmdline"], params["run"])
    if running and params["out"] and not record:
        # Started, but its record is missing: a run nobody can find must not keep running.
        os.kill(pid, 15)
        module.fail_json(
            msg=(
                f"{params['script']} started as PID {pid} (run {params['run']}) but wrote no run record "
                f"in {params['out']} within {params['settle']:.0f} s, so it was stopped (SIGTERM). "
                f"Last lines of {params['log']}:\n" + "\n".join(tail(params["log"], params["tail_lines"]))
            ),
            changed=True,
        )
    if not alive or not current["alive"] or not is_trainer_cmdline(current["cmdline"], params["run"]):
        time.sleep(0.2)  # let an exiting trainer's last lines reach the log
        log_tail = tail(params["log"], params["tail_lines"])
        ended = {}
        if alive:
            what = "is not the trainer: " + (" ".join(current["cmdline"]) or "(empty command line)")
        else:
            ended = ended_at_start(params["out"], pid, params["log"])
            what = f"exited; exit status: {describe_exit(ended)}"
        module.fail_json(
            msg=(
                f"{params['script']} started as PID {pid} (run {params['run']}) but it {what}. "
                f"Last lines of {params['log']}:\n" + "\n".join(log_tail)
            ),
            changed=True,
            pid=pid,
            boot_id=current.get("boot_id"),
            **({"run_state": ended["run_state"]} if ended else {}),
        )
    module.exit_json(
        changed=True,
        kept_log=kept,
        moved_aside=str(moved) if moved else None,
        record=record,
        run_id=record.get("run_id") if record else None,
        started_at=record.get("started_at") if record else None,
        pid=pid,
        start_time=current["start_time"],
        boot_id=current["boot_id"],
        cmdline=current["cmdline"],
    )


if __name__ == "__main__":
    main()
