"""Unit tests of the collection dflash.ct200, with no playbook run: its plugins are imported as the
Python modules they are (`ansible_collections.dflash.ct200.plugins...`), through ansible's own
collection loader (set up in tests/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible_collections.dflash.ct200.plugins.module_utils.trainer_proc import (
    boot_id,
    is_trainer_cmdline,
    read_cmdline,
    read_stat,
)


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


@pytest.fixture
def live_trainer():
    """A live process whose command line is a trainer's (python -m trainer --run nographs) and its
    recorded identity; killed and reaped at the end of the test."""
    process = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "-m", "trainer", "--run", "nographs"]
    )
    try:
        deadline = time.monotonic() + 10
        # Until it has exec'd, the child's command line is still this test's.
        while not is_trainer_cmdline(read_cmdline(process.pid)) and time.monotonic() < deadline:
            time.sleep(0.01)
        identity = {
            "pid": process.pid,
            "start_time": read_stat(process.pid)["start_time"],
            "boot_id": boot_id(),
            "run": "nographs",
        }
        yield SimpleNamespace(process=process, identity=identity)
    finally:
        process.kill()
        process.wait(timeout=10)
