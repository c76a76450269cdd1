"""A run over two hosts of group `trainers`, both this machine: one torchrun each (gloo on CPU), a
rendezvous on loopback, separate workspaces. Through the real playbooks (dflashctl over
ansible-runner): bad setups are refused on every host before anything starts."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml
from conftest import ledger

from dflashctl import Controller, PlaybookFailed, Settings

HOSTS = ("node0", "node1")
# The tiny CPU run of test_orch_flow: no compile, no regeneration, a progress line every step.
TINY = [
    "compile.mode=none",
    "data.regenerate=false",
    "train.batch_size=1",
    "train.eval_prompts=1",
    "train.eval_max_new_tokens=2",
    "train.log_every=1",
    "train.eval_every=0",
    "train.checkpoint_every=0",
    "train.steps=100000",
]


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
            "trainer_workspace": str(tmp_path / name),
            **(host_vars or {}).get(name, {}),
        }
        for name in HOSTS
    }
    variables = {
        "trainer_python": "{{ ansible_playbook_python }}",
        "preflight_gpus_required": False,
        "trainer_rendezvous_endpoint": f"127.0.0.1:{free_loopback_port()}",
        "trainer_machine": {
            "parallel": {
                "devices": "cpu",
                "cpu_workers": 1,
                "rendezvous_timeout_s": 120,
                "step_timeout_s": 120,
                "shutdown_timeout_s": 60,
            }
        },
        "workspace_trainer_set": TINY,
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


def nothing_started(tmp_path: Path) -> None:
    for name in HOSTS:
        assert not (tmp_path / name).exists(), f"{name}'s workspace was created"
    assert ledger(tmp_path / "state") == []


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
    ctl = pair_controller(tmp_path, group_vars={"trainer_rendezvous_endpoint": endpoint})
    with pytest.raises(PlaybookFailed) as failure:
        ctl.launch("process")
    message = str(failure.value)
    assert "must be one HOST:PORT with a port 1..65535" in message
    assert f"it is {endpoint!r}".replace("'", '"') in message, "the error shows the value given"
    assert "Set trainer_rendezvous_endpoint once for the group" in message
    nothing_started(tmp_path)


@pytest.mark.slow
def test_hosts_disagreeing_on_the_endpoint_are_refused(tmp_path: Path) -> None:
    ctl = pair_controller(tmp_path, host_vars={"node1": {"trainer_rendezvous_endpoint": "127.0.0.2:29400"}})
    with pytest.raises(PlaybookFailed, match="the hosts set different trainer_rendezvous_endpoint values"):
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
