"""Shared fixtures: one embedded cache (tiny target, data, regenerated set) per test session."""

from __future__ import annotations

import fcntl
import os
import shutil
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


def session_shared_dir(tmp_path_factory, name: str) -> Path:
    """A directory that every pytest-xdist worker of this session shares (the parent of their base
    directories, which pytest makes anew for each session); this session's own without xdist."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def trained_run_embedded(tmp_path_factory) -> tuple[Path, Path]:
    """The embedded cache the trained run uses: (target dir, data file). One for every worker of the
    session, next to the run (see trained_run)."""
    from trainer.data.embedded import ensure_embedded

    shared = session_shared_dir(tmp_path_factory, "trained-run")
    with (shared / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return ensure_embedded(shared / "cache")


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, trained_run_embedded) -> Path:
    """A short eager run of the embedded default with checkpoints at steps 40 and 80 (tau evaluated
    at both): what the export is made from. Made once per session and only read by the tests
    (about 15 CPU seconds): the first worker to need it trains it, under a lock, in a directory every
    worker shares, with the embedded cache of trained_run_embedded; the others wait for it."""
    shared = session_shared_dir(tmp_path_factory, "trained-run")
    out, done = shared / "run", shared / "done"
    with (shared / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a worker that failed half-way
            cache = shared / "cache"
            result = run_trainer(
                "--run",
                "eager",
                "--out",
                str(out),
                "--steps",
                str(EXPORT_RUN_STEPS[-1]),
                "--set",
                f"data.cache_dir={cache}",
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
            done.write_text("")
    return out


def fill_disk_when(monkeypatch, full) -> None:
    """A full disk for checkpoints being written (their temporary files): a write fails with ENOSPC
    where full(data, bytes written to the file before it) says so; other files are left alone."""
    import errno
    import pathlib

    opened = pathlib.Path.open

    class Filling:
        def __init__(self, handle):
            self.handle, self.written = handle, 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            if full(data, self.written):
                raise OSError(errno.ENOSPC, "No space left on device")
            self.written += len(data)
            return self.handle.write(data)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    def open_filling(self, mode="r", *args, **kwargs):
        handle = opened(self, mode, *args, **kwargs)
        checkpoint_being_written = self.name.startswith(".step_") and self.name.endswith(".tmp")
        return Filling(handle) if "w" in mode and checkpoint_being_written else handle

    monkeypatch.setattr(pathlib.Path, "open", open_filling)


@pytest.fixture
def tiny_disk(tmp_path: Path):
    """A real 1 MiB file system (tmpfs), which a test fills up; skipped where mounting is not allowed."""
    mount = tmp_path / "disk"
    mount.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)]
    mounted = subprocess.run(command, capture_output=True)
    if mounted.returncode:
        pytest.skip("mounting a tmpfs needs root (a full disk cannot be made here)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)
