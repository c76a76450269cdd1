"""A run whose disk cannot hold one checkpoint is refused at its start, before it trains: its
first checkpoint (a stop's included) would fail and lose the training before it."""

from __future__ import annotations

import pytest
import torch

import trainer.run.train
from trainer.cli import main
from trainer.run.train import checkpoint_room_problem


def drafter() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    model[1].weight.requires_grad_(False)  # frozen: not in a checkpoint's optimizer state
    return model


@pytest.mark.unit
def test_the_room_a_checkpoint_needs_is_the_trainable_weights_and_two_moments(tmp_path, monkeypatch):
    trainable = 64 * 64 + 64 + 8  # the frozen weight left out
    needed = 3 * 4 * trainable + trainer.run.train.CHECKPOINT_EXTRA_BYTES
    monkeypatch.setattr(trainer.run.train, "free_disk_bytes", lambda path: needed)
    assert checkpoint_room_problem(tmp_path / "run", drafter()) is None
    monkeypatch.setattr(trainer.run.train, "free_disk_bytes", lambda path: needed - 1)
    problem = checkpoint_room_problem(tmp_path / "run", drafter())
    assert f"the disk of {tmp_path / 'run' / 'checkpoints'} has 0.00 GiB free" in problem
    assert f"the drafter's {trainable:,} trainable parameters" in problem
    assert "Free space there, or give the run an output on a larger disk" in problem


@pytest.mark.unit
def test_the_free_space_of_an_output_not_made_yet_is_its_nearest_parent_s(tmp_path):
    import shutil

    assert trainer.run.train.free_disk_bytes(tmp_path / "a" / "b" / "checkpoints") == pytest.approx(
        shutil.disk_usage(tmp_path).free, rel=0.01
    )


@pytest.mark.slow
def test_a_run_whose_disk_cannot_hold_a_checkpoint_is_refused_before_it_trains(
    tmp_path, cache_dir, monkeypatch, capsys
):
    monkeypatch.setattr(trainer.run.train, "free_disk_bytes", lambda path: 2**20)
    out = tmp_path / "run"
    status = main(["--run", "eager", "--out", str(out), "--steps", "5", f"--set=data.cache_dir={cache_dir}",
                   "--set=train.eval_prompts=4", "--set=train.eval_max_new_tokens=8"])  # fmt: skip
    assert status == 2
    said = capsys.readouterr()
    assert "has 0.00 GiB free, and a checkpoint of this run takes about" in said.err + said.out
    assert not any(line.startswith("step ") for line in said.out.splitlines())  # it never trained
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert "error: the disk of" in said.err + said.out
