"""Both inventories name the container host ct200; only the local one allows CPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def host_vars(inventory: str) -> dict:
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-inventory"),
            "-i",
            f"inventory/{inventory}",
            "--host",
            "ct200",
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


def test_every_inventory_machine_config_is_one_the_trainer_accepts(tmp_path: Path) -> None:
    # What the workspace role templates into machine.yml must pass the trainer's own checks
    # (a device name like plain "cuda" would only fail on the host, at launch).
    import yaml

    from trainer.config import ConfigError, load_config

    for inventory in ("local", "gpu", "proxmox"):
        machine = host_vars(inventory).get("trainer_machine", {})
        path = tmp_path / f"{inventory}.yml"
        path.write_text(yaml.safe_dump(machine))
        try:
            cfg = load_config("nographs", machine_config=str(path))
        except ConfigError as error:
            raise AssertionError(f"inventory/{inventory}: {error.problems}") from None
        spec = cfg.parallel.devices
        assert spec in ("auto", "cpu") or all(name.strip().startswith("cuda:") for name in spec.split(",")), (
            f"inventory/{inventory}: parallel.devices={spec!r}"
        )
