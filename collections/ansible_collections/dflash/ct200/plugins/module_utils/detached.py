# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Start a program detached from the module that starts it (its own session), for trainer_start.

Why not AnsibleModule.run_command: it waits for the program to exit and collects its output
through pipes, and the trainer must outlive the module and the connection that started it. What
it needs is what ``setsid PROGRAM </dev/null >LOG 2>&1`` does, with no shell: a new session (so
the connection's hang-up and the end of an ``async`` job's process group never reach it), stdin
from /dev/null, stdout and stderr to one log (started empty; trainer_start has moved an earlier
one aside), only the listed file descriptors inherited
(the output lock). Nobody waits for it here: once the module exits it belongs to its session.
"""

from __future__ import annotations

import os
import subprocess


def start_detached(
    argv: list[str], log_path: str, cwd: str, env: dict, pass_fds: tuple[int, ...] = ()
) -> int:
    """Start argv in a new session, stdin /dev/null, stdout and stderr to log_path (truncated);
    return its PID without waiting for it."""
    with open(log_path, "wb") as log, open(os.devnull, "rb") as devnull:
        process = subprocess.Popen(
            argv,
            stdin=devnull,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
            env=env,
            cwd=cwd,
        )
    process.returncode = 0  # keeps Popen's destructor from warning about a running child
    return process.pid
