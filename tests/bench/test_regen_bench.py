"""The regeneration bench's harness on CPU (tiny shape): the in-process static row, the workers row
through the product's worker processes, and the --warm pass all produce their rows."""

from __future__ import annotations

import re
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
    for row in (r"static B\d+ pass 2", r"workers x2 pass 2", r"warm \(fresh process\) pass 1"):
        assert re.search(f"^{row} ", result.stdout, re.MULTILINE), result.stdout  # B: the default batch size
    assert "worker 1 on cpu: pass 2: 4 prompts" in result.stdout


@pytest.mark.slow
def test_a_chat_file_runs_as_one_call_and_as_the_products_shards_and_turns(tmp_path: Path) -> None:
    from trainer.data.embedded import build_sized

    build_sized(tmp_path / "model", "qwen3-tiny", 60, "cpu")
    result = subprocess.run(
        [
            sys.executable, "bench/regen_bench.py", "--shape", "tiny", "--rows", "static,shards",
            "--chat", str(tmp_path / "model" / "chat.jsonl"), "--target", str(tmp_path / "model" / "target"),
            "--new-tokens", "4", "--shard-size", "16", "--compile-cache", str(tmp_path / "cache"),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    calls = re.search(r"chat.jsonl: (\d+) engine calls", result.stdout)
    assert calls and int(calls[1]) >= 4, result.stdout  # 4 shards of 16, some with a second turn
    rows = re.findall(r"^(static|shards) B\d+ pass 2 +(\d+) prompts", result.stdout, re.MULTILINE)
    assert [name for name, _ in rows] == ["static", "shards"] and rows[0][1] == rows[1][1], result.stdout


def test_a_chat_file_without_a_target_is_refused_naming_the_option() -> None:
    result = subprocess.run(
        [sys.executable, "bench/regen_bench.py", "--chat", "x.jsonl", "--rows", "static"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "--chat needs --target" in result.stderr, result.stderr
