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
    from trainer.data.embedded import ensure_embedded

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


EXPORT_RUN_STEPS = (40, 80)
EXPORT_RUN_EVAL = {"prompts": 8, "max_new_tokens": 48}


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, cache_dir, embedded) -> Path:
    """A short eager run of the embedded default with checkpoints at steps 40 and 80 (tau evaluated
    at both): what the export is made from."""
    out = tmp_path_factory.mktemp("trained") / "run"
    result = run_trainer(
        "--run",
        "eager",
        "--out",
        str(out),
        "--steps",
        str(EXPORT_RUN_STEPS[-1]),
        "--set",
        f"data.cache_dir={cache_dir}",
        "--set",
        f"train.eval_every={EXPORT_RUN_STEPS[0]}",
        "--set",
        f"train.checkpoint_every={EXPORT_RUN_STEPS[0]}",
        "--set",
        f"train.eval_prompts={EXPORT_RUN_EVAL['prompts']}",
        "--set",
        f"train.eval_max_new_tokens={EXPORT_RUN_EVAL['max_new_tokens']}",
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return out
