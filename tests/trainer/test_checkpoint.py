"""Checkpoints: atomic files, verified on load; corrupt and partial ones are rejected."""

from __future__ import annotations

import hashlib

import pytest
import torch

from trainer.cli import main
from trainer.run.checkpoint import (
    CheckpointError,
    checkpoint_from_bytes,
    header_digest,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)


def _state():
    return {"step": 7, "weights": torch.arange(1000, dtype=torch.float32), "rng": torch.get_rng_state()}


def test_round_trip(tmp_path):
    path = save_checkpoint(tmp_path, 7, _state())
    assert path.name == "step_00000007.pt"
    loaded = load_checkpoint(path)
    assert loaded["step"] == 7 and torch.equal(loaded["weights"], _state()["weights"])
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000007.pt"]  # no temporary file left


def test_bytes_received_from_another_rank_are_verified_like_a_file(tmp_path):
    """What rank 0 sends on --resume: the file's bytes, checked against the digest it announced."""
    path = save_checkpoint(tmp_path, 3, _state())
    raw = path.read_bytes()
    digest = header_digest(path)
    assert digest == hashlib.sha256(raw.split(b"\n", 3)[3]).hexdigest(), (
        "the header names the payload's SHA-256"
    )
    assert checkpoint_from_bytes(raw, "received", digest)["step"] == 7
    other = save_checkpoint(tmp_path, 4, {**_state(), "step": 8})
    with pytest.raises(CheckpointError, match="is another checkpoint"):
        checkpoint_from_bytes(other.read_bytes(), "received", digest)
    with pytest.raises(CheckpointError, match="truncated"):
        checkpoint_from_bytes(raw[:-10], "received", digest)
    assert header_digest(tmp_path / "step_00000099.pt") is None
    (tmp_path / "foreign.pt").write_bytes(b"not a checkpoint at all")
    assert header_digest(tmp_path / "foreign.pt") is None


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
