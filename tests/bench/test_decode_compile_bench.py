"""The decode compile bench's harness on CPU: the step compiled once for every shape
(data.regen_compile_dynamic), cold and warm, with the graphs Dynamo compiled per shape (none warm:
the step's traces are kept in the compile cache) and the answers checked against the uncompiled
loop. Its static rows run the same harness, a compile per shape (the static engine's compiles and
loads are tested in tests/trainer/test_compile_cache.py and test_regen.py); they are left out here
for the suite's time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_dynamic_step_compiles_once_for_every_shape_cold_and_nothing_warm() -> None:
    result = subprocess.run(
        [
            sys.executable, "bench/decode_compile_bench.py", "--layers", "1", "--shapes", "2x16,4x24",
            "--new-tokens", "3", "--dynamic", "dynamic",
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
    assert len(graphs) == 4, result.stdout  # 2 starts x 2 shapes, answers equal
    # Cold, one graph serves both shapes; warm, the step's traces are loaded with it from the
    # compile cache: Dynamo traces nothing.
    assert graphs["dynamic", "cold", "2x16"] == graphs["dynamic", "cold", "4x24"] == 1, result.stdout
    assert graphs["dynamic", "warm", "2x16"] == graphs["dynamic", "warm", "4x24"] == 0, result.stdout
    said = r"step dynamic warm: compile cache: .*1 compiled function\(s\) loaded with their traces"
    assert re.search(said, result.stdout), result.stdout
