"""python -m trainer.regen as a process: a SIGKILL half way then a rerun gives what an uninterrupted
regeneration gives; two ranks under torchrun (gloo) each regenerate their shards. Small data, few
tokens; every process a test starts is ended by its PID, every wait bounded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer.data.chat import iter_conversations
from trainer.run import runrecord

from .conftest import REPO, run_trainer

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups and SIGKILL")

CONVERSATIONS = 40


@pytest.fixture(scope="module")
def small_data(tmp_path_factory, embedded) -> Path:
    rows = [json.dumps({"messages": m}) for _, m in iter_conversations(embedded[1])][:CONVERSATIONS]
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def regen_args(embedded, data: Path, cache: Path, out: Path, run_dir: Path, run: str = "eager") -> list[str]:
    settings = {
        "data.train_file": data, "model.target_path": embedded[0], "data.cache_dir": cache,
        "parallel.devices": "cpu", "train.eval_prompts": 2, "data.regen_max_new_tokens": 8,
        "data.regen_shard_size": 4, "data.regen_batch_size": 4, "data.regen_progress_every_s": 0.5,
    }  # fmt: skip
    sets = [f"--set={key}={value}" for key, value in settings.items()]
    return ["--run", run, *sets, "--out", str(out), "--dir", str(run_dir)]


def regen(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.regen", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def shards(cache: Path) -> list[Path]:
    return sorted(cache.glob("regenerated/*/shard-*.jsonl"))


def sealed(cache: Path) -> list[Path]:
    """The finished shards: a kill between a shard and its seal leaves one the next start redoes."""
    return [shard for shard in shards(cache) if shard.with_suffix(".sha256").exists()]


def test_a_sigkill_half_way_then_a_rerun_equals_an_uninterrupted_regeneration(tmp_path, embedded, small_data):
    # A run record the stage notes its figures in: its recorded PID this process, the stage's parent.
    runrecord.write_record(tmp_path / "r1", {"run_id": "whole", "pid": os.getpid(), "state": "running"})
    whole = regen(
        *regen_args(embedded, small_data, tmp_path / "c1", tmp_path / "whole.jsonl", tmp_path / "r1")
    )
    assert whole.returncode == 0, whole.stderr
    assert "regen: 40/40 conversations" in whole.stdout
    # the paged engine (the default) says how busy its slots were, in its line and in the run record
    used = r"[0-9,]+ decode steps, [0-9]+% of their slot-steps decoding an answer token"
    assert re.search(used, whole.stdout), whole.stdout
    stage = json.loads((tmp_path / "r1" / "run.json").read_text())["regen"]
    assert 0 < stage["decode_steps"] <= stage["tokens"] - stage["answers"], stage  # a token a step at least
    # at most a token a slot-step, the slot-steps as the line counts them
    assert stage["decode_steps"] <= stage["tokens"] - stage["answers"] <= stage["slot_steps"], stage
    share = (stage["tokens"] - stage["answers"]) / stage["slot_steps"]
    assert f"{share:.0%} of their slot-steps decoding" in whole.stdout, whole.stdout

    args = regen_args(embedded, small_data, tmp_path / "c2", tmp_path / "resumed.jsonl", tmp_path / "r2")
    log = tmp_path / "killed.log"
    with log.open("w") as handle:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.regen", *args], cwd=REPO, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while len(sealed(tmp_path / "c2")) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, f"finished before it could be killed:\n{log.read_text()}"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    kept = len(sealed(tmp_path / "c2"))
    assert 3 <= kept < 10, log.read_text()
    resumed = regen(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"({CONVERSATIONS - 4 * kept} on this machine" in resumed.stdout  # only the missing shards
    assert f"regen: {CONVERSATIONS}/{CONVERSATIONS} conversations" in resumed.stdout  # counts the kept ones
    assert (tmp_path / "resumed.jsonl").read_text() == (tmp_path / "whole.jsonl").read_text()
    events = [json.loads(line) for line in (tmp_path / "r2" / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["regen", "regen", "regen"]  # start, (killed), start, end
    assert f"regenerated {CONVERSATIONS - 4 * kept} conversations" in events[-1]["text"]

    # The trainer finds the data there: no regeneration of its own.
    train_args = [*args[: args.index("--out")], "--steps=1", "--set=train.eval_max_new_tokens=2"]
    trained = run_trainer(*train_args, "--out", str(tmp_path / "trained"), timeout=300)
    assert trained.returncode == 0, trained.stderr
    directory = shards(tmp_path / "c2")[0].parent
    assert f"data: {CONVERSATIONS} regenerated conversations from {directory}" in trained.stdout
    assert "regenerating" not in trained.stdout


def test_two_ranks_under_torchrun_each_regenerate_their_shards(tmp_path, embedded, small_data):
    threaded = regen(
        *regen_args(embedded, small_data, tmp_path / "c1", tmp_path / "one.jsonl", tmp_path / "r1")
    )
    assert threaded.returncode == 0, threaded.stderr
    args = regen_args(
        embedded, small_data, tmp_path / "c2", tmp_path / "two.jsonl", tmp_path / "r2", "process"
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    result = subprocess.run(
        [*torchrun, "-m", "trainer.regen", "--", *args, "--set=parallel.step_timeout_s=120"],
        cwd=REPO, capture_output=True, text=True, timeout=300, start_new_session=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    # Rank 0 reports its own share: half of the ten shards; the other half is rank 1's.
    assert "(20 on this process" in result.stdout, result.stdout
    assert "data: regenerated 20 conversations" in result.stdout, result.stdout
    assert len(shards(tmp_path / "c2")) == 10
    assert (tmp_path / "two.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()


def test_an_empty_data_file_is_one_error_line_naming_it(tmp_path, embedded):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    result = regen(*regen_args(embedded, empty, tmp_path / "c", tmp_path / "out.jsonl", tmp_path / "r"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {empty}: no conversation with an assistant turn; expected one "
        '{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]} per line'
    ]
    assert not (tmp_path / "out.jsonl").exists()


def test_a_shard_damaged_on_disk_is_regenerated_in_the_same_launch_with_a_true_reason(
    tmp_path, embedded, small_data
):
    args = regen_args(embedded, small_data, tmp_path / "c", tmp_path / "out.jsonl", tmp_path / "r")
    assert regen(*args).returncode == 0
    shard = shards(tmp_path / "c")[1]
    body = bytearray(shard.read_bytes())
    body[len(body) // 2 : len(body) // 2 + 3] = b"@#!"  # the same size: only its contents tell
    shard.write_bytes(bytes(body))
    sets = [arg for arg in args if arg.startswith("--set=")]
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "--run", "eager", *sets, "--out", str(tmp_path / "run"),
         "--steps", "1", "--set", "train.eval_max_new_tokens=4"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stdout
    assert (
        f"data: {shard} cannot be used: its contents do not match its checksum (moved to "
        f"{shard.name}.damaged); it is regenerated"
    ) in log
    assert "no checksum" not in log and "run again" not in log + result.stderr
    assert shard.with_suffix(".sha256").exists() and shard.read_bytes() != bytes(body)
