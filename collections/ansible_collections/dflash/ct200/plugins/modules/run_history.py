#!/usr/bin/python
# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Read what the target holds about its runs: events, metrics and the configured step count."""

from __future__ import annotations

DOCUMENTATION = r"""
module: run_history
short_description: Read the structured outputs of DFlash runs on the target
description:
  - For each run output directory (O(outs), or every directory under O(root)), reads
    C(events.jsonl) (start, crash, restart, finish, stop, failed), C(metrics.jsonl) (train and eval
    rows) and C(config.yml) (the step count), and returns a summary per run - last step and total,
    last loss, best and last tau, tokens per second, the events - and, with O(points), the loss,
    tau and tokens/s series (evenly thinned to at most that many points), and from C(run.json) the
    run's stretches (from which step, how many workers, which topology, how many hosts) and its
    newest start (C(record) with run_id, state, exit_status, exit_reason, data_only, and C(trained),
    whether metrics.jsonl holds a training row of that start, after the record's C(metrics_from)).
  - Changes nothing; a missing or half-written file is read as far as it goes.
options:
  outs:
    description: Run output directories.
    type: list
    elements: path
    default: []
  root:
    description: A directory whose subdirectories are run outputs (the workspace's C(runs)).
    type: path
  points:
    description: Return the series with at most this many points each; 0 returns none.
    type: int
    default: 0
  live:
    description: Launches to probe (C(pid), C(start_time), C(boot_id), C(run)); RV(alive) says
      for each PID whether that trainer still runs.
    type: list
    elements: dict
    default: []
author:
  - DFlash CT 200 team (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Every run of the workspace
  dflash.ct200.run_history:
    root: /workspace/runs
"""

RETURN = r"""
runs:
  description: One entry per output directory that exists, in the order given (root - by name).
  type: list
  elements: dict
  returned: always
alive:
  description: PID (as a string) to whether the launch of O(live), or of a start event, with
    that PID still runs.
  type: dict
  returned: always
"""

import json
import os

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.dflash.ct200.plugins.module_utils.run_record import jsonl_rows, read_record
from ansible_collections.dflash.ct200.plugins.module_utils.trainer_proc import config_steps, probe

MAX_EVENTS = 200


def thin(rows: list, points: int) -> list:
    if points <= 0 or len(rows) <= points:
        return rows
    stride = len(rows) / points
    picked = [rows[int(i * stride)] for i in range(points)]
    picked[-1] = rows[-1]
    return picked


def stretches_of(out: str) -> list:
    """The run record's stretches (the trainer writes them, docs/ARCHITECTURE.md); [] where the
    record has none or they are not a list of objects."""
    stretches = (read_record(out) or {}).get("stretches")
    return [s for s in stretches if isinstance(s, dict)] if isinstance(stretches, list) else []


def current_rows(metrics: list[dict], kind: str, valid=lambda row: True) -> list[dict]:
    """The rows of one kind along the run's current course, in step order: a resumed run repeats
    the steps after its checkpoint, and a row that goes back drops every later step an earlier
    launch logged (a launch killed at step 60 after its checkpoint at 50, resumed: 51.. replace
    51..60, and step 60 is no longer where the run is)."""
    rows: list[dict] = []
    for row in metrics:
        if row.get("kind") != kind or not isinstance(row.get("step"), int) or not valid(row):
            continue
        while rows and rows[-1]["step"] >= row["step"]:
            rows.pop()
        rows.append(row)
    return rows


def trained_since(out: str, offset) -> bool | None:
    """Whether metrics.jsonl holds a training row after `offset` (the run record's metrics_from:
    where the newest start's rows begin); None where the record does not say."""
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        return None
    try:
        with open(os.path.join(out, "metrics.jsonl"), "rb") as handle:
            handle.seek(offset)
            chunk = handle.read(256 * 1024)
    except OSError:
        return False
    for line in chunk.decode("utf-8", "replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("kind") == "train":
            return True
    return False


def newest_start(out: str) -> dict | None:
    """The newest start of an output as its run record tells it: its run id, how it ended (state,
    exit status and reason), whether it only prepared data, and whether it trained a step."""
    record = read_record(out)
    if not record or not isinstance(record.get("run_id"), str):
        return None
    return {
        "run_id": record["run_id"],
        "state": record.get("state"),
        "exit_status": record.get("exit_status"),
        "exit_reason": record.get("exit_reason"),
        "data_only": "--data-only" in (record.get("cmdline") or []),
        "trained": trained_since(out, record.get("metrics_from")),
    }


def summarize(out: str, points: int) -> dict:
    metrics = jsonl_rows(os.path.join(out, "metrics.jsonl"))
    train_rows = current_rows(metrics, "train")
    eval_rows = current_rows(metrics, "eval", lambda row: isinstance(row.get("tau"), (int, float)))
    recent = [
        row["tokens_per_s"] for row in train_rows[-5:] if isinstance(row.get("tokens_per_s"), (int, float))
    ]
    events = jsonl_rows(os.path.join(out, "events.jsonl"))[-MAX_EVENTS:]
    result = {
        "out": out,
        "name": os.path.basename(out.rstrip("/")),
        "total_steps": config_steps(out),
        "last_step": train_rows[-1]["step"] if train_rows else None,
        "last_loss": train_rows[-1].get("loss") if train_rows else None,
        "elapsed_s": train_rows[-1].get("elapsed_s") if train_rows else None,
        "tokens_per_s": sum(recent) / len(recent) if recent else None,
        "best_tau": max(row["tau"] for row in eval_rows) if eval_rows else None,
        "last_tau": eval_rows[-1]["tau"] if eval_rows else None,
        "events": [event for event in events if "event" in event],
        "stretches": stretches_of(out),
        "record": newest_start(out),
    }
    if points:
        result["series"] = {
            "train": [
                [row["step"], row.get("loss"), row.get("tokens_per_s")] for row in thin(train_rows, points)
            ],
            "eval": [[row["step"], row["tau"]] for row in thin(eval_rows, points)],
        }
    return result


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "outs": {"type": "list", "elements": "path", "default": []},
            "root": {"type": "path"},
            "points": {"type": "int", "default": 0},
            "live": {"type": "list", "elements": "dict", "default": []},
        },
        supports_check_mode=True,
    )
    outs = list(module.params["outs"])
    root = module.params["root"]
    if root and os.path.isdir(root):
        outs += sorted(
            os.path.join(root, name) for name in os.listdir(root) if os.path.isdir(os.path.join(root, name))
        )
    runs = [summarize(out, module.params["points"]) for out in outs if os.path.isdir(out)]
    alive = {}
    # Launches the targets' own events name (those the controller's ledger may have lost).
    started = [e for run in runs for e in run["events"] if e.get("event") == "start" and e.get("start_time")]
    for launch in [*started, *module.params["live"]]:
        try:
            pid = int(launch.get("pid") or 0)
            start_time = int(launch["start_time"]) if launch.get("start_time") is not None else None
        except (TypeError, ValueError):
            continue
        if pid:
            found = probe(pid, start_time, launch.get("boot_id"), launch.get("run"))
            alive[str(pid)] = found["state"] == "running"
    module.exit_json(changed=False, runs=runs, alive=alive)


if __name__ == "__main__":
    main()
