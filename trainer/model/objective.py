"""The DFlash training objective: anchors, blocks, the block attention mask and the loss weights.

A block is [anchor token, MASK x (B-1)] placed at positions anchor+k. It sees the target context
strictly before its anchor, itself bidirectionally, and never another block. Block position k
predicts token anchor+k (k=0, the anchor itself, is given and excluded from the loss); its loss
weight is exp(-(k-1)/gamma). In a packed row (several conversations, position ids restarting
with each) a block's context, positions and labels stay inside its anchor's conversation. The
anchor count is padded to a fixed number so every step has the
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


def anchor_candidates(loss_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Positions that may anchor a block: supervised tokens followed by at least one supervised token
    of the same conversation (in a packed row the position ids restart with each conversation).

    The anchor plays the token the target has just produced; the block then drafts what follows.
    """
    candidates = torch.zeros_like(loss_mask, dtype=torch.bool)
    candidates[:, :-1] = loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool()
    if position_ids is not None:
        candidates[:, :-1] &= position_ids[:, 1:] == position_ids[:, :-1] + 1
    return candidates


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to num_anchors anchors per row (drawn over the whole row, whatever conversation they fall
    in), sorted, padded with position 0 marked invalid."""
    candidates = anchor_candidates(loss_mask, position_ids)
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
    block_positions: torch.Tensor  # [b, A*B] the anchor's position in its conversation + k
    labels: torch.Tensor  # [b, A*B] token at anchor + k, or IGNORE
    weights: torch.Tensor  # [b, A*B] loss weight (0 where ignored)
    anchors: torch.Tensor  # [b, A] anchor positions in the row (the attention mask is built from them)
    anchor_starts: torch.Tensor  # [b, A] where the anchor's conversation starts in the row
    context_positions: torch.Tensor  # [b, L] each context token's position in its conversation
    context_len: int

    @property
    def attention_mask(self) -> torch.Tensor:
        """The dense mask, [b, A*B, L + A*B], on the anchors' device."""
        block_size = self.block_ids.shape[1] // self.anchors.shape[1]
        return block_attention_mask(self.anchors, self.context_len, block_size, self.anchor_starts)

    def to(self, device: torch.device | str) -> Blocks:
        tensors = (
            "block_ids", "block_positions", "labels", "weights",
            "anchors", "anchor_starts", "context_positions",
        )  # fmt: skip
        moved = {name: getattr(self, name).to(device, non_blocking=True) for name in tensors}
        return Blocks(**moved, context_len=self.context_len)


def build_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    position_ids: torch.Tensor | None = None,
) -> Blocks:
    """position_ids: each token's position in its conversation ([b, L]; None: one conversation per
    row, 0..L-1). A block's labels, positions and context stay inside its anchor's conversation."""
    batch, seq_len = input_ids.shape
    num_anchors = anchors.shape[1]
    if position_ids is None:
        position_ids = torch.arange(seq_len).expand(batch, seq_len)
    offsets = torch.arange(block_size)
    positions = anchors[:, :, None] + offsets  # [b, A, B] in the row
    in_range = positions < seq_len
    gathered = positions.clamp(max=seq_len - 1)
    targets = torch.gather(input_ids, 1, gathered.flatten(1)).view(batch, num_anchors, block_size)
    supervised = torch.gather(loss_mask.bool(), 1, gathered.flatten(1)).view(batch, num_anchors, block_size)
    anchor_position = torch.gather(position_ids, 1, anchors)  # [b, A] in the conversation
    conversation_positions = anchor_position[:, :, None] + offsets
    # The same conversation: its positions run on from the anchor's without a restart.
    same_conversation = torch.gather(position_ids, 1, gathered.flatten(1)).view_as(positions) == (
        conversation_positions
    )
    keep = in_range & supervised & same_conversation & anchor_valid[:, :, None]
    keep[:, :, 0] = False
    labels = torch.where(keep, targets, torch.full_like(targets, IGNORE))
    weights = loss_weights(block_size, gamma).expand(batch, num_anchors, block_size) * keep

    block_ids = torch.full((batch, num_anchors, block_size), mask_token_id, dtype=input_ids.dtype)
    block_ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return Blocks(
        block_ids=block_ids.flatten(1),
        block_positions=conversation_positions.flatten(1),
        labels=labels.flatten(1),
        weights=weights.flatten(1),
        anchors=anchors,
        anchor_starts=anchors - anchor_position,
        context_positions=position_ids,
        context_len=seq_len,
    )


def block_attention_mask(
    anchors: torch.Tensor, context_len: int, block_size: int, anchor_starts: torch.Tensor | None = None
) -> torch.Tensor:
    """[b, A*B, context_len + A*B]: a block sees the context of its conversation before its anchor
    (from anchor_starts, 0 when None) and all of itself.

    Built on the anchors' device, so a GPU step never copies this (large) mask from the host.
    """
    batch, num_anchors = anchors.shape
    device = anchors.device
    query_anchor = anchors.repeat_interleave(block_size, dim=1)  # [b, Q]
    kv = torch.arange(context_len, device=device)[None, None, :]
    sees_context = kv < query_anchor[:, :, None]
    if anchor_starts is not None:
        sees_context &= kv >= anchor_starts.repeat_interleave(block_size, dim=1)[:, :, None]
    block_of = torch.arange(num_anchors, device=device).repeat_interleave(block_size)  # [Q]
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    return torch.cat([sees_context, sees_block], dim=2)


class FlexBlockMask:
    """The pattern of block_attention_mask as a flex_attention BlockMask, for one run's shapes.

    flex_attention skips every 128x128 tile the mask rules out; with sorted anchors a query tile
    reaches only the context before its last anchor and the diagonal of the block part, so about
    half the context and 1/64 of the block keys are computed, where dense SDPA computes all of them.

    The mask function is a method of this long-lived object and reads the anchors from it: compiled
    layers receive the BlockMask, and a new closure every step would be a new function to Dynamo,
    which would then compile the layers again at every step.
    """

    def __init__(self, context_len: int, block_size: int):
        self.context_len = context_len
        self.block_size = block_size
        self.anchors: torch.Tensor | None = None
        self.anchor_starts: torch.Tensor | None = None
        holder = self

        def allowed(b, _h, q, kv):  # made once, so the same function object every step
            block = q // block_size
            in_context = kv < context_len
            own_conversation = (kv < holder.anchors[b, block]) & (kv >= holder.anchor_starts[b, block])
            sees_context = in_context & own_conversation
            sees_own_block = ~in_context & ((kv - context_len) // block_size == block)
            return sees_context | sees_own_block

        self.mask_mod = allowed

    def __call__(self, anchors: torch.Tensor, anchor_starts: torch.Tensor | None = None):
        from torch.nn.attention.flex_attention import create_block_mask

        self.anchors = anchors
        self.anchor_starts = torch.zeros_like(anchors) if anchor_starts is None else anchor_starts
        batch, num_anchors = anchors.shape
        queries = num_anchors * self.block_size
        return create_block_mask(
            self.mask_mod,
            B=batch,
            H=None,
            Q_LEN=queries,
            KV_LEN=self.context_len + queries,
            device=anchors.device,
        )


def flex_block_mask(
    anchors: torch.Tensor, context_len: int, block_size: int, anchor_starts: torch.Tensor | None = None
):
    """A BlockMask for these anchors (see FlexBlockMask)."""
    return FlexBlockMask(context_len, block_size)(anchors, anchor_starts)
