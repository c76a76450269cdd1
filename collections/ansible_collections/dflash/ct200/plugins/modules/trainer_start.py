#!/usr/bin/python
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
  - No shell is involved: the script path is passed as one argument.
options:
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
  - DFlash CT 200 team
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
cmdline:
  description: The trainer's command line.
  type: list
  elements: str
  returned: success
"""

import os
import subprocess
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.dflash.ct200.plugins.module_utils.trainer_proc import (
    VERDICT_LINES,
    describe_exit,
    exit_from_log,
    is_trainer_cmdline,
    probe,
    read_stat,
    tail,
)

POLL_S = 0.05


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


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "script": {"type": "path", "required": True},
            "log": {"type": "path", "required": True},
            "run": {"type": "str", "required": True},
            "settle": {"type": "float", "default": 10},
            "args": {"type": "list", "elements": "str", "default": []},
            "tail_lines": {"type": "int", "default": 20},
        },
        supports_check_mode=True,
    )
    params = module.params
    if module.check_mode:
        # Before the script check: in check mode the workspace role has only said what it would write.
        module.exit_json(changed=True, msg=f"would start {params['script']} detached (log {params['log']})")
    if not os.access(params["script"], os.X_OK):
        module.fail_json(msg=f"{params['script']} is missing or not executable: run the workspace role first")

    kept = keep_earlier_log(params["log"])
    with open(params["log"], "wb") as log, open(os.devnull, "rb") as devnull:
        process = subprocess.Popen(
            [params["script"], *params["args"]],
            stdin=devnull,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            cwd=os.path.dirname(params["script"]) or "/",
        )
    pid = process.pid
    # Nobody waits for the trainer here: it belongs to its own session once this module exits.
    process.returncode = 0  # keeps Popen's destructor from warning about a running child
    deadline = time.monotonic() + params["settle"]
    current = probe(pid, None, None, None)
    # While run.sh exec's python, /proc/<pid>/cmdline may read empty or show the shell: poll.
    while time.monotonic() < deadline and not is_trainer_cmdline(current["cmdline"]):
        stat = read_stat(pid)
        if stat is None or stat["state"] in ("Z", "X"):
            break
        time.sleep(POLL_S)
        current = probe(pid, None, None, None)
    stat = read_stat(pid)
    alive = stat is not None and stat["state"] not in ("Z", "X")
    if not alive or not current["alive"] or not is_trainer_cmdline(current["cmdline"], params["run"]):
        time.sleep(0.2)  # let an exiting trainer's last lines reach the log
        log_tail = tail(params["log"], params["tail_lines"])
        if alive:
            what = "is not the trainer: " + (" ".join(current["cmdline"]) or "(empty command line)")
        else:
            what = f"exited; exit status: {describe_exit(exit_from_log(tail(params['log'], VERDICT_LINES)))}"
        module.fail_json(
            msg=(
                f"{params['script']} started as PID {pid} (run {params['run']}) but it {what}. "
                f"Last lines of {params['log']}:\n" + "\n".join(log_tail)
            ),
            changed=True,
            pid=pid,
            boot_id=current.get("boot_id"),
        )
    module.exit_json(
        changed=True,
        kept_log=kept,
        pid=pid,
        start_time=current["start_time"],
        boot_id=current["boot_id"],
        cmdline=current["cmdline"],
    )


if __name__ == "__main__":
    main()
