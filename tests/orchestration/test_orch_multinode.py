"""A run over two hosts of group `trainers`, both this machine: one torchrun each (gloo on CPU), a
rendezvous on loopback, separate workspaces (no shared storage). Through the real playbooks
(dflashctl over ansible-runner): launch, status and stop report every host; resume sends rank 0's
checkpoint to the host that lacks it; bad setups are refused on every host before anything starts,
and a start that fails on one host stops what started on the other."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
import yaml
from conftest import ENDLESS_TINY_RUN, end_torchruns_of, is_our_trainer, ledger, stop_leftovers

from dflashctl import Controller, PlaybookFailed, Settings

HOSTS = ("node0", "node1")


def free_loopback_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pair_inventory(tmp_path: Path, group_vars: dict | None = None, host_vars: dict | None = None) -> Path:
    """An inventory of group trainers = node0, node1 (local connection, own workspaces under
    tmp_path, rendezvous on 127.0.0.1 at a free port); group_vars/host_vars override."""
    hosts = {
        name: {
            "ansible_connection": "local",
            "ansible_python_interpreter": "{{ ansible_playbook_python }}",
            "dflash_workspace": str(tmp_path / name),
            **(host_vars or {}).get(name, {}),
        }
        for name in HOSTS
    }
    variables = {
        "dflash_python": "{{ ansible_playbook_python }}",
        "preflight_gpus_required": False,
        "dflash_rendezvous_endpoint": f"127.0.0.1:{free_loopback_port()}",
        "dflash_machine": {
            "parallel": {
                "devices": "cpu",
                "cpu_workers": 1,
                "rendezvous_timeout_s": 120,
                "step_timeout_s": 120,
                "shutdown_timeout_s": 60,
            }
        },
        "workspace_trainer_set": ENDLESS_TINY_RUN,
        # gloo between the two "hosts" over loopback only (not the address the hostname resolves to).
        "workspace_trainer_env": {"GLOO_SOCKET_IFNAME": "lo"},
        **(group_vars or {}),
    }
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    (inventory / "hosts.yml").write_text(
        yaml.safe_dump({"all": {"children": {"trainers": {"hosts": hosts, "vars": variables}}}})
    )
    return inventory


def pair_controller(tmp_path: Path, limit: str | None = None, **inventory) -> Controller:
    return Controller(
        Settings(
            inventory=pair_inventory(tmp_path, **inventory),
            state_dir=tmp_path / "state",
            limit=limit,
            timeout=900,
        )
    )


def cleanup(ctl: Controller, tmp_path: Path) -> None:
    """Stop whatever this test started: stop.yml, then recorded PIDs, then torchruns of its workspaces."""
    stop_leftovers(ctl, tmp_path / "state")
    end_torchruns_of(tmp_path)


def nothing_started(tmp_path: Path) -> None:
    for name in HOSTS:
        assert not (tmp_path / name).exists(), f"{name}'s workspace was created"
    assert ledger(tmp_path / "state") == []


@pytest.mark.slow
def test_two_hosts_launch_status_stop_resume(tmp_path: Path) -> None:
    ctl = pair_controller(tmp_path)
    try:
        records = ctl.launch_by_host("process")
        assert list(records) == list(HOSTS)
        for rank, name in enumerate(HOSTS):
            record = records[name]
            assert record["host"] == name and record["state"] == "running"
            assert record["log"] == str(tmp_path / name / "train_process.log")
            cmdline = [
                p.decode() for p in Path(f"/proc/{record['pid']}/cmdline").read_bytes().split(b"\0") if p
            ]
            assert "trainer.torchrun" in cmdline, "the recorded PID is this host's torchrun"
            assert f"--node-rank={rank}" in cmdline and "--nnodes=2" in cmdline, cmdline
            assert any(arg.startswith("--rdzv-endpoint=127.0.0.1:") for arg in cmdline), cmdline
            assert "\nstep " in Path(record["log"]).read_text(), f"{name} logs progress"
        lead_log = Path(records["node0"]["log"]).read_text()
        assert "topology process, devices 2 process(es) (gloo), rank 0 on cpu" in lead_log
        assert "2 process(es) (gloo), rank 1 on cpu" in Path(records["node1"]["log"]).read_text()

        status = ctl.run_playbook("status.yml", {}).stats
        assert list(status["dflash_status_by_host"]) == list(HOSTS)
        for name in HOSTS:
            report = status["dflash_status_by_host"][name]
            assert report["state"] == "running" and report["pid"] == records[name]["pid"], report
            assert report["last_progress"].startswith("step "), report
            # node1 has no metrics.jsonl (rank 0 alone writes it): its tau comes from its log.
            assert report["last_eval"]["step"] == 0, report
            assert f"{name}: running: process as PID {records[name]['pid']}" in status["dflash_summary"]
        assert status["dflash_status"] == status["dflash_status_by_host"]["node0"]

        stopped = ctl.stop_by_host()
        assert list(stopped) == list(HOSTS)
        for name in HOSTS:
            assert stopped[name]["state_before"] == "running" and stopped[name]["killed"] is False, stopped
        step = int(stopped["node0"]["checkpoint"].split()[3])
        checkpoint = tmp_path / "node0" / "runs" / "process" / "checkpoints" / f"step_{step:08d}.pt"
        assert stopped["node0"]["checkpoint"] == f"checkpoint saved step {step} {checkpoint}"
        assert stopped["node1"]["checkpoint"].endswith(f"by rank 0 on {socket.gethostname()}: {checkpoint}")
        assert checkpoint.is_file()
        # Rank 0 alone writes the run's files; every host keeps its own run record (and output lock).
        node1_files = sorted(p.name for p in (tmp_path / "node1" / "runs" / "process").iterdir())
        assert node1_files == [".run.json.reserve", "run.json"], "its record, and room for its last write"
        after = ctl.status_by_host()
        for name in HOSTS:
            assert after[name]["state"] == "exited" and after[name]["exit_status"] == 0, after[name]
            assert not is_our_trainer(records[name])

        resumed = ctl.launch_by_host("process", resume=True)
        logs = {name: Path(resumed[name]["log"]).read_text() for name in HOSTS}
        assert f"resumed from {checkpoint} at step {step}\n" in logs["node0"], logs["node0"][-2000:]
        assert f"resumed from {checkpoint} at step {step} (received from rank 0)" in logs["node1"]
        again = ctl.stop_by_host()
        for name in HOSTS:
            assert again[name]["state_before"] == "running" and again[name]["killed"] is False, again
            assert not is_our_trainer(resumed[name])
        assert [record["state"] for record in ledger(tmp_path / "state")] == ["stopped"] * 4
    finally:
        cleanup(ctl, tmp_path)


@pytest.mark.slow
def test_threaded_run_on_two_hosts_is_refused(tmp_path: Path) -> None:
    ctl = pair_controller(tmp_path)
    with pytest.raises(PlaybookFailed) as failure:
        ctl.launch("nographs")
    message = str(failure.value)
    assert "Threaded runs on one host; use a process-topology run such as `process` or `graphs`" in message
    assert "or --limit to one host" in message
    nothing_started(tmp_path)


@pytest.mark.slow
def test_limit_leaving_out_a_host_of_the_run_is_refused(tmp_path: Path) -> None:
    ctl = pair_controller(tmp_path, limit="node0")
    with pytest.raises(PlaybookFailed) as failure:
        ctl.launch("process")
    message = str(failure.value)
    assert "leaves out node1 (--limit)" in message and "Launch without --limit" in message
    nothing_started(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("endpoint", ["127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", "two words:29400", ""])
def test_malformed_rendezvous_endpoint_is_refused(tmp_path: Path, endpoint: str) -> None:
    ctl = pair_controller(tmp_path, group_vars={"dflash_rendezvous_endpoint": endpoint})
    with pytest.raises(PlaybookFailed) as failure:
        ctl.launch("process")
    message = str(failure.value)
    assert "must be one HOST:PORT with a port 1..65535" in message
    assert f"it is {endpoint!r}".replace("'", '"') in message, "the error shows the value given"
    assert "Set dflash_rendezvous_endpoint once for the group" in message
    nothing_started(tmp_path)


@pytest.mark.slow
def test_hosts_disagreeing_on_the_endpoint_are_refused(tmp_path: Path) -> None:
    ctl = pair_controller(tmp_path, host_vars={"node1": {"dflash_rendezvous_endpoint": "127.0.0.2:29400"}})
    with pytest.raises(PlaybookFailed, match="the hosts set different dflash_rendezvous_endpoint values"):
        ctl.launch("process")
    nothing_started(tmp_path)


@pytest.mark.slow
def test_preflight_failing_on_one_host_starts_nothing_anywhere(tmp_path: Path) -> None:
    """node1 requires GPUs and has no nvidia-smi: node0 passes its preflight but must not start."""
    ctl = pair_controller(tmp_path, host_vars={"node1": {"preflight_gpus_required": True}})
    with pytest.raises(PlaybookFailed) as failure:
        ctl.launch("process")
    assert "No GPU can be read on node1" in str(failure.value)
    nothing_started(tmp_path)


@pytest.mark.slow
def test_start_failing_on_one_host_stops_the_other(tmp_path: Path) -> None:
    """node1's python does not exist, so its run.sh dies at once; node0's torchrun, which started
    and waits in the rendezvous, is stopped and recorded stopped, as its run record says: nothing is
    left waiting."""
    ctl = pair_controller(tmp_path, host_vars={"node1": {"dflash_python": str(tmp_path / "no-such-python")}})
    try:
        with pytest.raises(PlaybookFailed) as failure:
            ctl.launch("process")
        message = str(failure.value)
        assert "node1: " in message and "exited; exit status" in message, "node1's own error"
        assert "The start failed on node1, and run process needs all 2 hosts (node0, node1)" in message
        assert "the trainer started here (PID " in message and "was stopped" in message
        records = ledger(tmp_path / "state")
        assert {record["host"]: record["state"] for record in records} == {
            "node0": "stopped",
            "node1": "failed",
        }
        node0 = json.loads((tmp_path / "node0" / "runs" / "process" / "run.json").read_text())
        assert node0["state"] == "stopped", "the ledger says what the run record says"
        for record in records:
            assert not is_our_trainer(record), f"{record['host']}'s trainer is still running"
        log = (tmp_path / "node0" / "train_process.log").read_text()
        assert "torchrun: SIGTERM while no rank runs (rendezvous or exit barrier): exiting" in log
    finally:
        cleanup(ctl, tmp_path)


@pytest.mark.slow
def test_trainer_dying_on_one_host_stops_the_other(tmp_path: Path) -> None:
    """node1's trainer refuses its data file and exits 2 before joining the process group; node0's
    rank would wait for it until parallel.step_timeout_s. The launch stops node0 and fails."""
    ctl = pair_controller(
        tmp_path,
        group_vars={
            # node0's wait runs out first (its rank is blocked, waiting for node1's), then it is stopped.
            "run_wait_timeout": 30,
            "dflash_machine": {
                "parallel": {
                    "devices": "cpu",
                    "cpu_workers": 1,
                    "step_timeout_s": 600,
                    "shutdown_timeout_s": 10,
                }
            },
        },
        host_vars={
            "node1": {
                "workspace_trainer_set": [*ENDLESS_TINY_RUN, "data.train_file=/nonexistent/chat.jsonl"],
                # node1's wait ends when its trainer exits, however long a loaded machine takes to get
                # there (over 30 s once in CI, which then read as "alive, no progress").
                "run_wait_timeout": 600,
            }
        },
    )
    try:
        with pytest.raises(PlaybookFailed) as failure:
            ctl.launch("process")
        message = str(failure.value)
        assert "node1: " in message and "exit status: 2" in message and "data.train_file" in message, message
        assert "could not go on without node1 and was stopped" in message, message
        records = ledger(tmp_path / "state")
        assert {record["host"]: record["state"] for record in records} == {
            "node0": "stopped",
            "node1": "failed",
        }
        node0 = json.loads((tmp_path / "node0" / "runs" / "process" / "run.json").read_text())
        assert node0["state"] == "stopped", "the ledger says what the run record says"
        for record in records:
            assert not is_our_trainer(record), f"{record['host']}'s trainer is still running"
    finally:
        cleanup(ctl, tmp_path)


@pytest.mark.slow
def test_a_host_whose_record_is_lost_is_found_by_its_lock_and_stopped_by_its_own_stop(tmp_path: Path) -> None:
    """First the fact cache alone lost: every host's trainer is still found (cache and ledger
    repaired) and a relaunch is refused naming it. Then node1's run record, the fact cache and the
    ledger all lost: status reports node1's torchrun from the process that holds its output's
    lock, and stop ends it on node1 itself (its stop reports it running before), not only through
    node0's collective, and the ledger says both runs stopped."""
    ctl = pair_controller(tmp_path)
    try:
        records = ctl.launch_by_host("process")
        shutil.rmtree(tmp_path / "state" / "facts")
        status = ctl.status_by_host()
        for name in HOSTS:
            assert status[name]["state"] == "running" and status[name]["pid"] == records[name]["pid"]
            assert "cache and ledger repaired" in status[name]["repaired"]
        with pytest.raises(PlaybookFailed) as again:
            ctl.launch_by_host("process", resume=True)
        assert any(f"as PID {records[name]['pid']} " in str(again.value) for name in HOSTS)

        node1_record = tmp_path / "node1" / "runs" / "process" / "run.json"
        node1_record.unlink()
        shutil.rmtree(tmp_path / "state" / "facts")
        (tmp_path / "state" / "runs.jsonl").unlink()

        status = ctl.status_by_host()
        for name in HOSTS:
            assert status[name]["state"] == "running" and status[name]["pid"] == records[name]["pid"], status
        assert json.loads(node1_record.read_text())["pid"] == records["node1"]["pid"], "record rebuilt"

        node1_record.unlink()
        shutil.rmtree(tmp_path / "state" / "facts")
        stopped = ctl.stop_by_host()
        for name in HOSTS:
            assert stopped[name]["state_before"] == "running", stopped
            assert not is_our_trainer(records[name]), f"{name}'s trainer still runs"
        assert json.loads(node1_record.read_text())["state"] == "stopped"
        states = {line["run_id"]: line["state"] for line in ledger(tmp_path / "state")}
        assert [states[records[name]["run_id"]] for name in HOSTS] == ["stopped", "stopped"]
    finally:
        cleanup(ctl, tmp_path)
