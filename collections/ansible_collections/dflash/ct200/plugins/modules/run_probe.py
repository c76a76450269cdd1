#!/usr/bin/python
"""Inspect the recorded trainer of a host (and its GPUs), optionally waiting for a line in its log."""

from __future__ import annotations

DOCUMENTATION = r"""
module: run_probe
short_description: Inspect a DFlash trainer process, its log and the host's GPUs
description:
  - Classifies a recorded trainer as C(none), C(running), C(exited) or C(not_ours) (its PID now
    belongs to another process, or the host rebooted), from the PID, its start time and the boot id.
  - Reports the latest progress line, the latest tau of C(metrics.jsonl) (else of the log's last
    C(eval step) line, as on the hosts of a multi-host run that do not hold rank 0) and the log's tail.
  - With O(wait_for), waits until a log line matches while the trainer lives, and fails with the
    exit status (as far as the log tells) and the log's tail when it dies or the time runs out.
  - With O(gpus), also reads GPU usage with C(nvidia-smi) (C(--query-gpu=index,memory.used,utilization.gpu),
    C(--query-gpu=index,uuid), C(--query-compute-apps=pid,gpu_uuid,process_name,used_memory)) and lists
    every busy GPU with its processes in RV(gpu.problems). One module run answers both questions, as
    each module run costs about half a second on a small host.
  - Never fails on a busy GPU or a missing C(nvidia-smi); the caller decides.
options:
  gpus:
    description: Also read GPU usage.
    type: bool
    default: false
  max_memory_mib:
    description: With O(gpus), used memory above this many MiB makes a GPU busy.
    type: int
    default: 1024
  max_utilization_pct:
    description: With O(gpus), utilization above this percentage makes a GPU busy.
    type: int
    default: 5
  pid:
    description: The recorded PID; 0 or absent means no run is recorded.
    type: int
  start_time:
    description: Field 22 of /proc/<pid>/stat recorded at launch.
    type: int
  boot_id:
    description: The boot id recorded at launch.
    type: str
  run:
    description: The run name the trainer's command line must carry (C(--run NAME)).
    type: str
  log:
    description: The run's log (the trainer's stdout and stderr).
    type: path
  metrics:
    description: The run's metrics.jsonl.
    type: path
  tail_lines:
    description: How many lines of the log to return.
    type: int
    default: 20
  runs_dir:
    description:
      - The workspace's runs directory (C(<workspace>/runs)). With it, the truth comes from the target
        first: every output's run record (C(<out>/run.json)) and lock (C(<runs>/.<run>.lock)) are read,
        and the run to report is the live one, else the one O(recorded) names, else the newest.
      - RV(target.repair) says in one line where the controller's cache (O(recorded)) disagrees, and
        RV(target.record) is the record to keep in the cache and the ledger.
    type: path
  recorded:
    description: The controller's cached record of this host's run (host fact C(trainer_run)); may be empty.
    type: dict
  out:
    description:
      - A run's output directory to inspect before a launch (RV(output)): its checkpoints, record and tau.
    type: path
  steps:
    description: With O(out), the steps the run is configured for (RV(output.finished)).
    type: int
  disk_path:
    description: A path whose file system's free space is reported (RV(disk)), or its nearest existing parent.
    type: path
  min_free_mib:
    description:
      - With O(disk_path), the free space needed in MiB; at least three times the newest checkpoint of O(out).
    type: int
    default: 1024
  wait_for:
    description: A regular expression; wait until a log line matches it.
    type: str
  timeout:
    description: Seconds to wait for O(wait_for).
    type: float
    default: 300
author:
  - DFlash CT 200 team
"""

EXAMPLES = r"""
- name: Wait for the first progress line
  dflash.ct200.run_probe:
    pid: "{{ trainer_run.pid }}"
    start_time: "{{ trainer_run.start_time }}"
    boot_id: "{{ trainer_run.boot_id }}"
    log: "{{ trainer_run.log }}"
    wait_for: '^step \d+/\d+ '
    timeout: 600
"""

RETURN = r"""
state:
  description: none, running, exited or not_ours.
  type: str
  returned: always
start_time:
  description: Start time of the process now behind the PID (clock ticks since boot).
  type: int
  returned: when the PID is alive
boot_id:
  description: The current boot id.
  type: str
  returned: always
cmdline:
  description: The command line behind the PID.
  type: list
  elements: str
  returned: always
last_progress:
  description: The latest progress line of the log.
  type: str
  returned: always
last_eval:
  description: The latest eval row of metrics.jsonl, else of the log (step, tau, prompts).
  type: dict
  returned: always
log_tail:
  description: The last lines of the log.
  type: list
  elements: str
  returned: always
gpu:
  description:
    - With O(gpus), available, note, gpus (index, uuid, memory_used_mib, utilization_pct, apps),
      problems, lines.
  type: dict
  returned: when O(gpus) is true
target:
  description:
    - With O(runs_dir), what the target holds (record, repair, live_runs), see O(runs_dir).
  type: dict
  returned: when O(runs_dir) is given
output:
  description:
    - With O(out), checkpoints (count), last_step, last_checkpoint, checkpoint_mib, tau (the latest
      eval row), record_state, finished (last_step >= O(steps)).
  type: dict
  returned: when O(out) is given
disk:
  description: With O(disk_path), path, free_mib, required_mib, ok.
  type: dict
  returned: when O(disk_path) is given
last_checkpoint:
  description: The newest checkpoint of the reported run's output (step, path), from its checkpoint directory.
  type: dict
  returned: with O(runs_dir)
exit_status:
  description:
    - The exit status as far as the log tells (0 finished or stopped, 2 bad input, 1 crash), else null.
  type: int
  returned: when the trainer has exited
"""

import os
import re
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.dflash.ct200.plugins.module_utils.gpu import gpu_report
from ansible_collections.dflash.ct200.plugins.module_utils.run_record import (
    checkpoints,
    last_metrics,
    read_record,
)
from ansible_collections.dflash.ct200.plugins.module_utils.trainer_proc import (
    PROGRESS_RE,
    VERDICT_LINES,
    boot_id,
    describe_exit,
    exit_from_log,
    last_matching,
    last_tau,
    last_tau_in_log,
    newest_checkpoint,
    probe,
    progress_line,
    reconcile,
    tail,
    target_runs,
)

POLL_S = 0.2


def output_report(out: str, steps: int | None) -> dict:
    found = checkpoints(out)
    newest = found[-1] if found else None
    record = read_record(out) or {}
    size = 0
    if newest:
        try:
            size = os.path.getsize(newest[1])
        except OSError:
            size = 0
    tau = last_metrics(out)["eval"]
    return {
        "path": out,
        "checkpoints": len(found),
        "last_step": newest[0] if newest else None,
        "last_checkpoint": str(newest[1]) if newest else None,
        "checkpoint_mib": round(size / 2**20, 1),
        "tau": tau,
        "record_state": record.get("state"),
        "finished": bool(newest and steps and newest[0] >= steps),
    }


def disk_report(path: str, min_free_mib: int, checkpoint_mib: float) -> dict:
    existing = path
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing.rstrip("/")) or "/"
    info = os.statvfs(existing)
    free = info.f_bavail * info.f_frsize / 2**20
    required = max(min_free_mib, 3 * checkpoint_mib)
    return {
        "path": existing,
        "free_mib": round(free),
        "required_mib": round(required),
        "ok": free >= required,
    }


def target_report(module: AnsibleModule) -> dict:
    """Status from the target's records and locks; the cached record only where the target has none."""
    params = module.params
    runs = target_runs(params["runs_dir"])
    chosen = reconcile(params["recorded"], runs)
    run = chosen["run"]
    record = chosen["record"] or {}
    result = {
        "target": {
            "record": chosen["record"],
            "repair": chosen["repair"],
            "live_runs": [
                {key: item["record"].get(key) for key in ("run", "run_id", "pid", "out", "started_at")}
                for item in runs
                if item["live"]
            ],
        }
    }
    log = record.get("log") or params["log"]
    out = record.get("out")
    if run is None:
        now = probe(record.get("pid"), record.get("start_time"), record.get("boot_id"), record.get("run"))
        result.update(now)
    else:
        result.update(run["probe"])
        result["state"] = "running" if run["live"] else "exited"
        result["pid"] = record.get("pid")
    result.setdefault("boot_id", boot_id())
    result["log_tail"] = tail(log, params["tail_lines"])
    steps = (run["record"].get("steps") if run else None) or None
    result["last_progress"] = progress_line(out, steps) or last_matching(log, PROGRESS_RE)
    result["last_eval"] = (last_metrics(out)["eval"] if out else None) or last_tau_in_log(log)
    newest = newest_checkpoint(out)
    result["last_checkpoint"] = {"step": newest[0], "path": newest[1]} if newest else None
    if result["state"] == "exited":
        if run is not None and run.get("exit_status") is not None:
            result.update(exit_status=run["exit_status"], exit_reason=run["exit_reason"])
        else:
            # No exit in the record (killed, or a rank's torchrun report): what the log says, if anything.
            verdict = exit_from_log(tail(log, VERDICT_LINES))
            if verdict["exit_status"] is None and run is not None:
                verdict["exit_reason"] = run["exit_reason"]
            result.update(verdict)
    return result


def report(module: AnsibleModule) -> dict:
    params = module.params
    if params["runs_dir"]:
        return target_report(module)
    result = probe(params["pid"], params["start_time"], params["boot_id"], params["run"])
    result.setdefault("boot_id", boot_id())
    log_tail = tail(params["log"], params["tail_lines"])
    result["log_tail"] = log_tail
    result["last_progress"] = last_matching(params["log"], PROGRESS_RE)
    result["last_eval"] = last_tau(params["metrics"]) or last_tau_in_log(params["log"])
    if result["state"] == "exited":
        result.update(exit_from_log(tail(params["log"], VERDICT_LINES)))
    return result


def wait(module: AnsibleModule, pattern: re.Pattern[str]) -> dict:
    params = module.params
    started = time.monotonic()
    deadline = started + params["timeout"]
    while True:
        result = report(module)
        lines = tail(params["log"], 2000)
        matched = next((line for line in lines if pattern.search(line)), None)
        if matched and result["state"] == "running":
            result["matched"] = matched
            result["waited_s"] = round(time.monotonic() - started, 2)
            return result
        if result["state"] != "running":
            time.sleep(POLL_S)  # let an exiting trainer's last lines reach the log
            result = report(module)
            shown = describe_exit(result)
            module.fail_json(
                msg=(
                    f"the trainer (PID {params['pid']}) is {result['state'].replace('_', ' ')} before "
                    f"logging a line matching {pattern.pattern!r}; exit status: {shown}. "
                    f"Last lines of {params['log']}:\n" + "\n".join(result["log_tail"])
                ),
                **result,
            )
        if time.monotonic() >= deadline:
            module.fail_json(
                msg=(
                    f"the trainer (PID {params['pid']}) is alive but logged no line matching "
                    f"{pattern.pattern!r} within {params['timeout']:.0f} s (it keeps running; stop it with "
                    f"./dev.sh stop or raise run_wait_timeout). Last lines of {params['log']}:\n"
                    + "\n".join(result["log_tail"])
                ),
                **result,
            )
        time.sleep(POLL_S)


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "pid": {"type": "int"},
            "start_time": {"type": "int"},
            "boot_id": {"type": "str"},
            "run": {"type": "str"},
            "log": {"type": "path"},
            "metrics": {"type": "path"},
            "tail_lines": {"type": "int", "default": 20},
            "wait_for": {"type": "str"},
            "gpus": {"type": "bool", "default": False},
            "max_memory_mib": {"type": "int", "default": 1024},
            "max_utilization_pct": {"type": "int", "default": 5},
            "timeout": {"type": "float", "default": 300},
            "runs_dir": {"type": "path"},
            "recorded": {"type": "dict"},
            "out": {"type": "path"},
            "steps": {"type": "int"},
            "disk_path": {"type": "path"},
            "min_free_mib": {"type": "int", "default": 1024},
        },
        supports_check_mode=True,
    )
    if module.params["wait_for"] and module.params["pid"]:
        result = wait(module, re.compile(module.params["wait_for"]))
    else:
        result = report(module)
    params = module.params
    if params["out"]:
        result["output"] = output_report(params["out"], params["steps"])
    if params["disk_path"]:
        checkpoint_mib = result["output"]["checkpoint_mib"] if params["out"] else 0
        result["disk"] = disk_report(params["disk_path"], params["min_free_mib"], checkpoint_mib)
    if module.params["gpus"]:
        params = module.params
        result["gpu"] = gpu_report(module, params["max_memory_mib"], params["max_utilization_pct"])
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
