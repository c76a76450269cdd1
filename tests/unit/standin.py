"""A stand-in trainer for the unit tests of trainer_start, run_probe and trainer_stop: a workspace
with a `run.sh` that execs `python -m trainer --run NAME` (the command line the modules look for)
and a `trainer` package of a few lines that behaves like the real one where the modules look:
the run record in `--out` (with the output lock it inherits), progress and eval lines in its log
and metrics.jsonl, and on SIGTERM a checkpoint file, the checkpoint line and `stopped at step N`.
It starts in a fraction of a second and stops itself after MAX_S, so a test that loses track of it
leaves nothing behind for long.

`--behave` (passed through the module's `args`) picks what it does: `train` (the default),
`bad-input` (an `error: ...` line, exit 2), `no-record` (never writes its run record),
`ignore-term` (SIGTERM ignored: only SIGKILL stops it), `finish` (two steps, `done: ...`, exit 0),
`checkpoint-every-step` (a checkpoint after each step, so that a stop rewrites the one just written),
and at a stop without a checkpoint: `write-fails-at-stop` (its write fails: an `error: ...` line, exit
1, the record as its supervisor leaves it), `killed-at-stop` (SIGKILL while it writes: the OOM killer)
and `dies-at-stop-unrecorded` (a crash that leaves its record saying running). A stop before the first
step says `nothing to checkpoint yet`, as the trainer does.
Checkpoints are written as the trainer writes them: a new file moved into place.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import time
from pathlib import Path

MAX_S = 60

TRAINER_MAIN = """
import json, os, signal, sys, time

MAX_S = {max_s}
args = sys.argv[1:]


def arg(name, default=None):
    return args[args.index(name) + 1] if name in args else default


run, out, behave = arg("--run"), arg("--out"), arg("--behave", "train")
delay = float(arg("--first-step-after", "0"))
pid = os.getpid()
step = 0


def say(line):
    print(line, flush=True)


def write_record(**fields):
    path = os.path.join(out, "run.json")
    try:
        with open(path) as handle:
            record = json.load(handle)
    except OSError:
        record = {{}}
    record.update(fields)
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)


def save():
    os.makedirs(os.path.join(out, "checkpoints"), exist_ok=True)
    path = os.path.join(out, "checkpoints", "step_%08d.pt" % step)
    with open(path + ".tmp", "wb") as handle:
        handle.write(b"checkpoint")
    os.replace(path + ".tmp", path)
    say("checkpoint saved step %d %s" % (step, path))


def on_term(signum, frame):
    say("signal SIGTERM: checkpointing and exiting")
    if step == 0:  # the real trainer's words for a stop before its first step
        say("nothing to checkpoint yet (training had not started)")
        say("stopped at step 0")
        if out:
            reason = "stopped at step 0, before training began"
            write_record(state="stopped", exit_status=0, exit_reason=reason)
        sys.exit(0)
    if behave == "write-fails-at-stop":
        error = (
            "cannot save the checkpoint of step %d in %s: No space left on device; the last intact "
            "checkpoint is none. Free space there and resume (-e resume=true)"
        ) % (step, os.path.join(out, "checkpoints"))
        say("error: " + error)
        write_record(
            state="stopped", exit_status=1, exit_reason="stopped by SIGTERM, then exit status 1: " + error,
            checkpoint_lost={{"step": step, "reason": error}},
        )
        sys.exit(1)
    if behave == "killed-at-stop":  # killed while it writes (the OOM killer); its supervisor's record
        reason = "stopped by SIGTERM, then killed by SIGKILL"
        write_record(state="stopped", exit_status=-9, exit_reason=reason)
        os.kill(pid, signal.SIGKILL)
    if behave == "dies-at-stop-unrecorded":
        say("RuntimeError: CUDA error: an illegal memory access was encountered")
        os._exit(1)
    if out:
        save()
        write_record(state="stopped", exit_status=0, exit_reason="stopped after a checkpoint")
    say("stopped at step %d" % step)
    sys.exit(0)


signal.signal(signal.SIGTERM, signal.SIG_IGN if behave == "ignore-term" else on_term)
say("run %s: stand-in trainer, pid %d" % (run, pid))
if behave == "bad-input":
    say("error: data.train_file /nonexistent/chat.jsonl does not exist; give a JSONL chat file")
    sys.exit(2)
if out and behave != "no-record":
    os.makedirs(out, exist_ok=True)
    with open("/proc/self/stat") as handle:
        start_time = int(handle.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/sys/kernel/random/boot_id") as handle:
        boot = handle.read().strip()
    write_record(
        format=1, run=run, run_id="%s-test-%d" % (run, pid), pid=pid, start_time=start_time,
        boot_id=boot, out=out, started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        steps=10, state="running",
    )
time.sleep(delay)
deadline = time.monotonic() + MAX_S
while time.monotonic() < deadline:
    step += 1
    say("step %d/10 loss 1.0000 lr 1.00e-04 tok/s 100" % step)
    if step % 2 == 0:
        say("eval step %d tau 1.50 prompts 4" % step)
    if out:
        with open(os.path.join(out, "metrics.jsonl"), "a") as handle:
            handle.write(json.dumps({{"kind": "train", "step": step, "loss": 1.0, "lr": 1e-4}}) + "\\n")
    if out and behave == "checkpoint-every-step":
        save()
    if behave == "finish" and step == 2:
        say("done: 2 steps")
        sys.exit(0)
    time.sleep(0.1)
"""


def workspace(root: Path, run: str = "nographs") -> Path:
    """A workspace under root with run.sh and the stand-in trainer package; returns run.sh's path."""
    package = root / "trainer"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(TRAINER_MAIN.format(max_s=MAX_S))
    script = root / "run.sh"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m trainer --run {run} "$@"\n')
    script.chmod(0o750)
    return script


def not_the_trainer(root: Path) -> Path:
    """A run.sh whose process is some other program (it sleeps, then exits by itself)."""
    root.mkdir(parents=True, exist_ok=True)
    script = root / "run.sh"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -c "import time; time.sleep({MAX_S})"\n')
    script.chmod(0o750)
    return script


def started_pid(result: dict) -> int | None:
    """The PID a trainer_start result names (its `pid`, else the `PID N` of its message)."""
    if result.get("pid"):
        return int(result["pid"])
    match = re.search(r"\bPID (\d+)", result.get("msg", ""))
    return int(match.group(1)) if match else None


class Started:
    """The processes a test started (trainer_start runs in the test process, so they are its
    children): killed by PID and reaped on exit, whatever the test did."""

    def __init__(self) -> None:
        self.pids: list[int] = []

    def add(self, result: dict) -> int | None:
        pid = started_pid(result)
        if pid:
            self.pids.append(pid)
        return pid

    def __enter__(self) -> Started:
        return self

    def __exit__(self, *exc) -> None:
        for pid in self.pids:
            kill_and_reap(pid)


def kill_and_reap(pid: int) -> None:
    """SIGKILL a child of this process and wait for it (a zombie until then; reaped once, so the PID
    cannot have been reused by another process when the signal is sent)."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def alive(pid: int) -> bool:
    """True while the process runs (a zombie, exited but not reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def gone_within(pid: int, seconds: float) -> bool:
    """Wait (bounded) until the process is gone; True when it is."""
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def logged_within(log: Path, text: str, seconds: float) -> bool:
    """Wait (bounded) until the log holds a line containing text; True when it does."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if log.exists() and text in log.read_text():
            return True
        time.sleep(0.05)
    return False
