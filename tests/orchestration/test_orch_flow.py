"""launch -> status -> stop of the real trainer (CPU) on the local default inventory."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from conftest import BUSY, ENDLESS_TINY_RUN, IDLE, end_torchruns_of, ledger, make_controller, stop_leftovers

from dflashctl import Controller, PlaybookFailed

PROGRESS = "step "


@pytest.mark.slow
def test_launch_status_stop(controller: Controller, state_dir: Path) -> None:
    record = controller.launch("nographs")
    pid = record["pid"]
    assert isinstance(pid, int) and pid > 0
    assert record["run"] == "nographs" and record["state"] == "running"
    assert record["log"].endswith("/workspace/train_compile_nographs.log")
    assert record["trainer_hash"].startswith("sha256:")
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert b"-m" in cmdline and b"trainer" in cmdline, "the recorded PID is the trainer, not a wrapper"
    assert [entry["run_id"] for entry in ledger(state_dir)] == [record["run_id"]]
    cached = "".join(path.read_text() for path in (state_dir / "facts").iterdir())
    assert "trainer_run" in cached and str(pid) in cached, "the run is a cached host fact"

    # One run at a time: a second launch is refused and records nothing.
    with pytest.raises(PlaybookFailed, match=f"still running on ct200 as PID {pid} "):
        controller.launch("nographs")
    assert len(ledger(state_dir)) == 1

    status = controller.status()
    assert status["state"] == "running"
    assert status["pid"] == pid
    assert status["last_progress"].startswith(PROGRESS)
    assert "nvidia-smi not found" in status["gpu_note"]

    stopped = controller.stop()
    assert stopped["state_before"] == "running"
    assert stopped["killed"] is False
    assert stopped["checkpoint"].startswith("checkpoint saved step ")
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
    assert ledger(state_dir)[0]["state"] == "stopped"

    after = controller.status()
    assert after["state"] == "exited"
    assert after["exit_status"] == 0
    # Idempotent and safe: nothing runs any more.
    again = controller.stop()
    assert again["state_before"] == "exited"
    assert ledger(state_dir)[0]["state"] == "stopped"


@pytest.mark.slow
def test_busy_gpu_refuses_launch(state_dir: Path) -> None:
    ctl = make_controller(state_dir, nvidia_smi_state=BUSY)
    with pytest.raises(PlaybookFailed) as failure:
        ctl.launch("nographs")
    message = str(failure.value)
    assert "GPU 0 is busy" in message
    assert "21363 MiB used" in message and "100 % utilization" in message
    assert "process 425 python3" in message
    assert not (state_dir / "workspace").exists()
    assert ledger(state_dir) == []


@pytest.mark.slow
def test_unnamed_host_process_still_makes_gpu_busy(state_dir: Path) -> None:
    """In a container the process list shows host PIDs without names: memory alone must refuse."""
    uuid = BUSY["gpus"][0]["uuid"]
    state = {**BUSY, "apps": [{"pid": 31337, "gpu_uuid": uuid, "process_name": "", "used_memory": 21354}]}
    ctl = make_controller(state_dir, nvidia_smi_state=state)
    with pytest.raises(PlaybookFailed, match="GPU 0 is busy: 21363 MiB used"):
        ctl.launch("nographs")


@pytest.mark.slow
def test_gpus_required_without_nvidia_smi(state_dir: Path) -> None:
    ctl = make_controller(state_dir, preflight_gpus_required=True)
    with pytest.raises(PlaybookFailed, match=r"nvidia-smi not found on PATH\).*requires"):
        ctl.launch("nographs")
    assert not (state_dir / "workspace").exists()


# A machine problem only the target can see (a data file that is not there): the trainer refuses at start.
MISSING_DATA = {"parallel": {"devices": "cpu"}, "data": {"train_file": "/nonexistent/chat.jsonl"}}


@pytest.mark.slow
def test_bad_setting_is_refused_on_the_controller(state_dir: Path) -> None:
    ctl = make_controller(state_dir, workspace_trainer_set=["train.no_such_setting=1"])
    with pytest.raises(PlaybookFailed, match=r"--set: train.no_such_setting: unknown key"):
        ctl.launch("nographs")
    assert not (state_dir / "workspace").exists()
    assert ledger(state_dir) == []


@pytest.mark.slow
def test_trainer_dying_at_start_fails_with_log_tail(state_dir: Path) -> None:
    ctl = make_controller(state_dir, dflash_machine=MISSING_DATA)
    try:
        with pytest.raises(PlaybookFailed) as failure:
            ctl.launch("nographs")
        message = str(failure.value)
        assert "exit status: 2" in message
        assert "Last lines of" in message and "train_compile_nographs.log" in message
        assert "error: " in message and "train_file" in message, "the trainer's own error is shown"
        assert message.count("Last lines of") == 1, f"said once: {message}"
        records = ledger(state_dir)
        assert len(records) == 1 and records[0]["state"] == "failed", "the failed run keeps its record"
    finally:
        stop_leftovers(ctl, state_dir)


@pytest.mark.slow
def test_rank_failing_under_torchrun_names_the_ranks_reason(state_dir: Path) -> None:
    """Process topology: the rank's own error, not torchrun's failure report, explains the exit."""
    ctl = make_controller(state_dir, dflash_machine=MISSING_DATA)
    try:
        with pytest.raises(PlaybookFailed) as failure:
            ctl.launch("process")
        message = str(failure.value)
        assert "exit status: 2 (bad input: data.train_file " in message, (
            "the rank's verdict, not torchrun's report"
        )
        status = ctl.status()
        assert status["state"] == "exited" and status["exit_status"] == 2
        assert "data.train_file" in status["exit_reason"]
    finally:
        stop_leftovers(ctl, state_dir)


@pytest.mark.slow
def test_output_holding_checkpoints_is_refused_before_a_start(state_dir: Path) -> None:
    existing = state_dir / "workspace" / "runs" / "process" / "checkpoints" / "step_00000005.pt"
    existing.parent.mkdir(parents=True)
    existing.write_bytes(b"an earlier run's checkpoint")
    ctl = make_controller(state_dir)
    with pytest.raises(PlaybookFailed) as failure:
        ctl.launch("process")
    message = str(failure.value)
    assert "already holds checkpoints (the last at step 5 of " in message
    assert "-e resume=true" in message and "-e fresh=true" in message
    assert existing.read_bytes() == b"an earlier run's checkpoint", "the earlier run is left alone"
    assert ledger(state_dir) == []
    assert not (state_dir / "workspace" / "run.sh").exists(), "refused before the workspace was written"


@pytest.mark.slow
def test_status_reports_gpus_and_a_reused_pid(state_dir: Path) -> None:
    """A record whose PID now belongs to another process is 'not ours' and stop leaves it alone."""
    me = os.getpid()
    stat = Path(f"/proc/{me}/stat").read_text()
    start_time = int(stat[stat.rindex(")") + 2 :].split()[19])
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    foreign = {
        "run_id": "nographs-20260101T000000Z-1",
        "run": "nographs",
        "pid": me,
        "start_time": start_time + 1,
        "boot_id": boot_id,
        "log": str(state_dir / "none.log"),
        "out": str(state_dir / "none"),
        "state": "running",
    }
    ctl = make_controller(state_dir, nvidia_smi_state=IDLE, trainer_run=foreign)
    status = ctl.status()
    assert status["state"] == "not_ours"
    assert status["gpus"][0]["memory_used_mib"] == 0
    assert ctl.stop()["state_before"] == "not_ours"
    assert Path(f"/proc/{me}").exists()


@pytest.mark.slow
def test_stop_kills_a_trainer_that_does_not_exit(state_dir: Path) -> None:
    """SIGTERM cannot end a stopped process: after run_stop_timeout stop.yml sends SIGKILL and says so;
    the trainer could not note its end, so the stop notes it in the target's record."""
    ctl = make_controller(state_dir, run_wait_enabled=False)
    try:
        record = ctl.launch("nographs")
        os.kill(record["pid"], signal.SIGSTOP)  # our own trainer, by its PID
        stopped = ctl.stop(run_stop_timeout=1)
        assert stopped["killed"] is True
        assert "sent SIGKILL" in stopped["msg"]
        assert ledger(state_dir)[0]["state"] == "stopped" and ledger(state_dir)[0]["killed"] is True
        status = ctl.status()
        assert status["state"] == "exited" and status["exit_status"] == -9, status
        assert status["exit_reason"] == "killed by the stop (SIGKILL)"
    finally:
        stop_leftovers(ctl, state_dir)


@pytest.mark.slow
def test_process_topology_launch_status_stop(state_dir: Path) -> None:
    """run.topology process: run.sh execs torchrun (2 gloo ranks on CPU); the recorded PID is
    torchrun's; stop.yml's SIGTERM reaches both ranks through it; the checkpoint is whole."""
    ctl = make_controller(
        state_dir,
        dflash_machine={"parallel": {"devices": "cpu", "cpu_workers": 2}},
        workspace_trainer_set=ENDLESS_TINY_RUN,
    )
    try:
        record = ctl.launch("process")
        pid = record["pid"]
        cmdline = [part.decode() for part in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if part]
        assert "trainer.torchrun" in cmdline and "--nproc-per-node=2" in cmdline, cmdline
        assert cmdline[cmdline.index("--run") + 1] == "process"
        ranks = [
            int(child)
            for task in Path(f"/proc/{pid}/task").iterdir()
            for child in (task / "children").read_text().split()
        ]
        assert len(ranks) == 2, ranks
        status = ctl.status()
        assert status["state"] == "running" and status["pid"] == pid
        assert status["last_progress"].startswith(PROGRESS)

        stopped = ctl.stop()
        assert stopped["killed"] is False
        assert stopped["checkpoint"].startswith("checkpoint saved step ")
        for rank in ranks:
            assert (
                not Path(f"/proc/{rank}").exists() or "Z" in Path(f"/proc/{rank}/stat").read_text().split()[2]
            )
        log = Path(record["log"]).read_text()
        assert "Traceback" not in log and "stopped at step " in log
        after = ctl.status()
        assert after["state"] == "exited" and after["exit_status"] == 0
        step = int(stopped["checkpoint"].split()[3])
        assert Path(record["out"], "checkpoints", f"step_{step:08d}.pt").is_file()
    finally:
        stop_leftovers(ctl, state_dir)
        end_torchruns_of(state_dir)
