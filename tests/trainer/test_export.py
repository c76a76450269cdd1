"""python -m trainer.export: a run's checkpoint as a DFlash drafter directory, and every refusal
(before anything is written)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from trainer.data.embedded import embedded_dir
from trainer.export import ExportError, export
from trainer.run.checkpoint import SEAL_BYTES, checkpoint_path, load_checkpoint, save_checkpoint

from .conftest import EXPORT_RUN_EVAL, EXPORT_RUN_STEPS, REPO

pytestmark = pytest.mark.slow

FIRST, LAST = EXPORT_RUN_STEPS


def run_export(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.export", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def run_copy(trained_run, tmp_path):
    """A copy of the trained run this test may damage."""
    copy = tmp_path / "run"
    shutil.copytree(trained_run, copy)
    return copy


def test_export_of_the_newest_checkpoint(trained_run, trained_run_embedded, tmp_path):
    result = run_export(trained_run, tmp_path / "drafter")
    assert result.returncode == 0, result.stderr
    directory = tmp_path / "drafter"
    assert sorted(p.name for p in directory.iterdir()) == [
        "README.md",
        "config.json",
        "export.json",
        "model.safetensors",
    ]
    assert result.stdout.startswith(f"exported step {LAST} of run eager to {directory} (bfloat16)")

    config = json.loads((directory / "config.json").read_text())
    target = json.loads((trained_run_embedded[0] / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["num_hidden_layers"] == 2 and config["layer_types"] == ["full_attention"] * 2
    assert config["num_target_layers"] == target["num_hidden_layers"]
    assert config["block_size"] == 16 and config["dtype"] == "bfloat16"
    assert config["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [1, 2, 3]}  # <|mask|>
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size"):
        assert config[key] == target[key], key

    weights = load_file(str(directory / "model.safetensors"))
    saved = load_checkpoint(checkpoint_path(trained_run / "checkpoints", LAST))["drafter"]
    assert set(weights) == set(saved)  # fc, hidden_norm, layers.N.*, norm: no embedding, no head
    assert not any(name.startswith(("embed", "lm_head", "model.")) for name in weights)
    assert all(weights[name].dtype == torch.bfloat16 for name in weights)
    assert torch.equal(weights["fc.weight"], saved["fc.weight"].to(torch.bfloat16))

    readme = (directory / "README.md").read_text()
    tau = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()][-1]["tau"]
    assert f"step {LAST}" in readme and f"`{trained_run_embedded[0]}`" in readme and f"{tau:.3f}" in readme
    assert f"{EXPORT_RUN_EVAL['prompts']} held-out prompts" in readme
    assert f"--speculative-algorithm DFLASH --speculative-draft-model-path {directory}" in readme
    assert f'"method": "dflash", "model": "{directory}", "num_speculative_tokens": 15' in readme


def test_export_of_a_chosen_step_in_a_chosen_dtype(trained_run, tmp_path):
    result = export(trained_run, tmp_path / "drafter", step=FIRST, dtype="float32")
    assert result["step"] == FIRST and result["changed"] is True
    weights = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    saved = load_checkpoint(checkpoint_path(trained_run / "checkpoints", FIRST))["drafter"]
    assert all(torch.equal(weights[name], saved[name]) for name in saved)


def test_the_newest_valid_checkpoint_is_taken_and_a_damaged_one_named(run_copy, tmp_path):
    newest = checkpoint_path(run_copy / "checkpoints", LAST)
    data = bytearray(newest.read_bytes())
    data[-SEAL_BYTES - 10] ^= 0xFF  # in the payload, before the seal
    newest.write_bytes(bytes(data))
    assert export(run_copy, tmp_path / "a")["step"] == FIRST
    result = run_export(run_copy, tmp_path / "b", "--step", LAST)
    assert result.returncode == 2
    assert f"checkpoint {newest} fails its checksum (corrupt); pick another step with --step" in result.stderr
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("empty", "no checkpoint in"),
        ("missing-step", "no checkpoint of step 7 in"),
        ("foreign-file", "has no seal at its end: it is truncated, or not a checkpoint this trainer wrote"),
        ("other-drafter", "does not match a drafter of its own config"),
        ("no-mask-token", "the run recorded no mask token id"),
    ],
)
def test_refusals_name_the_problem_and_write_nothing(run_copy, tmp_path, damage, message):
    checkpoints = run_copy / "checkpoints"
    step = []
    if damage == "empty":
        shutil.rmtree(checkpoints)
    elif damage == "missing-step":
        step = ["--step", 7]
    elif damage == "foreign-file":
        checkpoint_path(checkpoints, 1).write_bytes(b"PK\x03\x04 a zip, say")
        step = ["--step", 1]
    else:
        state = load_checkpoint(checkpoint_path(checkpoints, LAST))
        if damage == "other-drafter":
            state["config"]["drafter"]["num_layers"] = 3  # a config that does not fit the weights
        else:
            # The same target, its tokenizer without a mask token, and drafter.mask_token_id -1.
            tokenizer = tmp_path / "target"
            shutil.copytree(embedded_dir(state["config"]["data"]["cache_dir"]) / "target", tokenizer)
            settings = json.loads((tokenizer / "tokenizer_config.json").read_text())
            settings.pop("mask_token")
            (tokenizer / "tokenizer_config.json").write_text(json.dumps(settings))
            state["config"]["model"]["target_path"] = str(tokenizer)
        save_checkpoint(checkpoints, LAST + 1, state)
    result = run_export(run_copy, tmp_path / "drafter", *step)
    assert result.returncode == 2, result.stdout
    assert result.stderr.startswith("error: ") and message in result.stderr, result.stderr
    assert not (tmp_path / "drafter").exists()


def test_an_occupied_directory_is_refused_and_only_an_earlier_export_replaced(trained_run, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    result = run_export(trained_run, other, "--force")
    assert result.returncode == 2 and "holds no earlier export" in result.stderr
    assert [p.name for p in other.iterdir()] == ["notes.txt"]

    directory = tmp_path / "drafter"
    export(trained_run, directory, step=FIRST)
    result = run_export(trained_run, directory)
    assert result.returncode == 2
    assert f"{directory} exists and is not empty; choose another EXPORT_DIR, or --force" in result.stderr
    assert json.loads((directory / "export.json").read_text())["step"] == FIRST
    assert export(trained_run, directory, step=FIRST, keep_same=True)["changed"] is False
    assert export(trained_run, directory, force=True)["changed"] is True
    assert json.loads((directory / "export.json").read_text())["step"] == LAST
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "other"]  # nothing left beside


def test_a_failed_write_leaves_the_earlier_export_as_it_was(trained_run, tmp_path, monkeypatch):
    directory = tmp_path / "drafter"
    export(trained_run, directory, step=FIRST)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_full)
    with pytest.raises(ExportError, match="No space left on device"):
        export(trained_run, directory, force=True)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]


def test_dry_run_writes_nothing(trained_run, tmp_path):
    result = run_export(trained_run, tmp_path / "drafter", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step"] == LAST
    assert not (tmp_path / "drafter").exists()
