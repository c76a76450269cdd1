"""The trainer record taken whole: the option `recorded` (module_utils/trainer_record.py, documented
once in the doc fragment dflash.ct200.trainer_record) and the action dflash.ct200.trainer_record,
which keeps the record in the cached host facts and the run ledger in one call."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible.errors import AnsibleActionFail
from ansible.plugins.loader import action_loader, fragment_loader
from ansible.utils.plugin_docs import get_docstring
from ansible_collections.dflash.ct200.plugins.module_utils import trainer_record
from ansible_collections.dflash.ct200.plugins.modules import run_probe, trainer_stop

RECORD = {
    "format": 1,
    "run": "nographs",
    "run_id": "nographs-20261130T101500Z-4242",
    "pid": 4242,
    "start_time": 123456,
    "boot_id": "b0",
    "host": "ct200",
    "out": "/workspace/runs/nographs",
    "log": "/workspace/train_compile_nographs.log",
    "state": "running",
}


def action(args: dict, check_mode: bool = False, name: str = "dflash.ct200.trainer_record"):
    """The action plugin as the task executor makes it, with a task that carries `args`."""
    task = SimpleNamespace(args=args, check_mode=check_mode, async_val=0, action=name)
    connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir="/nonexistent"))
    return action_loader.get(
        name,
        task=task,
        connection=connection,
        play_context=None,
        loader=None,
        templar=None,
        shared_loader_obj=None,
    )


def ledger_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def gone_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# -- the action: facts and ledger in one call --------------------------------------------------


def test_one_call_returns_the_cacheable_facts_and_writes_the_ledger(tmp_path) -> None:
    ledger = tmp_path / "state" / "runs.jsonl"
    result = action({"record": RECORD, "ledger": str(ledger)}).run(task_vars={})
    assert not result.get("failed")
    assert result["ansible_facts"] == {"trainer_run": RECORD, "trainer_pid": 4242}
    assert result["_ansible_facts_cacheable"] is True
    assert result["changed"] is True and result["ledger_error"] is None
    assert ledger_lines(ledger) == [RECORD]
    assert oct(ledger.stat().st_mode & 0o777) == "0o640"


def test_update_replaces_the_records_fields_and_its_ledger_line(tmp_path) -> None:
    ledger = tmp_path / "runs.jsonl"
    other = {**RECORD, "run_id": "other-1", "pid": 1}
    ledger.write_text(json.dumps(other) + "\nnot json, kept as it is\n")
    action({"record": RECORD, "ledger": str(ledger)}).run(task_vars={})
    result = action({"record": RECORD, "update": {"state": "failed"}, "ledger": str(ledger)}).run(
        task_vars={}
    )
    assert result["ansible_facts"]["trainer_run"]["state"] == "failed"
    assert RECORD["state"] == "running", "the caller's record is not changed in place"
    lines = ledger.read_text().splitlines()
    assert lines[1] == "not json, kept as it is"
    assert [json.loads(lines[i])["run_id"] for i in (0, 2)] == ["other-1", RECORD["run_id"]]
    assert json.loads(lines[2])["state"] == "failed"


def test_the_same_record_again_changes_nothing(tmp_path) -> None:
    ledger = tmp_path / "runs.jsonl"
    action({"record": RECORD, "ledger": str(ledger)}).run(task_vars={})
    again = action({"record": RECORD, "ledger": str(ledger)}).run(task_vars={})
    assert again["changed"] is False
    assert len(ledger_lines(ledger)) == 1


def test_check_mode_returns_the_facts_and_leaves_the_ledger_alone(tmp_path) -> None:
    ledger = tmp_path / "runs.jsonl"
    result = action({"record": RECORD, "ledger": str(ledger)}, check_mode=True).run(task_vars={})
    assert result["changed"] is True, "it would change"
    assert result["ansible_facts"]["trainer_pid"] == 4242
    assert not ledger.exists()


def test_an_unwritable_ledger_fails_the_task_naming_the_file(tmp_path) -> None:
    ledger = tmp_path / "runs.jsonl"
    ledger.mkdir()  # a directory where the file should be
    result = action({"record": RECORD, "ledger": str(ledger)}).run(task_vars={})
    assert result["failed"] is True
    assert result["msg"].startswith(f"cannot write the run ledger {ledger}: ")
    assert "recorded on the target (<out>/run.json)" in result["msg"]
    assert result["ledger_error"] == result["msg"]


def test_an_unwritable_ledger_can_be_reported_without_failing(tmp_path) -> None:
    ledger = tmp_path / "runs.jsonl"
    ledger.mkdir()
    args = {"record": RECORD, "ledger": str(ledger), "fail_on_ledger_error": False}
    result = action(args).run(task_vars={})
    assert not result.get("failed")
    assert "cannot write the run ledger" in result["ledger_error"]
    assert result["ansible_facts"]["trainer_run"] == RECORD, "the facts are still set"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".runs-")], "no partial ledger left"


def test_a_record_without_run_id_is_refused_before_anything_is_written(tmp_path) -> None:
    ledger = tmp_path / "runs.jsonl"
    record = {key: value for key, value in RECORD.items() if key != "run_id"}
    with pytest.raises(AnsibleActionFail, match="needs a record with run_id"):
        action({"record": record, "ledger": str(ledger)}).run(task_vars={})
    assert not ledger.exists()


def test_bad_arguments_are_refused_by_the_argument_spec(tmp_path) -> None:
    with pytest.raises(AnsibleActionFail, match="record"):
        action({"record": "not a dict", "ledger": str(tmp_path / "r.jsonl")}).run(task_vars={})
    with pytest.raises(AnsibleActionFail, match="ledger"):
        action({"record": RECORD}).run(task_vars={})


def test_run_ledger_writes_through_the_same_ledger_code(tmp_path) -> None:
    ledger = tmp_path / "runs.jsonl"
    result = action({"path": str(ledger), "record": RECORD}, name="dflash.ct200.run_ledger").run(task_vars={})
    assert result["changed"] is True and "ansible_facts" not in result
    assert ledger_lines(ledger) == [RECORD]


# -- the option `recorded` -------------------------------------------------------------------------


def test_identity_fields_are_read_and_converted_from_the_record() -> None:
    found = trainer_record.record_identity({**RECORD, "pid": "4242", "start_time": "123456"})
    assert found == {
        "pid": 4242,
        "start_time": 123456,
        "boot_id": "b0",
        "run": "nographs",
        "log": "/workspace/train_compile_nographs.log",
    }
    assert trainer_record.record_identity({}) == dict.fromkeys(trainer_record.IDENTITY_FIELDS)
    assert trainer_record.record_identity(None)["pid"] is None


def test_a_bad_identity_field_is_named() -> None:
    with pytest.raises(ValueError, match=r"recorded\.pid is 'forty-two'"):
        trainer_record.record_identity({"pid": "forty-two"})


MODULES_TAKING_THE_RECORD = [
    pytest.param(run_probe, id="run_probe"),
    pytest.param(trainer_stop, id="trainer_stop"),
]


@pytest.mark.parametrize("module", MODULES_TAKING_THE_RECORD)
def test_every_module_that_takes_the_record_documents_it_through_the_fragment(module) -> None:
    spec = trainer_record.argument_spec()
    assert "recorded:" not in module.DOCUMENTATION, "documented once, in the fragment"
    assert "  - dflash.ct200.trainer_record\n" in module.DOCUMENTATION
    doc = get_docstring(module.__file__, fragment_loader, collection_name="dflash.ct200")[0]
    option = doc["options"]["recorded"]
    assert option["type"] == spec["recorded"]["type"] == "dict"
    assert "trainer_run" in " ".join(option["description"])


def test_the_modules_that_take_the_record_are_the_ones_that_declare_the_fragment() -> None:
    modules = Path(trainer_stop.__file__).parent
    takes = {p.stem for p in modules.glob("*.py") if "trainer_record.argument_spec()" in p.read_text()}
    declares = {p.stem for p in modules.glob("*.py") if "  - dflash.ct200.trainer_record\n" in p.read_text()}
    assert takes == declares == {"run_log", "run_probe", "trainer_stop"}


def test_run_probe_classifies_the_trainer_named_by_the_record_alone(run_module, tmp_path) -> None:
    log = tmp_path / "train.log"
    log.write_text("step 5/300 loss 3.2\ntraining done: 300 steps\n")
    exited = run_module(run_probe.main, {"recorded": {**RECORD, "pid": gone_pid(), "log": str(log)}})
    assert exited.result["state"] == "exited"
    assert exited.result["last_progress"] == "step 5/300 loss 3.2", "the log came from the record"
    me = os.getpid()
    reused = run_module(run_probe.main, {"recorded": {**RECORD, "pid": me, "start_time": 1, "log": str(log)}})
    assert reused.result["state"] == "not_ours", "a PID with another start time is not the trainer"
    assert run_module(run_probe.main, {"recorded": {}}).result["state"] == "none"


def test_an_option_given_on_its_own_wins_over_the_records_field(run_module, tmp_path) -> None:
    result = run_module(
        run_probe.main, {"recorded": {**RECORD, "pid": os.getpid(), "start_time": 1}, "pid": 0}
    )
    assert result.result["state"] == "none"


def test_a_record_with_a_bad_pid_fails_the_module_naming_the_field(run_module) -> None:
    result = run_module(trainer_stop.main, {"recorded": {**RECORD, "pid": "forty-two"}})
    assert result.failed
    assert "recorded.pid is 'forty-two'" in result.result["msg"]
    assert "trainer_run" in result.result["msg"]


def test_trainer_stop_leaves_an_exited_trainer_of_the_record_alone(run_module) -> None:
    result = run_module(trainer_stop.main, {"recorded": {**RECORD, "pid": gone_pid()}, "timeout": 1})
    assert not result.failed and result.result["changed"] is False
    assert result.result["state_before"] == "exited"
    assert result.result["msg"] == "the recorded trainer has exited already"
