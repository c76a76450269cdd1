"""The test node for tests/proxmox: one for the module that uses it, always stopped (also when a test
fails). The node is machine state (its LXC containers, /run paths) and its tests run in file order:
under pytest-xdist they need `--dist loadfile` (what ./dev.sh test uses), which gives the whole
file to one worker."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from realhost import RealHostNode, missing_requirements


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "proxmox: the real-host path against the test node (root, LXC, sshd)")


# Module scope: the worker that ran these tests may go on with others, which must see neither the
# node nor the environment it set (restored when the module ends).
@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealHostNode]:
    why = missing_requirements()
    if why:
        if os.environ.get("DFLASH_REQUIRE_TESTNODE"):  # CI installs the node's needs: never skip there
            pytest.fail(f"DFLASH_REQUIRE_TESTNODE is set but {why}")
        pytest.skip(why)
    saved = dict(os.environ)
    state = Path(os.environ.get("TESTNODE_STATE_PYTEST", "/run/dflash-testnode-pytest"))
    started = RealHostNode.start(state, tmp_path_factory.mktemp("realhost"))
    try:
        yield started
    finally:
        try:
            started.stop()
        finally:
            os.environ.clear()
            os.environ.update(saved)


@pytest.fixture(autouse=True)
def nothing_meant_for_the_ct_runs_on_the_node(node: RealHostNode) -> Iterator[None]:
    """Every test here fails if a command meant for CT 200 ran on the node (its tripwires caught it)."""
    before = len(node.commands_on_node())
    yield
    caught = node.commands_on_node()[before:]
    assert not caught, f"ran on the Proxmox node instead of CT 200: {caught}"
