#!/usr/bin/python
# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
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
        first; every output's run record (C(<out>/run.json)) and lock (C(<runs>/.<run>.lock)) are read,
        and the run to report is the live one, else the one O(recorded) names, else the newest.
      - RV(target.repair) says in one line where the controller's cache (O(recorded)) disagrees,
        RV(target.ended) where the run it holds as running has ended since, and RV(target.record) is
        the record to keep in the cache and the ledger.
    type: path
  out:
    description:
      - A run's output directory to inspect before a launch (RV(output)), its checkpoints, record and tau.
    type: path
  steps:
    description:
      - With O(out), the steps this launch asks for (C(-e steps), else the run profile's).
      - Unless O(steps_given), a run whose output records its own length (its run record, else its
        C(config.yml)) keeps it - a run is as long as it was started - and RV(output.steps) says which.
    type: int
  steps_given:
    description: Whether O(steps) was asked for (C(-e steps)), so that it wins over the recorded length.
    type: bool
    default: false
  disk_path:
    description: A path whose file system's free space is reported (RV(disk)), or its nearest existing parent.
    type: path
  min_free_mib:
    description:
      - With O(disk_path), the free space needed in MiB; at least room for the checkpoints the run may still
        add to O(out), each the size of its newest (see O(keep_checkpoints)).
    type: int
    default: 1024
  keep_checkpoints:
    description:
      - The run's C(train.keep_checkpoints). It keeps that many and the best-tau one, and writes the next
        before it removes the oldest, so O(out) may hold that many plus two; the disk needs room for those
        not there yet. 0 (every checkpoint kept) or not given, room for three.
    type: int
  wait_for:
    description: A regular expression; wait until a log line matches it.
    type: str
  wait_what:
    description:
      - What O(wait_for) waits for, in words (C(its first progress line)), for the messages; without
        it they name the regular expression.
    type: str
  wait_stage:
    description:
      - With O(wait_for), a matching line counts only once the run record's C(stage) is one of these
        (the data stage has passed its checks and begun, C(regenerating)), or the trainer has ended
        with exit status 0; a start refused after its first line fails the wait with its own reason.
    type: list
    elements: str
    default: []
  timeout:
    description: Seconds to wait for O(wait_for).
    type: float
    default: 300
extends_documentation_fragment:
  - dflash.ct200.trainer_record
author:
  - DFlash CT 200 team (!UNKNOWN)
"""

EXAMPLES = r"""
- name: Wait for the first progress line of the recorded trainer
  dflash.ct200.run_probe:
    recorded: "{{ trainer_run }}"
    wait_for: '^step \d+/\d+ '
    timeout: 600

- name: Read what the target runs, compared with the cached record
  dflash.ct200.run_probe:
    runs_dir: /workspace/runs
    recorded: "{{ trainer_run | default({}) }}"
"""

RETURN = r"""
state:
  description: none, running, exited or not_ours.
  type: str
  returned: always
pid:
  description: The PID looked at (the target's live run's with O(runs_dir)), null when none is recorded.
  type: int
  returned: always
alive:
  description:
    - Whether a process lives behind the PID (it may be another program; then RV(state) is C(not_ours)).
  type: bool
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
  description:
    - The latest progress line of the log (with O(runs_dir), of the run's metrics.jsonl first).
    - While the run regenerates its data (RV(stage)), that stage's progress from the run record.
  type: str
  returned: always
stage:
  description:
    - C(regenerating) while a live run's target regenerates its data before training (docs/DATA.md).
    - C(exiting) while a live run has ended its run (its run record says how, or says C(stage=exiting))
      and its process is on its way out, for instance waiting for its experiment trackers.
  type: str
  returned: when the run record says so
recorded_state:
  description: The state in the target's run record of a live run that is C(exiting) (finished, ..., running).
  type: str
  returned: with RV(stage) C(exiting)
exiting:
  description: What an C(exiting) run waits for, as its run record says (for instance its trackers), or null.
  type: str
  returned: with RV(stage) C(exiting)
data_only:
  description: Whether the regenerating run only prepares its data (C(--data-only), C(./dev.sh regen)).
  type: bool
  returned: with RV(stage)
last_eval:
  description: The latest eval row of metrics.jsonl, else of the log (step, tau, prompts).
  type: dict
  returned: always
log_tail:
  description: The last lines of the log.
  type: list
  elements: str
  returned: always
matched:
  description: With O(wait_for), the first log line that matched.
  type: str
  returned: when O(wait_for) matched
waited_s:
  description: With O(wait_for), seconds waited for the match.
  type: float
  returned: when O(wait_for) matched
gpu:
  description: With O(gpus), the host's GPU usage.
  type: dict
  returned: when O(gpus) is true
  contains:
    available:
      description: Whether nvidia-smi answered with at least one GPU.
      type: bool
    note:
      description: Why no GPU is listed (no C(nvidia-smi), its error), else empty.
      type: str
    gpus:
      description: Every GPU (index, uuid, memory_used_mib, utilization_pct, apps).
      type: list
      elements: dict
    problems:
      description: One line per busy GPU, naming its processes.
      type: list
      elements: str
    lines:
      description: One line per GPU, for a report.
      type: list
      elements: str
target:
  description: With O(runs_dir), what the target holds, see O(runs_dir).
  type: dict
  returned: when O(runs_dir) is given
  contains:
    record:
      description: The record to keep in the controller's cache and ledger.
      type: dict
    repair:
      description: One line where the controller's cache (O(recorded)) named another run, or null.
      type: str
    ended:
      description: One line where the run the cache holds as running has ended since it was cached, else null.
      type: str
    live_runs:
      description: The runs whose trainer is alive (run, run_id, pid, out, started_at).
      type: list
      elements: dict
output:
  description: With O(out), what the output holds before a launch.
  type: dict
  returned: when O(out) is given
  contains:
    path:
      description: O(out).
      type: str
    checkpoints:
      description: How many complete checkpoints it holds.
      type: int
    last_step:
      description: The step of the newest checkpoint, null when none.
      type: int
    last_checkpoint:
      description: The newest checkpoint's path, null when none.
      type: str
    checkpoint_mib:
      description: The newest checkpoint's size in MiB.
      type: float
    tau:
      description: The latest eval row of its metrics.jsonl.
      type: dict
    record_state:
      description: The state its run record says.
      type: str
    steps:
      description: The run's length for this launch - O(steps) when given, else the length the output
        records, else O(steps).
      type: int
    recorded_steps:
      description: The length the output records (run record, else config.yml); null when none.
      type: int
    finished:
      description: Whether the newest checkpoint is at or after RV(output.steps).
      type: bool
disk:
  description:
    - With O(disk_path), path, free_mib, required_mib, ok, and refusal (why the space would be short and
      the way out that works, in words).
  type: dict
  returned: when O(disk_path) is given
last_checkpoint:
  description:
    - The newest checkpoint of the reported run's output (step, path), from its checkpoint directory,
      and the steps of every checkpoint kept there (kept, oldest first; train.keep_checkpoints
      removes the rest).
  type: dict
  returned: with O(runs_dir)
exit_status:
  description:
    - The exit status as far as the record or the log tells (0 finished or stopped, 2 bad input,
      1 crash), else null.
  type: int
  returned: when the trainer has exited
exit_reason:
  description: What the exit status means, or why it is unknown.
  type: str
  returned: when the trainer has exited
run_state:
  description:
    - How the run ended, in the documented states (finished, stopped, failed, crashed), from its
      run record, else from the exit status (an unknown one is C(crashed), the process killed).
  type: str
  returned: when the trainer has exited
"""

import datetime
import os
import re
import time

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.dflash.ct200.plugins.module_utils import trainer_record
from ansible_collections.dflash.ct200.plugins.module_utils.gpu import gpu_report
from ansible_collections.dflash.ct200.plugins.module_utils.run_record import (
    checkpoints,
    last_metrics,
    read_record,
)
from ansible_collections.dflash.ct200.plugins.module_utils.trainer_proc import (
    ENDED_STATES,
    PROGRESS_RE,
    VERDICT_LINES,
    boot_id,
    describe_exit,
    exit_from_log,
    last_matching,
    last_tau,
    last_tau_in_log,
    probe,
    progress_line,
    reconcile,
    run_steps,
    tail,
    target_run,
    target_runs,
)

POLL_S = 0.2


def regen_progress_line(regen: dict | None) -> str | None:
    """The data stage's progress as the run record holds it, worded like its log line."""
    if not isinstance(regen, dict) or not isinstance(regen.get("conversations"), int):
        return None
    eta = regen.get("eta_s")
    eta_text = "?" if not isinstance(eta, (int, float)) else str(datetime.timedelta(seconds=int(max(0, eta))))
    return (
        f"regen: {regen['conversations']:,}/{regen.get('total', 0):,} conversations, "
        f"{regen.get('tokens', 0):,} tokens, {regen.get('tokens_per_s', 0):,.0f} tok/s, eta {eta_text}"
    )


def output_report(out: str, steps: int | None, steps_given: bool = False) -> dict:
    found = checkpoints(out)
    recorded_steps = run_steps(out) if found else None
    if recorded_steps and not steps_given:
        steps = recorded_steps
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
        "steps": steps,
        "recorded_steps": recorded_steps,
        "finished": bool(newest and steps and newest[0] >= steps),
    }


def checkpoint_room(keep: int | None, existing: int) -> int:
    """Checkpoints the run may still add to its output: train.keep_checkpoints K keeps the newest K
    and the best-tau one and writes the next before it removes the oldest, K + 2 at once; keeping
    every one (0), or K unknown, three (a floor: such a run grows without bound)."""
    if not keep:
        return 3
    return max(1, keep + 2 - existing)


def disk_report(path: str, min_free_mib: int, checkpoint_mib: float, room: int = 3) -> dict:
    existing = path
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing.rstrip("/")) or "/"
    info = os.statvfs(existing)
    free = info.f_bavail * info.f_frsize / 2**20
    required = max(min_free_mib, room * checkpoint_mib)
    return {
        "path": existing,
        "free_mib": round(free),
        "required_mib": round(required),
        "ok": free >= required,
        "refusal": disk_refusal(existing, free, min_free_mib, checkpoint_mib, room),
    }


def disk_refusal(path: str, free: float, min_free_mib: int, checkpoint_mib: float, room: int = 3) -> str:
    """Why the space is short and the way out that works: preflight_min_free_mib is only the floor
    where the checkpoints to come need less; where they need more, lowering it changes nothing."""
    checkpoints = room * checkpoint_mib
    have = f"{path} has {free:.0f} MiB free"
    if checkpoints > min_free_mib:
        return (
            f"{have}, {checkpoints:.0f} MiB are needed: room for {room} more checkpoint(s) of "
            f"{checkpoint_mib:.1f} MiB (the output's newest; train.keep_checkpoints decides how many a "
            f"run holds at once); preflight_min_free_mib={min_free_mib} is below that, so lowering it "
            "does not help. Free space there (a resume needs only the newest checkpoint), keep fewer "
            '(workspace_trainer_set: ["train.keep_checkpoints=N"] in the inventory), or give the run an '
            "output on a larger disk"
        )
    sized = f"; a checkpoint of this run takes {checkpoint_mib:.1f} MiB" if checkpoint_mib else ""
    return (
        f"{have}, {min_free_mib} MiB are needed (preflight_min_free_mib{sized}). Free space there, "
        "or lower preflight_min_free_mib in the inventory"
    )


def target_report(module: AnsibleModule) -> dict:
    """Status from the target's records and locks; the cached record only where the target has none."""
    params = module.params
    runs = with_cached_output(target_runs(params["runs_dir"]), params["recorded"])
    chosen = reconcile(params["recorded"], runs)
    run = chosen["run"]
    record = chosen["record"] or {}
    result = {
        "target": {
            "record": chosen["record"],
            "repair": chosen["repair"],
            "ended": chosen["ended"],
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
    target_record = run["record"] if run else {}
    if result["state"] == "running" and target_record.get("stage") == "regenerating":
        # The data stage (docs/DATA.md) notes its progress in the run record as it goes.
        result["stage"] = "regenerating"
        # ./dev.sh regen (trainer --data-only): no training follows.
        result["data_only"] = "--data-only" in (target_record.get("cmdline") or [])
        result["last_progress"] = regen_progress_line(target_record.get("regen")) or result["last_progress"]
    result["last_eval"] = (last_metrics(out)["eval"] if out else None) or last_tau_in_log(log)
    kept = checkpoints(out) if out else []
    newest = (kept[-1][0], str(kept[-1][1])) if kept else None
    result["last_checkpoint"] = (
        {"step": newest[0], "path": newest[1], "kept": [found[0] for found in kept]} if newest else None
    )
    if result["state"] == "running" and (
        target_record.get("stage") == "exiting" or target_record.get("state") in ENDED_STATES
    ):
        # The run has ended and its process is on its way out (docs/OPERATING.md): the target's record
        # says so, whatever the controller's cache still holds.
        result.update(stage="exiting", recorded_state=target_record.get("state"))
        result["exiting"] = target_record.get("exiting")
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


def with_cached_output(runs: list[dict], recorded: dict | None) -> list[dict]:
    """The target's runs under the runs directory, and the cached run's own output where it lies
    elsewhere (launched with another workspace): status needs no repeated -e to read its record."""
    out = recorded.get("out") if isinstance(recorded, dict) else None
    if not isinstance(out, str) or not out or any(run["record"].get("out") == out for run in runs):
        return runs
    cached = target_run(out)
    if cached is None:
        return runs
    return sorted([*runs, cached], key=lambda run: str(run["record"].get("started_at", "")), reverse=True)


def recorded_run(recorded: dict | None) -> dict | None:
    """The target's run (target_run) of the cached record, or None where its output holds another."""
    out = recorded.get("out") if isinstance(recorded, dict) else None
    run = target_run(out) if isinstance(out, str) and out else None
    if run is None or run["record"].get("run_id") != recorded.get("run_id"):
        return None
    return run


def recorded_exit(recorded: dict | None) -> dict | None:
    """How the recorded run ended as its run record says (the one source every view reads:
    docs/OPERATING.md), or None where the record does not say (killed, or no record)."""
    run = recorded_run(recorded)
    if run is None or run["live"] or run.get("exit_status") is None:
        return None
    return {"exit_status": run["exit_status"], "exit_reason": run["exit_reason"], "run_state": run["state"]}


RUN_ENDS = ("finished", "stopped", "failed", "crashed")


def run_state_of(verdict: dict) -> str:
    """The documented end state of an exit that its record does not state: as the status tells."""
    if verdict.get("run_state") in RUN_ENDS:
        return verdict["run_state"]
    status, reason = verdict.get("exit_status"), str(verdict.get("exit_reason") or "")
    if status == 0:
        return "stopped" if reason.startswith("stopped") else "finished"
    return "failed" if status == 2 else "crashed"


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
    if result["state"] in ("exited", "not_ours"):
        ended = recorded_exit(params["recorded"])
        if ended is None:
            ended = exit_from_log(tail(params["log"], VERDICT_LINES))
            run = recorded_run(params["recorded"])
            if ended["exit_status"] is None and run is not None and not run["live"]:
                ended.update(exit_reason=run["exit_reason"], run_state=run["state"])
        ended["run_state"] = run_state_of(ended)
        result.update(ended)
    return result


def stage_reached(module: AnsibleModule) -> bool:
    """Whether the run record's stage is one of O(wait_stage) (always, without it)."""
    wanted = module.params["wait_stage"]
    if not wanted:
        return True
    run = recorded_run(module.params["recorded"])
    return run is not None and run["record"].get("stage") in wanted


def ended_text(pid, what: str, result: dict) -> str:
    """How the trainer ended before what the wait waited for, in words, for the launch's message."""
    state = result.get("run_state") or run_state_of(result)
    shown = describe_exit(result)
    if state == "stopped":
        return f"the trainer (PID {pid}) was stopped before {what} (exit status: {shown}); the run is stopped"
    if state == "finished":
        return f"the trainer (PID {pid}) finished before {what} (exit status: {shown})"
    return f"the trainer (PID {pid}) ended before {what}: {state}, exit status: {shown}"


def wait(module: AnsibleModule, pattern: re.Pattern[str]) -> dict:
    params = module.params
    what = params["wait_what"] or f"a line matching {pattern.pattern!r}"
    started = time.monotonic()
    deadline = started + params["timeout"]
    while True:
        result = report(module)
        lines = tail(params["log"], 2000)
        matched = next((line for line in lines if pattern.search(line)), None)
        if matched and result["state"] == "running" and stage_reached(module):
            result["matched"] = matched
            result["waited_s"] = round(time.monotonic() - started, 2)
            return result
        if result["state"] != "running":
            time.sleep(POLL_S)  # let an exiting trainer's last lines reach the log
            result = report(module)
            matched = next((line for line in tail(params["log"], 2000) if pattern.search(line)), None)
            if matched and result.get("exit_status") == 0 and result.get("run_state") == "finished":
                # A short run (a data-only regeneration whose cache holds the data) may end cleanly
                # before a poll sees it run: it logged the line and ended well.
                result["matched"] = matched
                result["waited_s"] = round(time.monotonic() - started, 2)
                return result
            module.fail_json(
                msg=(
                    f"{ended_text(params['pid'], what, result)}. Last lines of {params['log']}:\n"
                    + "\n".join(result["log_tail"])
                ),
                **result,
            )
        if time.monotonic() >= deadline:
            module.fail_json(
                msg=(
                    f"the trainer (PID {params['pid']}) runs but has not reached {what} within "
                    f"{params['timeout']:.0f} s (it keeps running; stop it with ./dev.sh stop or raise "
                    f"run_wait_timeout). Last lines of {params['log']}:\n" + "\n".join(result["log_tail"])
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
            "wait_what": {"type": "str"},
            "wait_stage": {"type": "list", "elements": "str", "default": []},
            "gpus": {"type": "bool", "default": False},
            "max_memory_mib": {"type": "int", "default": 1024},
            "max_utilization_pct": {"type": "int", "default": 5},
            "timeout": {"type": "float", "default": 300},
            "runs_dir": {"type": "path"},
            **trainer_record.argument_spec(),
            "out": {"type": "path"},
            "steps": {"type": "int"},
            "steps_given": {"type": "bool", "default": False},
            "disk_path": {"type": "path"},
            "min_free_mib": {"type": "int", "default": 1024},
            "keep_checkpoints": {"type": "int"},
        },
        supports_check_mode=True,
    )
    trainer_record.identity(module)
    if module.params["wait_for"] and module.params["pid"]:
        try:
            pattern = re.compile(module.params["wait_for"])
        except re.error as exc:
            module.fail_json(msg=f"wait_for {module.params['wait_for']!r} is not a regular expression: {exc}")
        result = wait(module, pattern)
    else:
        result = report(module)
    params = module.params
    if params["out"]:
        result["output"] = output_report(params["out"], params["steps"], params["steps_given"])
    if params["disk_path"]:
        output = result["output"] if params["out"] else {"checkpoint_mib": 0, "checkpoints": 0}
        room = checkpoint_room(params["keep_checkpoints"], output["checkpoints"])
        mib = output["checkpoint_mib"]
        result["disk"] = disk_report(params["disk_path"], params["min_free_mib"], mib, room)
    if module.params["gpus"]:
        params = module.params
        result["gpu"] = gpu_report(module, params["max_memory_mib"], params["max_utilization_pct"])
    module.exit_json(changed=False, **result)


if __name__ == "__main__":
    main()
