"""CPU seconds per test, with everything the test starts (playbooks, detached trainers, torchrun).

    PYTHONPATH=tests DFLASH_TEST_CPU_LOG=/tmp/cpu.jsonl python -m pytest -p cpuacct_plugin -n 3 ...

Each pytest process (each xdist worker) moves itself into a cgroup of its own under the cgroup v1
`cpuacct` controller, so the processes it starts, detached ones included, are counted there; a
test's CPU is the group's usage after it minus before it, one JSON line per test in the file
DFLASH_TEST_CPU_LOG names. Wall time alone hides where a CPU-bound suite's time goes: on two cores
a test's wall time is mostly its neighbours' work. Needs root and /sys/fs/cgroup/cpuacct; elsewhere
it says so once and records nothing. The groups stay behind, empty; rmdir removes them.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def pytest_configure(config: pytest.Config) -> None:
    config.cpuacct_group = None
    if not os.environ.get("DFLASH_TEST_CPU_LOG"):
        return
    group = CPUACCT / f"dflash-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as error:
        warnings.warn(f"no CPU per test: cannot use {CPUACCT} ({error})", stacklevel=1)
        return
    config.cpuacct_group = group


def usage_s(group: Path) -> float:
    return int((group / "cpuacct.usage").read_text()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    group = item.config.cpuacct_group
    if group is None:
        yield
        return
    cpu, wall = usage_s(group), time.monotonic()
    yield
    cpu_s, wall_s = usage_s(group) - cpu, time.monotonic() - wall
    row = {"test": item.nodeid, "cpu_s": round(cpu_s, 2), "wall_s": round(wall_s, 2)}
    with open(os.environ["DFLASH_TEST_CPU_LOG"], "a", encoding="utf-8") as log:
        log.write(json.dumps(row) + "\n")
