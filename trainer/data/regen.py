"""Regeneration: every assistant turn of a chat data set replaced by the target's greedy answer,
through transformers' own batched generation, shard by shard, resumable.

The data file is indexed once (conversations, their line numbers and byte offsets; nothing else is
kept in memory), then cut into shards of `shard_size` conversations. Shard i goes to worker
i % workers (a thread per device, or a rank under torchrun); each shard is generated turn by turn
(a later turn sees the regenerated earlier ones) and written atomically as
<cache>/regenerated/<key>/shard-<first>-<end>.jsonl, one {"line", "turns"} row per conversation.
Beside each shard, its seal (shard-<first>-<end>.sha256: SHA-256, size, rows) is written after it: a
shard with its seal is finished; one without, or of another size, is missing (generated again), and
one whose contents do not match is never read: it is moved aside (`<shard>.damaged`) and generated
again, in the same start where its contents are checked before the data is read (set_aside_damaged),
else at the next start (ShardDamaged). A stop or a crash loses at most the
shards being generated, and the next start generates only what is missing. The key covers the data
file's bytes (as indexed, in the same pass), the target's and tokenizer's files, the generation
settings and the dtype.

Engines (data.regen_engine): "static" decodes greedily over a static KV cache (trainer/data/decode.py,
compiled on CUDA) left-padded batches of similar length, widths rounded up to min_width x a power of
two so few shapes compile; "continuous" is transformers' continuous batching (`generate_batch`, paged
attention); "paged" is the product's own continuous batching over a paged KV cache
(trainer/data/engine/), which queues a conversation's next turn as soon as its previous answer is
done. All are greedy; in float32 all give plain `generate`'s answers token for token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import itertools
import json
import os
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import FLEX_MIN_LEN, REGEN_TAIL_SLOTS, DataConfig
from ..model.target import attention_of
from .chat import (
    MAX_LINE_BYTES,
    ChatFormat,
    DataError,
    DiskFull,
    Example,
    iter_lines,
    parse_line,
    prompt_ids,
    tokenize_stream,
)
from .decode import StaticDecoder

# In the cache key: shards made before the decoder built its own flex-attention masks (3) may hold
# wrong answers (compiled on a GPU, a batch in a reused cache), so they are never read as current.
REGEN_FORMAT = 3
ENGINES = ("static", "continuous", "paged")
HASH_CHUNK = 1 << 20
# Each (rows, width) shape compiles the decode step once: a few per bucketed width, a dozen widths
# at most, more than Dynamo's default limit of 8 (past it, it runs eagerly).
RECOMPILE_LIMIT = 64


@dataclass
class RegenSettings:
    """What decides the answers (the key covers these) and how they are produced. The defaults are
    the config's (data.regen_*); the product builds these from the config (settings_of)."""

    max_new_tokens: int = DataConfig.regen_max_new_tokens
    engine: str = DataConfig.regen_engine
    shard_size: int = DataConfig.regen_shard_size
    batch_size: int = DataConfig.regen_batch_size
    batch_tokens: int = DataConfig.regen_batch_tokens
    min_width: int = DataConfig.regen_min_width
    compile: bool = DataConfig.regen_compile
    compile_scope: str = DataConfig.regen_compile_scope
    compile_dynamic: bool = DataConfig.regen_compile_dynamic
    attention: str = DataConfig.regen_attention
    slots: int = DataConfig.regen_slots
    page_size: int = DataConfig.regen_page_size
    prefill_chunk: int = DataConfig.regen_prefill_chunk
    tail_slots: tuple[int, ...] = REGEN_TAIL_SLOTS
    dtype: str = "float32"
    # A turn is generated only while the conversation before it is shorter than this (the run's
    # train.seq_len): training cuts every conversation to it, so a later turn would never be seen.
    # None: every turn.
    max_prompt_tokens: int | None = None
    # The KV cache tokens a batch may hold on the device it decodes on, its free memory counting each
    # batch's prefill too (memory_tokens); None: not sized to a device (a CPU).
    memory_tokens: int | None = None

    @property
    def token_limit(self) -> int:
        """The KV cache tokens a batch may hold: batch_tokens, or less where the device has less."""
        return self.batch_tokens if self.memory_tokens is None else min(self.batch_tokens, self.memory_tokens)

    def key_fields(self) -> str:
        # batch_size, batch_tokens, memory_tokens, min_width, compile, compile_scope, compile_dynamic,
        # attention, slots, page_size and prefill_chunk change how, not what (exactly so in float32).
        fields = f"{REGEN_FORMAT}|{self.max_new_tokens}|{self.engine}|{self.shard_size}|{self.dtype}"
        return fields if self.max_prompt_tokens is None else f"{fields}|before {self.max_prompt_tokens}"


def file_digest(path: Path, digest=None):
    """sha256 of a file read in 1 MiB chunks: memory does not grow with the file."""
    digest = digest or hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest


def model_fingerprint(directory: Path, digest) -> None:
    """Small files (configs, tokenizer) by content, weights by name, size and mtime."""
    for item in sorted(directory.iterdir()):
        if not item.is_file():
            continue
        stat = item.stat()
        if stat.st_size < HASH_CHUNK:
            digest.update(item.name.encode() + b"|" + item.read_bytes())
        else:
            digest.update(f"{item.name}|{stat.st_size}|{int(stat.st_mtime)}|".encode())


def key_seed(settings: RegenSettings | None):
    """The digest a cache key starts from, before the data file's bytes: the regeneration's settings,
    or (settings None) a data file used as it is. DataIndex.build feeds it the bytes it indexes."""
    return hashlib.sha256(settings.key_fields().encode() if settings is not None else b"raw|")


def regen_key(train_file: Path, target_path: Path, tokenizer_path: Path, settings: RegenSettings,
              indexed=None) -> str:  # fmt: skip
    """The regeneration's cache key. `indexed`: key_seed(settings) as DataIndex.build fed it (the
    key is then of exactly the contents indexed); without it the file is read here."""
    digest = indexed if indexed is not None else file_digest(train_file, key_seed(settings))
    model_fingerprint(target_path, digest)
    if tokenizer_path != target_path:
        model_fingerprint(tokenizer_path, digest)
    return digest.hexdigest()[:24]


def raw_key(train_file: Path, tokenizer_path: Path, indexed=None) -> str:
    """The key of a data file used as it is (data.regenerate: false): its bytes and the tokenizer."""
    digest = indexed if indexed is not None else file_digest(train_file, key_seed(None))
    model_fingerprint(tokenizer_path, digest)
    return "raw-" + digest.hexdigest()[:24]


def line_hash(raw: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)


@dataclass
class DataIndex:
    """Where each conversation of a JSONL file is (its line number and byte offset) and what it was
    (a hash of its line): the whole file is parsed once, so a malformed line is refused before any
    work, and every later read of a conversation is checked against what was indexed, so a file
    changed in place (even at the same size and mtime) is noticed before anything is generated or
    stored from the new contents under the old contents' key. 16 bytes a conversation."""

    path: Path
    lines: array = field(default_factory=lambda: array("q"))
    offsets: array = field(default_factory=lambda: array("q"))
    hashes: array = field(default_factory=lambda: array("q"))

    @classmethod
    def build(cls, path: Path, digest=None) -> DataIndex:
        """The index of `path`; `digest` (a hashlib object, key_seed) is fed every byte indexed."""
        index = cls(path)
        for number, offset, raw in iter_lines(path):
            if digest is not None:
                digest.update(raw)
            if parse_line(path, number, raw) is not None:
                index.lines.append(number)
                index.offsets.append(offset)
                index.hashes.append(line_hash(raw))
        if not index.lines:
            raise DataError(
                f"{path}: no conversation with an assistant turn; expected one "
                '{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]} per line'
            )
        return index

    def __len__(self) -> int:
        return len(self.lines)

    def changed(self, line: int) -> str:
        return (
            f"{self.path}:{line} changed while the run was reading the file (its contents are not "
            "the ones its cache key was computed from); what was stored so far is kept under the "
            "original contents' key. Leave the file alone while a run uses it, and run again (the "
            "new contents get a key of their own)"
        )

    def read(self, start: int, end: int) -> list[tuple[int, list[dict[str, str]]]]:
        """(line number, messages) of conversations start..end-1, each checked against the index."""
        found = []
        with self.path.open("rb") as handle:
            for i in range(start, end):
                handle.seek(self.offsets[i])
                raw = handle.readline(MAX_LINE_BYTES + 1)
                if line_hash(raw) != self.hashes[i]:
                    raise DataError(self.changed(self.lines[i]))
                found.append((self.lines[i], parse_line(self.path, self.lines[i], raw)))
        return found

    def messages(self, start: int = 0, end: int | None = None, chunk: int = 1024) -> Iterator[list[dict]]:
        """The messages of conversations start..end-1, read (and checked) `chunk` at a time."""
        end = len(self) if end is None else end
        for first in range(start, end, chunk):
            yield from (messages for _, messages in self.read(first, min(first + chunk, end)))


# ---- engines: prompts in, greedy answers (without the end token) out, in the prompts' order ----


def answers_cut(answers: list[list[int]], settings: RegenSettings) -> int:
    """How many answers reached the cap: an engine returns an answer without its end token, so one
    of max_new_tokens tokens never got to end (or would have ended just there: either way the cap
    decided where it stops)."""
    return sum(len(answer) >= settings.max_new_tokens for answer in answers)


def cut_answer(row: list[int], end_id: int) -> list[int]:
    return row[: row.index(end_id)] if end_id in row else row


def bucket_width(longest: int, min_width: int) -> int:
    """min_width x the smallest power of two that holds `longest` (64, 128, 256, ...)."""
    width = min_width
    while width < longest:
        width *= 2
    return width


def rows_per_batch(width: int, settings: RegenSettings) -> int:
    """Prompts in one batch of this width: the largest power of two whose KV cache, rows x (width +
    new tokens), fits in batch_tokens (and in the device's memory: token_limit), at most
    batch_size, at least one. A decode step reads every row's whole static cache, so long prompts go
    in smaller batches and a step costs about the same at every width."""
    row_tokens = width + settings.max_new_tokens
    rows = 1
    while rows * 2 <= settings.batch_size and rows * 2 * row_tokens <= settings.token_limit:
        rows *= 2
    return rows


def kv_cache_bytes(config, rows: int, length: int, dtype: torch.dtype) -> int:
    """A static KV cache of rows x length tokens: keys and values of every layer's KV heads."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim
    return rows * length * per_token * dtype.itemsize


def prefill_peak_bytes(config, rows: int, width: int, dtype: torch.dtype) -> int:
    """The most the uncompiled prefill of rows x width prompt tokens holds at once beside the
    weights and the KV cache: prefill_token_bytes for every prompt token, and the last position's
    logits (logits_to_keep=1: never a prompt's every position, 128 x 1,024 x a vocabulary of
    151,936 being 40 GB in bf16)."""
    return rows * width * prefill_token_bytes(config, dtype) + rows * logits_row_bytes(config)


def prefill_token_bytes(config, dtype: torch.dtype) -> int:
    """A prompt token's share of the prefill's peak: one decoder layer's activations (the layers
    run one after the other, each freeing its own), the larger of its MLP's (gate, its activation
    and up: three of intermediate size) and its attention's (queries, keys and values, and their
    normed float32 copies), on top of the residual stream and a norm's float32 copies."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    size, wide = dtype.itemsize, torch.float32.itemsize
    projections = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    layer = max(3 * config.intermediate_size * size, projections * (2 * size + 2 * wide))
    return layer + config.hidden_size * (4 * size + 2 * wide)


def logits_row_bytes(config) -> int:
    """A row's last-position logits and their float32 copy (the argmax reads them)."""
    return config.vocab_size * 2 * torch.float32.itemsize


GIB = 1 << 30
# Held back from a device's free memory when its batches are sized: a share of it (the caching
# allocator's rounding and fragmentation), and room for what the shapes do not tell (the compiled
# step's buffers and CUDA graph, cuBLAS' and Triton's workspaces, the attention masks).
MEMORY_MARGIN = 0.10
MEMORY_RESERVE = 2 * GIB


def usable_bytes(device: torch.device) -> int:
    """What this process can still allocate on the CUDA device: the device's free memory and what
    torch's caching allocator holds unused (the target's weights and everything live excluded)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def memory_tokens(config, dtype: torch.dtype, free_bytes: int, settings: RegenSettings, widest: int,
                  device="the device") -> int:  # fmt: skip
    """The KV cache tokens a batch may hold so that its cache and its prefill's peak fit in
    free_bytes, less MEMORY_MARGIN and MEMORY_RESERVE: each cache token counted with a prompt
    token's prefill share (a row's prompt is never longer than its cache), and every row of the
    largest batch with its logits. Raises DataError, naming the figures and the way out, where not
    even one prompt of `widest` tokens fits."""
    per_token = kv_cache_bytes(config, 1, 1, dtype) + prefill_token_bytes(config, dtype)
    held_back = (
        int(free_bytes * MEMORY_MARGIN) + MEMORY_RESERVE + settings.batch_size * logits_row_bytes(config)
    )
    tokens = max(0, free_bytes - held_back) // per_token
    one_row = widest + settings.max_new_tokens
    if tokens < one_row:
        kv = kv_cache_bytes(config, 1, one_row, dtype)
        prefill = prefill_peak_bytes(config, 1, widest, dtype)
        raise DataError(
            f"{device} has {free_bytes / GIB:.1f} GiB free with the target loaded: too little to regenerate "
            f"one prompt of {widest:,} tokens and {settings.max_new_tokens} new, which needs "
            f"{(kv + prefill) / GIB:.2f} GiB (a KV cache of {kv / GIB:.2f} GiB, the prefill's peak "
            f"{prefill / GIB:.2f} GiB) beside {held_back / GIB:.1f} GiB held back ({MEMORY_MARGIN:.0%} of "
            f"the free memory, {MEMORY_RESERVE / GIB:.0f} GiB for the compiled step and workspaces, the "
            f"logits of data.regen_batch_size {settings.batch_size} rows). Free the GPU of other processes "
            "(nvidia-smi lists them), lower data.regen_batch_size or data.regen_max_new_tokens, or "
            "regenerate on a card with more memory; the finished shards are kept"
        )
    return tokens


def sized_to_device(target, device: torch.device, settings: RegenSettings, prompts) -> RegenSettings:
    """The settings whose batches fit the CUDA device's free memory now (memory_tokens), counting
    the KV cache and the prefill; data.regen_batch_tokens stays the cap. On a CPU: as they are."""
    if device.type != "cuda" or not prompts:
        return settings
    widest = bucket_width(max(len(prompt) for prompt in prompts), settings.min_width)
    dtype = next(target.parameters()).dtype
    limit = memory_tokens(target.config, dtype, usable_bytes(device), settings, widest, device)
    return dataclasses.replace(settings, memory_tokens=limit)


def compiled_rows(rows: int, width: int, settings: RegenSettings) -> int:
    """Rows a compiled batch is filled up to: the next power of two, so the last batch of a width
    (often a few long prompts) runs at its own small shape, and a data set compiles a few shapes
    per width at most. Compiled for every shape (compile_dynamic), two rows at least: Dynamo
    compiles a size of one on its own."""
    filled = 2 if settings.compile_dynamic else 1
    while filled < rows:
        filled *= 2
    return min(filled, rows_per_batch(width, settings))


def static_batches(prompts: list[list[int]], settings: RegenSettings) -> Iterator[tuple[int, list[int]]]:
    """(width, prompt indices) for each batch: the fewest batches, then the fewest cache tokens.

    Prompts are sorted by length and every batch is a run of that order, as wide as its longest
    prompt's bucket (bucket_width) and at most rows_per_batch(width) rows. A batch costs a decode
    step per new token whatever its rows, so a width's part-full last batch is carried up into a
    wider width's batches (its prompts padded further) wherever that saves a batch; among layouts
    of as few batches, the one reading the fewest cache tokens (filled rows x (width + new
    tokens)) wins. Left padding leaves greedy answers unchanged (exactly so in float32)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    cuts = fewest_batches([len(prompts[i]) for i in order], settings)
    for start, end in itertools.pairwise(cuts):
        yield bucket_width(len(prompts[order[end - 1]]), settings.min_width), order[start:end]


def fewest_batches(lengths: list[int], settings: RegenSettings) -> list[int]:
    """Batch boundaries over ascending prompt lengths, [0, ..., len(lengths)]: dynamic programming
    over where the last batch starts (cost: batches first, then cache tokens). The cheapest cover
    of the first s prompts never falls as s grows, so among the row counts a batch fills up to the
    same compiled rows the largest is best: only powers of two (and the width's limit) are tried."""
    scale = 1 << 40  # one batch outweighs any count of cache tokens
    best, start_of = [0] * (len(lengths) + 1), [0] * (len(lengths) + 1)
    for end in range(1, len(lengths) + 1):
        width = bucket_width(lengths[end - 1], settings.min_width)
        limit = rows_per_batch(width, settings)
        row_tokens = width + settings.max_new_tokens
        sizes = {min(1 << k, limit, end) for k in range(limit.bit_length() + 1)}
        best[end], start_of[end] = min(
            (best[end - r] + scale + compiled_rows(r, width, settings) * row_tokens, end - r) for r in sizes
        )
    cuts = [len(lengths)]
    while cuts[-1] > 0:
        cuts.append(start_of[cuts[-1]])
    return cuts[::-1]


def decode_attention(settings: RegenSettings, compiled: bool) -> str | None:
    """The attention the static engine decodes with; None keeps the target's own. 'auto': flex
    attention when compiled. With a padded static cache transformers' sdpa path copies the keys and
    values of every layer four times a step (grouped-query heads repeated, since a mask rules out
    SDPA's own GQA there); flex attention reads them once. One H200, Qwen3-8B shape, batch 256,
    128-token prompts, 256 new tokens: 49.7 ms a token with sdpa, 23.4 with flex attention."""
    if settings.attention == "auto":
        return "flex_attention" if compiled else None
    return settings.attention


def static_generate(target, prompts, settings, chat, pad_id, should_stop) -> list[list[int]] | None:
    """Greedy answers over a static KV cache, batch by batch (static_batches), decoded by
    StaticDecoder (trainer/data/decode.py): compiled on CUDA, one CUDA graph per (rows, width)
    shape; a batch that is not full is then filled with copies of its last prompt up to
    compiled_rows (their answers are dropped), so a whole data set compiles a handful of shapes.
    Uncompiled (data.regen_compile: false) it is `generate` with the dynamic cache, the faster one
    eagerly (H200: 775 tok/s dynamic against 1,366 static once compiled). None if a stop came
    between batches."""
    device = next(target.parameters()).device
    compiled = settings.compile and device.type == "cuda"
    attention = decode_attention(settings, compiled)
    settings = sized_to_device(target, device, widths_for(settings, attention), prompts)
    if settings.compile:
        scope = "step" if settings.compile_scope == "auto" else settings.compile_scope  # the static engine's
        decoder = StaticDecoder(target, compiled, scope, settings.compile_dynamic)

        def decode(ids, mask):
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return decoder.decode(ids, mask, settings.max_new_tokens, chat.end_id)
    else:
        decode = dynamic_decoder(target, settings, chat.end_id, pad_id)
    with attention_of(target, attention):
        return decode_batches(prompts, settings, decode, device, pad_id, chat.end_id, should_stop, compiled)


def dynamic_decoder(target, settings, end_id: int, pad_id: int):
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=settings.max_new_tokens, do_sample=False, eos_token_id=end_id, pad_token_id=pad_id
    )

    def decode(ids, mask):
        output = target.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        return output[:, ids.shape[1] :]

    return decode


def widths_for(settings: RegenSettings, attention: str | None) -> RegenSettings:
    """The settings whose min_width this attention can prefill. Flex attention takes its decoding
    kernel for fewer than 128 query tokens, and Inductor finds no kernel for such a prefill
    (NoValidChoicesError: 64-token prompts, one H200, torch 2.11): there widths start at 128."""
    if attention == "flex_attention" and settings.min_width < FLEX_MIN_LEN:
        return dataclasses.replace(settings, min_width=FLEX_MIN_LEN)
    return settings


def decode_batches(prompts, settings, decode, device, pad_id, end_id, should_stop, compiled):
    answers: list[list[int]] = [[] for _ in prompts]
    for width, chunk in static_batches(prompts, settings):
        if should_stop():
            return None
        rows = [prompts[i] for i in chunk]
        if compiled:
            rows += [rows[-1]] * (compiled_rows(len(rows), width, settings) - len(rows))
        ids = torch.tensor([[pad_id] * (width - len(row)) + row for row in rows])
        mask = (torch.arange(width) >= width - torch.tensor([len(row) for row in rows])[:, None]).long()
        try:
            output = decode(ids.to(device), mask.to(device))
        except torch.OutOfMemoryError as exc:
            raise DataError(out_of_memory(device, len(rows), width, settings)) from exc
        for i, row in zip(chunk, output[: len(chunk)].tolist(), strict=True):
            answers[i] = cut_answer(row, end_id)
    return answers


def out_of_memory(device, rows: int, width: int, settings: RegenSettings) -> str:
    cache = rows * (width + settings.max_new_tokens)
    sized = "" if settings.memory_tokens is None else f", the device's free memory {settings.memory_tokens:,}"
    return (
        f"{device} ran out of memory decoding a batch of {rows} prompts of {width} tokens and "
        f"{settings.max_new_tokens} new (a KV cache of {cache:,} tokens; data.regen_batch_tokens is "
        f"{settings.batch_tokens:,}{sized}, data.regen_batch_size {settings.batch_size}). Lower "
        f"data.regen_batch_tokens (e.g. to {max(1, settings.token_limit // 2):,}) and run again: the "
        "finished shards are kept"
    )


def paged_out_of_memory(device, settings: RegenSettings) -> str:
    return (
        f"{device} ran out of memory with a paged KV cache of {settings.batch_tokens:,} tokens "
        f"(data.regen_batch_tokens) and {settings.slots} slots (data.regen_slots). Lower either and run "
        "again: the finished shards are kept"
    )


def continuous_generate(target, prompts, settings, chat, pad_id, should_stop) -> list[list[int]] | None:
    """transformers' continuous batching (paged attention); one call per shard and turn."""
    from transformers import GenerationConfig

    if should_stop():
        return None
    config = GenerationConfig(
        max_new_tokens=settings.max_new_tokens, do_sample=False, eos_token_id=chat.end_id, pad_token_id=pad_id
    )
    options = {}
    if next(target.parameters()).device.type == "cpu":
        options["continuous_batching_config"] = cpu_cache_config(prompts, settings.max_new_tokens)
    results = target.generate_batch(
        [list(p) for p in prompts], generation_config=config, progress_bar=False, **options
    )
    # Request ids are req_<n>, numbered in the order of the inputs.
    in_order = sorted(results.items(), key=lambda item: int(item[0].rsplit("_", 1)[1]))
    return [cut_answer(list(result.generated_tokens), chat.end_id) for _, result in in_order]


# transformers' paged cache: tokens of one page, and its default cap on the tokens of one forward.
CACHE_PAGE_TOKENS = 256
CACHE_MAX_BATCH_TOKENS = 8192


def cpu_cache_config(prompts, max_new_tokens: int):
    """The paged cache on a CPU, sized for this call's requests. Left to size itself, it takes a share
    of the machine's RAM less this process's resident memory, and on a 24 GB machine a share small
    enough to leave no room once its fixed tensors are paid ("Invalid values: ... num_sectors = -6");
    a large share would allocate gigabytes the call never reads."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    pages = sum(-(-(len(prompt) + max_new_tokens) // CACHE_PAGE_TOKENS) for prompt in prompts)
    tokens = sum(len(prompt) + max_new_tokens for prompt in prompts)
    return ContinuousBatchingConfig(
        page_size=CACHE_PAGE_TOKENS,
        num_blocks=pages,
        max_batch_tokens=max(CACHE_PAGE_TOKENS, min(CACHE_MAX_BATCH_TOKENS, tokens)),
    )


GENERATORS = {"static": static_generate, "continuous": continuous_generate}


def turns_seen_in_training(examples, todo, prompts, turn, header: int, limit: int | None):
    """(todo, prompts) less the turns whose conversation before them (the prompt less its `header`
    tokens) already holds `limit` tokens: those conversations end before this turn (it and every
    later turn are left out, never generated). Their first `limit` tokens, all a training row takes
    of them, are the same either way. None: every turn."""
    if limit is None:
        return todo, prompts
    kept_todo, kept_prompts = [], []
    for i, prompt in zip(todo, prompts, strict=True):
        if len(prompt) - header >= limit:
            examples[i].turns = examples[i].turns[:turn]
        else:
            kept_todo.append(i)
            kept_prompts.append(prompt)
    return kept_todo, kept_prompts


class ShardDamaged(DataError):
    """A shard's contents do not match the checksum written with it."""


def shard_seal(body: bytes, rows: int) -> dict:
    return {"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body), "rows": rows}


def shard_range(path: Path) -> tuple[int, int]:
    """(start, end) from a shard's name, shard-<start>-<end>.jsonl."""
    _, start, end = path.stem.split("-")
    return int(start), int(end)


def write_durably(path: Path, data: bytes) -> None:
    """Atomically: a temporary file beside it, fsync, rename, fsync of the directory."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with tmp.open("wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Progress:
    """Conversations and tokens done across every worker of this process (thread-safe): of `total`
    (this process's share of the data set), `done_before` were done by an earlier start; the rate
    and the time left count this start's work only. `answers` counts the answers generated, `cut`
    those that reached the cap (data.regen_max_new_tokens) before their end token; the paged engine
    adds its decode steps and their slot-steps (each step's width: data.regen_slots, or a narrower
    one at the data set's tail) as each of its engines ends."""

    total: int
    done_before: int = 0
    done: int = 0
    tokens: int = 0
    answers: int = 0
    cut: int = 0
    decode_steps: int = 0
    slot_steps: int = 0
    started: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, conversations: int, tokens: int, answers: int = 0, cut: int = 0,
            decode_steps: int = 0, slot_steps: int = 0) -> None:  # fmt: skip
        with self.lock:
            self.done += conversations
            self.tokens += tokens
            self.answers += answers
            self.cut += cut
            self.decode_steps += decode_steps
            self.slot_steps += slot_steps

    def snapshot(self) -> dict:
        with self.lock:
            elapsed = max(time.monotonic() - self.started, 1e-9)
            rate = self.done / elapsed
            eta = (self.total - self.done_before - self.done) / rate if rate > 0 else None
            return {
                "kind": "regen", "conversations": self.done_before + self.done, "total": self.total,
                "tokens": self.tokens, "answers": self.answers, "answers_cut": self.cut,
                "decode_steps": self.decode_steps, "slot_steps": self.slot_steps,
                "tokens_per_s": self.tokens / elapsed, "elapsed_s": elapsed, "eta_s": eta,
            }  # fmt: skip


class Regeneration:
    """The shards of one data set under one key: which exist, generating the missing ones, and the
    regenerated conversations streamed back in the input's order."""

    def __init__(self, index: DataIndex, settings: RegenSettings, cache_root: Path, key: str,
                 chat: ChatFormat, pad_id: int, max_positions: int | None):  # fmt: skip
        self.index, self.settings, self.key, self.chat = index, settings, key, chat
        self.pad_id, self.max_positions = pad_id, max_positions
        # A fast tokenizer used from several threads at once can fail ("Already borrowed"): the
        # workers take turns for it (it is cheap next to generating).
        self.tokenizer_lock = threading.Lock()
        self.directory = cache_root / "regenerated" / key
        size = settings.shard_size
        self.ranges = [(s, min(s + size, len(index))) for s in range(0, len(index), size)]

    def __getstate__(self) -> dict:
        # Handed to a worker process (trainer/data/regen_worker.py): everything but the lock.
        return {name: value for name, value in self.__dict__.items() if name != "tokenizer_lock"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.tokenizer_lock = threading.Lock()

    def shard_path(self, start: int, end: int) -> Path:
        return self.directory / f"shard-{start:09d}-{end:09d}.jsonl"

    def seal_path(self, start: int, end: int) -> Path:
        """Beside each shard: its sha256, size and rows, written with it (shard_seal)."""
        return self.directory / f"shard-{start:09d}-{end:09d}.sha256"

    def seal(self, start: int, end: int) -> dict | None:
        try:
            seal = json.loads(self.seal_path(start, end).read_text())
        except (OSError, ValueError):
            return None
        return seal if isinstance(seal, dict) and {"sha256", "bytes", "rows"} <= seal.keys() else None

    def damage(self, start: int, end: int) -> str | None:
        """Why a shard on disk cannot be used, judged by its size against its seal (cheap enough for
        every start and every rank: the contents are checked whole when read, read_shard); None for
        a shard that looks whole or is not there at all."""
        path = self.shard_path(start, end)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        seal = self.seal(start, end)
        if seal is None:
            return "it has no checksum beside it (written by an older trainer, or its write was cut off)"
        if size != seal["bytes"] or seal["rows"] != end - start:
            return f"it is {size:,} bytes, its checksum says {seal['bytes']:,} (cut short or emptied on disk)"
        return None

    def damaged(self) -> list[tuple[Path, str]]:
        """The shards on disk that cannot be used, and why: missing() counts them, and they are
        generated again."""
        found = ((self.shard_path(s, e), self.damage(s, e)) for s, e in self.ranges)
        return [(path, why) for path, why in found if why]

    def missing(self) -> list[int]:
        return [
            i
            for i, (s, e) in enumerate(self.ranges)
            if not self.shard_path(s, e).exists() or self.damage(s, e) is not None
        ]

    def read_shard(self, start: int, end: int) -> list[dict]:
        """The rows of a shard, its contents checked against its seal first: a damaged shard is never
        read short or half. It raises ShardDamaged (its seal is removed, so the next start
        generates it again)."""
        path = self.shard_path(start, end)
        try:
            body = path.read_bytes()
        except FileNotFoundError:
            body = b""
        seal = self.seal(start, end)
        if seal is None or seal["rows"] != end - start or hashlib.sha256(body).hexdigest() != seal["sha256"]:
            aside = self.set_aside(start, end)
            raise ShardDamaged(
                f"{path} is damaged: its contents do not match the checksum written with it. It was moved "
                f"to {aside} and is regenerated at the next start ({end - start:,} conversations): run again"
            )
        return [json.loads(line) for line in body.splitlines()]

    def contents_damaged(self, start: int, end: int) -> bool:
        """Whether a shard that looks whole (its size matches its seal) holds other bytes than were
        sealed: a full read, done only where the data is about to be read anyway."""
        seal = self.seal(start, end)
        try:
            body = self.shard_path(start, end).read_bytes()
        except FileNotFoundError:
            return False  # moved aside meanwhile (another rank): missing, so generated again
        return seal is not None and hashlib.sha256(body).hexdigest() != seal["sha256"]

    def set_aside(self, start: int, end: int) -> Path:
        """A damaged shard out of the way as <shard>.damaged (kept for a look, the next one replaces
        it) and its seal removed: it is missing from now on, so generated again."""
        path = self.shard_path(start, end)
        aside = path.with_name(path.name + ".damaged")
        with contextlib.suppress(OSError):  # another rank may have moved it already
            self.seal_path(start, end).unlink()
        with contextlib.suppress(OSError):
            os.replace(path, aside)
        return aside

    def set_aside_damaged(self) -> list[tuple[Path, str]]:
        """Every shard that looks whole but whose contents do not match its seal, set aside (and so
        generated again before the data is read): (its path, why)."""
        found = []
        for start, end in self.ranges:
            if self.damage(start, end) is None and self.contents_damaged(start, end):
                aside = self.set_aside(start, end)
                why = f"its contents do not match its checksum (moved to {aside.name})"
                found.append((self.shard_path(start, end), why))
        return found

    def conversations_done(self) -> int:
        gone = set(self.missing())
        return sum(e - s for i, (s, e) in enumerate(self.ranges) if i not in gone)

    def others(self) -> list[tuple[Path, int]]:
        """The other regenerations beside this one in the cache (another data file, target,
        setting of the key or format), with their bytes: this run never reads them. A directory
        removed while this looks is left out."""
        found = []
        for directory in sorted(self.directory.parent.glob("*")):
            if directory == self.directory or not directory.is_dir():
                continue
            with contextlib.suppress(OSError):
                found.append((directory, sum(f.stat().st_size for f in directory.iterdir() if f.is_file())))
        return found

    def prepare(self) -> None:
        """The directory, and no temporary file of a killed writer left behind (never read)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for leftover in self.directory.glob(".shard-*.tmp"):
            with contextlib.suppress(OSError):
                leftover.unlink()

    @contextlib.contextmanager
    def lock(self):
        """One regeneration per key at a time on this cache (a second one is refused, not queued)."""
        path = self.directory / ".lock"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DataError(
                f"cannot write the regeneration cache {self.directory}: {exc.strerror}; point "
                "data.cache_dir at a writable directory with room for the regenerated data"
            ) from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                raise DataError(
                    f"another regeneration (pid {holder}) is filling {self.directory}; wait for it to "
                    "finish (its shards will be used) or stop it"
                ) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            yield
        finally:
            os.close(fd)

    def generate(self, worker: int, workers: int, target, progress: Progress,
                 should_stop: Callable[[], bool]) -> bool:  # fmt: skip
        """This worker's missing shards (i % workers == worker). False if a stop came."""
        mine = [shard for shard in self.missing() if shard % workers == worker]
        if self.settings.engine == "paged":  # one stream: the slots stay busy across the shards' ends

            def write(start: int, end: int, rows: list[dict]) -> None:
                self.write_shard(self.shard_path(start, end), rows)
                progress.add(end - start, 0)

            ranges = [self.ranges[shard] for shard in mine]
            return self.regenerate_paged(ranges, target, progress, should_stop, write)
        for shard in mine:
            start, end = self.ranges[shard]
            rows = self.regenerate_shard(start, end, target, progress, should_stop)
            if rows is None:
                return False
            self.write_shard(self.shard_path(start, end), rows)
            progress.add(end - start, 0)
        return True

    def regenerate_shard(self, start, end, target, progress, should_stop) -> list[dict] | None:
        if self.settings.engine == "paged":
            kept: list[list[dict]] = []
            finished = lambda start, end, rows: kept.append(rows)  # noqa: E731
            done = self.regenerate_paged([(start, end)], target, progress, should_stop, finished)
            return kept[0] if done else None
        conversations = self.index.read(start, end)
        with self.tokenizer_lock:
            examples = list(tokenize_stream((messages for _, messages in conversations), self.chat))
        generate = GENERATORS[self.settings.engine]
        header, limit = len(self.chat.header("assistant")), self.settings.max_prompt_tokens
        for turn in range(max(len(e.turns) for e in examples)):
            todo = [
                i for i, e in enumerate(examples) if len(e.turns) > turn and e.turns[turn][0] == "assistant"
            ]
            if not todo:
                continue
            with self.tokenizer_lock:
                prompts = [prompt_ids(examples[i], self.chat, turn) for i in todo]
            todo, prompts = turns_seen_in_training(examples, todo, prompts, turn, header, limit)
            if not todo:
                continue
            self.check_context([conversations[i][0] for i in todo], prompts)
            with torch.no_grad():
                answers = generate(target, prompts, self.settings, self.chat, self.pad_id, should_stop)
            if answers is None:
                return None
            for i, answer in zip(todo, answers, strict=True):
                examples[i].turns[turn] = ("assistant", answer)
            progress.add(0, sum(len(a) for a in answers), len(answers), answers_cut(answers, self.settings))
        return [
            {"line": line, "turns": e.turns} for (line, _), e in zip(conversations, examples, strict=True)
        ]

    def regenerate_paged(self, ranges, target, progress, should_stop, finished) -> bool:
        """Every turn of these shards through the paged engine, one stream
        (trainer/data/engine/conversations.py); finished(start, end, rows) as each shard is done."""
        from .engine.conversations import paged_shards

        device = next(target.parameters()).device
        compiled = self.settings.compile and device.type == "cuda"
        with torch.no_grad():
            try:
                return paged_shards(self, ranges, target, progress, should_stop, compiled, finished)
            except torch.OutOfMemoryError as exc:
                raise DataError(paged_out_of_memory(device, self.settings)) from exc

    def check_context(self, lines: list[int], prompts: list[list[int]]) -> None:
        if self.max_positions is None:
            return
        for line, prompt in zip(lines, prompts, strict=True):
            if len(prompt) + self.settings.max_new_tokens > self.max_positions:
                raise DataError(self.too_long(line, len(prompt)))

    def too_long(self, line: int, prompt_tokens: int) -> str:
        return (
            f"{self.index.path}:{line}: the conversation needs up to {prompt_tokens} prompt tokens + "
            f"{self.settings.max_new_tokens} new ones, more than the target's context of "
            f"{self.max_positions}; shorten or remove it, or lower data.regen_max_new_tokens "
            "(the shards finished so far are kept)"
        )

    def check_contexts_before_generating(self, shards: list[int]) -> None:
        """Every conversation of these shards fits the target's context even if each earlier answer
        takes all max_new_tokens: checked before any generation, so a conversation that cannot fit
        stops the run at its start, not hours in (fixing the file changes its key). A turn after
        max_prompt_tokens is never generated, so with max_prompt_tokens + max_new_tokens within the
        context every conversation fits, however long."""
        if self.max_positions is None:
            return
        longest_answer = self.settings.max_new_tokens
        limit = self.settings.max_prompt_tokens
        header = len(self.chat.header("assistant"))
        closing = len(self.chat.end) + len(self.chat.newline)
        for shard in shards:
            conversations = self.index.read(*self.ranges[shard])
            with self.tokenizer_lock:
                examples = list(tokenize_stream((messages for _, messages in conversations), self.chat))
            for (line, _), example in zip(conversations, examples, strict=True):
                prompt = 0
                for role, content in example.turns:
                    # The longest prefix that is still generated: its answers may be shorter.
                    reached = prompt if limit is None else min(prompt, limit - 1)
                    if role == "assistant" and reached + header + longest_answer > self.max_positions:
                        raise DataError(self.too_long(line, reached + header))
                    body = longest_answer if role == "assistant" else len(content)
                    prompt += len(self.chat.header(role)) + body + closing

    def write_shard(self, path: Path, rows: list[dict]) -> None:
        """The shard, then its seal (shard_seal), each atomically (write_durably). A full disk leaves
        no partial shard, and every finished shard stays; a shard whose seal is not written yet is
        missing (generated again)."""
        body = "".join(json.dumps(row) + "\n" for row in rows).encode()
        seal = self.seal_path(*shard_range(path))
        try:
            seal.unlink(missing_ok=True)  # never a new shard beside an older shard's seal
            write_durably(path, body)
            write_durably(seal, json.dumps(shard_seal(body, len(rows))).encode())
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                done = self.conversations_done()
                raise DiskFull(
                    f"disk full writing {path}: {exc.strerror}; {done} of {len(self.index)} conversations "
                    f"are regenerated and kept in {self.directory}. Free space and run again to continue"
                ) from None
            raise

    def examples(self, start: int = 0, end: int | None = None) -> ShardedExamples:
        return ShardedExamples(self, start, len(self.index) if end is None else end)


class ShardedExamples:
    """Regenerated conversations start..end-1 in the input's order, streamed from the shard files
    (one shard in memory at a time); iterable any number of times."""

    def __init__(self, regeneration: Regeneration, start: int, end: int):
        self.regeneration, self.start, self.end = regeneration, start, end

    def __len__(self) -> int:
        return self.end - self.start

    def rows(self) -> Iterator[dict]:
        for start, end in self.regeneration.ranges:
            if end <= self.start or start >= self.end:
                continue
            for position, row in enumerate(self.regeneration.read_shard(start, end), start):
                if self.start <= position < self.end:
                    yield row

    def __iter__(self) -> Iterator[Example]:
        for row in self.rows():
            yield Example([(role, ids) for role, ids in row["turns"]])


class TokenizedFile:
    """Conversations start..end-1 of a data file used as it is, tokenized as they are read (each read
    checked against the index: DataIndex.read)."""

    def __init__(self, index: DataIndex, chat: ChatFormat, start: int, end: int):
        self.index, self.chat, self.start, self.end = index, chat, start, end

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self) -> Iterator[Example]:
        yield from tokenize_stream(self.index.messages(self.start, self.end), self.chat)


def run_workers(regeneration: Regeneration, targets: list, progress: Progress, should_stop,
                report: Callable[[], None], report_every_s: float, rank: int = 0,
                world_size: int = 1) -> bool:  # fmt: skip
    """One generating thread per target (device) while this thread reports progress every
    report_every_s. Under torchrun each of the world_size ranks runs this with its own targets: the
    run's workers are every rank's threads, worker rank * len(targets) + thread. False if a stop
    came; a worker's exception stops the others at their next batch and is raised here once every
    worker has ended (the shards they finished are kept)."""
    errors: list[BaseException] = []
    stopped = threading.Event()

    def stop_requested() -> bool:
        return bool(errors) or should_stop()

    def work(worker: int, target) -> None:
        try:
            workers = world_size * len(targets)
            if not regeneration.generate(
                rank * len(targets) + worker, workers, target, progress, stop_requested
            ):
                stopped.set()
        except BaseException as exc:  # handed to the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w, t), daemon=True) for w, t in enumerate(targets)]
    for thread in threads:
        thread.start()
    next_report = time.monotonic() + report_every_s
    first = True  # the first shard finished is reported at once: a short regeneration shows progress too
    while any(thread.is_alive() for thread in threads):  # ends when the workers do
        threads[0].join(timeout=0.1)
        if time.monotonic() >= next_report or (first and progress.done > 0):
            report()
            first = progress.done == 0
            next_report = time.monotonic() + report_every_s
    if errors:
        raise errors[0]
    return not stopped.is_set()


def export_chat_jsonl(index: DataIndex, examples: ShardedExamples, tokenizer, destination: Path) -> int:
    """The regenerated data set as chat JSONL ({"messages": [...]} per line, the input's order):
    the input's messages with every assistant turn's content replaced by the decoded answer. A
    conversation generated only up to max_prompt_tokens ends there, and one left without an answer
    is left out. Written atomically. Returns the number of conversations written."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    tmp = destination.with_name(f".{destination.name}.{os.getpid()}.tmp")
    count = 0
    try:
        with tmp.open("w") as handle:
            for messages, row in zip(index.messages(), examples.rows(), strict=True):
                messages = messages[: len(row["turns"])]  # ended where generation stopped (max_prompt_tokens)
                if not any(role == "assistant" for role, _ in row["turns"]):
                    continue
                for message, (role, ids) in zip(messages, row["turns"], strict=True):
                    if role == "assistant":
                        message["content"] = tokenizer.decode(ids, skip_special_tokens=False)
                handle.write(json.dumps({"messages": messages}, ensure_ascii=False) + "\n")
                count += 1
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, destination)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    return count
