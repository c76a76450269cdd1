"""Every `python -m trainer...` entry point answers --help with its usage and exit status 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def entry_points() -> list[str]:
    """The modules under trainer/ that run as `python -m`: a __main__.py, or a __main__ guard."""
    found = []
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if path.name == "__main__.py":
            found.append(module.removesuffix(".__main__"))
        elif 'if __name__ == "__main__":' in path.read_text():
            found.append(module)
    return found


def help_process(module: str) -> subprocess.Popen:
    command = [sys.executable, "-m", module, "--help"]
    pipe = subprocess.PIPE
    return subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=pipe, stderr=pipe, text=True)


def test_every_entry_point_answers_help_with_exit_status_0():
    modules = entry_points()
    assert {"trainer", "trainer.supervise", "trainer.launch", "trainer.data.regen_worker"} <= set(modules)
    # Started together, then awaited: the slowest import (torch) sets the time, not their sum.
    started = {module: help_process(module) for module in modules}
    failed = []
    try:
        for module, process in started.items():
            out, err = process.communicate(timeout=120)
            if process.returncode != 0 or "usage:" not in out:
                failed.append(f"{module}: exit status {process.returncode}, stderr {err.strip()[-300:]!r}")
    finally:
        for process in started.values():
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
    assert failed == []
