"""A bad run name is refused before anything changes, and never reaches a shell."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ledger, make_controller

from dflashctl import PlaybookFailed

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
