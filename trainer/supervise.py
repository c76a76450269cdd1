"""Keep a threaded run going through crashes: `python -m trainer.supervise [--max-restarts N]
[--backoff-s S] -m trainer -- TRAINER ARGS`.

trainer.launch execs this for the threaded topology, so the PID that launch recorded (and that
stop.yml signals) is this supervisor's. It runs the trainer as its child and:
- forwards SIGTERM/SIGINT to it: a stop is for good, the trainer checkpoints and exits 0, nothing
  restarts;
- on a crash (exit status 1, or killed by a signal it did not forward) starts it again with
  `--resume` (from the newest valid checkpoint) after --backoff-s seconds, at most --max-restarts
  times; a further crash ends the run `failed`, exit status 1, with the reason (with
  --max-restarts 0 the crash itself ends it: `crashed`);
- never restarts bad input (exit status 2) or a run that finished or stopped (exit status 0), and
  exits with the trainer's own status.
Each of these is a line of <out>/events.jsonl (trainer/run/events.py) and a notice where one is set up.
The trainer dies with the supervisor (parent-death signal), so a SIGKILL to the recorded PID
leaves no orphan training on.

Process topology: torchrun restarts the ranks itself (trainer/torchrun.py, --max-restarts).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .run.events import EventLog, describe_status
from .run.runrecord import tail_lines

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PR_SET_PDEATHSIG = 1


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    usage = "python -m trainer.supervise [--max-restarts N] [--backoff-s S] -m trainer -- TRAINER ARGS"
    parser = argparse.ArgumentParser(
        prog="python -m trainer.supervise",
        usage=usage,
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--max-restarts", type=int, default=0, help="restarts after crashes (default 0)")
    parser.add_argument("--backoff-s", type=float, default=10.0, help="wait before a restart (default 10)")
    parser.add_argument("-m", dest="module", default="trainer", choices=["trainer"], help="what runs")
    split = argv.index("--") if "--" in argv else len(argv)
    if {"-h", "--help"} & set(argv[:split]):
        parser.parse_args(["--help"])  # prints the help and exits 0
    if split == len(argv):
        raise SystemExit(f"usage: {usage}")
    args = parser.parse_args(argv[:split])
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must not be negative, got {args.max_restarts}")
    if args.backoff_s < 0:
        parser.error(f"--backoff-s must not be negative, got {args.backoff_s}")
    return args, argv[split + 1 :]


def die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGKILL when the supervisor dies."""
    # Not Linux: no prctl, and a SIGKILLed supervisor may leave its trainer running.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def crash_reason(status: int) -> str:
    """How the trainer crashed: its own last `error:` or exception line where the log has one."""
    what = describe_status(status)
    if status < 0:
        return what
    try:
        lines = tail_lines(os.readlink("/proc/self/fd/2"), 32 * 1024)
    except OSError:
        return what
    for line in reversed(lines):
        head = line.split(": ", 1)[0]
        if line.startswith("error: ") or (": " in line and head.endswith(("Error", "Exception"))):
            return f"{what}: {line.removeprefix('error: ')[:300]}"
    return what


class Supervisor:
    def __init__(self, trainer_argv: list[str], max_restarts: int, backoff_s: float, events: EventLog):
        self.trainer_argv = trainer_argv
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.events = events
        self.child: subprocess.Popen | None = None
        self.stop_signal: str | None = None
        self.wake = threading.Event()

    def on_signal(self, signum: int, _frame) -> None:
        if self.stop_signal is not None:
            # A second stop (two stop.yml at once): the trainer already checkpoints and exits; the
            # signal forwarded again would reach it after it restored the default handlers, on its
            # way out, and end a clean stop as "killed by SIGTERM".
            print(f"supervise: {signal.Signals(signum).name} again: the stop is under way", flush=True)
            return
        self.stop_signal = signal.Signals(signum).name
        print(f"supervise: {self.stop_signal}: stopping the trainer for good (no restart)", flush=True)
        self.wake.set()
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)

    def start(self, resume: bool) -> None:
        argv = list(self.trainer_argv)
        if resume and "--resume" not in argv:
            argv.append("--resume")
        self.child = subprocess.Popen(
            [sys.executable, "-m", "trainer", *argv], stdin=subprocess.DEVNULL, preexec_fn=die_with_parent
        )
        if self.stop_signal is not None:  # a stop that came while the child was being created
            self.child.send_signal(signal.SIGTERM)

    def wait(self) -> int:
        while True:
            try:
                return self.child.wait()
            except InterruptedError:
                continue

    def run(self) -> int:
        resume = "--resume" in self.trainer_argv
        crashes = 0
        self.start(resume)
        self.events.record("start", "started" + (" (resuming)" if resume else ""))
        while True:
            status = self.wait()
            ended = self.how_it_ended(status, crashes)
            if ended is not None:
                return ended
            reason = crash_reason(status)
            crashes += 1
            self.events.record(
                "crash", f"crashed ({reason})", exit_status=status, reason=reason, restarts=crashes - 1
            )
            verdict = self.give_up(status, crashes, reason)
            if verdict is not None:
                return verdict
            self.start(resume=True)
            self.events.record(
                "restart",
                f"restart {crashes}/{self.max_restarts} with --resume after {reason}",
                exit_status=status,
                reason=reason,
                restarts=crashes,
            )

    def how_it_ended(self, status: int, crashes: int) -> int | None:
        """The supervisor's exit status when the trainer's end is final (finished, stopped, bad
        input), recorded as an event; None for a crash."""
        if self.stop_signal is not None and status in (0, -signal.SIGTERM, -signal.SIGINT):
            self.events.record("stop", f"stopped by {self.stop_signal}", exit_status=status, restarts=crashes)
            return 0 if status <= 0 else status
        if status == 0:
            self.events.record("finish", "finished", exit_status=0, restarts=crashes)
            return 0
        if status == 2:
            reason = crash_reason(status)
            # A diverged run (trainer/cli.py) says so; any other exit status 2 is bad input.
            reason = reason.replace("exit status 2: diverged: ", "diverged: ", 1)
            reason = reason.replace("exit status 2: ", "bad input: ", 1)
            self.events.record("failed", reason, exit_status=2, reason=reason, restarts=crashes)
            return 2
        if self.stop_signal is not None:
            # It died on its way out of a stop: still a stop, never a restart.
            reason = crash_reason(status)
            self.events.record(
                "stop",
                f"stopped by {self.stop_signal}, then {reason}",
                exit_status=status,
                reason=reason,
                restarts=crashes,
            )
            return 1
        return None

    def give_up(self, status: int, crashes: int, reason: str) -> int | None:
        """After a crash: the exit status when no restart follows (none allowed, too many crashes,
        a stop during the backoff); None once the backoff has passed and a restart is due."""
        if self.max_restarts == 0:
            print(f"supervise: the trainer {reason}; not restarted (recover_max_restarts=0)", flush=True)
            return 1
        if crashes > self.max_restarts:
            why = (
                f"crashed {crashes} time(s), more than recover_max_restarts={self.max_restarts} allows; "
                f"last: {reason}"
            )
            print(f"supervise: failed: {why}", flush=True)
            # The run's exit status is the supervisor's (1); the last crash's is in the reason.
            self.events.record("failed", why, exit_status=1, reason=why, restarts=crashes - 1)
            return 1
        print(
            f"supervise: the trainer {reason}; restart {crashes}/{self.max_restarts} with --resume "
            f"in {self.backoff_s:g}s",
            flush=True,
        )
        if self.wake.wait(self.backoff_s) or self.stop_signal is not None:
            self.events.record(
                "stop",
                f"stopped by {self.stop_signal} before restarting",
                exit_status=status,
                restarts=crashes - 1,
            )
            return 0
        return None


def main(argv: list[str] | None = None) -> int:
    args, trainer_argv = parse_args(sys.argv[1:] if argv is None else argv)
    from .cli import parse_args as parse_trainer_args

    trainer_args = parse_trainer_args(trainer_argv)
    out_dir = Path(trainer_args.out or f"runs/{trainer_args.run}").expanduser().absolute()
    supervisor = Supervisor(
        trainer_argv, args.max_restarts, args.backoff_s, EventLog(out_dir, trainer_args.run)
    )
    for sig in STOP_SIGNALS:
        signal.signal(sig, supervisor.on_signal)
    # trainer.launch blocked them before exec: a stop that came meanwhile is delivered now, to the
    # handler (the trainer, started after this, inherits them unblocked).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
