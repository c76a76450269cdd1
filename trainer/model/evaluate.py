"""Acceptance length tau: speculative decoding with the drafter, verified greedily by the target.

Per verify step the drafter fills a block [last token, MASK x (B-1)] from the target context of
everything before it; the target runs over the block and accepts the longest prefix of drafts that
equals its own greedy choice, plus its own next token. tau = mean tokens gained per verify step
(1.0: the drafter never helps).

All prompts advance together: sequences are right-padded (the target is causal, so padding after a
row's end changes nothing in it) and each block's attention mask shows it only its own row's
context, through the same block_attention_mask as training.

The context grows by up to a block every verify step and prompts finish at different steps, so the
drafter's input shapes change at nearly every call. Compiled code with static shapes would
recompile for each new shape (until Dynamo's recompile limit, then silently run eagerly), so by
default the drafter runs eagerly here, under torch.compiler.set_stance("force_eager"), whatever
was compiled for training. `pad_buckets=True` is the other way, kept for bench/eval_compile.py: the
context padded to a few lengths (powers of two) and the batch to the prompt count, so compiled code
sees a handful of shapes. Measured on CPU (docs/PERFORMANCE.md), eager is faster there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from .objective import block_attention_mask
from .target import attention_of, target_features_and_next


def _padded(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Right-padded with token 0: any valid id will do, as nothing attends to positions after it."""
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)


def bucket(length: int, smallest: int = 64) -> int:
    """The next power of two from `smallest` up: a handful of context shapes for any length."""
    size = smallest
    while size < length:
        size *= 2
    return size


@torch.no_grad()
def draft_blocks(
    drafter, features: list[torch.Tensor], anchors: list[int], block_size: int, mask_id: int,
    device: torch.device, pad_buckets: bool,
) -> list[list[int]]:  # fmt: skip
    """The drafter's greedy guesses for the block after each row's anchor, given each row's context
    features (block_size - 1 tokens a row)."""
    ctx_lens = torch.tensor([len(f) for f in features])
    context = pad_sequence(features, batch_first=True)
    if pad_buckets:
        context = F.pad(context, (0, 0, 0, bucket(context.shape[1]) - context.shape[1]))
    block = torch.full((len(features), block_size), mask_id, device=device)
    block[:, 0] = torch.tensor(anchors, device=device)
    positions = (ctx_lens[:, None] + torch.arange(block_size)).to(device)
    allowed = block_attention_mask(ctx_lens[:, None], context.shape[1], block_size).to(device)
    hidden = drafter.hidden(context.to(drafter.fc.weight.dtype), block, positions, allowed)
    return drafter.logits(hidden)[:, 1:].argmax(dim=-1).tolist()


def kept_tokens(gained: list[int], eos_id: int, room: int) -> list[int]:
    """The tokens of a verify step the generation keeps: none past the end-of-turn token or past
    the token budget (a serving engine, and the reference dflash_generate, count the same way)."""
    if eos_id in gained:
        gained = gained[: gained.index(eos_id) + 1]
    return gained[:room]


def speculative_generate(
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
    pad_buckets: bool = False,
) -> tuple[list[list[int]], list[list[int]]] | None:
    """Greedy generation with drafts for every prompt at once.

    Returns (generated tokens per prompt, tokens gained per verify step per prompt), or None if
    stopped part-way. pad_buckets: see the module docstring.
    """
    sequences = [list(p) for p in prompts]
    features, next_tokens = target_features_and_next(target, _padded(sequences, device), layer_ids)
    row_features = [features[i, : len(s)] for i, s in enumerate(sequences)]
    anchors = [int(next_tokens[i, len(s) - 1]) for i, s in enumerate(sequences)]
    generated = [[a] for a in anchors]
    accepted_per_step: list[list[int]] = [[] for _ in prompts]
    active = [i for i in range(len(prompts)) if anchors[i] != eos_id and max_new_tokens > 1]
    while active:
        if should_stop():
            return None
        # With pad_buckets, finished prompts' places are taken by copies of an active row (their
        # drafts are dropped) and the context is padded to its bucket: the mask hides the padding.
        rows = active + [active[0]] * (len(prompts) - len(active)) if pad_buckets else active
        drafts = draft_blocks(
            drafter, [row_features[i] for i in rows], [anchors[i] for i in rows], block_size, mask_id, device,
            pad_buckets,
        )[: len(active)]  # fmt: skip

        candidates = [sequences[i] + [anchors[i]] + d for i, d in zip(active, drafts, strict=True)]
        cand_features, cand_next = target_features_and_next(target, _padded(candidates, device), layer_ids)
        still_active = []
        for row, i in enumerate(active):
            start = len(sequences[i])
            verified = cand_next[row, start : start + block_size].tolist()  # after anchor, after each draft
            accepted = 0
            while accepted < block_size - 1 and drafts[row][accepted] == verified[accepted]:
                accepted += 1
            gained = kept_tokens(
                [*drafts[row][:accepted], verified[accepted]], eos_id, max_new_tokens - len(generated[i])
            )
            accepted_per_step[i].append(len(gained))
            keep = start + 1 + accepted  # context now covers the anchor and the accepted drafts
            sequences[i] = candidates[row][:keep]
            row_features[i] = cand_features[row, :keep]
            anchors[i] = gained[-1]
            generated[i] += gained
            if eos_id not in gained and len(generated[i]) < max_new_tokens:
                still_active.append(i)
        active = still_active
    return generated, accepted_per_step


def eager_attention(target) -> str | None:
    """The attention the target verifies with, uncompiled. Flex attention (the target's for packed
    rows in training) runs uncompiled here: force_eager reaches transformers' compiled flex call too,
    and its unfused fallback materialises every row's whole score matrix (rows x heads x length^2).
    SDPA's causal kernels read right-padded rows of one conversation each as they are. None keeps
    the target's own (sdpa, or the causal kernel, already fine uncompiled)."""
    return "sdpa" if target.config._attn_implementation == "flex_attention" else None


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
    pad_buckets: bool = False,
) -> float | None:
    """tau over the prompts, or None when stopped part-way.

    Compiled drafter code runs eagerly here unless pad_buckets (see the module docstring)."""
    was_training = drafter.training
    drafter.eval()
    stance = contextlib.nullcontext() if pad_buckets else torch.compiler.set_stance("force_eager")
    try:
        with stance, attention_of(target, eager_attention(target)):
            result = speculative_generate(
                drafter,
                target,
                prompts,
                layer_ids,
                block_size,
                mask_id,
                max_new_tokens,
                eos_id,
                device,
                should_stop,
                pad_buckets,
            )
    finally:
        drafter.train(was_training)
    if result is None:
        return None
    per_step = [n for steps in result[1] for n in steps]
    return sum(per_step) / max(len(per_step), 1)
