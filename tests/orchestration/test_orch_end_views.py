"""Every view of a run tells one truth about how it ended: the launch's and the regeneration's
failure, status, runs, the ledger and run.json say the same state and reason. Real playbooks
(dflashctl over ansible-runner), the real trainer on CPU."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    ENDLESS_TINY_RUN,
    REPO,
    is_our_trainer,
    ledger,
    make_controller,
    press_ctrl_c,
    stop_leftovers,
)

from dflashctl import PlaybookFailed

pytestmark = pytest.mark.slow


def runs_the_wait(playbook_pid: int, settled_s: float = 1.5) -> bool:
    """A module has run under this playbook for settled_s: with the trainer held still, only the
    wait's can (each other task's module ends at once). A module runs in a process under a worker,
    which is in a session of its own but still the playbook's child; the trainer is not below it."""
    parents, ages = {}, {}
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    ticks = os.sysconf("SC_CLK_TCK")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parents[int(proc.name)] = int(fields[1])
        ages[int(proc.name)] = uptime - int(fields[19]) / ticks
    for pid, age in ages.items():
        if age < settled_s or parents.get(pid) == playbook_pid:
            continue
        ancestor = parents.get(pid, 1)
        while ancestor > 1 and ancestor != playbook_pid:
            ancestor = parents.get(ancestor, 1)
        if ancestor == playbook_pid:
            return True
    return False


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_an_early_stop_is_stopped_in_every_view_and_a_refused_regen_fails_with_its_reason(
    state_dir: Path,
) -> None:
    """SIGTERM to the recorded trainer a second after its record appears: the launch fails once, in
    words, saying it was stopped; run.json, the ledger, status and runs all say stopped. Then a
    regeneration whose conversations cannot fit the target's context (each answer may take 5,000
    new tokens, the tiny target holds 1,024): the trainer refuses it after the data stage's first
    line, and the regeneration fails with that reason."""
    ctl = make_controller(state_dir, workspace_trainer_set=ENDLESS_TINY_RUN)
    out = state_dir / "workspace" / "runs" / "nographs"
    failure: list = []

    def launch() -> None:
        try:
            ctl.launch("nographs")
        except PlaybookFailed as exc:
            failure.append(exc)

    thread = threading.Thread(target=launch)
    thread.start()
    try:
        wait_for(lambda: (out / "run.json").exists(), 300, "the run record")
        record = json.loads((out / "run.json").read_text())
        time.sleep(1.0)
        os.kill(record["pid"], signal.SIGTERM)
        thread.join(timeout=600)
        assert failure, "the launch of a run stopped before its first progress line fails"
        message = str(failure[0])
        said = f"the trainer (PID {record['pid']}) was stopped before its first progress line"
        assert message.count(said) == 1, message
        assert "matching" not in message and "is exited" not in message, message
        on_disk = json.loads((out / "run.json").read_text())
        assert on_disk["state"] == "stopped" and on_disk["exit_status"] == 0, on_disk
        assert [line["state"] for line in ledger(state_dir) if line["run_id"] == record["run_id"]] == [
            "stopped"
        ]
        status = ctl.status()
        assert status["recorded_state"] == "stopped" and status["exit_status"] == 0, status
        (row,) = ctl.runs(run="nographs")
        assert row["state"] == "stopped" and row["exit_reason"] == on_disk["exit_reason"], row

        # A cache of its own: a regeneration the shared cache holds already is never checked again.
        cache = f"data.cache_dir={state_dir.parent / 'cache'}"
        regen = make_controller(state_dir, workspace_trainer_set=["data.regen_max_new_tokens=5000", cache])
        with pytest.raises(PlaybookFailed) as refused:
            regen.regen("eager")
        message = str(refused.value)
        eager = json.loads((state_dir / "workspace" / "runs" / "eager" / "run.json").read_text())
        assert eager["state"] == "failed" and eager["exit_status"] == 2, eager
        assert (
            f"ended before the start of its data stage: failed, exit status: 2 ({eager['exit_reason']})"
            in (message)
        ), message
        assert [line["state"] for line in ledger(state_dir) if line["run_id"] == eager["run_id"]] == [
            "failed"
        ]
    finally:
        thread.join(timeout=60)
        stop_leftovers(ctl, state_dir)
        for line in ledger(state_dir):
            assert not is_our_trainer(line), "a trainer of this test still runs"


def test_ctrl_c_during_the_wait_says_the_trainer_runs_and_the_ledger_keeps_it_running(
    state_dir: Path,
) -> None:
    """Ctrl-C to ansible-playbook while it waits for the first progress line (the ledger holds the
    run by then): it says the trainer keeps running, its PID and log, and how to stop it; the
    ledger says running, as the trainer does; status sees it and stop ends it."""
    ctl = make_controller(state_dir, workspace_trainer_set=ENDLESS_TINY_RUN)
    state_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(state_dir / "facts"),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    extravars = json.dumps(
        {"run": "nographs", "dflash_state_dir": str(state_dir), "workspace_trainer_set": ENDLESS_TINY_RUN}
    )
    output = state_dir.parent / "launch-playbook.log"
    with output.open("wb") as sink:
        playbook = subprocess.Popen(
            ["ansible-playbook", str(REPO / "playbooks" / "launch.yml"), "-e", extravars],
            cwd=REPO,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    frozen = None
    try:
        wait_for(
            lambda: any(line["state"] == "running" for line in ledger(state_dir)), 300, "the ledger's line"
        )
        (line,) = ledger(state_dir)
        # The trainer is held still (its own session, so its group) until the Ctrl-C has ended the
        # playbook: its first progress line must not end the wait before the Ctrl-C lands.
        os.killpg(line["pid"], signal.SIGSTOP)
        frozen = line["pid"]
        log = Path(line["log"])
        assert not (log.exists() and "\nstep " in log.read_text(errors="replace")), (
            "too late: it trains already"
        )
        # In the wait itself: a Ctrl-C that lands while a task's worker hands its result back (the
        # ledger's line is written just before) can leave ansible-core waiting on its result
        # queue's lock in its cleanup.
        wait_for(lambda: runs_the_wait(playbook.pid), 300, "the wait's module")
        honoured = press_ctrl_c(playbook, output)
        os.killpg(frozen, signal.SIGCONT)
        frozen = None
        said = output.read_text(errors="replace")
        if honoured:
            assert f"  ct200: run nographs as PID {line['pid']}, log {line['log']}" in said, said[-3000:]
            assert "stop it with ./dev.sh stop" in said, said[-3000:]
        assert is_our_trainer(line), "the trainer keeps running"
        assert [row["state"] for row in ledger(state_dir)] == ["running"]
        status = ctl.status()
        assert status["state"] == "running" and status["pid"] == line["pid"], status
        assert ctl.stop()["state_before"] == "running"
        assert [row["state"] for row in ledger(state_dir)] == ["stopped"]
    finally:
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(frozen, signal.SIGCONT)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(playbook.pid, signal.SIGKILL)
        stop_leftovers(ctl, state_dir)
