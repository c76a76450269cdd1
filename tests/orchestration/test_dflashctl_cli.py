"""python -m dflashctl: the command line's options reach the playbooks as the extra variables the
roles read (no playbook run: the controller is replaced by one that records its calls)."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

import dflashctl.__main__ as cli

pytestmark = pytest.mark.unit


class RecordingController:
    calls: ClassVar[list[tuple[str, tuple, dict]]] = []

    def __init__(self, settings):
        self.settings = settings

    def launch(self, run, **extravars):
        self.calls.append(("launch", (run,), extravars))
        return {"run": run, **extravars}

    def regen(self, run, **extravars):
        self.calls.append(("regen", (run,), extravars))
        return {"run": run, **extravars}


@pytest.fixture
def recorded(monkeypatch):
    RecordingController.calls = []
    monkeypatch.setattr(cli, "Controller", RecordingController)
    return RecordingController.calls


def test_launch_passes_resume_and_steps_as_the_roles_read_them(recorded, capsys) -> None:
    assert cli.main(["launch", "nographs", "--resume", "--steps", "300"]) == 0
    assert recorded == [("launch", ("nographs",), {"resume": True, "steps": 300})]
    assert json.loads(capsys.readouterr().out) == {"run": "nographs", "resume": True, "steps": 300}


def test_launch_without_options_passes_none(recorded) -> None:
    assert cli.main(["launch", "nographs"]) == 0
    assert recorded == [("launch", ("nographs",), {})]


def test_steps_must_be_a_number(recorded, capsys) -> None:
    with pytest.raises(SystemExit) as refused:
        cli.main(["launch", "nographs", "--steps", "many"])
    assert refused.value.code == 2 and "invalid int value: 'many'" in capsys.readouterr().err
    assert recorded == []


def test_regen_runs_the_regen_playbook_for_the_run(recorded, monkeypatch, capsys) -> None:
    assert cli.main(["regen", "nographs"]) == 0
    assert recorded == [("regen", ("nographs",), {})]
    from types import SimpleNamespace

    from dflashctl.api import Controller

    played = []

    def run_playbook(self, playbook, extravars):
        played.append((playbook, extravars))
        return SimpleNamespace(
            stats={"dflash_launch_by_host": {"ct200": {"run": "nographs", "pid": 7}}}, facts={}
        )

    monkeypatch.setattr(Controller, "run_playbook", run_playbook)
    assert Controller().regen("nographs") == {"run": "nographs", "pid": 7}
    assert played == [("regen.yml", {"run": "nographs"})]


def test_ctrl_c_during_a_launch_says_the_trainer_it_started_keeps_running(
    monkeypatch, tmp_path, capsys
) -> None:
    """The launch wrote its ledger line, then Ctrl-C came while it waited for the first progress line."""

    class Interrupted(RecordingController):
        def launch(self, run, **extravars):
            line = {"run": run, "host": "ct200", "pid": 4242, "log": "/ws/train.log", "state": "running"}
            line["started_at"] = "2999-01-01T00:00:00Z"
            (tmp_path / "runs.jsonl").write_text(json.dumps(line) + "\n")
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "Controller", Interrupted)
    assert cli.main(["--state-dir", str(tmp_path), "launch", "nographs"]) == 130
    said = capsys.readouterr().err
    assert "the trainer started keeps running: ct200: run nographs as PID 4242, log /ws/train.log" in said
    assert "stop it with python -m dflashctl stop" in said
