"""A run whose loss or weights stop being finite ends `failed` (exit status 2, no restart) with one
line, and never writes a checkpoint of non-finite weights: the newest one stays the last finite."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from trainer.cli import main
from trainer.run import runrecord
from trainer.run.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow

FAST = ["--set=train.eval_prompts=4", "--set=train.eval_max_new_tokens=8", "--set=train.eval_every=0"]


def _poison_weights_after_step(monkeypatch, poisoned_step: int) -> None:
    """After training step `poisoned_step`, every drafter weight is NaN (what an lr of inf does)."""
    import trainer.run.train

    real_step, steps = trainer.run.train.train_step, []

    def step_then_poison(topology, loader):
        result = real_step(topology, loader)
        steps.append(len(steps) + 1)
        if len(steps) == poisoned_step:
            with torch.no_grad():
                for param in topology.replicas[0].params:
                    param.fill_(float("nan"))
        return result

    monkeypatch.setattr(trainer.run.train, "train_step", step_then_poison)


@pytest.mark.parametrize(
    ("cadence", "caught"),
    [
        # Logged every step: step 4's loss is the first non-finite one.
        (["--set=train.log_every=1", "--set=train.checkpoint_every=2"], "the loss is nan at step 4"),
        # Checkpointed every step: step 3's loss was still finite, its weights are not.
        (["--set=train.log_every=5", "--set=train.checkpoint_every=1"], "weights are not finite at step 3"),
    ],
)
def test_non_finite_training_stops_failed_keeping_the_last_finite_checkpoint(
    cadence, caught, tmp_path, cache_dir, monkeypatch, capsys
):
    _poison_weights_after_step(monkeypatch, 3)
    out = tmp_path / "out"
    out.mkdir()  # the record trainer.launch writes before the trainer starts (this process is the run's)
    runrecord.write_record(out, {"run_id": "diverging", "pid": os.getpid(), "state": "running"})
    code = main(["--run", "eager", "--out", str(out), "--steps", "10", f"--set=data.cache_dir={cache_dir}",
                 *FAST, *cadence])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 2  # bad input for the supervisor: no restart into the same divergence
    errors = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and caught in errors[0], captured.err
    assert errors[0].startswith("error: diverged: ")
    assert "its newest checkpoint, step 2, is kept" in errors[0] and "lower train.lr" in errors[0]
    assert "Traceback" not in captured.err
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved[-1] == "step_00000002.pt"
    state = load_checkpoint(out / "checkpoints" / saved[-1])
    weights = [t for t in _tensors(state) if t.is_floating_point()]
    assert weights and all(bool(torch.isfinite(t).all()) for t in weights)
    record = json.loads(Path(out / "run.json").read_text())
    assert record["state"] == "failed" and record["exit_status"] == 2
    assert record["exit_reason"].startswith("diverged: ") and caught in record["exit_reason"]


def test_a_divergence_while_the_last_checkpoint_is_still_being_written_names_it_once_written(
    tmp_path, cache_dir, monkeypatch, capsys
):
    """The newest checkpoint the line names is the one in flight, waited for: step 2's write lasts
    past step 4's non-finite loss here."""
    import time

    from trainer.run import checkpoint as ckpt

    real = ckpt.save_checkpoint

    def slow(directory, step, state):
        time.sleep(3)
        return real(directory, step, state)

    monkeypatch.setattr(ckpt, "save_checkpoint", slow)
    _poison_weights_after_step(monkeypatch, 3)
    out = tmp_path / "out"
    code = main(["--run", "eager", "--out", str(out), "--steps", "10", f"--set=data.cache_dir={cache_dir}",
                 *FAST, "--set=train.log_every=1", "--set=train.checkpoint_every=2",
                 "--set=train.checkpoint_writer=thread"])  # fmt: skip
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "the loss is nan at step 4" in errors[0], errors
    assert "its newest checkpoint, step 2, is kept" in errors[0], errors
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step_00000002.pt"


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
