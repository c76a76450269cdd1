"""Greedy decoding of one left-padded batch over a static KV cache, in a loop of our own.

transformers' `generate` spends host time on every token: it rebuilds the attention mask, grows
the inputs, runs its logits processors and stopping criteria and reads two device flags (whether
every row has ended), so the GPU waits for the host a quarter to half of each decode step
(docs/PERFORMANCE.md: 22.4 ms a token at 256 rows x 128 with 16.2 ms of kernels). Here a decode
step is the target's forward and the argmax, compiled as one CUDA graph per (rows, cache length);
the mask covers the whole cache from the start (the cache's own position makes it causal), so
nothing between steps depends on the step; and whether every row has ended is read once every
STOP_CHECK_EVERY tokens. The host queues steps ahead of the GPU.

Answers equal `generate`'s greedy ones: the same forward, the same argmax (of the same logits),
and a row that has ended keeps decoding tokens that cut_answer drops at its end token.
"""

from __future__ import annotations

import inspect

import torch

# A batch ends this many steps at most after its last row has: each check waits for the GPU.
STOP_CHECK_EVERY = 16


def greedy_step(target, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: dict):
    """One decode step: the next token of every row. Compiled whole (CUDA graphs) on a GPU."""
    logits = target(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                    logits_to_keep=1, **cache).logits  # fmt: skip
    return logits[:, -1].argmax(-1)


class StaticDecoder:
    """Decodes batch after batch with one target. Keeps the compiled step (compiled once per
    process and shape) and the static cache of the last shape (reused, so the step's CUDA graph
    is not recorded again for each batch of that shape)."""

    def __init__(self, target, compiled: bool):
        self.target = target
        self.cache_name = cache_keyword(target)
        self.cache = None
        self.cache_shape: tuple[int, int] | None = None
        self.compiled = compiled
        self.step = compiled_step() if compiled else greedy_step

    def static_cache(self, rows: int, length: int):
        from transformers import StaticCache

        if self.cache_shape == (rows, length):
            self.cache.reset()
        else:
            self.cache = None  # the last shape's memory is given back before the new one is taken
            self.cache = StaticCache(config=self.target.config, max_cache_len=length)
            self.cache_shape = (rows, length)
        return self.cache

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, end_id: int) -> torch.Tensor:
        """ids, mask: [rows, width], left-padded (mask 0 on padding). Returns [rows, new_tokens] (or
        fewer columns once every row has produced end_id); tokens after a row's end_id are noise."""
        rows, width = ids.shape
        cache = {self.cache_name: self.static_cache(rows, width + new_tokens)}
        # The mask of the whole cache: padding off, the rest on; causality comes from the cache's
        # position, so the same tensor serves the prefill and every step (one shape, no rebuild).
        full_mask = torch.cat([mask, mask.new_ones(rows, new_tokens)], dim=1)
        prompt_positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as `generate` numbers them
        logits = self.target(input_ids=ids, position_ids=prompt_positions, attention_mask=full_mask,
                             use_cache=True, logits_to_keep=1, **cache).logits  # fmt: skip
        out = torch.empty(rows, new_tokens, dtype=torch.long, device=ids.device)
        out[:, 0] = logits[:, -1].argmax(-1)
        del logits
        positions = mask.sum(-1, keepdim=True)
        for i in range(1, new_tokens):
            if i % STOP_CHECK_EVERY == 0 and bool((out[:, :i] == end_id).any(-1).all()):
                return out[:, :i]
            if self.compiled:
                torch.compiler.cudagraph_mark_step_begin()
            out[:, i] = self.step(self.target, out[:, i - 1 : i], positions, full_mask, cache)
            positions = positions + 1
        return out


_COMPILED_STEP = None


def compiled_step():
    """greedy_step compiled once a process: a new torch.compile wrapper would trace again."""
    global _COMPILED_STEP
    if _COMPILED_STEP is None:
        _COMPILED_STEP = torch.compile(greedy_step, mode="reduce-overhead", dynamic=False, fullgraph=False)
    return _COMPILED_STEP


def cache_keyword(target) -> str:
    """The forward's name for the KV cache: `past_key_values` (transformers up to 5.17 at least) or
    `cache` (5.24)."""
    parameters = inspect.signature(target.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
