"""The regeneration stage's worker processes (trainer/data/regen_worker.py): several devices in one
process regenerate in one worker process each, with the single process's output; a failed worker
names its device and stops the others with their shards kept; a stop ends every worker; a worker
never outlives a parent killed with SIGKILL. Every process a test starts is ended by its PID."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainer.data.chat import DataError
from trainer.data.regen import Progress
from trainer.data.regen_worker import Job, RegenWorkerFailed, run_worker_processes

from .conftest import REPO
from .test_regen_stage import regen, regen_args, shards

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG, SIGKILL")


@dataclass
class Stub(Job):
    """A worker that does what the test says: work a few steps, wait for a stop, fail, or die."""

    does: str = "work"
    pid_file: str = ""

    def run(self, send, should_stop) -> bool:
        if self.pid_file:
            Path(self.pid_file).write_text(str(os.getpid()))
        if self.does == "fail":
            raise RuntimeError("out of device memory (a stand-in)")
        if self.does == "bad data":
            raise DataError("chat.jsonl:7: not JSON")
        if self.does == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        for _ in range(3 if self.does == "work" else 600):
            if should_stop():
                return False
            send({"progress": [1, 10]})
            time.sleep(0.05)
        return True


def run(jobs, should_stop=lambda: False) -> tuple[bool, Progress, list[str]]:
    progress, lines = Progress(total=100), []
    finished = run_worker_processes(jobs, progress, should_stop, lambda: None, 60.0, lines.append)
    return finished, progress, lines


def test_two_cpu_workers_regenerate_in_two_processes_with_the_single_process_output(
    tmp_path, embedded, small_data
):
    one = regen(*regen_args(embedded, small_data, tmp_path / "c1", tmp_path / "one.jsonl", tmp_path / "r1"))
    assert one.returncode == 0, one.stderr
    assert "worker processes" not in one.stdout  # one device: generated in the process itself
    args = regen_args(embedded, small_data, tmp_path / "c2", tmp_path / "two.jsonl", tmp_path / "r2")
    two = regen(*args, "--set=parallel.cpu_workers=2")
    assert two.returncode == 0, two.stdout + two.stderr
    assert "data: 2 worker processes, one per device: cpu, cpu" in two.stdout, two.stdout
    pids = set(re.findall(r"data: worker \d on cpu: started \(pid (\d+)\)", two.stdout))
    assert len(pids) == 2, two.stdout
    assert "regen: 40/40 conversations" in two.stdout, two.stdout  # progress from both workers
    assert len(shards(tmp_path / "c2")) == 10
    assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    # The answers the cap cut, counted in the workers and added up here: the one process's count.
    cut = r"data: regenerated 40 conversations, .* (\d+) of (\d+) answers cut at the cap of 8 tokens"
    counted = [re.search(cut, run.stdout) for run in (one, two)]
    assert all(counted) and int(counted[0][2]) >= 40, one.stdout + two.stdout
    assert counted[0].groups() == counted[1].groups(), two.stdout


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, embedded) -> Path:
    from trainer.data.chat import iter_conversations

    rows = [json.dumps({"messages": m}) for _, m in iter_conversations(embedded[1])][:40]
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_every_worker_reports_its_progress_and_ends():
    finished, progress, _ = run([Stub("cpu", "kept"), Stub("cpu", "kept")])
    assert finished
    assert progress.snapshot()["conversations"] == 6 and progress.snapshot()["tokens"] == 60


def test_a_failed_worker_names_its_device_and_the_others_stop_at_their_next_batch():
    began = time.monotonic()
    with pytest.raises(RegenWorkerFailed) as failed:
        run([Stub("cuda:0", "/cache/x", "wait"), Stub("cuda:1", "/cache/x", "fail")])
    message = str(failed.value)
    assert message.startswith("the regeneration worker on cuda:1 (pid ")
    assert "the finished shards are kept in /cache/x" in message
    assert "out of device memory (a stand-in)" in message  # its traceback
    assert time.monotonic() - began < 25  # the waiting worker was stopped, not waited out (30 s)


def test_a_worker_killed_outright_is_named_with_its_signal():
    with pytest.raises(RegenWorkerFailed, match=r"worker on cuda:3 .*killed by signal 9"):
        run([Stub("cuda:3", "/cache/x", "die")])


def test_bad_data_in_a_worker_is_the_same_data_error_as_in_a_thread():
    with pytest.raises(DataError, match=r"chat\.jsonl:7: not JSON"):
        run([Stub("cpu", "/cache/x", "bad data")])


def test_a_stop_ends_every_worker():
    calls = []

    def stop_soon() -> bool:
        calls.append(1)
        return len(calls) > 20

    began = time.monotonic()
    finished, _, _ = run([Stub("cpu", "kept", "wait"), Stub("cpu", "kept", "wait")], stop_soon)
    assert not finished
    assert time.monotonic() - began < 25


PARENT = """
import sys, time
sys.path.insert(0, {repo!r})
from tests.trainer.test_regen_workers import Stub, run
run([Stub("cpu", "kept", "wait", {pid_file!r})])
"""


def test_a_worker_does_not_outlive_a_parent_killed_with_sigkill(tmp_path):
    pid_file = tmp_path / "worker.pid"
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT.format(repo=str(REPO), pid_file=str(pid_file))], cwd=REPO,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid_file.exists(), "the worker never started"
        time.sleep(0.2)
        worker = int(pid_file.read_text())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(worker), "the worker outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def alive(pid: int) -> bool:
    """Running (a zombie, reaped by nobody yet, counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"
