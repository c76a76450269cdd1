#!/usr/bin/python
# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Read a run's log from an offset: one bounded read, optionally waiting a little for new lines."""

from __future__ import annotations

DOCUMENTATION = r"""
module: run_log
short_description: Read the lines of a DFlash run's log from an offset
description:
  - With O(offset) below 0, returns the last O(lines) lines of O(path) and the offset of its end.
  - With O(offset) 0 or more, returns the complete lines written since that offset (at most
    O(max_bytes)), waiting up to O(wait_s) for some to appear while the trainer lives. A log that
    became shorter than O(offset) (replaced) is read from its start.
  - Says whether the recorded trainer still lives (PID, start time, boot id) and, once it does
    not, how the run ended - the last event of the run's C(events.jsonl) where there is one, else
    what the log's last lines say.
  - Changes nothing. The action plugin of the same name calls it in a loop to follow a log.
options:
  path:
    description: The run's log.
    type: path
    required: true
  offset:
    description: Byte offset to read from; below 0, the last O(lines) lines.
    type: int
    default: -1
  lines:
    description: Lines returned when O(offset) is below 0.
    type: int
    default: 20
  wait_s:
    description: Seconds to wait for new lines while the trainer lives.
    type: float
    default: 0
  max_bytes:
    description: At most this many bytes are read per call.
    type: int
    default: 262144
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
    description: The run name on the trainer's command line.
    type: str
  events:
    description: The run's events.jsonl.
    type: path
  follow:
    description:
      - Handled by the action plugin of the same name, never by the module - keep reading new
        lines (bounded module runs, each waiting up to O(poll_s)) until the trainer exits.
    type: bool
    default: false
  poll_s:
    description: Handled by the action plugin - seconds each read waits for new lines while following.
    type: float
    default: 5
  max_s:
    description: Handled by the action plugin - stop following after this many seconds.
    type: float
    default: 604800
  prefix:
    description: Handled by the action plugin - text put before every line shown (the host, on several hosts).
    type: str
    default: ""
extends_documentation_fragment:
  - dflash.ct200.trainer_record
author:
  - DFlash CT 200 team (!UNKNOWN)
"""

EXAMPLES = r"""
- name: The last 50 lines of the recorded run's log
  dflash.ct200.run_log:
    path: "{{ trainer_run.log }}"
    lines: 50
"""

RETURN = r"""
log_lines:
  description: The lines read (without line ends).
  type: list
  elements: str
  returned: always
offset:
  description: The offset to read from next.
  type: int
  returned: always
more:
  description: Whether more was written than this call read.
  type: bool
  returned: always
alive:
  description: Whether the recorded trainer still runs.
  type: bool
  returned: always
ended:
  description: How the run ended, once the trainer no longer runs (else null).
  type: str
  returned: always
"""

import json
import os
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.dflash.ct200.plugins.module_utils import trainer_record
from ansible_collections.dflash.ct200.plugins.module_utils.trainer_proc import (
    describe_exit,
    exit_from_log,
    probe,
    tail,
)

POLL_S = 0.5


def last_event(path: str | None) -> dict | None:
    """The last ending event (finish, stop, failed) of events.jsonl, or the last crash."""
    for line in reversed(tail(path, 200)):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("event") in ("finish", "stop", "failed", "crash"):
            return row
    return None


def how_it_ended(params: dict) -> str:
    event = last_event(params["events"])
    if event is not None:
        step = f" at step {event['step']}" if event.get("step") is not None else ""
        tau = f", tau {event['tau']:.3f}" if isinstance(event.get("tau"), (int, float)) else ""
        restarts = f", after {event['restarts']} restart(s)" if event.get("restarts") else ""
        words = {"finish": "finished", "stop": "stopped", "failed": "failed", "crash": "crashed"}[
            event["event"]
        ]
        reason = f": {event['reason']}" if event.get("reason") and event["event"] != "stop" else ""
        return f"{words}{step}{tau}{restarts}{reason}"
    return "exit status " + describe_exit(exit_from_log(tail(params["path"], 400)))


def size_of(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def read_from(path: str, offset: int, max_bytes: int, complete_only: bool) -> tuple[list[str], int, bool]:
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(max_bytes + 1)
    except FileNotFoundError:
        return [], offset, False
    more = len(data) > max_bytes
    data = data[:max_bytes]
    if complete_only or more:
        # A line still being written is left for the next call.
        end = data.rfind(b"\n") + 1
        if end == 0 and more:
            end = len(data)  # one line longer than max_bytes: return it in pieces
        data = data[:end]
    text = data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
    return text.splitlines(), offset + len(data), more


def alive(params: dict) -> bool:
    if not params["pid"]:
        return False
    found = probe(params["pid"], params["start_time"], params["boot_id"], params["run"])
    return found["state"] == "running"


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "path": {"type": "path", "required": True},
            "offset": {"type": "int", "default": -1},
            "lines": {"type": "int", "default": 20},
            "wait_s": {"type": "float", "default": 0},
            "max_bytes": {"type": "int", "default": 262144},
            "pid": {"type": "int"},
            "start_time": {"type": "int"},
            "boot_id": {"type": "str"},
            "run": {"type": "str"},
            "events": {"type": "path"},
            # Options of the action plugin of the same name, which takes them before calling this.
            "follow": {"type": "bool", "default": False},
            "poll_s": {"type": "float", "default": 5},
            "max_s": {"type": "float", "default": 604800},
            "prefix": {"type": "str", "default": ""},
            **trainer_record.argument_spec(),
        },
        supports_check_mode=True,
    )
    trainer_record.identity(module)  # pid, start_time, boot_id, run from O(recorded)
    params = module.params
    if params["lines"] < 0 or params["max_bytes"] < 1 or params["wait_s"] < 0:
        module.fail_json(msg="run_log: lines must not be negative, max_bytes positive, wait_s not negative")
    path = params["path"]
    running = alive(params)
    if params["offset"] < 0:
        lines = tail(path, params["lines"])
        result = {"log_lines": lines, "offset": size_of(path), "more": False}
    else:
        offset = params["offset"] if params["offset"] <= size_of(path) else 0
        deadline = time.monotonic() + params["wait_s"]
        while running and size_of(path) <= offset and time.monotonic() < deadline:
            time.sleep(POLL_S)
            running = alive(params)
        lines, offset, more = read_from(path, offset, params["max_bytes"], complete_only=running)
        result = {"log_lines": lines, "offset": offset, "more": more}
    module.exit_json(changed=False, alive=running, ended=None if running else how_it_ended(params), **result)


if __name__ == "__main__":
    main()
