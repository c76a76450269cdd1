"""dflash.ct200.run_log, the module: the last lines of a log, the complete lines written since an
offset (bounded, waiting for new ones while the trainer lives), whether the recorded trainer lives
and how the run ended; and the action of the same name: its options, what it hands the module, and
its follow loop, with the module run in this process in place of a connection."""

from __future__ import annotations

import json
import sys
import threading
import time
from types import SimpleNamespace

import pytest
from ansible.errors import AnsibleActionFail
from ansible.plugins.loader import action_loader
from ansible_collections.dflash.ct200.plugins.modules import run_log

LINES = ["step 1 loss 9.0", "step 2 loss 5.0", "eval step 2 tau 1.5", "done: 2 steps"]


@pytest.fixture
def log(tmp_path):
    path = tmp_path / "train.log"
    path.write_text("\n".join(LINES) + "\n")
    return path


@pytest.fixture
def fast_poll(monkeypatch):
    monkeypatch.setattr(run_log, "POLL_S", 0.05)


def read(run_module, check_mode=False, **args) -> dict:
    result = run_module(run_log.main, args, check_mode=check_mode)
    assert not result.failed, result.result.get("msg")
    return result.result


def test_a_negative_offset_returns_the_last_lines_and_the_end_offset(run_module, log) -> None:
    result = read(run_module, path=str(log), lines=2)
    assert result["log_lines"] == LINES[-2:]
    assert result["offset"] == log.stat().st_size and result["more"] is False
    assert result["changed"] is False
    assert result["alive"] is False and result["ended"] == "exit status 0 (finished)"
    assert read(run_module, path=str(log), lines=0)["log_lines"] == []
    assert read(run_module, path=str(log))["log_lines"] == LINES  # default: up to 20


def test_an_offset_returns_what_was_written_after_it(run_module, log) -> None:
    start = len(("\n".join(LINES[:2]) + "\n").encode())
    result = read(run_module, path=str(log), offset=start)
    assert result["log_lines"] == LINES[2:] and result["offset"] == log.stat().st_size
    at_end = read(run_module, path=str(log), offset=result["offset"])
    assert at_end["log_lines"] == [] and at_end["offset"] == result["offset"]


def test_reads_are_bounded_and_continue_from_the_returned_offset(run_module, log) -> None:
    first = read(run_module, path=str(log), offset=0, max_bytes=40)
    assert first["more"] is True and first["log_lines"] == LINES[:2]  # only complete lines
    assert first["offset"] == len(("\n".join(LINES[:2]) + "\n").encode())
    rest = read(run_module, path=str(log), offset=first["offset"], max_bytes=40)
    assert rest["log_lines"] == LINES[2:] and rest["more"] is False


def test_a_line_longer_than_max_bytes_comes_in_pieces(run_module, tmp_path) -> None:
    path = tmp_path / "train.log"
    path.write_text("x" * 25 + "\n")
    first = read(run_module, path=str(path), offset=0, max_bytes=10)
    assert first == {**first, "log_lines": ["x" * 10], "offset": 10, "more": True}
    second = read(run_module, path=str(path), offset=10, max_bytes=10)
    assert second["log_lines"] == ["x" * 10] and second["offset"] == 20


def test_a_log_shorter_than_the_offset_was_replaced_and_is_read_from_its_start(run_module, log) -> None:
    result = read(run_module, path=str(log), offset=log.stat().st_size + 1000)
    assert result["log_lines"] == LINES and result["offset"] == log.stat().st_size


def test_carriage_returns_end_lines(run_module, tmp_path) -> None:
    path = tmp_path / "train.log"
    path.write_bytes(b"a\r\nb\rc\n")
    assert read(run_module, path=str(path), offset=0)["log_lines"] == ["a", "b", "c"]


def test_a_missing_log_reads_as_empty_and_says_the_log_does_not_tell(run_module, tmp_path) -> None:
    missing = str(tmp_path / "nowhere.log")
    tail = read(run_module, path=missing)
    assert tail["log_lines"] == [] and tail["offset"] == 0
    assert tail["ended"] == "exit status unknown (the log does not say)"
    from_offset = read(run_module, path=missing, offset=500)
    assert from_offset["log_lines"] == [] and from_offset["offset"] == 0


def test_how_the_run_ended_comes_from_its_last_ending_event(run_module, log, tmp_path) -> None:
    events = tmp_path / "events.jsonl"

    def ended(*rows) -> str:
        events.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"event": "fin')
        return read(run_module, path=str(log), events=str(events))["ended"]

    start = {"event": "start", "run": "nographs", "pid": 5}
    finish = {"event": "finish", "step": 150, "tau": 1.95, "restarts": 1, "reason": "finished"}
    assert ended(start, finish) == "finished at step 150, tau 1.950, after 1 restart(s): finished"
    assert ended(start, {"event": "crash", "reason": "killed by SIGKILL"}, {"event": "restart"}) == (
        "crashed: killed by SIGKILL"
    )
    assert ended(start, {"event": "stop", "step": 40, "reason": "SIGTERM"}) == "stopped at step 40"
    assert ended(start, {"event": "failed", "reason": "bad input: data.train_file"}) == (
        "failed: bad input: data.train_file"
    )
    # No ending event yet: the log decides.
    assert ended(start) == "exit status 0 (finished)"


def test_the_log_names_a_bad_input_exit(run_module, tmp_path) -> None:
    path = tmp_path / "train.log"
    path.write_text("loading\nerror: data.train_file /x does not exist\n")
    assert read(run_module, path=str(path))["ended"] == (
        "exit status 2 (bad input: data.train_file /x does not exist)"
    )


@pytest.mark.parametrize(
    "args",
    [{"lines": -1}, {"max_bytes": 0}, {"wait_s": -0.5}],
    ids=["negative-lines", "zero-max-bytes", "negative-wait"],
)
def test_bad_numbers_fail_naming_the_limits(run_module, log, args) -> None:
    result = run_module(run_log.main, {"path": str(log), **args})
    assert result.failed
    assert "lines must not be negative, max_bytes positive, wait_s not negative" in result.result["msg"]


def test_a_missing_path_or_an_unknown_option_fails(run_module, log) -> None:
    no_path = run_module(run_log.main, {"lines": 3})
    assert no_path.failed and "path" in no_path.result["msg"]
    unknown = run_module(run_log.main, {"path": str(log), "tail": True})
    assert unknown.failed and "tail" in unknown.result["msg"]


def test_the_record_whole_gives_the_identity(run_module, log, live_trainer) -> None:
    whole = run_module(run_log.main, {"path": str(log), "lines": 1, "recorded": live_trainer.identity})
    assert not whole.failed and whole.result["alive"], whole.result
    bad = run_module(run_log.main, {"path": str(log), "recorded": {"pid": "forty-two"}})
    assert bad.failed and "recorded.pid" in bad.result["msg"]


def test_check_mode_reads_the_same(run_module, log) -> None:
    assert read(run_module, check_mode=True, path=str(log), lines=2) == read(
        run_module, path=str(log), lines=2
    )


def test_a_live_trainer_keeps_its_unfinished_line_for_the_next_read(
    run_module, tmp_path, live_trainer, fast_poll
) -> None:
    path = tmp_path / "train.log"
    path.write_text("step 1 loss 9.0\nstep 2 lo")
    result = read(run_module, path=str(path), offset=0, **live_trainer.identity)
    assert result["alive"] is True and result["ended"] is None
    assert result["log_lines"] == ["step 1 loss 9.0"] and result["offset"] == len("step 1 loss 9.0\n")
    # Once the trainer is gone, the rest is returned as it stands.
    live_trainer.process.kill()
    live_trainer.process.wait(timeout=10)
    rest = read(run_module, path=str(path), offset=result["offset"], **live_trainer.identity)
    assert rest["alive"] is False and rest["log_lines"] == ["step 2 lo"]


def test_another_process_behind_the_pid_is_not_alive(run_module, log, live_trainer) -> None:
    result = read(run_module, path=str(log), **{**live_trainer.identity, "run": "graphs"})
    assert result["alive"] is False and result["ended"] == "exit status 0 (finished)"
    result = read(run_module, path=str(log), **{**live_trainer.identity, "start_time": 1})
    assert result["alive"] is False


def test_waits_for_new_lines_while_the_trainer_lives(run_module, log, live_trainer, fast_poll) -> None:
    size = log.stat().st_size
    began = time.monotonic()
    idle = read(run_module, path=str(log), offset=size, wait_s=0.3, **live_trainer.identity)
    assert idle["log_lines"] == [] and idle["alive"] is True
    assert time.monotonic() - began >= 0.3

    def append() -> None:
        with open(log, "a") as handle:
            handle.write("step 3 loss 2.0\n")

    writer = threading.Timer(0.2, append)
    writer.start()
    try:
        began = time.monotonic()
        result = read(run_module, path=str(log), offset=size, wait_s=20, **live_trainer.identity)
    finally:
        writer.join()
    assert result["log_lines"] == ["step 3 loss 2.0"]
    assert time.monotonic() - began < 10  # returned when the line came, not at wait_s


def test_a_dead_trainer_is_not_waited_for(run_module, log, tmp_path) -> None:
    began = time.monotonic()
    result = read(run_module, path=str(log), offset=log.stat().st_size, wait_s=30, pid=2**22 + 7)
    assert result["alive"] is False and time.monotonic() - began < 5


# The action.


def action_for(args: dict, run_module, calls: list | None = None, after_read=None):
    """The action as a play resolves it, with _execute_module running the module here (and then
    after_read(number of reads so far), where given)."""
    task = SimpleNamespace(args=args, check_mode=False, async_val=0, action="dflash.ct200.run_log")
    connection = SimpleNamespace(_shell=SimpleNamespace(tmpdir=None))
    action = action_loader.get(
        "dflash.ct200.run_log",
        task=task,
        connection=connection,
        play_context=None,
        loader=None,
        templar=None,
        shared_loader_obj=None,
    )

    def execute(module_name, module_args, task_vars):
        assert module_name == "dflash.ct200.run_log"
        if calls is not None:
            calls.append(dict(module_args))
        result = run_module(run_log.main, module_args).result
        if after_read is not None:
            after_read(len(calls) if calls is not None else None)
        return result

    action._execute_module = execute
    return action


@pytest.fixture
def shown(monkeypatch):
    """The lines the action displays."""
    lines: list[str] = []
    module = sys.modules[action_loader.get("dflash.ct200.run_log", class_only=True).__module__]
    monkeypatch.setattr(module.display, "display", lambda text, *args, **kwargs: lines.append(text))
    return lines


def test_the_action_shows_the_last_lines_with_its_prefix(run_module, log, shown) -> None:
    calls: list = []
    action = action_for({"path": str(log), "lines": 2, "prefix": "ct200| ", "pid": None}, run_module, calls)
    result = action.run(task_vars={})
    assert shown == [f"ct200| {line}" for line in LINES[-2:]]
    assert result["lines_shown"] == 2 and result["offset"] == log.stat().st_size
    assert result["changed"] is False and result["followed"] is False and result["timed_out"] is False
    assert result["ended"] == "exit status 0 (finished)"
    # Its own options and unset ones stay on the controller.
    assert calls == [{"path": str(log), "lines": 2, "offset": -1}]


def test_the_action_refuses_an_unknown_option(run_module, log) -> None:
    with pytest.raises(AnsibleActionFail, match="wait"):
        action_for({"path": str(log), "wait": 3}, run_module).run(task_vars={})


def test_a_module_failure_fails_the_action_with_its_message(run_module, log) -> None:
    with pytest.raises(AnsibleActionFail, match="max_bytes positive"):
        action_for({"path": str(log), "max_bytes": 0}, run_module).run(task_vars={})


def test_follow_shows_new_lines_until_the_trainer_exits(
    run_module, log, live_trainer, shown, fast_poll
) -> None:
    def write_then_exit() -> None:
        with open(log, "a") as handle:
            handle.write("step 3 loss 2.0\n")
            handle.flush()
            time.sleep(0.3)
            handle.write("step 4 loss 1.0\nstopped at step 4")
        live_trainer.process.kill()
        live_trainer.process.wait(timeout=10)

    writer = threading.Timer(0.2, write_then_exit)
    calls: list = []
    action = action_for(
        {"path": str(log), "lines": 1, "follow": True, "poll_s": 0.2, **live_trainer.identity},
        run_module,
        calls,
    )
    writer.start()
    try:
        result = action.run(task_vars={})
    finally:
        writer.join()
    assert shown == [LINES[-1], "step 3 loss 2.0", "step 4 loss 1.0", "stopped at step 4"]
    assert result["lines_shown"] == 4 and result["alive"] is False and result["followed"] is True
    assert result["ended"] == "exit status 0 (stopped after a checkpoint)" and result["timed_out"] is False
    assert all(call["wait_s"] == 0.2 and call["offset"] >= 0 for call in calls[1:])


def test_follow_reads_what_is_left_after_the_trainer_exits(run_module, log, live_trainer, shown) -> None:
    late = [f"step {n} loss 1.{n}" for n in range(3, 13)]

    def exit_after_the_first_read(reads: int) -> None:
        if reads == 1:
            with open(log, "a") as handle:
                handle.write("".join(line + "\n" for line in late))
            live_trainer.process.kill()
            live_trainer.process.wait(timeout=10)

    calls: list = []
    args = {
        "path": str(log),
        "lines": 1,
        "max_bytes": 40,
        "follow": True,
        "poll_s": 0.1,
        **live_trainer.identity,
    }
    result = action_for(args, run_module, calls, exit_after_the_first_read).run(task_vars={})
    assert shown == [LINES[-1], *late]  # every bounded read until nothing more, though it had exited
    assert len(calls) > 3 and result["alive"] is False and result["offset"] == log.stat().st_size


def test_follow_stops_at_max_s_while_the_trainer_still_runs(
    run_module, log, live_trainer, shown, fast_poll
) -> None:
    args = {"path": str(log), "follow": True, "poll_s": 0.1, "max_s": 0.5, **live_trainer.identity}
    began = time.monotonic()
    result = action_for(args, run_module).run(task_vars={})
    assert result["timed_out"] is True and result["alive"] is True and result["ended"] is None
    assert result["lines_shown"] == len(LINES) and shown == LINES
    assert time.monotonic() - began < 10


def test_the_documented_module_options_are_its_argument_spec() -> None:
    import yaml

    documented = set(yaml.safe_load(run_log.DOCUMENTATION)["options"])
    action = sys.modules[action_loader.get("dflash.ct200.run_log", class_only=True).__module__]
    # The module's own options, which the action passes on, and the action's, documented here too.
    assert documented == {*action.MODULE_OPTIONS, "offset", "wait_s"} - {"recorded"} | {
        "follow",
        "poll_s",
        "max_s",
        "prefix",
    }
