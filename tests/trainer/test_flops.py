"""The FLOP count behind the progress line's MFU (trainer/run/flops.py), and the bench's use of it."""

from __future__ import annotations

import types

import pytest
import torch

from trainer.config import load_config
from trainer.data.embedded import TARGET_SHAPES
from trainer.model.drafter import target_layer_ids
from trainer.run.flops import FlopShape, peak_flops, squared_conversation_lengths
from trainer.run.train import StepCount, Throughput

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)

SMALL = FlopShape(
    hidden=2, heads=1, kv_heads=1, head_dim=2, intermediate=3, vocab=5, target_layers_run=1,
    drafter_layers=1, context_layers=1, block=2, anchors=2, seq_len=4,
)  # fmt: skip


def test_conversation_lengths_squared_in_packed_and_padded_rows():
    """Packed rows restart their positions with each conversation; a padded row holds one
    conversation, its padding after it (positions going on, not real)."""
    packed_positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
    packed_real = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert squared_conversation_lengths(packed_positions, packed_real) == 9 + 4 + 1 + 16
    padded_positions = torch.arange(6).expand(2, 6)
    padded_real = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    assert squared_conversation_lengths(padded_positions, padded_real) == 9 + 25


def test_a_full_row_with_every_anchor_counts_its_whole_work_and_small_sizes_count_by_hand():
    """A row that is one conversation of seq_len tokens with every anchor filled is useful work
    all through; the sizes of SMALL give the figures counted by hand."""
    row = SMALL.per_row(SMALL.mean_visible_keys())
    whole = SMALL.useful(real_tokens=4, squared_lengths=16, valid_anchors=2)
    assert whole == pytest.approx(row["target"] + row["drafter"])
    # Target, one layer: q, o (2 x 2 x 2 each), k, v (2 x 2 x 2 each), gate, up, down (2 x 3 each).
    assert row["target_linear_per_token"] == 2 * (8 + 8 + 18)
    assert row["target"] == 4 * 68 + 2 * 1 * 2 * 4 * 4
    # Drafter: the fused context 4*4*1*2*2; its layer over 4 block queries and 8 keys and values
    # with 1.5 + 2 keys seen a query; the head over 2 anchors x 1 predicted token.
    layer = 6 * 4 * (8 + 18) + 6 * 8 * 2 * 2 * 2 + 12 * 2 * 4 * 3.5
    assert row["drafter"] == pytest.approx(64 + layer + 4 * 2 * 1 * 5 * 2)
    # Half the anchors, a shorter conversation: less of each part.
    part = SMALL.useful(real_tokens=3, squared_lengths=9, valid_anchors=1)
    assert part == pytest.approx(68 * 3 + 2 * 2 * 9 + row["drafter"] / 2)


def test_the_bench_counts_the_recipe_as_the_product_does():
    """bench/trainer_bench.py's 8b shape (the qwen3-8b profile over the Qwen3-8B layout) and the
    product's count of that run are one shape, so their MFU figures are one figure."""
    from bench.trainer_bench import flop_shape, recipe_shape

    cfg = load_config("qwen3-8b", sets=["model.target_path=-", "data.train_file=-"])
    sizes = TARGET_SHAPES["qwen3-8b"]
    config = types.SimpleNamespace(**sizes)
    layer_ids = target_layer_ids(sizes["num_hidden_layers"], cfg.drafter.num_context_layers)
    product = FlopShape.of(config, layer_ids, cfg.drafter, cfg.train.seq_len)
    assert product == flop_shape(recipe_shape())
    assert product.target_layers_run == max(layer_ids) + 1 < sizes["num_hidden_layers"]


def test_throughput_reports_mfu_only_where_the_peak_is_known():
    """TFLOP/s per GPU always; the MFU with a known peak (a CPU has none)."""
    meter = Throughput(total_steps=10, gpus=2, peak_flops=1e12)
    meter.add(StepCount(real_tokens=10, row_tokens=12, valid_anchors=1, anchor_slots=2, useful_flops=4e12))
    window, _, _ = meter.report(step=1)
    assert window["mfu"] > 0
    assert window["mfu"] == pytest.approx(window["tflops_per_gpu"])  # a peak of 1 TFLOP/s a GPU
    unknown = Throughput(total_steps=10)
    unknown.add(StepCount(10, 12, 1, 2, 4e12))
    window, _, _ = unknown.report(step=1)
    assert "mfu" not in window and window["tflops_per_gpu"] > 0
    assert peak_flops(torch.device("cpu")) is None
