"""Shared fixtures: one embedded cache (tiny target, data, regenerated set) per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_trainer(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """python -m trainer ARGS in the repository root; bounded by `timeout`."""
    return subprocess.run(
        [sys.executable, "-m", "trainer", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def embedded(cache_dir):
    """Build the embedded target and data once; returns (target dir, data file)."""
    from trainer.embedded import ensure_embedded

    return ensure_embedded(cache_dir)


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """In-process tests use one intra-op thread, like the trainer's default (parallel.cpu_threads=1):
    on a shared 2-core machine spinning OpenMP threads make tiny ops many times slower."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
