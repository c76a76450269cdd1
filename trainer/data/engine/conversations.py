"""Shards of conversations through the paged engine, as one stream: every conversation's first
assistant turn is queued with its shard, each later turn as soon as the answer before it is done
(its prompt holds that answer), and the next shard as soon as no turn waits, so a slot never waits
for other conversations' turns nor for a shard's end. What a turn's prompt is, which turns
are generated (those a training row can see) and the context check are the regeneration's own
(trainer/data/regen.py): a shard's rows are the static engine's, byte for byte in float32."""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...model.target import attention_of
from ..chat import DataError, prompt_ids, tokenize_stream
from .engine import PagedEngine, PagedSettings
from .kv_pages import pages_for

_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_for(target, settings: PagedSettings) -> PagedEngine:
    """The target's engine at these settings, kept from stream to stream (its pages, compiled step and
    CUDA graph); at new settings the old one's memory is given back before the new one's is taken."""
    kept = _ENGINES.get(target)
    if kept is not None and kept.settings == settings:
        return kept
    _ENGINES.pop(target, None)
    del kept
    engine = _ENGINES[target] = PagedEngine(target, settings)
    return engine


def release_engines() -> None:
    """Drop every kept engine (its KV pool, compiled step's buffers and CUDA graph): a run that
    regenerates and then trains on the same target must give the pool back first, as the kept
    engine lives as long as its target (at the Qwen3-8B shape the default pool is 36 GiB)."""
    _ENGINES.clear()


def longest_sequence(examples, chat, max_new_tokens: int, max_prompt_tokens: int | None) -> int:
    """The most tokens any generated turn of these conversations can hold (prompt + answer, less the
    last answer token, which is never cached), were every earlier answer max_new_tokens long."""
    header, closing = len(chat.header("assistant")), len(chat.end) + len(chat.newline)
    longest = 1
    for example in examples:
        before = 0
        for role, content in example.turns:
            if role == "assistant":
                prompt = before + header
                if max_prompt_tokens is not None:
                    prompt = min(prompt, max_prompt_tokens - 1 + header)  # a later turn is not generated
                longest = max(longest, prompt + max_new_tokens - 1)
            body = max_new_tokens if role == "assistant" else len(content)
            before += len(chat.header(role)) + body + closing
    return longest


def slot_tokens(longest: int, page_size: int, pool_pages: int) -> int:
    """A slot's tokens: whole pages, a power of two of them, so a data set's shards share a few
    decode-step shapes (each compiles once); at most the pool's pages (less scratch) where those
    hold the longest sequence."""
    needed, pages = pages_for(longest, page_size), 1
    while pages < needed:
        pages *= 2
    return max(needed, min(pages, pool_pages - 1)) * page_size


@dataclass
class ShardInFlight:
    """A shard being regenerated: its conversations, their examples (filled in place as answers
    arrive) and how many conversations still have a turn queued or decoding."""

    start: int
    end: int
    conversations: list
    examples: list
    longest: int
    open: int = 0


def paged_shards(regeneration, ranges: Iterable[tuple[int, int]], target, progress, should_stop,
                 compiled: bool, finished: Callable[[int, int, list[dict]], None]) -> bool:  # fmt: skip
    """Every generated assistant turn of these shards (start, end) through one paged engine, as one
    stream: the next shard's first turns are queued as soon as none waits, so the slots stay busy
    across a shard's end (its longest answers) instead of idling until it is written. A shard is
    handed to `finished(start, end, rows)` as soon as its last answer is in. A shard whose longest
    conversation needs longer slots than the running engine's waits for it to drain, then gets an
    engine of its own. False if a stop came (the shards finished so far are kept)."""
    from .. import regen

    settings, chat = regeneration.settings, regeneration.chat
    header = len(chat.header("assistant"))
    pool_pages = fitting_pool_pages(target, settings)
    in_flight: dict[int, ShardInFlight] = {}
    ranges = iter(ranges)

    def load(start: int, end: int) -> ShardInFlight:
        conversations = regeneration.index.read(start, end)
        with regeneration.tokenizer_lock:
            examples = list(tokenize_stream((messages for _, messages in conversations), chat))
        longest = longest_sequence(examples, chat, settings.max_new_tokens, settings.max_prompt_tokens)
        return ShardInFlight(start, end, conversations, examples, longest)

    def next_turn(shard: ShardInFlight, i: int, after: int) -> list:
        turns = shard.examples[i].turns
        turn = next((t for t in range(after + 1, len(turns)) if turns[t][0] == "assistant"), None)
        if turn is None:
            return []
        with regeneration.tokenizer_lock:
            prompt = prompt_ids(shard.examples[i], chat, turn)
        kept, _ = regen.turns_seen_in_training(shard.examples, [i], [prompt], turn, header,
                                               settings.max_prompt_tokens)  # fmt: skip
        if not kept:
            return []
        regeneration.check_context([shard.conversations[i][0]], [prompt])
        return [((shard.start, i, turn), prompt)]

    def conversation_done(shard: ShardInFlight) -> None:
        shard.open -= 1
        if shard.open == 0:
            del in_flight[shard.start]
            pairs = zip(shard.conversations, shard.examples, strict=True)
            finished(shard.start, shard.end, [{"line": line, "turns": e.turns} for (line, _), e in pairs])

    def begin(shard: ShardInFlight) -> list:
        in_flight[shard.start] = shard
        shard.open = len(shard.examples) + 1  # held open until every first turn is queued
        requests = []
        for i in range(len(shard.examples)):
            first = next_turn(shard, i, -1)
            requests += first
            if not first:
                conversation_done(shard)
        conversation_done(shard)
        return requests

    def answered(key, answer: list[int]) -> list:
        start, i, turn = key
        shard = in_flight[start]
        shard.examples[i].turns[turn] = ("assistant", answer)
        progress.add(0, len(answer), 1, int(len(answer) >= settings.max_new_tokens))
        following = next_turn(shard, i, turn)
        if not following:
            conversation_done(shard)
        return following

    following = next(ranges, None)
    pending = load(*following) if following is not None else None
    while pending is not None:
        try:
            max_tokens = slot_tokens(pending.longest, settings.page_size, pool_pages)
            engine_settings = paged_settings(settings, max_tokens, compiled, pool_pages)
        except ValueError as exc:
            limited = ""
            if pool_pages < settings.batch_tokens // settings.page_size:
                limited = (
                    "; the pool is what the GPU's free memory holds (its line above): free the GPU of "
                    "other processes or regenerate on a card with more memory"
                )
            raise DataError(f"{exc}{limited} (the shards finished so far are kept)") from None
        engine = engine_for(target, engine_settings)
        first, pending = begin(pending), None

        def more(longest_fitting=engine_settings.max_tokens) -> list:
            """The next shard's first turns, loaded when no turn waits; nothing once a shard needs
            longer slots (it waits for this engine to drain) or none is left."""
            nonlocal pending
            while (following := next(ranges, None)) is not None:
                shard = load(*following)
                if shard.longest > longest_fitting:
                    pending = shard
                    return []
                requests = begin(shard)
                if requests:
                    return requests
            return []

        with attention_of(target, gathered_attention(target, settings)):
            answers = engine.generate(first, settings.max_new_tokens, chat.end_id, answered, should_stop,
                                      more=more)  # fmt: skip
        if answers is None:
            return False
        progress.add(0, 0, decode_steps=engine.decode_steps, slot_steps=engine.slot_steps)
    return True


def engine_attention(settings, compiled: bool) -> str:
    """How the decode step reads the pages (data.regen_attention): 'flex_attention' is flex
    attention over the pool in place; 'sdpa' and 'eager' the gathered pages (with the one named).
    'auto' is flex where the step is compiled (a GPU), and falls back to the gathered pages if it
    fails to compile there; the gathered pages elsewhere (uncompiled, flex attention computes the
    scores of every key of the pool). Flex reads the pages in use; gathering copies every slot's
    whole table each step (at 8B, 256 slots of 4,096 tokens: some 4 GiB a layer a step)."""
    if settings.attention == "flex_attention" or (settings.attention == "auto" and compiled):
        return "flex"
    return "gather"


def gathered_attention(target, settings) -> str | None:
    """The target's attention over gathered pages (prefills, and gathered decode steps): the one set
    (sdpa or eager), else sdpa where the target's own is neither (the masks here are theirs)."""
    if settings.attention in ("sdpa", "eager"):
        return settings.attention
    return None if target.config._attn_implementation in ("sdpa", "eager") else "sdpa"


def fitting_pool_pages(target, settings, notice=None) -> int:
    """The pool's pages: data.regen_batch_tokens tokens of them, or on a GPU as many as its free
    memory holds beside the engine's own working memory, if fewer (pool_pages). The pool the
    target's kept engine holds counts as free: it is given back before a new one is taken
    (engine_for)."""
    from ..regen import usable_bytes

    parameter = next(target.parameters())
    free = None
    if parameter.device.type == "cuda":
        kept = _ENGINES.get(target)
        free = usable_bytes(parameter.device) + (kept.kv.bytes if kept is not None else 0)
    return pool_pages(target.config, parameter.dtype, settings, free, parameter.device, notice)


def pool_pages(config, dtype, settings, free: int | None, device="the device", notice=None) -> int:
    """data.regen_batch_tokens tokens of pages, or fewer where `free` bytes (None: not counted, a
    CPU) do not hold them beside the engine's working memory: a share and a reserve held back as
    for the static engine's batches, a prefill chunk's peak and the decode step's logits. Fewer is
    said once, with the figures: a card that other processes share, or a target too large to leave
    room for the default pool."""
    from ..regen import (
        GIB,
        MEMORY_MARGIN,
        MEMORY_RESERVE,
        kv_cache_bytes,
        logits_row_bytes,
        prefill_token_bytes,
    )

    wanted = settings.batch_tokens // settings.page_size
    if free is None:
        return wanted
    working = (
        int(free * MEMORY_MARGIN) + MEMORY_RESERVE  # the compiled step, its CUDA graph, workspaces
        + settings.prefill_chunk * prefill_token_bytes(config, dtype)  # a prefill chunk's peak
        + settings.slots * logits_row_bytes(config)  # the decode step's logits
    )
    page = kv_cache_bytes(config, 1, settings.page_size, dtype)
    fitting = max(0, free - working) // page
    if fitting >= wanted:
        return wanted
    (notice or _say)(
        f"paged engine: a pool of {fitting * settings.page_size:,} tokens ({fitting * page / GIB:.1f} GiB), "
        f"not data.regen_batch_tokens {settings.batch_tokens:,} ({wanted * page / GIB:.1f} GiB): "
        f"{device} has {free / GIB:.1f} GiB free with the target loaded, less "
        f"{working / GIB:.1f} GiB for the engine's own work; fewer sequences fit at once"
    )
    return fitting


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def paged_settings(settings, max_tokens: int, compiled: bool, pages: int | None = None) -> PagedSettings:
    """The engine's settings from the regeneration's: the pool is `pages` pages, by default
    data.regen_batch_tokens tokens of them."""
    pages = pages if pages is not None else settings.batch_tokens // settings.page_size
    return PagedSettings(
        slots=settings.slots, page_size=settings.page_size, pages=pages,
        max_tokens=max_tokens, chunk=settings.prefill_chunk, compile=compiled, compile_prefill=compiled,
        attention=engine_attention(settings, compiled),
        gather_if_flex_fails=settings.attention == "auto",
        compile_scope="layers" if settings.compile_scope == "auto" else settings.compile_scope,
        tail_slots=tuple(sorted({width for width in settings.tail_slots if width < settings.slots})),
    )  # fmt: skip
