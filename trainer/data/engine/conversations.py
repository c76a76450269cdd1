"""A shard's conversations through the paged engine: every conversation's first assistant turn is
queued at once, and each later turn as soon as the answer before it is done (its prompt holds that
answer), so a slot never waits for other conversations' turns. What a turn's prompt is, which turns
are generated (those a training row can see) and the context check are the regeneration's own
(trainer/data/regen.py): a shard's rows are the static engine's, byte for byte in float32."""

from __future__ import annotations

import weakref

from ...model.target import attention_of
from ..chat import DataError, prompt_ids
from .engine import PagedEngine, PagedSettings
from .kv_pages import pages_for

_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_for(target, settings: PagedSettings) -> PagedEngine:
    """The target's engine at these settings, kept from shard to shard (its pages, compiled step and
    CUDA graph); at new settings the old one's memory is given back before the new one's is taken."""
    kept = _ENGINES.get(target)
    if kept is not None and kept.settings == settings:
        return kept
    _ENGINES.pop(target, None)
    del kept
    engine = _ENGINES[target] = PagedEngine(target, settings)
    return engine


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


def paged_shard(regeneration, conversations, examples, target, progress, should_stop, compiled: bool) -> bool:
    """Fills every generated assistant turn of `examples` in place. False if a stop came."""
    from .. import regen

    settings, chat = regeneration.settings, regeneration.chat
    header = len(chat.header("assistant"))

    def next_turn(i: int, after: int) -> list:
        turns = examples[i].turns
        turn = next((t for t in range(after + 1, len(turns)) if turns[t][0] == "assistant"), None)
        if turn is None:
            return []
        with regeneration.tokenizer_lock:
            prompt = prompt_ids(examples[i], chat, turn)
        limit = settings.max_prompt_tokens
        kept, _ = regen.turns_seen_in_training(examples, [i], [prompt], turn, header, limit)
        if not kept:
            return []
        regeneration.check_context([conversations[i][0]], [prompt])
        return [((i, turn), prompt)]

    def answered(key, answer: list[int]) -> list:
        i, turn = key
        examples[i].turns[turn] = ("assistant", answer)
        progress.add(0, len(answer))
        return next_turn(i, turn)

    longest = longest_sequence(examples, chat, settings.max_new_tokens, settings.max_prompt_tokens)
    try:
        pool_pages = settings.batch_tokens // settings.page_size
        max_tokens = slot_tokens(longest, settings.page_size, pool_pages)
        engine_settings = paged_settings(settings, max_tokens, compiled)
    except ValueError as exc:
        raise DataError(f"{exc} (the shards finished so far are kept)") from None
    engine = engine_for(target, engine_settings)
    requests = [request for i in range(len(examples)) for request in next_turn(i, -1)]
    with attention_of(target, gathered_attention(target, settings)):
        answers = engine.generate(requests, settings.max_new_tokens, chat.end_id, answered, should_stop)
    return answers is not None


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


def paged_settings(settings, max_tokens: int, compiled: bool) -> PagedSettings:
    """The engine's settings from the regeneration's: the pool is data.regen_batch_tokens tokens."""
    return PagedSettings(
        slots=settings.slots, page_size=settings.page_size, pages=settings.batch_tokens // settings.page_size,
        max_tokens=max_tokens, chunk=settings.prefill_chunk, compile=compiled,
        attention=engine_attention(settings, compiled),
        gather_if_flex_fails=settings.attention == "auto",
    )  # fmt: skip
