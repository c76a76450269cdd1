"""Regeneration in worker processes: one process per device, each compiling its own decode step
(Dynamo is not thread safe, so threads could not all run compiled).

The parent (`run_worker_processes`) starts `python -m trainer.data.regen_worker` once per job,
hands it the pickled job on stdin, and reads its messages, one JSON object a line, from its
stdout: progress, log lines, how it ended. A stop in the parent (SIGTERM/SIGINT) is passed on as
SIGTERM: every worker ends after its current batch, keeping its finished shards. A worker never
outlives the parent: it asks the kernel for SIGKILL when the parent dies (PR_SET_PDEATHSIG). A
worker that fails makes the others stop at their next batch, and the parent raises once all have
ended: DataError for bad data (the same message a thread would give), RegenWorkerFailed naming the
worker's device otherwise.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..model import compile_cache
from .chat import DataError

PARENT_ENV = "TRAINER_REGEN_PARENT"
PR_SET_PDEATHSIG = 1


class RegenWorkerFailed(Exception):
    """A worker process failed (an exception, or it died): names its device; what it and the other
    workers finished is kept."""

    def __init__(self, device: str, pid: int, what: str, kept_in: str):
        super().__init__(
            f"the regeneration worker on {device} (pid {pid}) failed; the finished shards are kept in "
            f"{kept_in} and the next start continues from them. {what}"
        )
        self.device = device


@dataclass
class Job:
    """What one worker process does; `run` executes in that process. A subclass says what
    (RegenJob: the product's shards; the bench: a list of prompts)."""

    device: str
    kept_in: str

    def run(self, send: Callable[[dict], None], should_stop: Callable[[], bool]) -> bool:
        raise NotImplementedError


@dataclass
class RegenJob(Job):
    """One worker's shards of a regeneration (shard i where i % workers == worker) on its device."""

    regeneration: object  # trainer.data.regen.Regeneration, without a target: the worker loads its own
    target_path: Path
    dtype: str
    worker: int
    workers: int
    threads: int | None
    compile_root: Path | None

    def run(self, send, should_stop) -> bool:
        from ..model.target import load_target

        if self.threads:
            torch.set_num_threads(self.threads)
        device = torch.device(self.device)
        target = load_target(self.target_path, device, self.dtype)
        send({"line": f"started (pid {os.getpid()}), the target loaded"})
        cache = compiling_cache(self.compile_root, device, self.regeneration.settings.compile)
        with compile_cache.persisted(cache, lambda text: send({"line": text})):
            progress = SentProgress(send)
            return self.regeneration.generate(self.worker, self.workers, target, progress, should_stop)


def compiling_cache(root: Path | None, device: torch.device, compile: bool) -> Path | None:
    """The compile cache directory for a worker on `device`, None when its engine compiles nothing
    (uncompiled, or on a CPU: the static engine compiles only on CUDA)."""
    if root is None or not compile or device.type != "cuda":
        return None
    return compile_cache.cache_directory(root, device)


class SentProgress:
    """Progress.add in a worker process: the parent's Progress adds it up."""

    def __init__(self, send: Callable[[dict], None]):
        self.send = send

    def add(self, conversations: int, tokens: int, answers: int = 0, cut: int = 0,
            decode_steps: int = 0, slot_steps: int = 0) -> None:  # fmt: skip
        self.send({"progress": [conversations, tokens, answers, cut, decode_steps, slot_steps]})


# ---- the parent ----


def run_worker_processes(jobs: list[Job], progress, should_stop: Callable[[], bool],
                         report: Callable[[], None], report_every_s: float,
                         log: Callable[[str], None]) -> bool:  # fmt: skip
    """Run every job in a process of its own while this thread reports progress every
    report_every_s; False if a stop came. See the module's docstring for stops and failures."""
    processes = [start_worker() for _ in jobs]
    try:
        messages: queue.Queue = queue.Queue()
        for number, (process, job) in enumerate(zip(processes, jobs, strict=True)):
            feed(process, job)
            threading.Thread(target=read_messages, args=(number, process, messages), daemon=True).start()
        outcome = Outcome(jobs, processes)
        watch(outcome, messages, progress, should_stop, report, report_every_s, log)
        for process in processes:
            process.wait()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    outcome.raise_failure()
    return outcome.finished()


def start_worker() -> subprocess.Popen:
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "trainer.data.regen_worker"]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)


def feed(process: subprocess.Popen, job: Job) -> None:
    """The job, pickled, on the worker's stdin (a worker that died before reading it is reported by
    its exit status)."""
    with contextlib.suppress(BrokenPipeError):
        pickle.dump(job, process.stdin)
        process.stdin.close()


def read_messages(number: int, process: subprocess.Popen, messages: queue.Queue) -> None:
    for raw in process.stdout:
        with contextlib.suppress(ValueError):
            messages.put((number, json.loads(raw)))
    messages.put((number, None))  # the worker's output ended: it exited


class Outcome:
    """How each worker ended, as its messages say."""

    def __init__(self, jobs: list[Job], processes: list[subprocess.Popen]):
        self.jobs, self.processes = jobs, processes
        self.ends: dict[int, str] = {}
        self.failures: list[tuple[int, dict]] = []
        self.stop_sent = False

    def finished(self) -> bool:
        return len(self.ends) == len(self.jobs) and all(end == "finished" for end in self.ends.values())

    def raise_failure(self) -> None:
        for number, process in enumerate(self.processes):
            if number in self.ends or any(n == number for n, _ in self.failures):
                continue
            code = process.returncode
            if self.stop_sent and code == -signal.SIGTERM:
                self.ends[number] = "stopped"  # stopped while starting, before it could say so
            else:
                how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
                self.failures.append((number, {"crash": f"It ended without a word ({how})."}))
        if not self.failures:
            return
        number, message = self.failures[0]
        if "data_error" in message:
            raise DataError(message["data_error"])
        job = self.jobs[number]
        raise RegenWorkerFailed(job.device, self.processes[number].pid, message["crash"], job.kept_in)


def watch(outcome: Outcome, messages: queue.Queue, progress, should_stop, report, report_every_s,
          log) -> None:  # fmt: skip
    """Until every worker's output has ended: progress added up, lines logged, a stop or a failure
    passed on to every worker as SIGTERM (once), progress reported on time."""
    open_workers = len(outcome.jobs)
    next_report = time.monotonic() + report_every_s
    while open_workers:
        try:
            number, message = messages.get(timeout=0.1)
        except queue.Empty:
            number, message = -1, {}
        if message is None:
            open_workers -= 1
        elif "progress" in message:
            progress.add(*message["progress"])
        elif "line" in message:
            log(f"worker {number} on {outcome.jobs[number].device}: {message['line']}")
        elif "end" in message:
            outcome.ends[number] = message["end"]
        elif message:
            outcome.failures.append((number, message))
        if not outcome.stop_sent and (outcome.failures or should_stop()):
            outcome.stop_sent = True
            for process in outcome.processes:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        if time.monotonic() >= next_report:
            report()
            next_report = time.monotonic() + report_every_s


# ---- the worker ----


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux), and exit now if it is already gone."""
    parent = int(os.environ.get(PARENT_ENV, "0"))
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent and os.getppid() != parent:
        os._exit(1)


def worker_main() -> int:
    die_with_parent()
    from ..model.torch_log import quiet_repeated_torch_warnings

    quiet_repeated_torch_warnings()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # Messages go on the real stdout; whatever a library prints goes to stderr (the run's log).
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    lock = threading.Lock()

    def send(message: dict) -> None:
        with lock:
            channel.write(json.dumps(message) + "\n")

    try:
        job = pickle.load(sys.stdin.buffer)
        finished = job.run(send, stop.is_set)
        send({"end": "finished" if finished else "stopped"})
        return 0
    except DataError as exc:
        send({"data_error": str(exc)})
    except BaseException:  # handed to the parent, which names this worker's device
        send({"crash": f"Its traceback:\n{traceback.format_exc()}"})
    return 1


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        # Not a command for people: the parent hands the job on stdin (this module's docstring).
        print(f"usage: python -m trainer.data.regen_worker < PICKLED_JOB\n\n{__doc__}")
        sys.exit(0)
    sys.exit(worker_main())
