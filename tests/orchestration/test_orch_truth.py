"""The run's truth lives on the target: whatever happens to the controller's files (fact cache lost,
corrupt or unwritable, ledger unwritable), two launches at once, an interrupted launch, bad
settings, an output that holds checkpoints or a finished run, a missing log: never a lost, doubled
or orphaned trainer. Real playbooks (dflashctl over ansible-runner), the real trainer on CPU."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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
    TINY_RUN,
    is_our_trainer,
    ledger,
    make_controller,
    press_ctrl_c,
    stop_leftovers,
)

from dflashctl import PlaybookFailed

TINY = TINY_RUN
FOREVER = ENDLESS_TINY_RUN  # keeps training until stopped


def out_of(state_dir: Path, run: str = "nographs") -> Path:
    return state_dir / "workspace" / "runs" / run


def run_record(state_dir: Path, run: str = "nographs") -> dict:
    return json.loads((out_of(state_dir, run) / "run.json").read_text())


def finished_and_gone(state_dir: Path) -> bool:
    """The run recorded itself finished and its process has exited: the trainer writes `finished`
    before it exits, and the supervisor it runs under (the recorded PID) lives until it has reaped
    it, so for a moment the run is finished on record and still running as a process."""
    record = run_record(state_dir)
    return record.get("state") == "finished" and not is_our_trainer(record)


def trainers_on(out: Path) -> list[int]:
    """PIDs of every live run on this output: the top process of each (a supervisor and the
    trainer it runs, or torchrun and its ranks, count as one run, named by the top PID)."""
    found: dict[int, int] = {}  # pid -> parent pid
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = proc.joinpath("cmdline").read_bytes().split(b"\0")
            fields = proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X") and b"trainer" in cmdline and str(out).encode() in cmdline:
            found[int(proc.name)] = int(fields[1])
    return sorted(pid for pid, parent in found.items() if parent not in found)


def end_trainers_of(state_dir: Path) -> None:
    """Kill every trainer a run record of this test names (ours only: PID and start time)."""
    for record_file in (state_dir / "workspace" / "runs").glob("*/run.json"):
        with contextlib.suppress(OSError, ValueError):
            record = json.loads(record_file.read_text())
            if is_our_trainer(record):
                os.kill(record["pid"], signal.SIGKILL)
                deadline = time.monotonic() + 10
                while is_our_trainer(record) and time.monotonic() < deadline:
                    time.sleep(0.1)


@pytest.fixture
def cleanup(state_dir: Path):
    controllers = []
    yield controllers
    for ctl in controllers:
        stop_leftovers(ctl, state_dir)
    end_trainers_of(state_dir)


def wait_for(predicate, timeout: float = 300, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


@pytest.mark.slow
def test_status_stop_and_relaunch_see_the_trainer_whatever_the_fact_cache(
    state_dir: Path, cleanup: list
) -> None:
    """One live trainer; the fact cache deleted, corrupt, then not a directory (each time with the
    ledger lost too): status finds the trainer and repairs both, a relaunch is refused naming it;
    then stop ends it (status has repaired the cache by then, whatever the damage was)."""
    ctl = make_controller(state_dir, workspace_trainer_set=FOREVER)
    cleanup.append(ctl)
    record = ctl.launch("nographs")
    pid = record["pid"]
    facts = state_dir / "facts"
    for damage in ("missing", "corrupt", "not_a_directory"):
        shutil.rmtree(facts)
        (state_dir / "runs.jsonl").unlink()
        if damage == "corrupt":
            facts.mkdir()
            (facts / "s1_ct200").write_text('{"trainer_run": {"pid": ')  # the file ansible-core 2.19 reads
        elif damage == "not_a_directory":
            facts.write_text("a file where the fact cache should be\n")

        status = ctl.status()
        assert status["state"] == "running" and status["pid"] == pid, damage
        assert status["last_progress"].startswith("step "), damage
        assert "cache and ledger repaired" in status["repaired"], f"{damage}: the repair is said in one line"
        assert [line["run_id"] for line in ledger(state_dir)] == [record["run_id"]], f"{damage}: the ledger"

        # A relaunch, also with resume, is refused naming the live trainer: never a second one.
        for extra in ({}, {"resume": True}):
            with pytest.raises(PlaybookFailed, match=f"as PID {pid} "):
                ctl.launch("nographs", **extra)
        assert trainers_on(out_of(state_dir)) == [pid], damage

    stopped = ctl.stop()
    assert stopped["state_before"] == "running"
    assert stopped["checkpoint"].startswith("checkpoint saved step ")
    assert not is_our_trainer(record)
    assert [line["state"] for line in ledger(state_dir) if line["run_id"] == record["run_id"]] == ["stopped"]
    assert run_record(state_dir)["state"] == "stopped"


@pytest.mark.slow
def test_two_launches_at_once_start_one_trainer(state_dir: Path, cleanup: list) -> None:
    controllers = [make_controller(state_dir, workspace_trainer_set=FOREVER) for _ in range(2)]
    cleanup.extend(controllers)
    results: list = [None, None]

    def launch(index: int) -> None:
        try:
            results[index] = controllers[index].launch("nographs")
        except PlaybookFailed as exc:
            results[index] = exc

    threads = [threading.Thread(target=launch, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=900)
    started = [result for result in results if isinstance(result, dict)]
    refused = [result for result in results if isinstance(result, PlaybookFailed)]
    assert len(started) == 1 and len(refused) == 1, results
    pid = started[0]["pid"]
    assert f"PID {pid}" in str(refused[0]), "the refusal names the trainer that holds the output"
    assert trainers_on(out_of(state_dir)) == [pid]
    assert [line["pid"] for line in ledger(state_dir) if line["state"] == "running"] == [pid]
    assert controllers[0].stop()["state_before"] == "running"
    assert trainers_on(out_of(state_dir)) == []


@pytest.mark.slow
def test_interrupted_launch_leaves_a_trainer_that_status_and_stop_find(
    state_dir: Path, cleanup: list
) -> None:
    """Ctrl-C to ansible-playbook the moment the trainer starts: no fact, no ledger line, yet the
    trainer is found, a relaunch is refused naming it, and stop ends it.

    That moment can meet ansible-core's hang in its cleanup (press_ctrl_c): the run's truth must hold
    whether the first Ctrl-C ended the playbook or a second one did."""
    ctl = make_controller(state_dir, workspace_trainer_set=FOREVER)
    cleanup.append(ctl)
    state_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(state_dir / "facts"),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    extravars = json.dumps(
        {"run": "nographs", "dflash_state_dir": str(state_dir), "workspace_trainer_set": FOREVER}
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
    try:
        wait_for(lambda: (out_of(state_dir) / "run.json").exists(), what="the run record")
        press_ctrl_c(playbook, output)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(playbook.pid, signal.SIGKILL)
    record = run_record(state_dir)
    assert is_our_trainer(record), "the started trainer keeps running"

    status = ctl.status()
    assert status["state"] == "running" and status["pid"] == record["pid"]
    assert status["run_id"] == record["run_id"]
    with pytest.raises(PlaybookFailed, match=f"as PID {record['pid']} "):
        ctl.launch("nographs")
    assert trainers_on(out_of(state_dir)) == [record["pid"]]
    assert ctl.stop()["state_before"] == "running"
    assert not is_our_trainer(record)
    assert [line["state"] for line in ledger(state_dir) if line["run_id"] == record["run_id"]] == ["stopped"]


BAD_PROFILES = {
    "lr_not_a_number": ("train:\n  lr: abc\n", "train.lr: expected a number, got 'abc'"),
    "negative_steps": ("train:\n  steps: -5\n", "train.steps must be at least 1, got -5"),
    "misspelled_key": ("train:\n  stpes: 5\n", "train.stpes: unknown key"),
    "unsafe_compile": (
        "compile:\n  mode: reduce-overhead\n",
        "CUDA graphs cannot be used in the threaded topology",
    ),
    "invalid_yaml": ("train: [steps: 5\n", "cannot be read"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_PROFILES))
def test_bad_profile_fails_on_the_controller_before_anything_changes(tmp_path: Path, case: str) -> None:
    source = tmp_path / "trainer"
    shutil.copytree(REPO / "trainer", source, ignore=shutil.ignore_patterns("__pycache__"))
    text, expected = BAD_PROFILES[case]
    profile = source / "runs" / "nographs.yml"
    profile.write_text("run:\n  topology: threaded\n" + text)
    state_dir = tmp_path / "state"
    ctl = make_controller(state_dir, dflash_trainer_source=str(source))
    with pytest.raises(PlaybookFailed) as failure:
        ctl.launch("nographs")
    message = str(failure.value)
    assert expected in message
    assert str(profile) in message or "run profile nographs" in message, "the file is named"
    assert "Traceback" not in message
    assert not (state_dir / "workspace").exists()
    assert ledger(state_dir) == []


@pytest.mark.slow
def test_output_with_checkpoints_needs_resume_or_fresh(state_dir: Path, cleanup: list) -> None:
    finite = [*TINY, "train.checkpoint_every=2", "train.steps=4"]
    ctl = make_controller(state_dir, workspace_trainer_set=finite, run_wait_enabled=False)
    cleanup.append(ctl)
    first = ctl.launch("nographs")
    wait_for(lambda: finished_and_gone(state_dir), what="the run to finish and exit")
    finished = run_record(state_dir)
    assert finished["last_step"] == 4 and finished["exit_status"] == 0
    status = ctl.status()
    assert status["state"] == "exited" and status["recorded_state"] == "finished"
    assert not status["repaired"], "a run that ended since the last look is news, not a repair"
    assert ledger(state_dir)[-1]["state"] == "finished", "the ledger learns how the run ended"
    metrics = [json.loads(line) for line in (out_of(state_dir) / "metrics.jsonl").read_text().splitlines()]
    tau = [row for row in metrics if row["kind"] == "eval"][-1]["tau"]

    with pytest.raises(PlaybookFailed) as again:
        ctl.launch("nographs")
    message = str(again.value)
    assert "has finished" in message and "step 4 of 4" in message
    assert "./dev.sh launch nographs -e fresh=true" in message
    assert "./dev.sh launch nographs -e resume=true -e steps=8" in message, "a way that is not refused"

    with pytest.raises(PlaybookFailed) as resumed:
        ctl.launch("nographs", resume=True)
    message = str(resumed.value)
    assert "has finished" in message and "step 4 of 4" in message
    assert f"tau {tau:.3f}" in message, "the run's real tau, not the first one"
    assert len(ledger(state_dir)) == 1, "nothing was started"

    with pytest.raises(PlaybookFailed) as bad_steps:
        ctl.launch("nographs", resume=True, steps="many")
    assert "steps must be a whole number of at least 1 (got \"many\")" in str(bad_steps.value)

    # The hint's way: resumed with more steps, the run continues from its last checkpoint.
    ctl.launch("nographs", resume=True, steps=8)
    wait_for(lambda: run_record(state_dir).get("last_step") == 8, what="the run to reach step 8")
    wait_for(lambda: finished_and_gone(state_dir), what="the run to finish and exit")
    assert "resumed from" in Path(run_record(state_dir)["log"]).read_text()

    earlier = sorted((out_of(state_dir) / "checkpoints").iterdir())
    fresh = make_controller(state_dir, workspace_trainer_set=FOREVER)
    cleanup.append(fresh)
    result = fresh.run_playbook("launch.yml", {"run": "nographs", "fresh": True})
    record = result.stats["dflash_launch_by_host"]["ct200"]
    assert record["run_id"] != first["run_id"]
    kept = [path for path in out_of(state_dir).parent.iterdir() if path.name.startswith("nographs.")]
    assert len(kept) == 1, "the earlier output is moved aside, not deleted"
    assert sorted(path.name for path in (kept[0] / "checkpoints").iterdir()) == [p.name for p in earlier]
    summary = "\n".join(result.stats["dflash_summary"])
    assert "./dev.sh status" in summary and "./dev.sh stop" in summary

    stopped = fresh.stop()
    step = int(stopped["checkpoint"].split()[3])
    resumed_record = fresh.launch("nographs", resume=True)
    log = Path(resumed_record["log"]).read_text()
    assert f"at step {step}" in log and "resumed from" in log
    assert fresh.stop()["state_before"] == "running"


@pytest.mark.slow
def test_status_and_stop_read_structured_state_not_the_log(state_dir: Path, cleanup: list) -> None:
    ctl = make_controller(
        state_dir, workspace_trainer_set=[*TINY, "train.checkpoint_every=3", "train.steps=100000"]
    )
    cleanup.append(ctl)
    record = ctl.launch("nographs")
    wait_for(lambda: any((out_of(state_dir) / "checkpoints").glob("step_*.pt")), what="a checkpoint")
    Path(record["log"]).unlink()
    status = ctl.status()
    assert status["state"] == "running"
    assert status["last_progress"].startswith("step "), "progress from metrics.jsonl"
    assert status["last_checkpoint"]["step"] >= 3
    assert status["last_checkpoint"]["kept"][-1] == status["last_checkpoint"]["step"], "what is kept"
    stopped = ctl.stop()
    assert stopped["checkpoint"].startswith("checkpoint saved step "), "the checkpoint from its directory"
    step = int(stopped["checkpoint"].split()[3])
    after = ctl.status()
    assert after["state"] == "exited" and after["exit_status"] == 0
    assert after["exit_reason"] == f"stopped at step {step}"
    assert after["recorded_state"] == "stopped"
    assert ledger(state_dir)[-1]["state"] == "stopped"


@pytest.mark.slow
def test_unwritable_ledger_stops_what_it_started(state_dir: Path, cleanup: list) -> None:
    (state_dir / "runs.jsonl").mkdir(parents=True)
    ctl = make_controller(state_dir, workspace_trainer_set=FOREVER)
    cleanup.append(ctl)
    with pytest.raises(PlaybookFailed) as failure:
        ctl.launch("nographs")
    (state_dir / "runs.jsonl").rmdir()  # the fixture's own clean-up reads the ledger
    message = str(failure.value)
    assert f"cannot write the run ledger {state_dir / 'runs.jsonl'}" in message
    assert "was stopped" in message
    assert trainers_on(out_of(state_dir)) == []
    assert ctl.status()["state"] == "exited", "status finds the stopped run on the target"


@pytest.mark.slow
def test_disk_threshold_refuses_naming_path_and_figures(state_dir: Path) -> None:
    ctl = make_controller(state_dir, preflight_min_free_mib=10**12)
    with pytest.raises(PlaybookFailed) as failure:
        ctl.launch("nographs")
    message = str(failure.value)
    assert "Not enough free disk space" in message and "MiB free" in message
    assert f"{10**12} MiB are needed" in message
    assert not (state_dir / "workspace").exists()
    assert ledger(state_dir) == []


@pytest.mark.slow
def test_dev_sh_passes_ansible_playbook_options_on(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    env = {**os.environ, "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(state_dir / "facts")}
    launch = subprocess.run(
        [
            "./dev.sh",
            "launch",
            "nographs",
            "-e",
            f"dflash_state_dir={state_dir}",
            "-e",
            "preflight_min_free_mib=999999999",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launch.returncode != 0
    assert "Not enough free disk space" in launch.stdout, "-e options reach ansible-playbook"
    status = subprocess.run(
        ["./dev.sh", "status", "-e", f"dflash_state_dir={state_dir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert "no run recorded" in status.stdout
