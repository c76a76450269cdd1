"""Unit tests of the collection dflash.ct200, with no playbook run: its plugins are imported as the
Python modules they are (`ansible_collections.dflash.ct200.plugins...`), through ansible's own
collection loader (set up in tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def pytest_collection_modifyitems(items) -> None:
    """Everything in this folder is a unit test (./dev.sh fast runs pytest -m unit)."""
    here = Path(__file__).resolve().parent
    for item in items:
        if here in item.path.resolve().parents:
            item.add_marker(pytest.mark.unit)


class ModuleExit(Exception):
    """What a module printed before it exited: its result, and whether it failed."""

    def __init__(self, result: dict):
        super().__init__(result.get("msg", ""))
        self.result = result
        self.failed = bool(result.get("failed"))


@pytest.fixture
def run_module(capsys):
    """run_module(main, args, check_mode=False) -> ModuleExit: runs a module's main() in this
    process with the given arguments and returns the JSON it exited with."""
    from ansible.module_utils.testing import patch_module_args

    def run(main, args: dict, check_mode: bool = False) -> ModuleExit:
        arguments = {**args, "_ansible_check_mode": check_mode}
        capsys.readouterr()
        with patch_module_args(arguments), pytest.raises(SystemExit):
            main()
        out = capsys.readouterr().out
        return ModuleExit(json.loads(out))

    return run
