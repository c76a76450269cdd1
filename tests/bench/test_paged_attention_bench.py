"""The paged decode attention bench on the CPU: every way of reading the pages gives the gathered
sdpa's output, and bad option sets are refused naming the form."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "bench/paged_attention_bench.py", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow
def test_flex_over_the_pool_equals_the_gathered_pages_for_each_option_set():
    result = bench("--slots", "6", "--pages", "48", "--page-size", "8", "--lengths", "20:90",
                   "--repeats", "1", "--options", "SPLIT_KV=2")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    rows = re.findall(r"^(gather|flex) .* ms .* equal to gather: (True|False)$", result.stdout, re.M)
    assert [name for name, _ in rows] == ["gather", "flex", "flex"], result.stdout
    assert all(equal == "True" for _, equal in rows), result.stdout


@pytest.mark.parametrize(("flag", "value"), [("--options", "SPLIT_KV"), ("--lengths", "90:20"),
                                             ("--lengths", "x")])  # fmt: skip
def test_bad_values_are_refused_naming_the_form(flag, value):
    result = bench(flag, value, timeout=120)
    assert result.returncode == 2 and ("NAME=VALUE" in result.stderr or "MEDIAN:CAP" in result.stderr)


def test_a_pool_too_small_for_the_lengths_is_refused_naming_the_pages():
    result = bench("--slots", "64", "--pages", "8", "--lengths", "100:200", timeout=120)
    assert result.returncode != 0 and "--pages 8 hold 7 pages" in result.stderr
