"""The objective and the drafter: mask, blocks, weights and shapes against hand-built cases."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.model.drafter import DFlashDrafter, DrafterShape, SharedTargetParts, target_layer_ids
from trainer.model.objective import (
    IGNORE,
    anchor_candidates,
    block_attention_mask,
    build_blocks,
    loss_weights,
    sample_anchors,
)

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)
MASK = 99


def test_mask_matches_hand_built_case():
    # context of 5 positions, anchors at 1 and 3, block size 2
    allowed = block_attention_mask(torch.tensor([[1, 3]]), context_len=5, block_size=2)
    T, F = True, False
    expected = torch.tensor(
        [
            [
                # ctx0 ctx1 ctx2 ctx3 ctx4 | b0k0 b0k1 b1k0 b1k1
                [T, F, F, F, F, T, T, F, F],  # block 0 (anchor 1), k=0: sees context before 1, its own block
                [T, F, F, F, F, T, T, F, F],  # block 0, k=1: the same (non-causal inside the block)
                [T, T, T, F, F, F, F, T, T],  # block 1 (anchor 3), k=0: context 0..2, its own block only
                [T, T, T, F, F, F, F, T, T],
            ]
        ]
    )
    assert allowed.shape == (1, 4, 9)
    assert torch.equal(allowed, expected)


def test_blocks_hand_built_case():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 0]])
    anchors = torch.tensor([[2, 4, 0]])
    valid = torch.tensor([[True, True, False]])  # third anchor is padding
    blocks = build_blocks(input_ids, loss_mask, anchors, valid, block_size=3, mask_token_id=MASK, gamma=7.0)
    assert torch.equal(blocks.block_ids, torch.tensor([[12, MASK, MASK, 14, MASK, MASK, 10, MASK, MASK]]))
    assert torch.equal(blocks.block_positions, torch.tensor([[2, 3, 4, 4, 5, 6, 0, 1, 2]]))
    # k=0 never a label; position 5 unsupervised; position 6 beyond the sequence; padded anchor: nothing
    assert torch.equal(
        blocks.labels, torch.tensor([[IGNORE, 13, 14, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]])
    )
    w1 = math.exp(-1 / 7.0)
    assert torch.allclose(blocks.weights, torch.tensor([[0, 1.0, w1, 0, 0, 0, 0, 0, 0]]))
    assert blocks.attention_mask.shape == (1, 9, 6 + 9)


def test_loss_weights():
    weights = loss_weights(16, 7.0)
    assert weights.shape == (16,)
    assert weights[0] == 0  # the anchor is given, never predicted
    for k in range(1, 16):
        assert weights[k].item() == pytest.approx(math.exp(-(k - 1) / 7.0))
    assert weights[1] == 1.0
    assert torch.all(weights[2:] < weights[1:-1])


def test_anchor_sampling_static_shape_and_supervised_only():
    loss_mask = torch.tensor([[0, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1, 1, 1]])
    candidates = anchor_candidates(loss_mask)
    assert candidates.tolist() == [
        [False, True, True, False, False, False, False, False],
        [False, False, False, False, False, True, True, False],
    ]
    anchors, valid = sample_anchors(loss_mask, num_anchors=4, generator=torch.Generator().manual_seed(0))
    assert anchors.shape == valid.shape == (2, 4)
    assert anchors[0, :2].tolist() == [1, 2] and valid[0].tolist() == [True, True, False, False]
    long_mask = torch.ones(1, 40, dtype=torch.long)
    anchors, valid = sample_anchors(long_mask, num_anchors=4, generator=torch.Generator().manual_seed(0))
    assert valid.all() and torch.all(anchors[0, 1:] > anchors[0, :-1])


def test_target_layers_spread():
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B, as in DFlash
    assert target_layer_ids(6, 3) == [1, 2, 3]
    with pytest.raises(ValueError, match="num_context_layers"):
        target_layer_ids(4, 3)


def _tiny_drafter(hidden=32, vocab=120, layers=2, context_layers=2):
    torch.manual_seed(0)
    shape = DrafterShape(
        hidden_size=hidden,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=64,
        num_layers=layers,
        num_context_layers=context_layers,
        rms_eps=1e-6,
        rope_theta=10000.0,
    )
    shared = SharedTargetParts(torch.nn.Embedding(vocab, hidden), torch.nn.Linear(hidden, vocab, bias=False))
    return DFlashDrafter(shape, shared).eval()


def test_drafter_shapes_and_attention_pattern():
    drafter = _tiny_drafter()
    ctx_len, block = 10, 4
    anchors = torch.tensor([[3, 7]])
    input_ids = torch.randint(0, 100, (1, ctx_len))
    blocks = build_blocks(
        input_ids, torch.ones_like(input_ids), anchors, torch.tensor([[True, True]]), block, MASK, 7.0
    )
    features = torch.randn(1, ctx_len, 2 * 32)

    def run(feats, ids):
        return drafter.hidden(feats, ids, blocks.block_positions, blocks.attention_mask)

    base = run(features, blocks.block_ids)
    assert base.shape == (1, 2 * block, 32)
    assert drafter.logits(base).shape == (1, 2 * block, 120)
    assert all(p.requires_grad for p in drafter.parameters())
    assert not any(p is drafter.shared.embed.weight for p in drafter.parameters())  # shared, not owned

    # Context at or after block 0's anchor (3) must not reach block 0; before it must.
    late = features.clone()
    late[:, 3:] += 1.0
    out = run(late, blocks.block_ids)
    assert torch.allclose(out[:, :block], base[:, :block], atol=1e-6)
    assert not torch.allclose(out[:, block:], base[:, block:], atol=1e-4)  # block 1 (anchor 7) sees 3..6
    early = features.clone()
    early[:, 2] += 1.0
    assert not torch.allclose(run(early, blocks.block_ids)[:, :block], base[:, :block], atol=1e-4)

    # Blocks never see each other; inside a block attention is bidirectional (k=0 sees k=3).
    other = blocks.block_ids.clone()
    other[0, block] = 5  # block 1's anchor token
    out = run(features, other)
    assert torch.allclose(out[:, :block], base[:, :block], atol=1e-6)
    inside = blocks.block_ids.clone()
    inside[0, block - 1] = 6  # last token of block 0
    assert not torch.allclose(run(features, inside)[:, 0], base[:, 0], atol=1e-4)
