"""The DFlash training objective: anchors, blocks, the block attention mask and the loss weights.

A block is [anchor token, MASK x (B-1)] placed at positions anchor+k. It sees the target context
strictly before its anchor, itself bidirectionally, and never another block. Block position k
predicts token anchor+k (k=0, the anchor itself, is given and excluded from the loss); its loss
weight is exp(-(k-1)/gamma). The anchor count is padded to a fixed number so every step has the
same shapes (compile never recompiles); padded anchors carry no loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

IGNORE = -100


def loss_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Weight per block position: 0 for k=0 (the given anchor), exp(-(k-1)/gamma) for k>=1."""
    weights = torch.tensor([math.exp(-(k - 1) / gamma) for k in range(block_size)], dtype=torch.float32)
    weights[0] = 0.0
    return weights


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions that may anchor a block: supervised tokens followed by at least one supervised token.

    The anchor plays the token the target has just produced; the block then drafts what follows.
    """
    candidates = torch.zeros_like(loss_mask, dtype=torch.bool)
    candidates[:, :-1] = loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool()
    return candidates


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to num_anchors anchors per sequence, sorted, padded with position 0 marked invalid."""
    candidates = anchor_candidates(loss_mask)
    batch = loss_mask.shape[0]
    anchors = torch.zeros(batch, num_anchors, dtype=torch.long)
    valid = torch.zeros(batch, num_anchors, dtype=torch.bool)
    for row in range(batch):
        positions = candidates[row].nonzero().flatten()
        if positions.numel() > num_anchors:
            pick = torch.randperm(positions.numel(), generator=generator)[:num_anchors]
            positions = positions[pick].sort().values
        anchors[row, : positions.numel()] = positions
        valid[row, : positions.numel()] = True
    return anchors, valid


@dataclass
class Blocks:
    """Drafter inputs and targets for one batch; every tensor has a fixed shape."""

    block_ids: torch.Tensor  # [b, A*B] anchor token then mask tokens
    block_positions: torch.Tensor  # [b, A*B] anchor + k
    labels: torch.Tensor  # [b, A*B] token at anchor + k, or IGNORE
    weights: torch.Tensor  # [b, A*B] loss weight (0 where ignored)
    attention_mask: torch.Tensor  # [b, A*B, L + A*B] True where a query may attend

    def to(self, device: torch.device | str) -> Blocks:
        return Blocks(*(getattr(self, f).to(device, non_blocking=True) for f in self.__dataclass_fields__))


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float,
) -> Blocks:
    batch, seq_len = input_ids.shape
    num_anchors = anchors.shape[1]
    offsets = torch.arange(block_size)
    positions = anchors[:, :, None] + offsets  # [b, A, B]
    in_range = positions < seq_len
    gathered = positions.clamp(max=seq_len - 1)
    targets = torch.gather(input_ids, 1, gathered.flatten(1)).view(batch, num_anchors, block_size)
    supervised = torch.gather(loss_mask.bool(), 1, gathered.flatten(1)).view(batch, num_anchors, block_size)
    keep = in_range & supervised & anchor_valid[:, :, None]
    keep[:, :, 0] = False
    labels = torch.where(keep, targets, torch.full_like(targets, IGNORE))
    weights = loss_weights(block_size, gamma).expand(batch, num_anchors, block_size) * keep

    block_ids = torch.full((batch, num_anchors, block_size), mask_token_id, dtype=input_ids.dtype)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return Blocks(
        block_ids=block_ids.flatten(1),
        block_positions=positions.flatten(1),
        labels=labels.flatten(1),
        weights=weights.flatten(1),
        attention_mask=block_attention_mask(anchors, seq_len, block_size),
    )


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """[b, A*B, context_len + A*B]: a block sees context before its anchor and all of itself."""
    batch, num_anchors = anchors.shape
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, Q]
    sees_context = torch.arange(context_len)[None, None, :] < query_anchor[:, :, None]
    block_of = torch.arange(num_anchors).repeat_interleave(block_size)  # [Q]
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    return torch.cat([sees_context, sees_block], dim=2)
