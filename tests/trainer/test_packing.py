"""A packed row trains like its conversations run alone: in float32 on CPU, through the real tiny
Qwen3 target (transformers' packed-sequence path) and the drafter, each conversation's loss in the
packed row equals its loss run by itself, to 1e-5."""

from __future__ import annotations

import pytest
import torch

from trainer.data.chat import ChatFormat, load_conversations, tokenize
from trainer.model.drafter import DFlashDrafter, DrafterObjective, DrafterShape, target_layer_ids
from trainer.model.objective import anchor_candidates, build_blocks
from trainer.model.target import FeatureReader, load_target, load_tokenizer, num_target_layers, shared_parts

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)
BLOCK = 4


@pytest.fixture(scope="module")
def parts(embedded):
    target_path, data_file = embedded
    tokenizer = load_tokenizer(target_path)
    chat = ChatFormat(tokenizer)
    target = load_target(target_path, "cpu", "float32")
    layers = target_layer_ids(num_target_layers(target.config), 3)
    torch.manual_seed(0)
    shape = DrafterShape.from_target(target.config, 2, len(layers))
    drafter = DFlashDrafter(shape, shared_parts(target)).eval()
    conversations = [chat.encode(e.turns) for e in tokenize(load_conversations(data_file)[:3], chat)]
    return target, layers, drafter, tokenizer.mask_token_id, conversations


def anchors_of(mask: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Every third anchor candidate (several per conversation, none at the end)."""
    return (
        anchor_candidates(mask[None], None if positions is None else positions[None])[0]
        .nonzero()
        .flatten()[::3]
    )


def losses(parts, ids, mask, positions, anchors, owner, conversations, attention="sdpa"):
    """Each conversation's weighted loss sum, from one forward over the row."""
    target, layers, drafter, mask_id, _ = parts
    ids, mask, anchors = ids[None], mask[None], anchors[None]
    pos = None if positions is None else positions[None]
    valid = torch.ones_like(anchors, dtype=torch.bool)
    blocks = build_blocks(ids, mask, anchors, valid, BLOCK, mask_id, 7.0, pos)
    with torch.no_grad():
        features = FeatureReader(target, layers)(ids, pos)  # the target cut after its last read layer
    objective = DrafterObjective(drafter, attention)
    out = []
    for conversation in range(conversations):
        mine = (owner == conversation).repeat_interleave(BLOCK)[None]
        args = (
            blocks.block_ids,
            blocks.block_positions,
            blocks.anchors,
            blocks.labels,
            blocks.weights * mine,
        )
        with torch.no_grad():
            out.append(float(objective(features, *args, blocks.anchor_starts, blocks.context_positions)))
    return out


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_each_conversation_of_a_packed_row_has_its_loss_run_alone(parts, attention):
    conversations = parts[4]
    alone, row_anchors, owner, offset = [], [], [], 0
    for number, (ids, mask) in enumerate(conversations):
        ids_t, mask_t = torch.tensor(ids), torch.tensor(mask)
        anchors = anchors_of(mask_t)
        alone += losses(parts, ids_t, mask_t, None, anchors, torch.zeros_like(anchors), 1, attention)
        row_anchors.append(anchors + offset)  # the same anchors, where the conversation sits in the row
        owner += [number] * len(anchors)
        offset += len(ids)

    padding = 5
    ids = torch.tensor([t for c, _ in conversations for t in c] + [0] * padding)
    mask = torch.tensor([m for _, c in conversations for m in c] + [0] * padding)
    positions = torch.cat([torch.arange(len(c)) for c, _ in conversations] + [torch.arange(padding)])
    anchors, owner = torch.cat(row_anchors), torch.tensor(owner)
    # They are anchor candidates of the row too: its candidates never cross a conversation's end.
    assert anchor_candidates(mask[None], positions[None])[0][anchors].all()
    packed = losses(parts, ids, mask, positions, anchors, owner, 3, attention)
    assert all(value > 0 for value in alone)
    assert packed == pytest.approx(alone, rel=1e-5, abs=1e-5)

    # Without the position ids the conversations see each other, and the losses differ: the test
    # above can fail.
    crossing = losses(parts, ids, mask, None, anchors, owner, 3, attention)
    assert crossing[1:] != pytest.approx(alone[1:], rel=1e-3)


def test_the_warm_up_lays_its_rows_out_as_the_run_s_rows():
    """Packed rows take transformers' packed mask (another flex kernel): a warm-up on rows of one
    conversation would leave that path to the first step of every start to compile."""
    from transformers.masking_utils import find_packed_sequence_indices

    from trainer.parallel.replica import warm_up_positions

    packed = warm_up_positions(3, 16, packed=True)
    assert packed.shape == (3, 16) and packed[0, 0] == 0 and (packed == 0).sum() == 6
    assert find_packed_sequence_indices(packed) is not None, "the packed path, as a real packed batch"
    assert find_packed_sequence_indices(warm_up_positions(3, 16, packed=False)) is None
