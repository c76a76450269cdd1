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
    writes = ("the product (pinned staging, reused)", "hash in line", "disk alone")
    rows = (*writes, "load, the product", "load, format 1")
    for row in rows:
        assert re.search(rf"{re.escape(row)}: median +[0-9.]+ s", out), out
    # what a checkpoint costs a training loop: written on a thread, by a writer process, in line
    for row in ("background write, a thread", "background write, a process", "write in line"):
        pause = rf"{row}: training paused median +[0-9.]+ s, the write +[0-9.]+ s; a step beside"
        assert re.search(pause, out), out
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
    out = run(
        "bench/regen_layout_bench.py", str(data), str(target), "--seq-len", "40", "--new-tokens", "64",
        "--batches", "1:4096,2:4096", "--paged", "2:16", "--by-shard",
    )  # fmt: skip
    assert "every turn: 2 turns generated (0 left out)" in out, out
    assert "turns before 40 tokens: 1 turns generated (1 left out)" in out, out
    # Two rounds of one prompt each (one with the long turn left out), both within one 128 width:
    # a batch each round, one compiled shape, at either batch size. Each answer is one token, so
    # a batch ends at the first check, 16 tokens in, not after 64.
    row = (
        r"batches of +(\d) rows, +4,096 cache tokens: +(\d+) batches = +(\d+) decode steps, +(\d+) compiled "
        r"shapes; answers ending as the file's: (\d+) steps"
    )
    every = [("1", "2", "128", "1", "32"), ("2", "2", "128", "1", "32")]
    seen = [("1", "1", "64", "1", "16"), ("2", "1", "64", "1", "16")]
    assert re.findall(row, out) == every + seen, out
    # The paged engine: the one turn a row sees, its answer of one token then the end token: the
    # first from the prefill, the second from one decode step of 2 slots, one of them decoding.
    paged = r"paged engine (one stream|shard by shard), +2 slots, .* iterations, (\d+) decode steps, (\d+)%"
    assert re.findall(paged, out) == [("one stream", "1", "50"), ("shard by shard", "1", "50")], out


@pytest.mark.slow
def test_the_layout_bench_with_answers_at_the_cap_sets_the_stream_beside_every_turn_at_once(
    tmp_path: Path,
) -> None:
    from trainer.data.embedded import ensure_embedded

    target, _ = ensure_embedded(tmp_path / "cache")  # its tokenizer
    two_turns = [
        {"role": "user", "content": "one two"}, {"role": "assistant", "content": "x"},
        {"role": "user", "content": "three"}, {"role": "assistant", "content": "y"},
    ]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": two_turns}) + "\n")
    out = run(
        "bench/regen_layout_bench.py", str(data), str(target), "--seq-len", "512", "--new-tokens", "8",
        "--paged", "2:64", "--answers-at-cap",
    )  # fmt: skip
    # Each answer is 8 tokens whatever the file's (1 and 1): the first from its prefill, 7 from decode
    # steps. The stream queues the second turn when the first answer is done: 7 + 7 steps, one slot of
    # two decoding; at once both turns decode side by side: 7 steps, both slots decoding.
    paged = (
        r"paged engine (one stream|every turn at once), +2 slots, .* iterations, (\d+) decode steps, "
        r"(\d+)%"
    )
    assert re.findall(paged, out) == [("one stream", "14", "50"), ("every turn at once", "7", "100")], out


@pytest.mark.slow
def test_the_layout_bench_s_pool_size_decides_how_many_sequences_decode_side_by_side(tmp_path: Path) -> None:
    from trainer.data.embedded import ensure_embedded

    target, _ = ensure_embedded(tmp_path / "cache")  # its tokenizer
    one_turn = [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "x"}]
    data = tmp_path / "chat.jsonl"
    data.write_text((json.dumps({"messages": one_turn}) + "\n") * 2)
    paged = r"one stream, +2 slots, .* ([0-9,]+) tokens of pages: .* iterations, (\d+) decode steps"
    steps = {}
    for pool in ("4096", "128"):  # pages of 64: 63 usable, or one (the other is scratch)
        out = run(
            "bench/regen_layout_bench.py", str(data), str(target), "--seq-len", "512", "--new-tokens", "8",
            "--paged", "2:64", "--answers-at-cap", "--pool-tokens", pool,
        )  # fmt: skip
        steps[pool] = re.findall(paged, out)
    # Side by side: 7 decode steps for both answers; one page: one sequence at a time, 7 + 7.
    assert steps == {"4096": [("4,096", "7")], "128": [("128", "14")]}, steps
    refused = subprocess.run(
        [sys.executable, "bench/regen_layout_bench.py", str(data), str(target), "--pool-tokens", "64"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
    )  # fmt: skip
    assert refused.returncode == 2 and "--pool-tokens must hold two pages of 64 tokens" in refused.stderr
