"""dflash.ct200 summary filters: the launch summary worded from each host's launch (role run_wait
publishes the data), the follow command and the `-i` options repeated in the commands shown."""

from __future__ import annotations

from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from ansible_collections.dflash.ct200.plugins.filter.summary import (
    follow_command,
    inventory_options,
    launch_summary,
)

REPO = "/home/me/dflash"


PROGRESS = "step 1/300 loss 9.1"


def launch(host: str, pid: int, matched: str | None = PROGRESS, waited_s: float | None = 41.5) -> dict:
    log = "/workspace/train_compile_nographs.log"
    return {
        "host": host,
        "run": "nographs",
        "run_id": f"nographs-20261130T101500Z-{pid}",
        "pid": pid,
        "log": log,
        "matched": matched,
        "waited_s": waited_s,
        "follow": f"tail -f {log}",
    }


def test_one_host_summary_names_run_pid_log_and_how_to_follow_watch_and_stop() -> None:
    assert launch_summary([launch("ct200", 4242)]) == [
        "run      nographs (nographs-20261130T101500Z-4242) on ct200",
        "PID      4242  (first progress after 41.5 s: step 1/300 loss 9.1)",
        "log      /workspace/train_compile_nographs.log",
        "follow   tail -f /workspace/train_compile_nographs.log",
        "status   ./dev.sh status",
        "stop     ./dev.sh stop",
    ]


def test_a_launch_that_did_not_wait_says_so() -> None:
    unwaited = launch("ct200", 4242, matched=None, waited_s=None)
    lines = launch_summary([unwaited], inventory=" -i inventory/gpu")
    assert lines[1] == "PID      4242  (not waited for progress)"
    assert lines[-2:] == [
        "status   ./dev.sh status -i inventory/gpu",
        "stop     ./dev.sh stop -i inventory/gpu",
    ]


def test_several_hosts_get_the_rendezvous_then_a_block_each_in_the_order_given() -> None:
    lines = launch_summary([launch("node1", 11), launch("node2", 22, matched=None)], endpoint="node1:29500")
    assert lines == [
        "run      nographs on 2 hosts (node1, node2), rendezvous node1:29500",
        "node1: PID 11 (nographs-20261130T101500Z-11), first progress after 41.5 s: step 1/300 loss 9.1",
        "  log      /workspace/train_compile_nographs.log",
        "  follow   tail -f /workspace/train_compile_nographs.log",
        "node2: PID 22 (nographs-20261130T101500Z-22), not waited for progress",
        "  log      /workspace/train_compile_nographs.log",
        "  follow   tail -f /workspace/train_compile_nographs.log",
        "status   ./dev.sh status",
        "stop     ./dev.sh stop",
    ]


def test_no_launch_no_summary() -> None:
    assert launch_summary([]) == []


def test_follow_goes_through_the_proxmox_node_where_the_inventory_does() -> None:
    proxmox = "community.proxmox.proxmox_pct_remote"
    assert follow_command("/workspace/a b.log", proxmox, "root", "pve1", 200) == (
        "ssh root@pve1 pct exec 200 -- tail -f '/workspace/a b.log'"
    )
    assert follow_command("/workspace/x.log", "ssh", "root", "10.0.0.5", None) == "tail -f /workspace/x.log"
    assert follow_command("/workspace/x.log", proxmox, "", "pve1", 200).startswith("ssh root@pve1 ")


def test_the_default_inventory_needs_no_option_others_are_named_relative_to_the_checkout() -> None:
    assert inventory_options([f"{REPO}/inventory/local"], REPO) == ""
    assert inventory_options([f"{REPO}/inventory/pair"], REPO) == " -i inventory/pair"
    assert inventory_options([f"{REPO}/inventory/local", "/etc/hosts.yml"], REPO + "/") == (
        " -i inventory/local -i /etc/hosts.yml"
    )


def test_roles_call_the_filters_from_jinja_as_written() -> None:
    """The calls of roles/run_wait and roles/preflight, through ansible's own templating."""
    templar = Templar(
        loader=DataLoader(),
        variables={
            "launches": [launch("ct200", 7)],
            "sources": [f"{REPO}/inventory/pair"],
            "playbook_dir": f"{REPO}/playbooks",
        },
    )
    options = templar.template(
        trust_as_template("{{ sources | dflash.ct200.inventory_options(playbook_dir | dirname) }}")
    )
    assert options == " -i inventory/pair"
    lines = templar.template(
        trust_as_template("{{ launches | dflash.ct200.launch_summary('', ' -i inventory/pair') }}")
    )
    assert lines[0] == "run      nographs (nographs-20261130T101500Z-7) on ct200"
    assert lines[-1] == "stop     ./dev.sh stop -i inventory/pair"
