"""dflash.ct200.run_summary: the lines a play stored under dflash_summary, after the recap, between
two rules."""

from __future__ import annotations

import configparser
from pathlib import Path

from ansible.executor.stats import AggregateStats
from ansible.plugins.loader import callback_loader


class Screen:
    """Stands in for ansible's Display: keeps what the callback would print."""

    def __init__(self):
        self.lines: list[str] = []

    def display(self, msg, *args, **kwargs) -> None:
        self.lines.append(msg)


def summary_of(custom: dict | None) -> list[str]:
    stats = AggregateStats()
    for key, value in (custom or {}).items():
        stats.set_custom_stats(key, value)
    screen = Screen()
    callback = callback_loader.get("dflash.ct200.run_summary")
    callback._display = screen
    callback.v2_playbook_on_stats(stats)
    return screen.lines


def test_prints_each_stored_line_between_rules_as_wide_as_the_longest() -> None:
    lines = ["run      nographs (nographs-1) on ct200", "PID      4086"]
    printed = summary_of({"dflash_summary": lines})
    width = len(lines[0]) + 2
    assert printed == ["-" * width, " " + lines[0], " " + lines[1], "-" * width]


def test_rules_stop_at_100_characters_and_long_lines_are_kept_whole() -> None:
    long_line = "log      /" + "x" * 200
    printed = summary_of({"dflash_summary": [long_line]})
    assert printed[0] == "-" * 100 and printed[-1] == "-" * 100
    assert printed[1] == " " + long_line


def test_prints_nothing_without_a_summary() -> None:
    assert summary_of(None) == []
    assert summary_of({"dflash_status": {"state": "none"}}) == []
    assert summary_of({"dflash_summary": []}) == []


def test_ansible_cfg_enables_it_since_it_prints_only_when_enabled() -> None:
    config = configparser.ConfigParser()
    config.read(Path(__file__).resolve().parents[2] / "ansible.cfg")
    enabled = [name.strip() for name in config["defaults"]["callbacks_enabled"].split(",")]
    assert callback_loader.get("dflash.ct200.run_summary").CALLBACK_NEEDS_ENABLED
    assert "dflash.ct200.run_summary" in enabled


class Result:
    """Stands in for ansible's TaskResult: the task's action, the host and the module's result."""

    def __init__(self, action: str, host: str, result: dict):
        self._task = type("Task", (), {"action": action})()
        self._host = type("Host", (), {"get_name": lambda self: host})()
        self._result = result


def test_an_interrupted_launch_says_the_trainer_keeps_running_and_how_to_stop_it() -> None:
    """Ctrl-C during the wait for the first progress line: ansible-playbook exits without the
    stats, so the summary never comes; the callback says at exit what was left running."""
    callback = callback_loader.get("dflash.ct200.run_summary")
    callback._display = Screen()
    record = {"run": "nographs", "log": "/ws/train_compile_nographs.log"}
    callback.v2_runner_on_ok(Result("dflash.ct200.trainer_start", "ct200", {"pid": 4242, "record": record}))
    assert callback.watching
    callback.say_left_running()
    assert callback._display.lines == [
        "Interrupted: the trainer started is not stopped; it keeps running:",
        "  ct200: run nographs as PID 4242, log /ws/train_compile_nographs.log",
        "Watch it with ./dev.sh status; stop it with ./dev.sh stop.",
    ]
    # A playbook that ends on its own (its summary says what runs), or stopped what it started: nothing.
    callback.v2_runner_on_ok(Result("dflash.ct200.trainer_stop", "ct200", {"changed": True}))
    assert callback.left_running_lines() == []
    callback.v2_runner_on_ok(Result("dflash.ct200.trainer_start", "ct200", {"pid": 4243, "record": record}))
    callback.v2_playbook_on_stats(AggregateStats())
    assert callback.left_running_lines() == []
