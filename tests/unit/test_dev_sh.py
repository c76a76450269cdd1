"""dev.sh's side_by_side: the two commands of `./dev.sh test` that run at once (ansible-lint beside the
sanity run, the molecule scenarios beside each other and the unit tests). Both outputs are shown,
a failure of either fails the step naming it, and an interrupt ends both process groups whole and
stops the test nodes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def side_by_side_script(tmp_path: Path, first: str, second: str) -> Path:
    """A shell script with dev.sh's own side_by_side, a stop_test_nodes that leaves a mark, and one call."""
    function = re.search(r"^side_by_side\(\) \{\n.*?^\}\n", (REPO / "dev.sh").read_text(), re.M | re.S)
    assert function, "dev.sh defines side_by_side() { ... }"
    script = tmp_path / "run.sh"
    script.write_text(
        "set -eu\n"
        f"stop_test_nodes() {{ echo stopped > {tmp_path}/test-nodes-stopped; }}\n"
        f"{function.group(0)}"
        f'side_by_side first "{first}" second "{second}"\n'
        "echo after\n"
    )
    return script


def run(script: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=60)


def test_both_outputs_are_shown_one_after_the_other_and_the_step_succeeds(tmp_path):
    # The first command ends last: its output still comes first, whole.
    result = run(side_by_side_script(tmp_path, "echo one; sleep 1; echo two", "echo three"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "one\ntwo\nthree\nafter\n"


@pytest.mark.parametrize("failing", ["first", "second"])
def test_a_failure_of_either_fails_the_step_naming_it_after_both_ended(tmp_path, failing):
    commands = {"first": "echo one", "second": "echo two"}
    commands[failing] += "; exit 3"
    result = run(side_by_side_script(tmp_path, commands["first"], commands["second"]))
    assert result.returncode == 1
    assert result.stdout == "one\ntwo\n", "both ran to their end, and nothing after the step"
    exits = {"first": 0, "second": 0, failing: 3}
    assert f"error: first exited {exits['first']}, second {exits['second']}" in result.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_ends_both_process_groups_and_stops_the_test_nodes(tmp_path, sig):
    marks = [tmp_path / "first.pid", tmp_path / "second.pid"]
    # Each command records its own shell's PID ($$, escaped so that that shell expands it): the leader
    # of its group under setsid. It then waits in a child of it.
    script = side_by_side_script(
        tmp_path, f"echo \\$\\$ > {marks[0]}; sleep 60", f"echo \\$\\$ > {marks[1]}; sleep 60"
    )
    # SIGINT at its default in the script, as in a shell started from a terminal: pytest itself may
    # run as a background job of a script (./dev.sh test runs the unit tests so), which ignores
    # SIGINT, and a shell cannot trap a signal ignored when it started.
    proc = subprocess.Popen(
        ["sh", str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    groups: list[int] = []
    try:
        deadline = time.monotonic() + 20
        while not all(m.exists() and m.read_text().strip() for m in marks):
            assert time.monotonic() < deadline, "both commands start"
            time.sleep(0.1)
        groups = [int(m.read_text()) for m in marks]
        assert proc.pid not in groups, "each command's own shell, not the script's"
        assert all(group_alive(g) for g in groups), "each command leads a live group"
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=20)
        assert proc.returncode == 130
        assert "after" not in out
        assert (tmp_path / "test-nodes-stopped").exists()
        deadline = time.monotonic() + 10
        while any(group_alive(g) for g in groups):
            assert time.monotonic() < deadline, "both process groups end, their sleeps included"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for group in groups:  # what this test started, also when it fails
            if group_alive(group):
                os.killpg(group, signal.SIGKILL)


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
