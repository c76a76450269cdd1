"""The shipped inventories: ct200 in local, gpu and proxmox (only local allows CPU runs); the pair
example holds two local trainer hosts with their own workspaces and a loopback rendezvous."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)
REPO = Path(__file__).resolve().parents[2]


def host_vars(inventory: str, host: str = "ct200") -> dict:
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-inventory"),
            "-i",
            f"inventory/{inventory}",
            "--host",
            host,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout)


def test_local_inventory_is_this_machine_with_cpu_allowed() -> None:
    hostvars = host_vars("local")
    assert hostvars["ansible_connection"] == "local"
    assert hostvars["preflight_gpus_required"] is False
    assert hostvars["preflight_max_memory_mib"] == 1024
    assert hostvars["preflight_max_utilization_pct"] == 5
    assert "ansible_python_interpreter" in hostvars


def test_proxmox_inventory_is_an_example_that_cannot_connect_anywhere() -> None:
    hostvars = host_vars("proxmox")
    assert hostvars["ansible_connection"] == "community.proxmox.proxmox_pct_remote"
    assert hostvars["ansible_host"].endswith(".invalid"), "a placeholder that cannot resolve"
    assert hostvars["proxmox_vmid"] == 200
    assert hostvars["preflight_gpus_required"] is True
    assert hostvars["ansible_python_interpreter"].startswith("/")


def test_pair_inventory_is_two_local_trainer_hosts_meeting_on_loopback() -> None:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-inventory"), "-i", "inventory/pair", "--list"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(done.stdout)["trainers"]["hosts"] == ["node0", "node1"], "node ranks 0 and 1"
    nodes = [host_vars("pair", host) for host in ("node0", "node1")]
    for hostvars in nodes:
        assert hostvars["ansible_connection"] == "local"
        assert hostvars["preflight_gpus_required"] is False
        assert hostvars["dflash_rendezvous_endpoint"] == "127.0.0.1:29400"
        assert hostvars["workspace_trainer_env"] == {"GLOO_SOCKET_IFNAME": "lo"}
        assert hostvars["dflash_machine"]["parallel"]["cpu_workers"] == 1
        # Each host its own workspace (as on separate machines): a folder named after the host.
        assert hostvars["dflash_workspace"].endswith("/pair/{{ inventory_hostname }}")


def test_every_inventory_machine_config_is_one_the_trainer_accepts(tmp_path: Path) -> None:
    # What the workspace role templates into machine.yml must pass the trainer's own checks
    # (a device name like plain "cuda" would only fail on the host, at launch).
    import yaml

    from trainer.config import ConfigError, load_config

    for inventory, host in (("local", "ct200"), ("gpu", "ct200"), ("proxmox", "ct200"), ("pair", "node1")):
        machine = host_vars(inventory, host).get("dflash_machine", {})
        path = tmp_path / f"{inventory}.yml"
        path.write_text(yaml.safe_dump(machine))
        try:
            cfg = load_config("process" if inventory == "pair" else "nographs", machine_config=str(path))
        except ConfigError as error:
            raise AssertionError(f"inventory/{inventory}: {error.problems}") from None
        spec = cfg.parallel.devices
        assert spec in ("auto", "cpu") or all(name.strip().startswith("cuda:") for name in spec.split(",")), (
            f"inventory/{inventory}: parallel.devices={spec!r}"
        )
