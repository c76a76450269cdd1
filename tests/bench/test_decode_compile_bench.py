"""The decode compile bench's harness on CPU: each scope static and dynamic, cold and warm, with
the graphs Dynamo compiled per shape (none warm: the step's traces are kept in the compile cache)
and the answers checked against the uncompiled loop."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_each_shape_compiles_once_per_shape_or_once_for_all_cold_and_warm() -> None:
    result = subprocess.run(
        [
            sys.executable, "bench/decode_compile_bench.py", "--layers", "1", "--shapes", "2x16,4x24",
            "--new-tokens", "3",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    graphs = {
        (dynamic, start, shape): int(count)
        for dynamic, start, shape, count in re.findall(
            r"^step +(static|dynamic) +(cold|warm) +(\dx\d+): first batch .* "
            r"graphs so far (\d+) \(.*\), answers equal", result.stdout, re.MULTILINE,
        )
    }  # fmt: skip
    assert len(graphs) == 8, result.stdout  # 2 starts x 2 shapes x static and dynamic, answers equal
    assert graphs["static", "cold", "4x24"] == 2 and graphs["dynamic", "cold", "4x24"] == 1, result.stdout
    # Warm, the step's traces are loaded with it from the compile cache: Dynamo traces nothing.
    assert graphs["static", "warm", "4x24"] == 0 and graphs["dynamic", "warm", "4x24"] == 0, result.stdout
    for dynamic in ("static", "dynamic"):
        said = rf"step {dynamic} warm: compile cache: .*1 compiled function\(s\) loaded with their traces"
        assert re.search(said, result.stdout), result.stdout
