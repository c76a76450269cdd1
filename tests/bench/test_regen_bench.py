"""The regeneration bench's harness on CPU (tiny shape): the in-process static row, the workers row
through the product's worker processes, and the --warm pass all produce their rows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_static_workers_and_warm_rows(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable, "bench/regen_bench.py", "--shape", "tiny", "--prompts", "8",
            "--rows", "static,workers", "--workers", "2", "--warm", "--compile-cache", str(tmp_path),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    for row in ("static B256 pass 2", "workers x2 pass 2", "warm (fresh process) pass 1"):
        assert row in result.stdout, result.stdout
    assert "worker 1 on cpu: pass 2: 4 prompts" in result.stdout
