"""Fixtures for the orchestration tests: real playbooks through ansible-runner (dflashctl), the real
trainer on CPU, controller state in a temporary directory, a stand-in nvidia-smi where a test needs one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflashctl import Controller, PlaybookFailed, Settings

REPO = Path(__file__).resolve().parents[2]
FAKES = Path(__file__).resolve().parent / "fakes"
H200_UUID = "GPU-7590547c-d9a8-b760-1c4e-93ce4dbbbac8"


def gpu_state(memory_used: int, utilization: int, apps: list[dict] | None = None) -> dict:
    """A one-GPU nvidia-smi state for the stand-in (modelled on the H200 reference capture)."""
    return {
        "gpus": [
            {
                "index": 0,
                "uuid": H200_UUID,
                "name": "NVIDIA H200",
                "memory_total": 143771,
                "memory_used": memory_used,
                "utilization": utilization,
            }
        ],
        "apps": apps or [],
    }


BUSY = gpu_state(
    21363, 100, [{"pid": 425, "gpu_uuid": H200_UUID, "process_name": "python3", "used_memory": 21354}]
)
IDLE = gpu_state(0, 0)


# The tiny embedded model on CPU: no compile, no regeneration, progress every step, no evaluation
# after step 0. Tests add the checkpoints and the steps they need.
TINY_RUN = [
    "compile.mode=none",
    "data.regenerate=false",
    "train.batch_size=1",
    "train.eval_prompts=1",
    "train.eval_max_new_tokens=2",
    "train.log_every=1",
    "train.eval_every=0",
]
# A tiny run that trains until it is stopped.
ENDLESS_TINY_RUN = [*TINY_RUN, "train.checkpoint_every=0", "train.steps=100000"]


# Autogroup nice levels of an endless trainer (see endless_trainers_yield_the_cpu): while it starts,
# once it trains, and once it has been told to stop.
STARTING_NICE, TRAINING_NICE, STOPPING_NICE = 5, 19, 0
STOP_SIGNALS = (1 << (15 - 1)) | (1 << (2 - 1))  # SIGTERM, SIGINT in /proc/PID/status masks


class EndlessTrainerGroup:
    """One autogroup (a session: a supervisor and its trainer, a torchrun, a rank) of endless
    trainer processes: its log (their stdout, as the starter opened it), how far it was read, and
    whether it trains or stops."""

    def __init__(self, proc: Path):
        try:
            self.log: Path | None = Path(os.readlink(proc / "fd" / "1"))
        except OSError:
            self.log = None
        self.offset = 0
        self.tail = b""
        self.training = False
        self.stopping = False

    def read(self) -> None:
        """Follow the log: a progress line means it trains, the trainer's stop line that it stops."""
        if self.log is None or self.stopping:
            return
        try:
            with self.log.open("rb") as log:
                log.seek(self.offset)
                chunk = log.read()
        except OSError:
            return  # not a file (a pipe, /dev/null) or gone: it stays at the starting level
        self.offset += len(chunk)
        text = self.tail + chunk
        self.tail = text[-64:]
        self.training = self.training or text.startswith(b"step ") or b"\nstep " in text
        self.stopping = b"checkpointing and exiting" in text

    def nice(self, signalled: bool) -> int:
        self.stopping = self.stopping or signalled
        if self.stopping:
            return STOPPING_NICE
        return TRAINING_NICE if self.training else STARTING_NICE


def stop_signal_pending(proc: Path) -> bool:
    """A stop signal not yet delivered: the process has not run since it came."""
    for line in proc.joinpath("status").read_text().splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) & STOP_SIGNALS:
            return True
    return False


@pytest.fixture(scope="session", autouse=True)
def endless_trainers_yield_the_cpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A trainer this session started that trains until it is stopped (train.steps=100000) only has to
    be alive and make progress; every step beyond that is CPU the playbooks checking it, and other
    tests, wait for (in a run of three orchestration files in three workers the endless trainers
    took a quarter of all CPU time at nice 5). The trainer is detached into its own session, which
    Linux schedules as an autogroup of its own with the weight of everything else together, so the
    autogroup's nice sets its share: nice 5 (a third of a normal weight) while it starts, so the
    launch waiting for its first progress line is not held up long; nice 19 (1.5 % of a normal
    weight) once its log shows progress, so its further steps come from idle CPU; nice 0 as soon as
    a stop signal is pending or its log says it checkpoints and exits, so a stop takes no longer
    than at full priority. Nothing a test checks depends on how fast a trainer steps; a finite run
    keeps its priority."""
    root = str(tmp_path_factory.getbasetemp()).encode()
    stop = threading.Event()
    groups: dict[str, EndlessTrainerGroup] = {}

    def adjust() -> None:
        members: dict[str, list[Path]] = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                parts = proc.joinpath("cmdline").read_bytes().split(b"\0")
                if (
                    b"trainer" in parts
                    and any(root in part for part in parts)
                    and any(part.endswith(b"steps=100000") for part in parts)
                ):
                    members.setdefault(proc.joinpath("autogroup").read_text().split()[0], []).append(proc)
            except (OSError, IndexError):
                continue  # gone meanwhile, or no autogroup scheduling here
        for name in set(groups) - set(members):
            del groups[name]
        for name, procs in members.items():
            group = groups.setdefault(name, EndlessTrainerGroup(procs[0]))
            try:
                group.read()
                wanted = group.nice(any(stop_signal_pending(proc) for proc in procs))
                autogroup = procs[0].joinpath("autogroup")
                if int(autogroup.read_text().split()[-1]) != wanted:
                    autogroup.write_text(str(wanted))
            except (OSError, IndexError, ValueError):
                continue

    def watch() -> None:
        while not stop.wait(0.5):
            adjust()

    thread = threading.Thread(target=watch, name="endless-trainers-yield", daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(timeout=10)


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


def make_controller(state_dir: Path, nvidia_smi_state: dict | None = None, **extravars) -> Controller:
    envvars = {}
    if nvidia_smi_state is not None:
        state_file = state_dir.parent / "nvidia-smi-state.json"
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(nvidia_smi_state), encoding="utf-8")
        envvars = {
            "PATH": os.pathsep.join([str(FAKES), str(Path(sys.executable).parent), os.environ["PATH"]]),
            "NVIDIA_SMI_STANDIN_STATE": str(state_file),
        }
    return Controller(Settings(state_dir=state_dir, envvars=envvars, extravars=extravars, timeout=900))


@pytest.fixture
def controller(state_dir: Path) -> Iterator[Controller]:
    """A controller on the local default inventory with its own state; stops what it launched."""
    ctl = make_controller(state_dir)
    yield ctl
    stop_leftovers(ctl, state_dir)


def ledger(state_dir: Path) -> list[dict]:
    path = state_dir / "runs.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def processes_under(root: Path) -> list[int]:
    """PIDs of the live processes that work under a directory (a trainer, its supervisor, torchrun
    and its ranks run in their workspace) or name it on their command line. Zombies and this
    process are left out."""
    root = str(root)
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
            cmdline = proc.joinpath("cmdline").read_bytes()
        except OSError:
            continue  # gone meanwhile, or a zombie (no cwd)
        if cwd == root or cwd.startswith(root + os.sep) or root.encode() in cmdline:
            found.append(int(proc.name))
    return found


def press_ctrl_c(playbook: subprocess.Popen, output: Path, patience_s: float = 20) -> bool:
    """Ctrl-C to an ansible-playbook started in a session of its own, as its terminal sends it (to
    its process group); whether that first one ended it. ansible-core ends on it within a second
    nearly always, but a Ctrl-C that lands as a task's worker hands its result back can leave it
    waiting on its result queue's lock in its cleanup (a stack dump showed it), never ending. Its
    handler restores the default action on the first SIGINT, so a second one ends it at once,
    without its words, as pressing Ctrl-C again does; that is warned, with its process tree and
    output, since the caller can then check only the run's truth."""
    os.killpg(playbook.pid, signal.SIGINT)
    try:
        playbook.wait(timeout=patience_s)
        return True
    except subprocess.TimeoutExpired:
        pass
    tree = subprocess.run(
        ["ps", "-o", "pid,ppid,stat,etime,args", "-s", str(playbook.pid)], capture_output=True, text=True
    ).stdout
    tail = output.read_text(errors="replace")[-2000:]
    warnings.warn(
        f"ansible-playbook outlived the first Ctrl-C by {patience_s:g} s:\n{tree}\n{tail}", stacklevel=2
    )
    os.killpg(playbook.pid, signal.SIGINT)
    playbook.wait(timeout=60)
    return False


def stop_leftovers(ctl: Controller, state_dir: Path) -> None:
    """Stop every trainer a test started: through stop.yml, else by its recorded PID (ours only).
    stop.yml costs about a CPU second even with nothing to stop, and most tests stop their trainers
    themselves: it runs only while a process of the test still lives under the state directory's
    parent (the test's tmp_path, which also holds the workspaces of tests/orchestration's pair
    inventory)."""
    if processes_under(state_dir.parent):
        with contextlib.suppress(PlaybookFailed):
            ctl.stop()
    for record in ledger(state_dir):
        if is_our_trainer(record):
            os.kill(record["pid"], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while is_our_trainer(record) and time.monotonic() < deadline:
                time.sleep(0.1)


def is_our_trainer(record: dict) -> bool:
    try:
        stat = Path(f"/proc/{record['pid']}/stat").read_text()
    except OSError:
        return False
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0] not in ("Z", "X") and int(fields[19]) == record["start_time"]


def end_torchruns_of(state_dir: Path) -> None:
    """SIGTERM (then SIGKILL) a torchrun this test started that no record led to: its cmdline names
    this test's own state directory. Its ranks follow it (they get SIGTERM when it dies)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = proc.joinpath("cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"trainer.torchrun" in cmdline and any(str(state_dir).encode() in part for part in cmdline):
            pid = int(proc.name)
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 30
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            if Path(f"/proc/{pid}").exists():
                os.kill(pid, signal.SIGKILL)
