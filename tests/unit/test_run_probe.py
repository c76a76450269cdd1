"""dflash.ct200.run_probe: classifies a recorded trainer (none, running, exited, not_ours) from PID,
start time and boot id; reads progress, tau and the log's tail; waits for a log line and fails
naming the exit status or the timeout; reports an output, free disk space, the target's records
(and what the controller's cache got wrong) and GPUs. Real processes: the stand-in trainer of
tests/unit/standin.py, started through trainer_start and killed by PID at the end of every test."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from ansible_collections.dflash.ct200.plugins.module_utils.trainer_proc import boot_id
from ansible_collections.dflash.ct200.plugins.modules import run_probe, trainer_start

from tests.unit.standin import Started, gone_within, kill_and_reap, logged_within, not_the_trainer, workspace


@pytest.fixture
def trainer(tmp_path, run_module):
    """start(*args, out=None) -> trainer_start's result for a stand-in trainer in tmp_path."""
    script = workspace(tmp_path / "ws")
    with Started() as started:

        def start(*args: str, out=None) -> dict:
            params = {"script": str(script), "log": str(tmp_path / "train.log"), "run": "nographs"}
            if out:
                params["out"] = str(out)
                args = (*args, "--out", str(out))
            result = run_module(trainer_start.main, {**params, "args": list(args)})
            started.add(result.result)
            assert not result.failed, result.result["msg"]
            return result.result

        yield start


def probe(run_module, **args):
    return run_module(run_probe.main, args)


def identity(started: dict) -> dict:
    return {key: started[key] for key in ("pid", "start_time", "boot_id")} | {"run": "nographs"}


def test_nothing_recorded_is_state_none(run_module) -> None:
    result = probe(run_module)
    assert not result.failed and result.result["changed"] is False
    assert result.result["state"] == "none" and result.result["pid"] is None
    assert result.result["boot_id"] == boot_id()


def test_a_live_trainer_is_running_with_its_progress_and_tau(tmp_path, run_module, trainer) -> None:
    started = trainer()
    log = tmp_path / "train.log"
    assert logged_within(log, "eval step 2 ", 10)
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"kind": "eval", "step": 4, "tau": 2.25, "prompts": 8}) + "\n{partial")
    result = probe(run_module, **identity(started), log=str(log), metrics=str(metrics), tail_lines=3)
    assert result.result["state"] == "running" and result.result["alive"] is True
    assert result.result["cmdline"] == started["cmdline"]
    assert result.result["last_progress"].startswith("step ")
    assert result.result["last_eval"] == {"kind": "eval", "step": 4, "tau": 2.25, "prompts": 8}
    assert len(result.result["log_tail"]) == 3
    # Without metrics.jsonl (a host that is not rank 0's), the log's eval line.
    from_log = probe(run_module, **identity(started), log=str(log))
    assert from_log.result["last_eval"]["tau"] == 1.5


def test_another_start_time_boot_id_or_program_behind_the_pid_is_not_ours(
    tmp_path, run_module, trainer
) -> None:
    started = trainer()
    recorded = identity(started)
    assert (
        probe(run_module, **{**recorded, "start_time": recorded["start_time"] - 1}).result["state"]
        == "not_ours"
    )
    assert probe(run_module, **{**recorded, "boot_id": "another-boot"}).result["state"] == "not_ours"
    assert probe(run_module, **{**recorded, "run": "graphs"}).result["state"] == "not_ours"
    other = trainer_start_other(tmp_path, run_module)
    try:
        mine = probe(run_module, pid=other, run="nographs")
        assert mine.result["state"] == "not_ours" and mine.result["alive"] is True
    finally:
        kill_and_reap(other)


def trainer_start_other(tmp_path, run_module) -> int:
    """A process that is not the trainer (started as trainer_start would, then left to run)."""
    script = not_the_trainer(tmp_path / "other")
    result = run_module(
        trainer_start.main,
        {"script": str(script), "log": str(tmp_path / "other.log"), "run": "nographs", "settle": 0.2},
    )
    assert result.failed and result.result["pid"]
    return result.result["pid"]


def test_an_ended_trainer_is_exited_with_the_status_its_log_tells(tmp_path, run_module, trainer) -> None:
    started = trainer("--behave", "finish")
    assert gone_within(started["pid"], 10)
    result = probe(run_module, **identity(started), log=str(tmp_path / "train.log"))
    assert result.result["state"] == "exited" and result.result["alive"] is False
    assert result.result["exit_status"] == 0 and result.result["exit_reason"] == "finished"


def test_wait_for_returns_the_matching_line_once_it_is_logged(tmp_path, run_module, trainer) -> None:
    started = trainer("--first-step-after", "0.5")
    result = probe(
        run_module,
        **identity(started),
        log=str(tmp_path / "train.log"),
        wait_for=r"^step \d+/\d+ ",
        timeout=20,
    )
    assert not result.failed, result.result["msg"]
    assert result.result["matched"].startswith("step 1/10 ")
    assert result.result["waited_s"] >= 0.3


def test_wait_for_fails_naming_the_exit_status_when_the_trainer_dies_first(
    tmp_path, run_module, trainer
) -> None:
    started = trainer("--first-step-after", "30")
    assert logged_within(tmp_path / "train.log", "stand-in trainer", 10)
    kill_and_reap(started["pid"])
    result = probe(
        run_module, **identity(started), log=str(tmp_path / "train.log"), wait_for="^step ", timeout=20
    )
    assert result.failed and result.result["state"] == "exited"
    assert (
        f"the trainer (PID {started['pid']}) ended before a line matching '^step ': crashed, "
        "exit status: unknown (the log does not say)" in (result.result["msg"])
    )
    assert result.result["run_state"] == "crashed"
    assert "stand-in trainer" in result.result["msg"], "the log's tail is missing"


def test_wait_for_fails_at_the_timeout_and_leaves_the_trainer_running(tmp_path, run_module, trainer) -> None:
    started = trainer("--first-step-after", "30")
    result = probe(
        run_module, **identity(started), log=str(tmp_path / "train.log"), wait_for="^step ", timeout=0.5
    )
    assert result.failed and result.result["state"] == "running"
    assert (
        "runs but has not reached a line matching '^step ' within 0 s (it keeps running"
        in result.result["msg"]
    )
    assert probe(run_module, **identity(started)).result["state"] == "running"


def test_the_target_s_records_win_over_an_empty_or_stale_cache(tmp_path, run_module, trainer) -> None:
    runs = tmp_path / "runs"
    started = trainer(out=runs / "nographs")
    for cached in ({}, {"run_id": "nographs-old", "pid": 1, "started_at": "2026-01-01T00:00:00Z"}):
        result = probe(run_module, runs_dir=str(runs), recorded=cached, log=str(tmp_path / "train.log"))
        assert not result.failed
        target = result.result["target"]
        assert result.result["state"] == "running" and result.result["pid"] == started["pid"]
        assert target["record"]["run_id"] == started["run_id"] and target["record"]["state"] == "running"
        assert target["repair"].startswith("the controller's cache had ")
        assert f"the target holds run {started['run_id']} (running, PID {started['pid']})" in target["repair"]
        assert [run["pid"] for run in target["live_runs"]] == [started["pid"]]
    agreeing = probe(run_module, runs_dir=str(runs), recorded=started["record"])
    assert agreeing.result["target"]["repair"] is None


def test_a_killed_run_is_closed_crashed_on_the_target_by_the_first_look(
    tmp_path, run_module, trainer
) -> None:
    """SIGKILL leaves run.json saying running: the first look (status, stop, a launch) closes it,
    on the target too, as crashed with what is known; no undocumented state leaves the module."""
    runs = tmp_path / "runs"
    started = trainer(out=runs / "nographs")
    kill_and_reap(started["pid"])
    result = probe(run_module, runs_dir=str(runs), recorded=started["record"])
    assert result.result["state"] == "exited"  # the process, gone
    assert result.result["exit_reason"].startswith("killed: it ended without closing its run record")
    assert result.result["target"]["record"]["state"] == "crashed"
    on_disk = json.loads((runs / "nographs" / "run.json").read_text())
    assert on_disk["state"] == "crashed" and on_disk["exit_status"] is None
    assert on_disk["exit_reason"].startswith("killed: it ended without closing its run record")
    target = result.result["target"]
    assert target["repair"] is None, "the cache was right when written: the run ended since, no fault"
    assert target["ended"] == (
        f"run {started['record']['run_id']} has crashed since the last look: record and ledger updated"
    )
    again = probe(run_module, runs_dir=str(runs), recorded=target["record"])
    assert again.result["target"]["record"]["state"] == "crashed" and again.result["target"]["ended"] is None


def test_a_damaged_record_is_rebuilt_from_the_lock_while_it_runs_and_closed_once_it_is_gone(
    tmp_path, run_module, trainer
) -> None:
    """Wrong types written into run.json during a run (state 5, pid "abc"): status sees the trainer
    through its lock and writes the record back whole; once the trainer is gone, its record is
    closed with a documented state."""
    runs = tmp_path / "runs"
    out = runs / "nographs"
    started = trainer("--first-step-after", "30", out=out)
    record = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**record, "state": 5, "pid": "abc"}))
    result = probe(run_module, runs_dir=str(runs), recorded=started["record"])
    assert result.result["state"] == "running" and result.result["pid"] == started["pid"]
    repaired = json.loads((out / "run.json").read_text())
    assert repaired["state"] == "running" and repaired["pid"] == started["pid"]
    assert repaired["run_id"] == record["run_id"]
    assert "damaged (pid: 'abc' is not an int" in repaired["rebuilt"]
    kill_and_reap(started["pid"])
    (out / "run.json").write_text(json.dumps({**repaired, "state": 5, "pid": "abc"}))
    gone = probe(run_module, runs_dir=str(runs), recorded=started["record"])
    assert gone.result["target"]["record"]["state"] == "crashed"
    closed = json.loads((out / "run.json").read_text())
    assert closed["state"] == "crashed"
    assert closed["exit_reason"].startswith("unknown: the run record was damaged")
    assert "pid" not in closed and closed["run_id"] == record["run_id"]


def test_an_output_and_the_disk_before_a_launch(tmp_path, run_module) -> None:
    out = tmp_path / "runs" / "nographs"
    (out / "checkpoints").mkdir(parents=True)
    for step in (5, 10):
        (out / "checkpoints" / f"step_{step:08d}.pt").write_bytes(b"x" * 2**20)
    (out / "checkpoints" / ".step_00000015.pt.99.tmp").write_bytes(b"a save cut short")
    (out / "run.json").write_text(json.dumps({"run_id": "r", "state": "finished"}))
    (out / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 10, "tau": 3.0}) + "\n")
    result = probe(
        run_module, out=str(out), steps=10, disk_path=str(tmp_path / "not" / "yet"), min_free_mib=1
    )
    output = result.result["output"]
    assert output["checkpoints"] == 2 and output["last_step"] == 10 and output["finished"] is True
    assert output["last_checkpoint"].endswith("step_00000010.pt") and output["checkpoint_mib"] == 1.0
    assert output["record_state"] == "finished" and output["tau"]["tau"] == 3.0
    disk = result.result["disk"]
    assert disk["path"] == str(tmp_path) and disk["ok"] is True and disk["required_mib"] == 3
    short = probe(run_module, out=str(out), steps=20, disk_path=str(tmp_path), min_free_mib=2**40)
    assert short.result["output"]["finished"] is False
    assert short.result["disk"]["ok"] is False and short.result["disk"]["required_mib"] == 2**40


def test_the_disk_needs_room_for_every_checkpoint_the_run_keeps_and_the_one_it_writes(
    tmp_path, run_module
) -> None:
    """keep_checkpoints K: K newest, the best-tau one and the one being written are on disk at once;
    room is needed for those not there yet. Every checkpoint kept (0) or K unknown: three."""
    out = tmp_path / "runs" / "recipe"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "step_00000010.pt").write_bytes(b"x" * 2**20)
    expected = {None: 3, 0: 3, 1: 2, 3: 4, 5: 6}
    for keep, room in expected.items():
        options = {} if keep is None else {"keep_checkpoints": keep}
        disk = probe(run_module, out=str(out), steps=20, disk_path=str(tmp_path), min_free_mib=1, **options)
        assert disk.result["disk"]["required_mib"] == room, keep  # checkpoints of 1 MiB
    assert [run_probe.checkpoint_room(3, existing) for existing in range(7)] == [5, 4, 3, 2, 1, 1, 1]
    free = shutil.disk_usage(tmp_path).free // 2**20
    (out / "checkpoints" / "step_00000010.pt").unlink()
    (out / "checkpoints" / "step_00000010.pt").write_bytes(b"")
    os.truncate(out / "checkpoints" / "step_00000010.pt", (free // 3) * 2**20)  # sparse: no space used
    where = {"out": str(out), "steps": 20, "disk_path": str(tmp_path), "min_free_mib": 1}
    short = probe(run_module, **where, keep_checkpoints=3).result["disk"]
    assert short["ok"] is False and "room for 4 more checkpoint(s)" in short["refusal"]
    assert probe(run_module, **where, keep_checkpoints=1).result["disk"]["ok"] is True  # 2 x a third fit


def test_gpus_without_nvidia_smi_do_not_fail(monkeypatch, tmp_path, run_module) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    result = probe(run_module, gpus=True)
    assert not result.failed
    assert result.result["gpu"] == {
        "available": False,
        "gpus": [],
        "problems": [],
        "lines": [],
        "note": "nvidia-smi not found on PATH",
    }


def test_bad_input_is_refused_by_name(run_module) -> None:
    not_a_pattern = probe(run_module, pid=1, wait_for="step (")
    assert not_a_pattern.failed
    assert not_a_pattern.result["msg"].startswith("wait_for 'step (' is not a regular expression: ")
    not_a_pid = probe(run_module, pid="twelve")
    assert not_a_pid.failed and "pid" in not_a_pid.result["msg"]


def test_check_mode_reports_the_same_and_changes_nothing(tmp_path, run_module, trainer) -> None:
    started = trainer()
    result = run_module(run_probe.main, identity(started), check_mode=True)
    assert not result.failed and result.result["changed"] is False
    assert result.result["state"] == "running"


def test_a_run_regenerating_its_data_is_reported_with_that_stage_s_progress(
    tmp_path, run_module, trainer
) -> None:
    from ansible_collections.dflash.ct200.plugins.filter.summary import status_line

    runs = tmp_path / "runs"
    started = trainer(out=runs / "nographs")
    record_file = runs / "nographs" / "run.json"
    record = json.loads(record_file.read_text())
    regen = {
        "conversations": 12288,
        "total": 800000,
        "tokens": 9437184,
        "tokens_per_s": 5321.4,
        "eta_s": 148862,
    }
    record_file.write_text(json.dumps({**record, "stage": "regenerating", "regen": regen}))
    result = probe(
        run_module, runs_dir=str(runs), recorded=started["record"], log=str(tmp_path / "train.log")
    )
    report = result.result
    assert report["state"] == "running" and report["stage"] == "regenerating"
    assert report["last_progress"] == (
        "regen: 12,288/800,000 conversations, 9,437,184 tokens, 5,321 tok/s, eta 1 day, 17:21:02"
    )
    assert status_line({**report, "run": "nographs"}) == (
        f"regenerating: nographs as PID {started['pid']} (the target regenerates its data; training follows)"
    )
    data_only = {
        **record,
        "cmdline": [*record.get("cmdline", ["python", "-m", "trainer"]), "--data-only"],
        "stage": "regenerating",
        "regen": regen,
    }
    record_file.write_text(json.dumps(data_only))  # ./dev.sh regen
    result = probe(run_module, runs_dir=str(runs), recorded=started["record"])
    assert status_line({**result.result, "run": "nographs"}).endswith(
        "(the target regenerates its data; no training follows)"
    )
    record_file.write_text(json.dumps({**record, "stage": "training", "regen": regen}))
    training = probe(
        run_module, runs_dir=str(runs), recorded=started["record"], log=str(tmp_path / "train.log")
    )
    assert "stage" not in training.result and status_line(training.result).startswith("running: ")


def test_a_live_run_whose_record_has_ended_is_exiting_whatever_the_cache_says(
    tmp_path, run_module, trainer
) -> None:
    from ansible_collections.dflash.ct200.plugins.filter.summary import status_line

    runs = tmp_path / "runs"
    started = trainer(out=runs / "nographs")
    out = runs / "nographs"
    waiting = "waiting at most 15s for tracker(s) mlflow to send what is left"
    close_record(
        out, state="finished", exit_status=0, exit_reason="finished", stage="exiting", exiting=waiting
    )
    # The controller's cached record still says running: the target's record is the truth.
    report = probe(run_module, runs_dir=str(runs), recorded=started["record"]).result
    assert report["state"] == "running"
    assert (report["stage"], report["recorded_state"], report["exiting"]) == ("exiting", "finished", waiting)
    assert status_line({**report, "run": "nographs"}) == (
        f"running: nographs as PID {started['pid']}, exiting (its run record says finished; {waiting})"
    )


def close_record(out, **fields) -> None:
    record = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**record, **fields}))


def test_the_launch_s_wait_takes_the_exit_from_the_run_record_not_the_log_s_last_line(
    tmp_path, run_module, trainer
) -> None:
    out = tmp_path / "runs" / "nographs"
    started = trainer("--first-step-after", "30", out=out)
    assert logged_within(tmp_path / "train.log", "stand-in trainer", 10)
    kill_and_reap(started["pid"])
    reason = "bad input: --resume: the checkpoint was trained with a different setup"
    close_record(out, state="failed", exit_status=2, exit_reason=reason)
    with (tmp_path / "train.log").open("a") as log:
        log.write("notice: the failed notice was not delivered (ConnectionRefusedError: refused)\n")
    result = probe(
        run_module, recorded=started["record"], log=str(tmp_path / "train.log"), wait_for="^step ", timeout=20
    )
    assert result.failed and f"exit status: 2 ({reason})" in result.result["msg"]


def test_status_reads_the_cached_run_s_own_output_without_the_launch_s_workspace(
    tmp_path, run_module, trainer
) -> None:
    out = tmp_path / "elsewhere" / "runs" / "nographs"
    started = trainer("--first-step-after", "30", out=out)
    kill_and_reap(started["pid"])
    close_record(out, state="crashed", exit_status=1, exit_reason="crashed: RuntimeError: boom")
    (tmp_path / "default-workspace" / "runs").mkdir(parents=True)
    result = probe(
        run_module, runs_dir=str(tmp_path / "default-workspace" / "runs"), recorded=started["record"]
    )
    assert (result.result["state"], result.result["exit_status"]) == ("exited", 1), result.result
    assert result.result["exit_reason"] == "crashed: RuntimeError: boom"
    assert result.result["target"]["record"]["run_id"] == started["run_id"]


def test_the_disk_refusal_offers_only_a_way_out_that_works() -> None:
    by_checkpoints = run_probe.disk_refusal("/ws", 2000, 1024, 5000.0)
    assert "room for 3 more checkpoint(s) of 5000.0 MiB" in by_checkpoints
    assert "15000 MiB are needed" in by_checkpoints and "train.keep_checkpoints=N" in by_checkpoints
    assert (
        "lowering it does not help" in by_checkpoints and "lower preflight_min_free_mib" not in by_checkpoints
    )
    new_output = run_probe.disk_refusal("/ws", 500, 1024, 0.0)
    assert new_output == (
        "/ws has 500 MiB free, 1024 MiB are needed (preflight_min_free_mib). Free space there, or lower "
        "preflight_min_free_mib in the inventory"
    )
    assert "0.0 MiB" not in new_output


def test_wait_for_succeeds_when_the_trainer_logged_the_line_and_ended_well(
    tmp_path, run_module, trainer
) -> None:
    """A data-only regeneration whose cache already holds the data may end before a poll sees it run."""
    started = trainer("--behave", "finish")
    assert gone_within(started["pid"], 10)
    result = probe(
        run_module,
        **identity(started),
        log=str(tmp_path / "train.log"),
        wait_for=r"^step \d+/\d+ ",
        timeout=20,
    )
    assert not result.failed, result.result["msg"]
    assert result.result["matched"].startswith("step ") and result.result["exit_status"] == 0


def test_a_trainer_stopped_before_its_first_line_is_said_stopped_in_words(
    tmp_path, run_module, trainer
) -> None:
    """SIGTERM in the first seconds: the record says stopped, so does the wait's failure, in words."""
    out = tmp_path / "runs" / "nographs"
    started = trainer("--first-step-after", "30", out=out)
    assert logged_within(tmp_path / "train.log", "stand-in trainer", 10)
    kill_and_reap(started["pid"])
    close_record(out, state="stopped", exit_status=0, exit_reason="stopped by SIGTERM")
    result = probe(
        run_module,
        recorded=started["record"],
        log=str(tmp_path / "train.log"),
        wait_for=r"^step \d+/\d+ ",
        wait_what="its first progress line",
        timeout=20,
    )
    assert result.failed and result.result["run_state"] == "stopped"
    message = result.result["msg"]
    assert message.startswith(
        f"the trainer (PID {started['pid']}) was stopped before its first progress line "
        "(exit status: 0 (stopped by SIGTERM)); the run is stopped."
    ), message
    assert "matching" not in message and "\\d" not in message


def test_a_wait_for_a_stage_fails_with_the_reason_of_a_start_refused_after_its_first_line(
    tmp_path, run_module, trainer
) -> None:
    """The data stage's first line comes before its checks: with wait_stage, the line alone is not
    enough; the stage noted in the record is, and a refusal after the line fails with its reason."""
    out = tmp_path / "runs" / "nographs"
    started = trainer(out=out)
    assert logged_within(tmp_path / "train.log", "step 1/10 ", 10)
    waiting = {
        "recorded": started["record"],
        "log": str(tmp_path / "train.log"),
        "wait_for": "^step ",
        "wait_what": "the start of its data stage",
        "wait_stage": ["regenerating", "regenerated"],
    }
    early = probe(run_module, **waiting, timeout=0.5)
    assert early.failed and "runs but has not reached the start of its data stage" in early.result["msg"]
    close_record(out, stage="regenerating")
    assert not probe(run_module, **waiting, timeout=5).failed
    kill_and_reap(started["pid"])
    reason = "bad input: chat.jsonl:3: the conversation has 1,400 tokens, longer than train.seq_len=1000"
    close_record(out, state="failed", exit_status=2, exit_reason=reason, stage="checking")
    refused = probe(run_module, **waiting, timeout=5)
    assert refused.failed and refused.result["run_state"] == "failed"
    assert (
        f"ended before the start of its data stage: failed, exit status: 2 ({reason})"
        in refused.result["msg"]
    )


def test_a_trainer_killed_before_its_first_line_is_said_crashed_killed(tmp_path, run_module, trainer) -> None:
    """SIGKILL in the first seconds: its record still says running; the wait closes it and says so."""
    out = tmp_path / "runs" / "nographs"
    started = trainer("--first-step-after", "30", out=out)
    assert logged_within(tmp_path / "train.log", "stand-in trainer", 10)
    kill_and_reap(started["pid"])
    result = probe(
        run_module,
        recorded=started["record"],
        log=str(tmp_path / "train.log"),
        wait_for="^step ",
        wait_what="its first progress line",
        timeout=20,
    )
    assert result.failed and result.result["run_state"] == "crashed"
    assert (
        "ended before its first progress line: crashed, exit status: unknown (killed: it ended without "
        "closing its run record" in result.result["msg"]
    ), result.result["msg"]
    assert json.loads((out / "run.json").read_text())["state"] == "crashed"
