"""dflash.ct200 summary filters: the launch, status and stop summaries worded from each host's data
(roles run_wait, run_status and run_stop publish it), the follow command and the `-i` options
repeated in the commands shown."""

from __future__ import annotations

from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template
from ansible_collections.dflash.ct200.plugins.filter.summary import (
    follow_command,
    inventory_options,
    launch_summary,
    status_block,
    status_line,
    stop_block,
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


def status_report(**changes) -> dict:
    report = {
        "state": "exited", "run": "nographs", "pid": 11540, "recorded_state": "finished",
        "exit_status": 0, "exit_reason": "finished", "repaired": None,
        "log": "/ws/train_compile_nographs.log", "last_progress": "step 150/150 loss 1.4856",
        "last_checkpoint": {"step": 150, "path": "/ws/runs/nographs/checkpoints/step_00000150.pt"},
        "last_eval": {"tau": 1.8723, "step": 150}, "gpus": [], "gpu_note": "nvidia-smi not found on PATH",
    }  # fmt: skip
    return {**report, **changes}


def test_status_names_the_checkpoints_kept_beside_the_newest() -> None:
    kept = {"step": 300, "path": "/ws/runs/r/checkpoints/step_00000300.pt", "kept": [100, 200, 300]}
    lines = status_block(status_report(last_checkpoint=kept), "ct200", [], [])
    assert "  ckpt     step 300 /ws/runs/r/checkpoints/step_00000300.pt (kept: steps 100, 200, 300)" in lines
    alone = {**kept, "kept": [300]}
    assert "  ckpt     step 300 /ws/runs/r/checkpoints/step_00000300.pt" in status_block(
        status_report(last_checkpoint=alone), "ct200", [], []
    )


def test_status_line_words_every_state() -> None:
    assert status_line(status_report()) == (
        "exited: nographs (PID 11540, recorded finished), exit status 0: finished"
    )
    killed = status_report(recorded_state="exited", exit_status=None, exit_reason="killed: ...")
    assert "exit status unknown: killed: ..." in status_line(killed)
    running = status_report(state="running", recorded_state="running")
    assert status_line(running) == "running: nographs as PID 11540"
    exiting = status_report(state="running", recorded_state="finished")  # the record written first
    assert status_line(exiting) == "running: nographs as PID 11540, exiting (its run record says finished)"
    waiting = "waiting at most 15s for tracker(s) wandb to send what is left"
    crashed = status_report(state="running", recorded_state="running", stage="exiting", exiting=waiting)
    assert status_line(crashed) == f"running: nographs as PID 11540, exiting ({waiting})"
    assert status_line(status_report(state="not_ours")).startswith("not ours: PID 11540 now belongs")
    assert status_line({"state": "none"}) == "no run recorded"


def test_status_block_lines_in_order_with_curves_and_the_gpu_note() -> None:
    curves = ["  loss     ▅▃▁ 1.4856 at step 150/150"]
    lines = status_block(status_report(), "ct200", curves, [])
    assert lines == [
        "ct200: exited: nographs (PID 11540, recorded finished), exit status 0: finished",
        "  log      /ws/train_compile_nographs.log",
        "  progress step 150/150 loss 1.4856",
        "  ckpt     step 150 /ws/runs/nographs/checkpoints/step_00000150.pt",
        "  tau      1.872 at step 150",
        "  loss     ▅▃▁ 1.4856 at step 150/150",
        "  gpus     nvidia-smi not found on PATH",
    ]


def test_status_block_of_a_fresh_run_with_gpus_and_a_repaired_cache() -> None:
    report = status_report(
        state="running", recorded_state="running", repaired="the controller's cache had no run; ...",
        last_checkpoint=None,
        last_eval=None, last_progress=None, log=None, gpus=[{"index": 0}],
    )  # fmt: skip
    lines = status_block(report, "ct200", None, ["gpu 0   H200  0 %"])
    assert lines == [
        "ct200: running: nographs as PID 11540",
        "  repaired the controller's cache had no run; ...",
        "  progress (no progress yet)",
        "  tau      (no eval yet)",
        "  gpu 0   H200  0 %",
    ]


def test_stop_block_names_the_run_stopped_or_that_none_was_recorded() -> None:
    record = {"run": "nographs", "run_id": "nographs-1", "log": "/ws/train.log"}
    assert stop_block({"msg": "stopped PID 7 after its checkpoint"}, "ct200", record) == [
        "ct200: stopped PID 7 after its checkpoint",
        "  run      nographs (nographs-1)",
        "  log      /ws/train.log",
    ]
    result = {"msg": "no run is recorded for this host", "repair": "cache had run x"}
    nothing = stop_block(result, "ct200", None)
    assert nothing == [
        "ct200: no run is recorded for this host",
        "  repaired cache had run x",
        "  run      none recorded",
        "  log      -",
    ]


def test_a_stop_with_a_cache_that_cannot_be_written_does_not_claim_the_repair() -> None:
    result = {
        "msg": "stopped PID 7 after its checkpoint",
        "repair": "the cache had no run: cache and ledger repaired",
    }
    write = {"cache_error": "the controller's fact cache cannot be used (read-only)"}
    lines = stop_block(result, "ct200", None, write)
    assert lines[1] == (
        "  repaired the cache had no run: ledger repaired; "
        "but the controller's fact cache cannot be used (read-only)"
    )


def test_roles_call_the_status_and_stop_filters_from_jinja_as_written() -> None:
    """The calls of roles/run_status and roles/run_stop, through ansible's own templating."""
    templar = Templar(
        loader=DataLoader(),
        variables={"report": status_report(), "result": {"msg": "done"}, "record": {}},
    )
    block = templar.template(trust_as_template("{{ report | dflash.ct200.status_block('ct200', [], []) }}"))
    assert block[0].startswith("ct200: exited: nographs")
    line = templar.template(trust_as_template("{{ report | dflash.ct200.status_line }}"))
    assert line == block[0].removeprefix("ct200: ")
    stop = templar.template(trust_as_template("{{ result | dflash.ct200.stop_block('ct200', record) }}"))
    assert stop == ["ct200: done", "  run      none recorded", "  log      -"]
