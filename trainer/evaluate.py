"""Acceptance length tau: speculative decoding with the drafter, verified greedily by the target.

Per verify step the drafter fills a block [last token, MASK x (B-1)] from the target context of
everything before it; the target runs over the block and accepts the longest prefix of drafts that
equals its own greedy choice, plus its own next token. tau = mean tokens gained per verify step
(1.0: the drafter never helps). Shapes vary here, so the eager drafter is used, not the compiled one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .objective import block_attention_mask
from .target import target_features_and_next


@torch.no_grad()
def speculative_generate(
    drafter,
    target,
    prompt: list[int],
    layer_ids: list[int],
    block_size: int,
    mask_id: int,
    max_new_tokens: int,
    eos_id: int,
    device: torch.device,
) -> tuple[list[int], list[int]]:
    """Greedy generation with drafts; returns (generated tokens, accepted count per verify step)."""
    sequence = torch.tensor([prompt], device=device)
    features, next_tokens = target_features_and_next(target, sequence, layer_ids)
    anchor = int(next_tokens[0, -1])
    generated = [anchor]
    accepted_per_step: list[int] = []
    while len(generated) < max_new_tokens and anchor != eos_id:
        ctx_len = sequence.shape[1]
        block = torch.full((1, block_size), mask_id, device=device)
        block[0, 0] = anchor
        positions = torch.arange(ctx_len, ctx_len + block_size, device=device)[None]
        allowed = block_attention_mask(torch.tensor([[ctx_len]]), ctx_len, block_size).to(device)
        hidden = drafter.hidden(features.to(drafter.fc.weight.dtype), block, positions, allowed)
        drafts = drafter.logits(hidden)[0, 1:].argmax(dim=-1)

        candidate = torch.cat([sequence, block[:, :1], drafts[None]], dim=1)
        cand_features, cand_next = target_features_and_next(target, candidate, layer_ids)
        verified = cand_next[0, ctx_len:]  # target's choice after the anchor and after each draft
        matches = (drafts == verified[:-1]).int()
        accepted = int(matches.cumprod(0).sum())
        gained = [*drafts[:accepted].tolist(), int(verified[accepted])]
        accepted_per_step.append(accepted + 1)

        keep = ctx_len + 1 + accepted  # context now covers the anchor and the accepted drafts
        sequence = candidate[:, :keep]
        features = cand_features[:, :keep]
        anchor = gained[-1]
        generated += gained
        if eos_id in gained:
            break
    return generated, accepted_per_step


def acceptance_length(
    drafter,
    target,
    prompts: list[list[int]],
    layer_ids: list[int],
    block_size: int,
    mask_id: int,
    max_new_tokens: int,
    eos_id: int,
    device: torch.device,
    should_stop: Callable[[], bool] = lambda: False,
) -> float | None:
    """tau over the prompts, or None when stopped part-way."""
    was_training = drafter.training
    drafter.eval()
    total_accepted = total_steps = 0
    try:
        for prompt in prompts:
            if should_stop():
                return None
            _, per_step = speculative_generate(
                drafter, target, prompt, layer_ids, block_size, mask_id, max_new_tokens, eos_id, device
            )
            total_accepted += sum(per_step)
            total_steps += len(per_step)
    finally:
        drafter.train(was_training)
    return total_accepted / max(total_steps, 1)
