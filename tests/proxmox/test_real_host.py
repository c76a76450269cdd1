"""The real-host path end to end against the test node (fakepve + LXC + sshd with a pct shim).

The tests run in file order on one node: the faults first (while no container exists), then
provisioning from nothing and again, then launch/status/stop of nographs inside the container
through community.proxmox.proxmox_pct_remote, and last a scan of everything written for the secret.
The steps that are timed record their seconds as properties of their test (pytest --junitxml puts
them in the report); tests/proxmox/measure.py prints them side by side.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from realhost import RealHostNode

pytestmark = [pytest.mark.proxmox, pytest.mark.slow]
VMID = "200"


def assert_failed_clearly(result, *expected: str) -> None:
    assert not result.ok, f"expected a failure, got {result.status}:\n{result.stdout[-3000:]}"
    messages = " | ".join(result.failure_messages())
    for text in expected:
        assert text in messages, f"{text!r} not in the failure: {messages}"


def test_missing_secret_fails_first_naming_the_variable(node: RealHostNode) -> None:
    before = node.api_state()
    result = node.play("provision.yml", env={"PROXMOX_TOKEN_SECRET": None})
    assert_failed_clearly(result, "PROXMOX_TOKEN_SECRET")
    assert node.api_state() == before


def test_wrong_token_is_refused_and_changes_nothing(node: RealHostNode) -> None:
    before = node.api_state()
    result = node.play("provision.yml", env={"PROXMOX_TOKEN_SECRET": "made-up-but-wrong"})
    assert_failed_clearly(
        result, "did not accept root@pam!dflash", "authentication failure", "PROXMOX_TOKEN_SECRET"
    )
    assert node.api_state() == before


def test_offline_node_is_named_and_changes_nothing(node: RealHostNode) -> None:
    before = node.api_state()
    node.control({"op": "node_offline", "offline": True})
    try:
        result = node.play("provision.yml")
    finally:
        node.control({"op": "clear_faults"})
    assert_failed_clearly(result, "Node pve1 is offline")
    assert node.api_state() == before


def test_create_task_error_is_reported_and_leaves_no_container(node: RealHostNode) -> None:
    before = node.api_state()
    message = (
        "unable to create CT 200 - rbd error: rbd: couldn't connect to the cluster! (Connection timed out)"
    )
    node.control({"op": "fail_task", "type": "vzcreate", "message": message})
    try:
        # community.proxmox waits its whole timeout on a task that ended in an error: keep it short.
        result = node.play("provision.yml", extravars={"pve_container_timeout": 5})
    finally:
        node.control({"op": "clear_faults"})
    assert_failed_clearly(result, "vzcreate", message)
    assert node.api_state() == before
    assert before["cts"] == {} and before["lxc"] == []


def test_check_mode_reports_and_changes_nothing(node: RealHostNode) -> None:
    before = node.api_state()
    result = node.play("provision.yml", "--check")
    assert result.ok, result.stdout[-3000:]
    assert result.changed() > 0
    assert "would be created" in result.stdout
    assert node.api_state() == before


def test_provision_from_nothing_then_no_change(node: RealHostNode, record_property) -> None:
    first = node.play("provision.yml")
    assert first.ok, first.stdout[-5000:]
    record_property("seconds provision from nothing", round(first.seconds, 1))
    assert node.pct("status", VMID).stdout.strip() == "status: running"
    config = node.pct("config", VMID).stdout
    for index in range(8):
        assert re.search(rf"^dev{index}: /dev/nvidia{index},mode=0666$", config, re.M), config
    assert re.search(r"^dev9: /dev/nvidia-uvm,mode=0666$", config, re.M), config
    assert re.search(r"^mp1: .*/host/ct200-workspace,mp=/workspace$", config, re.M), config
    # The container sees what was passed through: the GPUs (device numbers read on the node) and the folders.
    seen = node.pct(
        "exec", VMID, "--", "sh", "-c", "stat -c '%n %t' /dev/nvidia0 /dev/nvidia-uvm; ls -d /data"
    )
    assert seen.returncode == 0, seen.stderr
    assert f"/dev/nvidia-uvm {node.info['uvm_major']:x}" in seen.stdout
    second = node.play("provision.yml")
    assert second.ok, second.stdout[-5000:]
    record_property("seconds provision again", round(second.seconds, 1))
    assert second.changed() == 0, second.stdout[-5000:]
    check = node.play("provision.yml", "--check")
    assert check.ok and check.changed() == 0, check.stdout[-3000:]


def test_the_node_catches_a_script_for_the_ct_that_its_shell_split(node: RealHostNode) -> None:
    """The tripwire the autouse check relies on: an unquoted script through `pct exec` sends only its
    first statement into the CT; the node's shell runs the rest, and the node's dpkg-query says so."""
    whole = node.node_shell(f"pct exec {VMID} -- sh -c 'hostname; dpkg-query -W -f=ok python3-venv'")
    assert whole.returncode == 0 and whole.stdout.endswith("ok"), whole.stderr
    assert node.commands_on_node() == []
    split = node.node_shell(f"pct exec {VMID} -- true; dpkg-query -W -f=ok python3-venv")
    assert split.returncode == 97 and "ran on the Proxmox node itself" in split.stderr
    assert node.commands_on_node() == ["dpkg-query -W -f=ok python3-venv"]
    (node.state_dir / "commands-on-node.log").write_text("")  # caught on purpose: not this test's failure


def test_locked_container_is_refused_and_changes_nothing(node: RealHostNode) -> None:
    node.control({"op": "lock", "vmid": 200, "lock": "backup"})
    try:
        before = node.api_state()
        result = node.play("provision.yml")
        after = node.api_state()
    finally:
        node.control({"op": "lock", "vmid": 200, "lock": None})
    assert_failed_clearly(result, "CT 200 is locked (backup)")
    assert after == before


def test_busy_gpu_makes_launch_fail_naming_it(node: RealHostNode) -> None:
    node.testnode("gpus", "--busy", "3")
    try:
        result = node.play("launch.yml", extravars={"run": "nographs"})
    finally:
        node.testnode("gpus")
    assert_failed_clearly(result, "GPU 3")
    # Refused before anything started: no run recorded, no trainer in the container.
    assert not (node.work_dir / "state" / "runs.jsonl").exists()
    assert node.pct("exec", VMID, "--", "pgrep", "-f", "trainer --run").returncode == 1


def test_launch_status_stop_through_pct(node: RealHostNode, record_property) -> None:
    # Steps enough that the run is still training when stop comes, however slow the playbooks
    # through pct are beside other work (the default's 150 steps can finish first).
    endless = {"run": "nographs", "workspace_trainer_set": ["train.steps=100000"]}
    launch = node.play("launch.yml", extravars=endless)
    assert launch.ok, launch.stdout[-5000:]
    record_property("seconds launch nographs through pct_remote", round(launch.seconds, 1))
    ledger = (node.work_dir / "state" / "runs.jsonl").read_text().splitlines()
    record = json.loads(ledger[-1])
    assert record["run"] == "nographs" and record["state"] == "running"
    # The recorded PID is the trainer process inside the container (its own PID namespace).
    cmdline = node.pct("exec", VMID, "--", "cat", f"/proc/{record['pid']}/cmdline")
    assert cmdline.returncode == 0, cmdline.stderr
    argv = cmdline.stdout.split("\0")
    assert "-m" in argv and "trainer" in argv and "nographs" in argv, argv
    assert argv[0].endswith("/workspace/.venv/bin/python"), argv
    status = node.play("status.yml")
    assert status.ok, status.stdout[-3000:]
    report = status.stats_data()["dflash_status"]
    assert report["state"] == "running" and int(report["pid"]) == record["pid"], report
    # The log read inside the container through pct_remote, while the trainer runs.
    logs = node.play("logs.yml", extravars={"lines": 20})
    assert logs.ok, logs.stdout[-3000:]
    shown = logs.stats_data()["dflash_logs"]["ct200"]
    assert shown["alive"] and int(shown["lines_shown"]) > 0, shown
    assert "step " in logs.stdout, logs.stdout[-3000:]
    stop = node.play("stop.yml")
    assert stop.ok, stop.stdout[-3000:]
    # Followed after the stop: the run's last lines and how it ended, then the playbook returns.
    followed = node.play("logs.yml", extravars={"lines": 5, "follow": True})
    assert followed.ok, followed.stdout[-3000:]
    ended = followed.stats_data()["dflash_logs"]["ct200"]
    assert not ended["alive"] and ended["ended"].startswith("stopped at step "), ended
    checkpoints = node.state_dir / "host" / "ct200-workspace" / "runs" / "nographs" / "checkpoints"
    assert sorted(checkpoints.glob("step_*.pt")), f"no checkpoint in {checkpoints}"
    gone = node.pct("exec", VMID, "--", "test", "-e", f"/proc/{record['pid']}")
    assert gone.returncode != 0, "the trainer is still running after stop"


def test_export_through_pct_fetches_the_drafter(node: RealHostNode, record_property) -> None:
    """The stopped run's checkpoint exported inside the container and fetched through pct_remote."""
    export = node.play("export.yml")
    assert export.ok, export.stdout[-3000:]
    record_property("seconds export and fetch through pct_remote", round(export.seconds, 1))
    report = export.stats_data()["dflash_export"]
    assert report["run"] == "nographs" and report["on_target"] == "/workspace/runs/nographs/export"
    dest = Path(report["dest"])
    assert sorted(p.name for p in dest.iterdir()) == [
        "README.md",
        "config.json",
        "export.json",
        "model.safetensors",
    ]
    assert json.loads((dest / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert f"--speculative-draft-model-path {dest} " in report["serve"]["sglang"]


def test_no_secret_in_any_output_log_cache_or_artifact(node: RealHostNode) -> None:
    assert node.runs > 0
    secret = node.token_secret.encode()
    places = [node.work_dir, node.state_dir / "node.log", node.state_dir / "host"]
    scanned, leaks = 0, []
    for place in places:
        files = (
            [place]
            if place.is_file()
            else [p for p in place.rglob("*") if p.is_file() and not p.is_symlink()]
        )
        for path in files:
            if ".venv" in path.parts:
                continue
            scanned += 1
            if secret in path.read_bytes():
                leaks.append(str(path))
    assert scanned > 10, f"only {scanned} files scanned"
    assert not leaks, f"the token secret appears in {leaks}"
    runner_events = list((node.work_dir / "state" / "runner").rglob("job_events/*.json"))
    assert runner_events, "no runner artifacts scanned"
