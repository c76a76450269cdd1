"""Helpers shared by the trainer modules: read a process from /proc and the trainer's log.

A PID alone does not identify a process: PIDs are reused. A trainer is identified by its PID,
its start time (field 22 of /proc/<pid>/stat, clock ticks since boot) and the boot id, as
recorded at launch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import time
from itertools import pairwise
from pathlib import Path

from ansible_collections.dflash.ct200.plugins.module_utils.run_record import (
    RECORD_FORMAT,
    checkpoints,
    last_metrics,
    lock_holder,
    lock_path,
    read_record,
    record_problems,
    sound_fields,
    utc_now,
    write_record,
)

PROGRESS_RE = re.compile(r"^step (\d+)/\d+ ")  # its group: the step
# Lines of the log read for how the trainer ended: torchrun's failure report alone is some 40 lines,
# and the trainer's own verdict (an `error: ...` line) comes before it.
VERDICT_LINES = 400
CHECKPOINT_RE = re.compile(r"^checkpoint saved step \d+ ")
CONFIG_STEPS_RE = re.compile(r"^\s+steps:\s*(\d+)\s*$")


def config_steps(out: str) -> int | None:
    """train.steps of <out>/config.yml (the trainer writes it at every start), without a YAML parser."""
    try:
        with open(os.path.join(out, "config.yml"), encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    section = None
    for line in lines:
        if line and not line[0].isspace():
            section = line.rstrip(":").strip()
        elif section == "train" and (match := CONFIG_STEPS_RE.match(line)):
            return int(match.group(1))
    return None


def run_steps(out: str) -> int | None:
    """The steps an output's run was started with: its record's, else its config.yml's (a run
    whose record was lost still knows its length), None where neither says."""
    record = read_record(out)
    steps = record.get("steps") if isinstance(record, dict) else None
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
        return steps
    return config_steps(out)


def boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
        return handle.read().strip()


def read_stat(pid: int) -> dict | None:
    """Return state and start time of a process, or None where it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as handle:
            raw = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) is in parentheses and may itself contain spaces or ')'.
    rest = raw[raw.rindex(")") + 2 :].split()
    return {"state": rest[0], "start_time": int(rest[19])}


def read_cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            raw = handle.read()
    except (FileNotFoundError, ProcessLookupError):
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def is_trainer_cmdline(cmdline: list[str], run: str | None = None) -> bool:
    """True when the command line runs the trainer package (python -m trainer, also under torchrun)."""
    runs_trainer = any(a == "-m" and b == "trainer" for a, b in pairwise(cmdline))
    if not runs_trainer:
        return False
    if run is None:
        return True
    return any(a == "--run" and b == run for a, b in pairwise(cmdline))


def probe(pid: int | None, start_time: int | None, recorded_boot_id: str | None, run: str | None) -> dict:
    """Classify a recorded trainer: none, running, exited or not_ours (the PID now belongs to another)."""
    if not pid:
        return {"state": "none", "alive": False, "pid": None, "cmdline": []}
    stat = read_stat(pid)
    current_boot = boot_id()
    if stat is None or stat["state"] in ("Z", "X"):
        return {"state": "exited", "alive": False, "pid": pid, "cmdline": []}
    cmdline = read_cmdline(pid)
    same_boot = recorded_boot_id is None or recorded_boot_id == current_boot
    same_start = start_time is None or start_time == stat["start_time"]
    if not (same_boot and same_start):
        # After a reboot or once the PID was reused, the recorded trainer is gone.
        state = "not_ours"
    elif not cmdline:
        # Our process, but its memory is already released: it is exiting.
        return {"state": "exited", "alive": False, "pid": pid, "cmdline": []}
    elif is_trainer_cmdline(cmdline, run):
        state = "running"
    else:
        state = "not_ours"
    return {
        "state": state,
        "alive": True,
        "pid": pid,
        "cmdline": cmdline,
        "start_time": stat["start_time"],
        "boot_id": current_boot,
    }


def tail(path: str | None, lines: int) -> list[str]:
    """The last lines of a text file (bounded read from the end), or [] where it does not exist."""
    if not path:
        return []
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - 64 * 1024))
            data = handle.read()
    except FileNotFoundError:
        return []
    text = data.decode("utf-8", "replace").replace("\r", "\n")
    return text.splitlines()[-lines:] if lines > 0 else []


def last_matching(path: str | None, pattern: re.Pattern[str]) -> str | None:
    for line in reversed(tail(path, 2000)):
        if pattern.search(line):
            return line
    return None


def last_tau(metrics_path: str | None) -> dict | None:
    """The latest eval row of metrics.jsonl ({"kind": "eval", "step", "tau", ...}), or None."""
    if not metrics_path:
        return None
    for line in reversed(tail(metrics_path, 2000)):
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a row being written right now
        if isinstance(row, dict) and row.get("kind") == "eval" and "tau" in row:
            return row
    return None


EVAL_RE = re.compile(r"^eval step (\d+) tau ([0-9.]+) prompts (\d+)")


def last_tau_in_log(log_path: str | None) -> dict | None:
    """The latest evaluation line of the log as a metrics row, or None: what a host other than rank
    0's has (in a multi-host run rank 0 alone writes metrics.jsonl; every host logs the line)."""
    for line in reversed(tail(log_path, 2000)):
        match = EVAL_RE.match(line)
        if match:
            step, tau, prompts = match.groups()
            return {"kind": "eval", "step": int(step), "tau": float(tau), "prompts": int(prompts)}
    return None


# The trainer's `error:` lines that end it with exit status 1, not bad input (trainer/exits.py): a
# full disk, a checkpoint it could not write (a stop's, the end's), a regeneration worker or a
# training worker that failed, a GPU out of memory in the step. Its record may not say so where
# no space was left for it. Every other `error:` line is bad input (status 2).
CRASH_ERROR_RE = re.compile(
    r"^error: (disk full |cannot save the checkpoint |the regeneration worker on |worker \d+ failed"
    r"|\S+ ran out of memory in the training step)"
)
# torchrun's own report of a failed rank (process topology): "... failed (exitcode: 2) local_rank: 0 ...".
TORCHRUN_FAILED_RE = re.compile(r"\bfailed \(exitcode: (-?\d+)\) local_rank: \d+")


def exit_from_log(lines: list[str]) -> dict:
    """What the log says about how the trainer ended (the exit status is only knowable from it:
    the trainer is not a child of the module, so nobody here can wait() for it).

    Under torchrun (process topology) the log ends with torchrun's report of the first rank that
    failed, its traceback and exit code: the trainer's own verdict is in the lines before that
    report (an `error: ...` line, a traceback), and the rank's exit code is the run's status.
    """
    for index, line in enumerate(lines):
        match = TORCHRUN_FAILED_RE.search(line)
        if match:
            code = int(match.group(1))
            own = _verdict(lines[:index])
            if own["exit_status"] is not None:
                return own
            what = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
            return {"exit_status": code, "exit_reason": f"a rank {what} (torchrun's report in the log)"}
    return _verdict(lines)


def describe_exit(verdict: dict) -> str:
    """`2 (bad input: ...)`, or that the status is unknown and what is known (`killed: ...` from
    the run record), else that the log does not tell, for messages."""
    if verdict.get("exit_status") is None:
        reason = verdict.get("exit_reason")
        if reason and not str(reason).startswith("unknown"):
            return f"unknown ({reason})"
        return "unknown (the log does not say)"
    return f"{verdict['exit_status']} ({verdict['exit_reason']})"


def _verdict(lines: list[str]) -> dict:
    for line in reversed(lines):
        if line.startswith("done: "):
            return {"exit_status": 0, "exit_reason": "finished"}
        if line.startswith("stopped at step "):
            return {"exit_status": 0, "exit_reason": "stopped after a checkpoint"}
        if CRASH_ERROR_RE.match(line):
            return {"exit_status": 1, "exit_reason": "crashed: " + line[len("error: ") :]}
        if line.startswith("error: diverged: "):
            return {"exit_status": 2, "exit_reason": line[len("error: ") :]}
        if line.startswith("error: "):
            return {"exit_status": 2, "exit_reason": "bad input: " + line[len("error: ") :]}
        if line.startswith("Traceback ") or line.startswith("RuntimeError") or "Error: " in line:
            return {"exit_status": 1, "exit_reason": "crashed: " + line}
    return {"exit_status": None, "exit_reason": "unknown (killed, or the log says nothing)"}


# The truth on the target: the run records and output locks under the workspace's runs directory
# (module_utils/run_record.py is trainer/run/runrecord.py, linked: one owner of the format).

# One vocabulary of end states (docs/OPERATING.md, "End states and exit statuses"): what the record
# says is what status, the ledger and the history say.
ENDED_STATES = {"finished": "finished", "stopped": "stopped", "failed": "failed", "crashed": "crashed"}
KILLED_REASON = (
    "killed: it ended without closing its run record (SIGKILL, out of memory, or the host went down)"
)


def _outputs(runs_dir: str | None) -> list:
    if not runs_dir:
        return []
    try:
        children = sorted(Path(runs_dir).iterdir())
    except OSError:
        return []
    # Outputs moved aside by a fresh start (<run>.<time>) keep their records but are history.
    return [child for child in children if child.is_dir() and "." not in child.name]


RUN_ID_ENV = b"DFLASH_RUN_ID="  # what trainer.launch puts in the environment it execs with


def _started_at(start_ticks: int) -> str | None:
    """A process's start as UTC time, from its start in clock ticks since boot (/proc/stat btime)."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            btime = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
        started = btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError):
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))


LOST = "the run record was lost; rebuilt from the process that holds the output's lock"


def rebuilt_record(out, holder: int, kept: dict | None = None, why: str = LOST) -> dict | None:
    """The run record of a live trainer whose record was lost (<out>/run.json deleted) or damaged
    (`kept`: its sound fields), rebuilt from what the target knows: the lock holder's process
    (start time, command line, the run id in its environment, the log its stdout goes to) and the
    output's config.yml. Written back to <out>/run.json, so that the trainer notes its end there
    again. None where the holder is not a trainer of this output."""
    stat = read_stat(holder)
    run = Path(out).name
    cmdline = read_cmdline(holder)
    if stat is None or stat["state"] in ("Z", "X") or not is_trainer_cmdline(cmdline, run):
        return None
    try:
        with open(f"/proc/{holder}/environ", "rb") as handle:
            environ = handle.read().split(b"\0")
    except OSError:
        environ = []
    run_id = next((v[len(RUN_ID_ENV) :].decode() for v in environ if v.startswith(RUN_ID_ENV)), None)
    try:
        log = os.readlink(f"/proc/{holder}/fd/1")
    except OSError:
        log = None
    record = {
        "format": RECORD_FORMAT,
        "run": run,
        "run_id": run_id or f"{run}-rebuilt-{holder}",
        "pid": holder,
        "start_time": stat["start_time"],
        "boot_id": boot_id(),
        "host": os.uname().nodename,
        "out": str(out),
        "log": log if log and log.startswith("/") else None,
        "started_at": _started_at(stat["start_time"]),
        "steps": run_steps(str(out)),
        "cmdline": cmdline,
        "state": "running",
    }
    record = {**(kept or {}), **{key: value for key, value in record.items() if value is not None}}
    record["rebuilt"] = why
    if kept and kept.get("run_id"):
        record["run_id"] = kept["run_id"]
    with contextlib.suppress(OSError):  # reported all the same: the lock says it runs
        write_record(out, record)
    return record


def damage_text(problems: dict) -> str:
    return f"the run record was damaged ({'; '.join(problems.values())})"


def closed_record(out, record: dict, problems: dict) -> dict:
    """The record of a run whose process is gone, closed with what is known, and written back
    (whoever first sees it dead closes it: status, stop, a launch). A record still saying running
    was killed (the process that ends a run closes its record first): `crashed`, exit status
    unknown. A damaged record keeps its sound fields. The output's lock is taken for the write, so
    that a start writing its own record at that instant is never overwritten; where a start holds
    it, nothing is written."""
    closed = sound_fields(record)
    damage = damage_text(problems)
    if problems:
        closed["repaired"] = f"{damage}; repaired by the controller, no process holds the output"
    if closed.get("state", "running") == "running":
        reason = f"unknown: {damage} and its process is gone" if problems else KILLED_REASON
        closed.update(state="crashed", exit_status=None, exit_reason=reason, closed_at=utc_now())
    try:
        fd = os.open(lock_path(out), os.O_RDWR | os.O_CREAT, 0o640)
    except OSError:
        return closed  # reported all the same; the next look tries again
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if read_record(out) == record:
            write_record(out, closed)
    except OSError:
        pass  # a start holds the lock now, or the disk refuses: the record is left as it is
    finally:
        os.close(fd)
    return closed


def target_run(out) -> dict | None:
    """One output's record with what the target says now: live (its lock is held by our trainer),
    the state for the controller's record and the exit as the record tells it. A live lock holder
    whose record was lost or damaged (wrong types) gets its record rebuilt (rebuilt_record): the
    lock is the last word. A run whose process is gone and whose record still says running, or is
    damaged, gets its record closed (closed_record): only documented states leave here."""
    record = read_record(out)
    holder = lock_holder(out)
    problems = record_problems(record) if record is not None else {}
    if (record is None or problems or not record.get("run_id")) and holder:
        kept = sound_fields(record) if record is not None else None
        rebuilt = rebuilt_record(out, holder, kept, damage_text(problems) if problems else LOST)
        if rebuilt is not None:
            record, problems = rebuilt, {}
    if record is None or not record.get("run_id") or "run_id" in problems:
        return None
    if "pid" in problems:
        now = {"state": "exited", "alive": False, "pid": None, "cmdline": []}
    else:
        now = probe(record.get("pid"), record.get("start_time"), record.get("boot_id"), record.get("run"))
    # The recorded PID with its start time, boot id and command line is the run's own process, alive:
    # live, whatever /proc/locks shows (inside some containers it lists no holder for a held lock).
    live = now["state"] == "running"
    if holder and not live and holder != record.get("pid"):
        # Held by a start that has not written its record yet: the holder is the run to see.
        live, now = True, {"state": "running", "alive": True, "pid": holder}
    if not live and (problems or record.get("state", "running") not in ENDED_STATES):
        record = closed_record(out, record, problems)
    if live:
        state, exit_info = "running", {}
    else:
        state = ENDED_STATES[record["state"]]
        exit_info = {"exit_status": record.get("exit_status"), "exit_reason": record.get("exit_reason")}
    return {"record": record, "live": live, "holder": holder, "probe": now, "state": state, **exit_info}


def target_runs(runs_dir: str | None) -> list[dict]:
    found = [run for run in (target_run(out) for out in _outputs(runs_dir)) if run]
    return sorted(found, key=lambda run: str(run["record"].get("started_at", "")), reverse=True)


CONTROLLER_FIELDS = ("run_id", "run", "pid", "start_time", "boot_id", "log", "out", "started_at")


def reconcile(recorded: dict | None, runs: list[dict]) -> dict:
    """Which run the controller should see, and whether its cache disagrees with the target.

    Returns {"run": the chosen target run or None, "record": the controller record to keep,
    "repair": one line saying what was wrong with the cache, or None, "ended": one line saying
    that the cached run has ended since the controller last looked, or None}. The controller
    cannot see a run end, so a run the cache holds as running that has ended is news, not a fault
    of the cache: it is said in "ended", and a repair only where the cache names another run than the
    target. A live run wins (the one the cache names if several live), else the run the cache
    names, else the newest on the target. A cached final state (stopped by stop.yml, failed at
    launch) is kept: it says what happened.
    """
    recorded = recorded if isinstance(recorded, dict) else {}
    by_id = {run["record"]["run_id"]: run for run in runs}
    live = [run for run in runs if run["live"]]
    cached = by_id.get(recorded.get("run_id"))
    if live:
        chosen = cached if cached in live else live[0]
    elif cached:
        chosen = cached
    elif runs and str(runs[0]["record"].get("started_at", "")) >= str(recorded.get("started_at", "")):
        chosen = runs[0]
    else:
        return {"run": None, "record": recorded or None, "repair": None, "ended": None}
    truth = {key: chosen["record"].get(key) for key in CONTROLLER_FIELDS}
    if chosen["live"] and chosen["probe"].get("pid") != truth["pid"]:
        truth["pid"] = chosen["probe"]["pid"]
    if recorded.get("run_id") != truth["run_id"]:
        record = {**truth, "state": chosen["state"]}
        had = f"run {recorded['run_id']}" if recorded.get("run_id") else "no run"
        repair = (
            f"the controller's cache had {had}; the target holds run {truth['run_id']} "
            f"({chosen['state']}, PID {truth['pid']}): cache and ledger repaired"
        )
        return {"run": chosen, "record": record, "repair": repair, "ended": None}
    record = {**recorded, **{key: value for key, value in truth.items() if value is not None}}
    if recorded.get("state", "running") == "running" and chosen["state"] != "running":
        record["state"] = chosen["state"]
        ended = f"run {truth['run_id']} has {chosen['state']} since the last look: record and ledger updated"
        return {"run": chosen, "record": record, "repair": None, "ended": ended}
    return {"run": chosen, "record": record, "repair": None, "ended": None}


def progress_line(out: str | None, steps: int | None) -> str | None:
    """The latest train row of <out>/metrics.jsonl as a progress line, or None."""
    row = last_metrics(out)["train"] if out else None
    if not row:
        return None
    total = f"/{steps}" if steps else ""
    return (
        f"step {row.get('step')}{total} loss {row.get('loss', 0):.4f} lr {row.get('lr', 0):.2e} "
        f"tok/s {row.get('tokens_per_s', 0):.0f}"
    )


def newest_checkpoint(out: str | None) -> tuple[int, str] | None:
    found = checkpoints(out) if out else []
    return (found[-1][0], str(found[-1][1])) if found else None
