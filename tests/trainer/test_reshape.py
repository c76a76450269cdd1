"""Resume on another shape of machine: a checkpoint written by N workers (threads or torchrun ranks)
resumes on M; the step and schedule continue, and within the epoch every conversation is trained
on exactly once, counted from the rows the loader really handed out (tests/trainer/batch_trace)."""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter
from pathlib import Path

import pytest

from trainer.cli import main

from .batch_trace.sitecustomize import traced
from .conftest import REPO
from .test_process import end, launch

pytestmark = pytest.mark.slow

TRACE_SITE = REPO / "tests" / "trainer" / "batch_trace"
BATCH = 4  # rows per worker and step; the embedded data packs into 128 rows of 96 tokens
COMMON = [
    "--seed=3", "--set=compile.mode=none", "--set=data.regenerate=false", f"--set=train.batch_size={BATCH}",
    "--set=train.eval_prompts=1", "--set=train.eval_max_new_tokens=2", "--set=train.log_every=1",
    "--set=train.eval_every=0", "--set=train.checkpoint_every=0", "--set=parallel.devices=cpu",
    "--set=parallel.step_timeout_s=60", "--set=parallel.shutdown_timeout_s=30",
]  # fmt: skip


def trained_steps(out: Path) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["step"] for row in rows if row["kind"] == "train"]


def first_epoch(trace: Path, rows: int) -> Counter:
    """How often each conversation was trained on in the first `rows` rows the run consumed."""
    batches = [json.loads(line)["conversations"] for line in trace.read_text().splitlines()]
    consumed = [row for batch in batches for row in batch]
    assert len(consumed) >= rows, f"the run consumed {len(consumed)} rows, fewer than an epoch's {rows}"
    return Counter(conversation for row in consumed[:rows] for conversation in row)


def data_line(text: str) -> tuple[int, int]:
    found = re.search(r"^data: (\d+) training conversations in (\d+) rows", text, re.M)
    return int(found.group(1)), int(found.group(2))


def test_threaded_two_then_one_then_two_workers(tmp_path, cache_dir, monkeypatch, capsys):
    """2 workers (optimizer sharded) stop at step 5; 1 worker resumes and is stopped before its first
    step, then again at step 11; 2 workers (sharded) finish step 20: 136 rows, past the end of the
    first epoch (128 rows), each of its conversations trained on once."""
    import trainer.data.rows
    import trainer.run.train
    from trainer.run.checkpoint import load_checkpoint

    out, trace = tmp_path / "run", tmp_path / "trace.jsonl"
    args = ["--run=eager", *COMMON, "--steps=20", f"--set=data.cache_dir={cache_dir}", "--out", str(out)]
    sharded = "--set=parallel.shard_optimizer=true"
    real_restore = trainer.run.train.Run.restore

    def restore_then_stop(run, resume_from, shape):
        step = real_restore(run, resume_from, shape)
        os.kill(os.getpid(), signal.SIGTERM)  # a stop while the resume on another count sets up
        return step

    segments = (
        ([2, sharded], 5, []),
        ([1], -1, ["--resume"]),
        ([1], 6, ["--resume"]),
        ([2, sharded], 0, ["--resume"]),
    )
    texts = []
    for (workers, *more), stop_after, resume in segments:
        with monkeypatch.context() as patch:
            recording = traced(trainer.data.rows.assemble, str(trace), max(stop_after, 0))
            patch.setattr(trainer.data.rows, "assemble", recording)
            if stop_after < 0:
                patch.setattr(trainer.run.train.Run, "restore", restore_then_stop)
            assert main([*args, f"--set=parallel.cpu_workers={workers}", *more, *resume]) == 0
        texts.append(capsys.readouterr().out)
    assert (
        "stopped at step 5" in texts[0]
        and "stopped at step 5" in texts[1]
        and "stopped at step 11" in texts[2]
    )
    checkpoint = out / "checkpoints" / "step_00000005.pt"
    conversations, rows = data_line(texts[0])
    assert rows == 128, texts[0]
    line = next(line for line in texts[1].splitlines() if line.startswith("resumed from"))
    assert line.startswith(
        f"resumed from {checkpoint} at step 5 on 1 worker thread (written by 2 worker threads): the data "
        f"continues after conversation "
    )
    assert f"of {conversations} of epoch 1, the global batch is now 4 rows (was 8)" in line
    assert line.endswith(
        "each worker's anchor stream re-derived from the seed and step; "
        "the run is no longer bit-exact with the original"
    )
    # Step 5's checkpoint is now one worker's: resuming it on one worker changes nothing.
    assert f"resumed from {checkpoint} at step 5\n" in texts[2]
    assert "at step 11 on 2 worker threads (written by 1 worker thread)" in texts[3]
    assert texts[3].splitlines()[-1].startswith("done: step 20, tau ")
    # The step continues: each step trained once in all.
    assert trained_steps(out) == list(range(1, 21))
    seen = first_epoch(trace, rows)
    assert set(seen) == set(range(conversations)) and set(seen.values()) == {1}, (
        "every conversation of the first epoch is trained on exactly once"
    )
    batches = [len(json.loads(line)["conversations"]) for line in trace.read_text().splitlines()]
    assert batches == [8] * 5 + [4] * 6 + [8] * 9  # the global batch follows the worker count
    final = load_checkpoint(out / "checkpoints" / "step_00000020.pt")
    assert [(s["from_step"], s["workers"]) for s in final["stretches"]] == [(0, 2), (5, 1), (11, 2)]


def test_threaded_two_then_two_ranks_then_one_thread(embedded, cache_dir, tmp_path):
    """Through trainer.launch, as launch.yml starts runs: 2 worker threads stop at step 3, 2 torchrun
    ranks resume and are stopped (SIGTERM) at step 7, 1 worker thread finishes step 26 (132 rows,
    past the 128 of an epoch). The run record keeps each stretch's worker count."""
    from trainer.run.runrecord import read_record

    out, trace, log = tmp_path / "run", tmp_path / "trace.jsonl", tmp_path / "train.log"
    args = ["--run=process", *COMMON, "--steps=26", f"--set=data.cache_dir={cache_dir}", "--out", str(out)]
    stretches = (
        (["--set=run.topology=threaded", "--set=parallel.cpu_workers=2"], 3),
        (["--set=parallel.cpu_workers=2", "--resume"], 4),
        (["--set=run.topology=threaded", "--set=parallel.cpu_workers=1", "--resume"], 0),
    )
    texts = []
    for options, stop_after in stretches:
        before = log.read_text() if log.exists() else ""
        # The repository too: sitecustomize runs before python -m puts the working directory on the path.
        env = {"PYTHONPATH": f"{TRACE_SITE}{os.pathsep}{REPO}", "DFLASH_TEST_BATCH_TRACE": str(trace)}
        env["DFLASH_TEST_STOP_AFTER"] = str(stop_after)
        proc = launch(*args, *options, log=log, env=env)
        try:
            assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
        finally:
            end(proc)
        texts.append(log.read_text()[len(before) :])
    assert "stopped at step 3" in texts[0] and "stopped at step 7" in texts[1], texts[1][-3000:]
    assert "topology process, devices 2 process(es) (gloo)" in texts[1]
    assert (
        f"resumed from {out / 'checkpoints' / 'step_00000003.pt'} at step 3 on 2 torchrun ranks "
        "(written by 2 worker threads): the data continues after conversation " in texts[1]
    )
    assert "each worker's anchor stream carried over; the run is no longer bit-exact" in texts[1]
    assert "at step 7 on 1 worker thread (written by 2 torchrun ranks)" in texts[2]
    assert "done: step 26, tau " in texts[2]
    conversations, rows = data_line(texts[0])
    assert trained_steps(out) == list(range(1, 27))
    seen = first_epoch(trace, rows)
    assert set(seen) == set(range(conversations)) and set(seen.values()) == {1}
    batches = [len(json.loads(line)["conversations"]) for line in trace.read_text().splitlines()]
    assert batches == [8] * 7 + [4] * 19
    record = read_record(out)
    assert [(s["from_step"], s["workers"], s["topology"], s["hosts"]) for s in record["stretches"]] == [
        (0, 2, "threaded", 1),
        (3, 2, "process", 1),
        (7, 1, "threaded", 1),
    ]
    assert record["state"] == "finished"
