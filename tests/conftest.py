"""For every test: the collection dflash.ct200 importable as the Python package it is
(`ansible_collections.dflash.ct200.plugins...`) through ansible's own collection loader (what
ANSIBLE_COLLECTIONS_PATH does for ansible-playbook), so lookups and callbacks get their options
from their DOCUMENTATION as they do in a play. Set up here, before any test module is imported: a
plain import of `ansible_collections` first would hide the collection from the loader."""

from __future__ import annotations

import contextlib
from pathlib import Path

# Importing ansible replaces sys.intern (ansible.module_utils._internal._patches), and torch._dynamo,
# when it is first imported, registers a stand-in for sys.intern and refuses one that is not a
# function. The trainer tests run in this same pytest process: import dynamo first.
with contextlib.suppress(ImportError):
    import torch._dynamo  # noqa: F401

from ansible.plugins.loader import init_plugin_loader

COLLECTIONS = Path(__file__).resolve().parents[1] / "collections"
init_plugin_loader([str(COLLECTIONS)])


def pytest_collection_modifyitems(items: list) -> None:
    """The real-host tests (tests/proxmox: one file, one test node, about six minutes in file order)
    first: under pytest-xdist (`--dist loadfile`, ./dev.sh test) that file is the longest piece one
    worker takes, and started first it ends while the other workers still share out the rest. The
    benches' tests (tests/bench: files of at most about a minute) last, where they fill the end of
    each worker's share instead of a long trainer or playbook file starting late (laid out on the
    durations of a CI run: the lane's end about 80 s sooner; docs/TESTING.md)."""
    here = Path(__file__).resolve().parent
    real_host, benches = here / "proxmox", here / "bench"

    def place(item) -> tuple[bool, bool]:
        parents = item.path.resolve().parents
        return real_host not in parents, benches in parents

    items.sort(key=place)
