"""The paged compile bench on the CPU: the default scope (layers) compiles cold and loads warm in
fresh processes over one compile cache, with the uncompiled engine's answers (the step scope runs
the same harness; both scopes' compiled answers are tested in
tests/trainer/test_regen_paged_compiled.py); the host bench runs the loop alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_layers_scope_compiles_cold_and_loads_warm_with_the_uncompiled_answers():
    result = subprocess.run(
        [sys.executable, "bench/paged_compile_bench.py", "--layers", "3", "--prompts", "4",
         "--new-tokens", "3", "--attention", "gather", "--scopes", "layers"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = re.findall(r"^(step|layers) +(cold|warm): .* equal the uncompiled engine's: (True|False)$",
                      result.stdout, re.M)  # fmt: skip
    ran = [(scope, process) for scope, process, _ in rows]
    assert ran == [("layers", "cold"), ("layers", "warm")], result.stdout
    assert all(equal == "True" for *_, equal in rows), result.stdout


def test_an_unknown_scope_is_refused_naming_the_scopes():
    result = subprocess.run(
        [sys.executable, "bench/paged_compile_bench.py", "--scopes", "whole"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "scopes are step, layers" in result.stderr


def test_the_host_bench_runs_the_loop_without_the_device_work_and_tells_its_parts():
    result = subprocess.run(
        [sys.executable, "bench/paged_host_bench.py", "--slots", "8", "--pages", "256", "--prompts", "40",
         "--cap", "64", "--median", "10"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    line = re.search(r"(\d+) decode steps in [\d.]+ s, ([\d.]+) ms an iteration on the host \(decode inputs",
                     result.stdout)  # fmt: skip
    assert line and int(line[1]) > 0 and float(line[2]) > 0, result.stdout
