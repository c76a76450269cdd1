"""Unit tests of the collection dflash.ct200, with no playbook run: its plugins are imported as the
Python modules they are (`ansible_collections.dflash.ct200.plugins...`) from collections/, through
ansible's own collection loader (what ANSIBLE_COLLECTIONS_PATH does for ansible-playbook), so
lookups and callbacks get their options from their DOCUMENTATION as they do in a play."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

# Importing ansible replaces sys.intern (ansible.module_utils._internal._patches), and torch._dynamo,
# when it is first imported, registers a stand-in for sys.intern and refuses one that is not a
# function. The trainer tests run in this same pytest process: import dynamo first.
with contextlib.suppress(ImportError):
    import torch._dynamo  # noqa: F401

from ansible.plugins.loader import init_plugin_loader

COLLECTIONS = Path(__file__).resolve().parents[2] / "collections"
init_plugin_loader([str(COLLECTIONS)])


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
