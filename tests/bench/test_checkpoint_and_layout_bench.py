"""The checkpoint bench and the regeneration layout bench run on CPU and print every row."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> str:
    result = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.slow
def test_the_checkpoint_bench_prints_each_write_and_load(tmp_path: Path) -> None:
    out = run("bench/checkpoint_bench.py", "--gib", "0.25", "--repeats", "1", "--dir", str(tmp_path / "b"))
    rows = ("the product (pinned staging, reused)", "hash in line", "disk alone", "load, the payload a view")
    for row in rows:
        assert re.search(rf"{re.escape(row)}: median +[0-9.]+ s", out), out
    assert not (tmp_path / "b").exists()  # cleaned up


@pytest.mark.slow
def test_the_layout_bench_counts_the_turns_past_the_rows(tmp_path: Path) -> None:
    from trainer.data.embedded import ensure_embedded

    target, _ = ensure_embedded(tmp_path / "cache")  # its tokenizer
    long_second_turn = [
        {"role": "user", "content": "one two"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "one " * 80}, {"role": "assistant", "content": "y"},
    ]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": long_second_turn}) + "\n")
    out = run("bench/regen_layout_bench.py", str(data), str(target), "--seq-len", "40", "--new-tokens", "8")
    assert "every turn:         2 turns generated (0 left out)" in out, out
    assert "1 turns generated (1 left out)" in out, out
