"""dflash.ct200.run_ledger (an action: it runs on the controller): appends a run record or replaces
the line of its run_id, keeps lines it cannot read, writes atomically (nothing partial on a failed
write), changes nothing in check mode and refuses a record without run_id."""

from __future__ import annotations

import json
import os
import stat
from types import SimpleNamespace

import pytest
from ansible.errors import AnsibleActionFail
from ansible.plugins.loader import action_loader
from ansible_collections.dflash.ct200.plugins.plugin_utils.ledger import merge


def run_ledger(args: dict, check_mode: bool = False) -> dict:
    """The action as a play runs it (resolved by name), with a task of these args."""
    task = SimpleNamespace(args=args, check_mode=check_mode, async_val=0, action="dflash.ct200.run_ledger")
    connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir=None))
    action = action_loader.get(
        "dflash.ct200.run_ledger",
        task=task,
        connection=connection,
        play_context=None,
        loader=None,
        templar=None,
        shared_loader_obj=None,
    )
    return action.run(task_vars={})


def lines(path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_are_appended_then_replaced_by_run_id(tmp_path) -> None:
    ledger = tmp_path / "state" / "runs.jsonl"
    first = run_ledger({"path": str(ledger), "record": {"run_id": "a-1", "state": "running", "pid": 10}})
    assert first["changed"] is True and first["path"] == str(ledger)
    assert stat.S_IMODE(os.stat(ledger).st_mode) == 0o640
    run_ledger({"path": str(ledger), "record": {"run_id": "b-2", "state": "running"}})
    replaced = run_ledger({"path": str(ledger), "record": {"run_id": "a-1", "state": "stopped", "pid": 10}})
    assert replaced["changed"] is True
    assert lines(ledger) == [
        {"run_id": "a-1", "state": "stopped", "pid": 10},
        {"run_id": "b-2", "state": "running"},
    ]
    again = run_ledger({"path": str(ledger), "record": {"run_id": "a-1", "state": "stopped", "pid": 10}})
    assert again["changed"] is False
    assert not [p for p in ledger.parent.iterdir() if p.name.startswith(".runs-")], (
        "a temporary file was left"
    )


def test_lines_it_cannot_read_are_kept(tmp_path) -> None:
    ledger = tmp_path / "runs.jsonl"
    ledger.write_text('{"run_id": "a-1"}\nnot json, written by hand\n["a", "list"]\n')
    run_ledger({"path": str(ledger), "record": {"run_id": "a-1", "state": "failed"}})
    assert ledger.read_text().splitlines() == [
        '{"run_id": "a-1", "state": "failed"}',
        "not json, written by hand",
        '["a", "list"]',
    ]


def test_check_mode_reports_the_change_and_writes_nothing(tmp_path) -> None:
    ledger = tmp_path / "runs.jsonl"
    result = run_ledger({"path": str(ledger), "record": {"run_id": "a-1"}}, check_mode=True)
    assert result["changed"] is True and result["record"] == {"run_id": "a-1"}
    assert not ledger.exists()


@pytest.mark.parametrize(
    "args",
    [
        {"record": {"run_id": "a"}},
        {"path": "x"},
        {"path": "x", "record": {"state": "running"}},
        {"path": "x", "record": "a"},
    ],
)
def test_a_missing_path_or_a_record_without_run_id_is_refused(tmp_path, args) -> None:
    if "path" in args:
        args = {**args, "path": str(tmp_path / args["path"])}
    with pytest.raises(AnsibleActionFail, match="run_ledger needs path and a record with run_id"):
        run_ledger(args)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_an_unwritable_ledger_fails_naming_it_and_the_record_on_the_target(tmp_path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "runs.jsonl").write_text('{"run_id": "a-1"}\n')
    state.chmod(0o500)
    try:
        with pytest.raises(
            AnsibleActionFail, match=r"cannot write the run ledger .*runs\.jsonl: Permission denied"
        ):
            run_ledger({"path": str(state / "runs.jsonl"), "record": {"run_id": "b-2"}})
    finally:
        state.chmod(0o700)
    assert (state / "runs.jsonl").read_text() == '{"run_id": "a-1"}\n'


def test_a_ledger_path_under_a_file_fails_naming_it(tmp_path) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state directory should be")
    with pytest.raises(AnsibleActionFail) as failure:
        run_ledger({"path": str(blocker / "runs.jsonl"), "record": {"run_id": "a-1"}})
    assert f"cannot write the run ledger {blocker / 'runs.jsonl'}" in str(failure.value)
    assert "the run itself is recorded on the target (<out>/run.json)" in str(failure.value)


def test_values_that_are_not_json_are_written_as_text(tmp_path) -> None:
    ledger = tmp_path / "runs.jsonl"
    result = run_ledger({"path": str(ledger), "record": {"run_id": "a-1", "out": tmp_path}})
    assert result["record"]["out"] == str(tmp_path)
    assert lines(ledger) == [{"run_id": "a-1", "out": str(tmp_path)}]


def test_merge_appends_replaces_and_reports_change() -> None:
    merged, changed = merge(['{"run_id": "a"}'], {"run_id": "b"})
    assert merged == ['{"run_id": "a"}', '{"run_id": "b"}'] and changed
    merged, changed = merge(['{"run_id": "a", "x": 1}'], {"x": 1, "run_id": "a"})
    assert merged == ['{"run_id": "a", "x": 1}'] and not changed


def test_update_changes_only_the_given_keys_of_an_existing_line_and_appends_nothing() -> None:
    merged, changed = merge(
        ['{"run_id": "a", "state": "running", "x": 1}'], {"run_id": "a", "restarts": 2}, True
    )
    assert [json.loads(line) for line in merged] == [
        {"run_id": "a", "state": "running", "x": 1, "restarts": 2}
    ]
    assert changed
    merged, changed = merge(['{"run_id": "a"}'], {"run_id": "b", "restarts": 1}, update=True)
    assert merged == ['{"run_id": "a"}'] and not changed


def test_the_documented_options_are_the_ones_the_action_reads(tmp_path) -> None:
    import yaml
    from ansible_collections.dflash.ct200.plugins.modules import run_ledger as documentation

    options = yaml.safe_load(documentation.DOCUMENTATION)["options"]
    assert set(options) == {"path", "record", "update"}
    assert options["path"]["required"] and options["record"]["required"]
    with pytest.raises(AnsibleActionFail):
        run_ledger({"path": str(tmp_path / "runs.jsonl")})  # each required one is needed
