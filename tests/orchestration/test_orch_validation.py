"""A bad run name is refused before anything changes, and never reaches a shell."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ledger, make_controller

from dflashctl import PlaybookFailed

REPO = Path(__file__).resolve().parents[2]
BAD_NAMES = [
    "x;touch {marker}",
    "$(touch {marker})",
    "`touch {marker}`",
    "../x",
    "nographs/../../x",
    "nographs\ntouch {marker}",
    "NoGraphs",
    "-rf",
    "",
    "a" * 65,
    "no-such-run",
]


@pytest.mark.slow
@pytest.mark.parametrize("template", BAD_NAMES, ids=range(len(BAD_NAMES)))
def test_bad_run_name_changes_nothing(tmp_path: Path, template: str) -> None:
    marker = tmp_path / "pwned"
    state_dir = tmp_path / "state"
    ctl = make_controller(state_dir)
    with pytest.raises(PlaybookFailed) as failure:
        ctl.launch(template.format(marker=marker))
    message = str(failure.value)
    assert "pass -e run=NAME" in message
    assert "nographs" in message, "the error lists the known runs"
    assert not marker.exists()
    assert not (state_dir / "workspace").exists()
    assert ledger(state_dir) == []
    facts = state_dir / "facts"
    assert not facts.exists() or not any(facts.iterdir()), "no fact was recorded"


@pytest.mark.slow
def test_run_name_must_be_a_string(tmp_path: Path) -> None:
    ctl = make_controller(tmp_path / "state")
    with pytest.raises(PlaybookFailed, match="Unknown run"):
        ctl.run_playbook("launch.yml", {"run": ["nographs"]})
    assert not (tmp_path / "state" / "workspace").exists()


def _inventory_with(tmp_path: Path, group_vars: str) -> Path:
    """An inventory like the local default's (this machine plays ct200) with these group vars."""
    inventory = tmp_path / "inventory"
    (inventory / "group_vars").mkdir(parents=True)
    (inventory / "hosts.yml").write_text(
        "all:\n  children:\n    trainers:\n      hosts:\n        ct200:\n"
        "          ansible_connection: local\n"
        '          ansible_python_interpreter: "{{ ansible_playbook_python }}"\n'
    )
    (inventory / "group_vars" / "trainers.yml").write_text(group_vars)
    return inventory


def _status(inventory: Path, state: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory),
         "-e", f"dflash_state_dir={state}", "playbooks/status.yml"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
             "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(state / "facts")},
    )  # fmt: skip


@pytest.mark.slow
def test_inputs_under_their_earlier_names_still_work(tmp_path: Path) -> None:
    """trainer_workspace and trainer_python, the earlier names of dflash_workspace and dflash_python,
    are read where the new names are not set (a fallback for inventories written before)."""
    workspace = tmp_path / "old-workspace"
    (workspace / "runs").mkdir(parents=True)
    inventory = _inventory_with(
        tmp_path, f'trainer_workspace: "{workspace}"\ntrainer_python: "{{{{ ansible_playbook_python }}}}"\n'
    )
    result = _status(inventory, tmp_path / "state")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    without = _status(_inventory_with(tmp_path / "none", "preflight_gpus_required: false\n"), tmp_path / "s2")
    assert without.returncode != 0
    assert "dflash_workspace" in without.stdout + without.stderr, "the missing input is named"
