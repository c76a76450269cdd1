"""Checkpoints: atomic files, verified on load; corrupt and partial ones are rejected."""

from __future__ import annotations

import pytest
import torch

from trainer.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint
from trainer.cli import main


def _state():
    return {"step": 7, "weights": torch.arange(1000, dtype=torch.float32), "rng": torch.get_rng_state()}


def test_round_trip(tmp_path):
    path = save_checkpoint(tmp_path, 7, _state())
    assert path.name == "step_00000007.pt"
    loaded = load_checkpoint(path)
    assert loaded["step"] == 7 and torch.equal(loaded["weights"], _state()["weights"])
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000007.pt"]  # no temporary file left


def test_truncated_checkpoint_rejected(tmp_path):
    path = save_checkpoint(tmp_path, 1, _state())
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(path)


def test_flipped_byte_rejected(tmp_path):
    path = save_checkpoint(tmp_path, 1, _state())
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path)


def test_foreign_file_rejected(tmp_path):
    path = tmp_path / "step_00000001.pt"
    torch.save(_state(), path)  # a plain torch file, not ours
    with pytest.raises(CheckpointError, match="bad header"):
        load_checkpoint(path)


def test_partial_write_is_never_listed(tmp_path):
    """A kill -9 mid-write leaves only a temporary file, which is ignored."""
    save_checkpoint(tmp_path, 10, _state())
    (tmp_path / ".step_00000020.pt.4242.tmp").write_bytes(b"DFLASH-CKPT 1\nhalf")
    assert [step for step, _ in list_checkpoints(tmp_path)] == [10]


def test_resume_from_corrupt_checkpoint_refused(tmp_path, capsys):
    out = tmp_path / "out"
    path = save_checkpoint(out / "checkpoints", 5, _state())
    path.write_bytes(path.read_bytes()[:-10])
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    code = main(
        ["--run", "eager", "--out", str(out), "--resume", "--set", f"data.cache_dir={tmp_path / 'c'}"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "truncated" in err[0] and "move it aside" in err[0]
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before
