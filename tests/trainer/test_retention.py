"""Checkpoints a days-long run can keep: the newest train.keep_checkpoints and the best-tau one, a
file being read never removed, and checkpoints by the clock (train.checkpoint_every_s)."""

from __future__ import annotations

import fcntl
import json
import re
from types import SimpleNamespace

import pytest
import torch

from trainer.run.checkpoint import (
    SEAL_BYTES,
    SEAL_MAGIC,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    wait_for_freeing,
)
from trainer.run.checkpoint import save_checkpoint as save
from trainer.run.train import Run

from .conftest import run_trainer


def _steps(directory) -> list[int]:
    return [step for step, _ in list_checkpoints(directory)]


def _saved(directory, *steps: int) -> None:
    for step in steps:
        save(directory, step, {"step": step, "weights": torch.full((64,), float(step))})


@pytest.mark.unit
def test_the_newest_are_kept_and_the_protected_one(tmp_path):
    _saved(tmp_path, 10, 20, 30, 40, 50)
    assert prune_checkpoints(tmp_path, 2, protected={20}) == [10, 30]
    assert _steps(tmp_path) == [20, 40, 50]
    assert load_checkpoint(tmp_path / "step_00000050.pt")["step"] == 50, "what is kept stays whole"


@pytest.mark.unit
def test_keep_zero_keeps_every_checkpoint(tmp_path):
    _saved(tmp_path, 1, 2, 3, 4)
    assert prune_checkpoints(tmp_path, 0, protected=set()) == []
    assert _steps(tmp_path) == [1, 2, 3, 4]


@pytest.mark.unit
def test_a_checkpoint_being_read_is_left_for_a_later_pass(tmp_path):
    _saved(tmp_path, 1, 2, 3)
    with (tmp_path / "step_00000001.pt").open("rb") as reader:
        fcntl.flock(reader, fcntl.LOCK_SH)  # what a resume or an export holds while it reads
        assert prune_checkpoints(tmp_path, 1, protected=set()) == [2]
        assert _steps(tmp_path) == [1, 3]
    assert prune_checkpoints(tmp_path, 1, protected=set()) == [1], "once read, it goes"
    assert _steps(tmp_path) == [3]


@pytest.mark.unit
def test_a_partial_write_a_killed_trainer_left_is_removed_by_the_next_checkpoint(tmp_path):
    _saved(tmp_path, 1)
    leftover = tmp_path / ".step_00000002.pt.12345.tmp"  # a kill -9 in the middle of a write
    leftover.write_bytes(b"DFLASH-CKPT 1\n" + b"\0" * 4096)
    _saved(tmp_path, 3)
    assert not leftover.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001.pt", "step_00000003.pt"]


@pytest.mark.unit
def test_a_pruned_checkpoint_is_gone_at_once_and_its_file_freed_in_the_background(tmp_path, monkeypatch):
    """The training thread waits for a rename only: freeing a 12 GB file's blocks (its unlink) is
    not its to wait for."""
    import threading

    import trainer.run.checkpoint as checkpoint

    _saved(tmp_path, 1, 2)
    release, unlinking = threading.Event(), []
    real_unlink_all = checkpoint._unlink_all

    def slow_unlink_all(paths):
        unlinking.append(threading.current_thread().name)
        assert release.wait(10), "bounded: the test releases it"
        real_unlink_all(paths)

    monkeypatch.setattr(checkpoint, "_unlink_all", slow_unlink_all)
    assert prune_checkpoints(tmp_path, 1, protected=set()) == [1]  # returned while the unlink waits
    assert _steps(tmp_path) == [2] and unlinking == ["checkpoint-freeing"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step_00000001.pt.removed", "step_00000002.pt"]
    release.set()
    wait_for_freeing()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002.pt"]


@pytest.mark.unit
def test_a_pruned_file_a_killed_trainer_did_not_free_is_removed_by_the_next_checkpoint(tmp_path):
    _saved(tmp_path, 2)
    leftover = tmp_path / ".step_00000001.pt.removed"  # a kill -9 before the unlink ran
    leftover.write_bytes(b"\0" * 4096)
    assert _steps(tmp_path) == [2], "no checkpoint: a resume never reads it"
    _saved(tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002.pt", "step_00000003.pt"]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("train.keep_checkpoints=-1", "train.keep_checkpoints must not be negative"),
        ("train.checkpoint_every_s=-5", "train.checkpoint_every_s must be in [0, 604800]"),
        ("train.checkpoint_every_s=1e9", "train.checkpoint_every_s must be in [0, 604800]"),
        ("train.checkpoint_every_s=nan", "train.checkpoint_every_s must be a finite number"),
        ("train.async_checkpoints=maybe", "train.async_checkpoints: expected true or false, got 'maybe'"),
        ("train.checkpoint_writer=fork", "train.checkpoint_writer must be one of thread, process"),
    ],
)
def test_bad_retention_and_clock_values_are_refused_by_name(setting, said):
    from trainer.config import ConfigError, load_config

    with pytest.raises(ConfigError) as refused:
        load_config("nographs", sets=[setting])
    assert any(said in problem for problem in refused.value.problems), refused.value.problems


@pytest.mark.unit
def test_the_seal_has_a_fixed_size_and_names_the_streamed_payload(tmp_path):
    path = save(tmp_path, 7, {"weights": torch.arange(5000, dtype=torch.float32)})
    raw = path.read_bytes()
    assert raw[-SEAL_BYTES:].startswith(SEAL_MAGIC)
    assert int(raw[-SEAL_BYTES:].split(b"\n")[2]) == len(raw) - SEAL_BYTES
    assert torch.equal(load_checkpoint(path)["weights"], torch.arange(5000, dtype=torch.float32))


class _World:
    def __init__(self, other_rank_due: bool = False):
        self.other_rank_due = other_rank_due

    def any(self, flag: bool) -> bool:
        return bool(flag) or self.other_rank_due


def _run(now: float, last_save: float, every_s: float, world=None) -> SimpleNamespace:
    train = SimpleNamespace(steps=1000, checkpoint_every=100, checkpoint_every_s=every_s)
    return SimpleNamespace(cfg=SimpleNamespace(train=train), world=world or _World(), last_save=last_save)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("step", "since_last", "every_s", "due"),
    [
        (100, 0.0, 0.0, True),  # a step checkpoint
        (1000, 0.0, 0.0, True),  # the last step
        (150, 10_000.0, 0.0, False),  # the clock is off
        (150, 3599.0, 3600.0, False),  # between two step checkpoints, not yet an hour
        (150, 3600.0, 3600.0, True),  # between two step checkpoints, an hour since the last one
    ],
)
def test_a_checkpoint_is_due_by_step_or_by_the_clock(monkeypatch, step, since_last, every_s, due):
    monkeypatch.setattr("trainer.run.train.time.monotonic", lambda: 50_000.0)
    assert Run.checkpoint_due(_run(50_000.0, 50_000.0 - since_last, every_s), step) is due


@pytest.mark.unit
def test_ranks_agree_on_a_clock_checkpoint_another_rank_found_due(monkeypatch):
    monkeypatch.setattr("trainer.run.train.time.monotonic", lambda: 100.0)
    assert Run.checkpoint_due(_run(100.0, 99.0, 3600.0, _World(other_rank_due=True)), 150) is True


@pytest.mark.slow
def test_a_run_keeps_the_newest_and_the_best_tau_checkpoint_and_says_what_each_cost(tmp_path, cache_dir):
    out = tmp_path / "run"
    result = run_trainer(
        "--run", "eager", "--steps", "24", "--out", str(out), "--set", f"data.cache_dir={cache_dir}",
        "--set", "train.checkpoint_every=3", "--set", "train.eval_every=4",
        "--set", "train.keep_checkpoints=2",
        "--set", "train.eval_prompts=4", "--set", "train.eval_max_new_tokens=12",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    taus = {
        row["step"]: row["tau"]
        for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if row["kind"] == "eval" and row["step"] > 0
    }
    kept = _steps(out / "checkpoints")
    assert kept[-2:] == [21, 24], "the newest two"
    assert len(kept) <= 3, kept
    assert max(taus.get(step, 0.0) for step in kept) == max(taus.values()), f"and the best tau's: {taus}"
    cost = (
        r"^checkpoint step (\d+): training paused [0-9.]+ s; [0-9.]+ GiB written in [0-9.]+ s; "
        r"kept steps ([0-9, ]+)"
    )
    costs = re.findall(cost, result.stdout, re.M)
    assert [int(step) for step, _ in costs][-1] == 24
    assert costs[-1][1].strip().split(", ") == [str(step) for step in kept], "the log says what is kept"
