"""log.tensorboard: true writes TensorBoard event files beside metrics.jsonl, with the same values."""

from __future__ import annotations

import json

import pytest

from .conftest import run_trainer

pytestmark = pytest.mark.slow


def test_tensorboard_event_files_hold_the_metrics(tmp_path, cache_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    machine = tmp_path / "machine.yml"
    machine.write_text(f"data:\n  cache_dir: {cache_dir}\nlog:\n  tensorboard: true\n")
    result = run_trainer(
        "--run",
        "eager",
        "--config",
        str(machine),
        "--out",
        str(out),
        "--steps",
        "4",
        "--set",
        "train.log_every=1",
        "--set",
        "train.eval_prompts=4",
        "--set",
        "train.eval_max_new_tokens=8",
    )
    assert result.returncode == 0, result.stderr
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [(row["step"], row["loss"]) for row in rows if row["kind"] == "train"]
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in board.Scalars("train/loss")] == losses
    taus = [(row["step"], row["tau"]) for row in rows if row["kind"] == "eval"]
    assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in board.Scalars("eval/tau")] == taus
    assert "train/tokens_per_s" in board.Tags()["scalars"]


def test_tensorboard_is_refused_in_a_profile(tmp_path):
    """A bad value of log.tensorboard is refused, naming the key."""
    result = run_trainer(
        "--run", "eager", "--check", "--out", str(tmp_path), "--set", "log.tensorboard=maybe"
    )
    assert result.returncode == 2 and "log.tensorboard" in result.stderr
