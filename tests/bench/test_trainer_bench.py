"""The benchmark's harness on CPU (tiny shape, no compile): both topologies produce a full row.

Figures come from GPU runs (docs/PERFORMANCE.md); this only keeps the program runnable, which a
rename in the topology API once broke without any test noticing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_threaded_and_process_settings_give_rows(tmp_path: Path) -> None:
    rows_file = tmp_path / "rows.json"
    result = subprocess.run(
        [
            sys.executable, "bench/trainer_bench.py", "--shape", "tiny", "--gpus", "0",
            "--settings", "eager,process-nographs", "--set", "compile.mode=none",
            "--steps", "2", "--warmup", "0", "--json", str(rows_file),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OUT": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = {row["setting"]: row for row in json.loads(rows_file.read_text())["rows"]}
    assert sorted(rows) == ["eager", "process-nographs"]
    for row in rows.values():
        assert row["gpus"] == 0
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0 and row["first_step_s"] > 0
        assert row["loss_first"] > 0 and row["loss_last"] > 0
    assert "1 rank(s) (gloo)" in result.stdout, "the process setting ran under torchrun"
    # The same seed, data and model in both topologies: the first step's loss is the same.
    assert rows["process-nographs"]["loss_first"] == pytest.approx(rows["eager"]["loss_first"], rel=1e-4)
    assert not list(tmp_path.glob(".bench_row_*")), "the hand-over file is cleaned up"


@pytest.mark.slow
def test_chat_lengths_run_padded_and_packed_side_by_side(tmp_path: Path) -> None:
    rows_file = tmp_path / "rows.json"
    result = subprocess.run(
        [
            sys.executable, "bench/trainer_bench.py", "--shape", "tiny", "--gpus", "0",
            "--settings", "eager", "--set", "compile.mode=none", "--lengths", "chat",
            "--steps", "2", "--warmup", "0", "--json", str(rows_file),
        ],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OUT": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = {row["mix"]: row for row in json.loads(rows_file.read_text())["rows"]}
    padded, packed = rows["chat-padded"], rows["chat-packed"]
    assert packed["padding_share"] < 0.1 < padded["padding_share"]
    assert packed["valid_anchor_share"] >= padded["valid_anchor_share"]
    assert 0 < packed["useful_mfu"] <= packed["mfu"] and 0 < padded["useful_mfu"] < padded["mfu"]
    per_conversation = rows["chat-packed-per-conversation"]
    assert per_conversation["anchors"] > packed["anchors"] == padded["anchors"]
    assert per_conversation["padding_share"] == packed["padding_share"]
    epoch_line = f"eager chat-packed ({packed['anchors']} anchors a row): an epoch of the chat mix takes "
    assert epoch_line in result.stdout
    assert "eager chat-packed-per-conversation (" in result.stdout


@pytest.mark.unit
def test_the_8b_shape_is_what_the_recipe_profile_trains() -> None:
    """The bench and the product train the same thing: the 8b shape comes from trainer/runs/qwen3-8b.yml
    and the layout of the target python -m trainer.data.embedded --shape qwen3-8b builds."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from trainer_bench import SHAPES
    finally:
        sys.path.remove(str(REPO / "bench"))
    from trainer.config import load_config
    from trainer.data.embedded import TARGET_SHAPES

    cfg = load_config("qwen3-8b", sets=["model.target_path=/t", "data.train_file=/d"])
    shape, target = SHAPES["8b"], TARGET_SHAPES["qwen3-8b"]
    assert (shape.seq_len, shape.batch, shape.anchors, shape.block) == (
        cfg.train.seq_len, cfg.train.batch_size, cfg.drafter.num_anchors, cfg.drafter.block_size
    )
    drafter = cfg.drafter
    assert (shape.drafter_layers, shape.context_layers) == (drafter.num_layers, drafter.num_context_layers)
    assert (shape.hidden, shape.layers, shape.vocab) == (
        target["hidden_size"], target["num_hidden_layers"], target["vocab_size"]
    )
