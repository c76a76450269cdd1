"""Chat data: JSONL conversations -> token ids with an assistant-only loss mask. Regeneration by the
target is regen.py's (`regenerate` here is the old loop, kept as the bench's baseline); the token
store (store.py) and the rows and loader (rows.py) are built from these."""

from __future__ import annotations

import errno
import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch


class DataError(Exception):
    pass


class DiskFull(OSError):
    """The disk filled while data derived from the data file was written (regenerated shards, the
    token store): a crash like a full disk while training (exit status 1, docs/OPERATING.md), not
    bad input; the message says what is kept and the way out."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


MAX_LINE_BYTES = 8 << 20
"""The longest line a data file may have (8 MiB): far more than any conversation a target's context
holds (128K tokens of JSON-escaped text is a few MiB), small enough that one bad line is refused in
well under a second and without gigabytes of memory."""


def iter_lines(path: str | Path, limit: int = MAX_LINE_BYTES) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, raw bytes) of each line; a line longer than `limit` bytes is
    refused (DataError, file:line) after reading at most limit + 1 bytes of it."""
    with Path(path).open("rb") as handle:
        offset = 0
        for number in itertools.count(1):
            raw = handle.readline(limit + 1)
            if not raw:
                return
            if len(raw) > limit and not raw.endswith(b"\n"):
                raise DataError(
                    f"{path}:{number}: the line is longer than {limit >> 20} MiB, more than any "
                    "conversation a target's context holds; split the conversation or remove the line"
                )
            yield number, offset, raw
            offset += len(raw)


def parse_line(path: str | Path, number: int, raw: bytes) -> list[dict[str, str]] | None:
    """The messages of one JSONL line; None for a blank line or a conversation without an assistant
    turn. A line that is not UTF-8 or not a conversation raises DataError naming file:line."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}:{number}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1}); "
            "save the file as UTF-8 JSON lines"
        ) from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(
            f'{path}:{number}: not JSON ({exc.msg}); every line must be one {{"messages": '
            '[{"role": ..., "content": ...}, ...]} object'
        ) from None
    messages = record.get("messages") if isinstance(record, dict) else record
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise DataError(f'{path}:{number}: expected {{"messages": [{{"role", "content"}}, ...]}}')
    return messages if any(m["role"] == "assistant" for m in messages) else None


def iter_conversations(path: str | Path) -> Iterator[tuple[int, list[dict[str, str]]]]:
    """Stream JSONL: (line number, messages) for each line {"messages": [{"role": ..., "content":
    ...}, ...]} (or a bare list) that has an assistant turn; blank lines and conversations with no
    assistant turn are skipped. Memory does not grow with the file (a line is at most
    MAX_LINE_BYTES)."""
    for number, _, raw in iter_lines(path):
        messages = parse_line(path, number, raw)
        if messages is not None:
            yield number, messages


def load_conversations(path: str | Path) -> list[list[dict[str, str]]]:
    """Every conversation of a JSONL file with an assistant turn, in memory (small files only)."""
    conversations = [messages for _, messages in iter_conversations(path)]
    if not conversations:
        raise DataError(f"{path}: no conversation with an assistant turn")
    return conversations


class ChatFormat:
    """ChatML (what Qwen uses): <|im_start|>role\\ncontent<|im_end|>\\n, built from ids so the loss
    mask is exact: the assistant's content and its <|im_end|> are supervised, nothing else."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.start = self._special("<|im_start|>")
        self.end = self._special("<|im_end|>")
        self.newline = tokenizer.encode("\n", add_special_tokens=False)
        self._headers: dict[str, list[int]] = {}  # per role: encode() needs one per turn

    def _special(self, token: str) -> list[int]:
        token_id = self.tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == self.tokenizer.unk_token_id:
            return self.tokenizer.encode(token, add_special_tokens=False)
        return [token_id]

    @property
    def end_id(self) -> int:
        return self.end[0]

    def text(self, content: str) -> list[int]:
        return self.tokenizer.encode(content, add_special_tokens=False)

    def texts(self, contents: list[str]) -> list[list[int]]:
        """The ids of many texts in one call, on every core: what text() gives for each. A fast
        tokenizer's backend encodes them without the character offsets the tokenizer's own call
        computes and drops: 5.5 s against 9.5 s for 20,000 chat conversations (8.75M tokens) on
        the 2-core machine, the same ids."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None and hasattr(backend, "encode_batch_fast"):
            encodings = backend.encode_batch_fast(contents, add_special_tokens=False)
            return [encoding.ids for encoding in encodings]
        return self.tokenizer(contents, add_special_tokens=False)["input_ids"]

    def header(self, role: str) -> list[int]:
        if role not in self._headers:
            self._headers[role] = self.start + self.tokenizer.encode(role + "\n", add_special_tokens=False)
        return list(self._headers[role])

    def encode(self, turns: list[tuple[str, list[int]]]) -> tuple[list[int], list[int]]:
        """turns: (role, content ids). Returns (ids, loss mask)."""
        ids: list[int] = []
        mask: list[int] = []
        for role, content in turns:
            head = self.header(role)
            ids += head
            mask += [0] * len(head)
            body = content + self.end
            ids += body
            mask += [1 if role == "assistant" else 0] * len(body)
            ids += self.newline
            mask += [0] * len(self.newline)
        return ids, mask


@dataclass
class Example:
    turns: list[tuple[str, list[int]]]


def tokenize(conversations: list[list[dict[str, str]]], chat: ChatFormat) -> list[Example]:
    return list(tokenize_stream(conversations, chat))


def tokenize_stream(
    conversations: Iterable[list[dict[str, str]]], chat: ChatFormat, chunk: int = 1024
) -> Iterator[Example]:
    """Examples of a stream of conversations, in order, tokenized `chunk` conversations per call of
    the tokenizer: a fast tokenizer encodes a batch on all cores, and one call per message costs
    ~0.3 ms of overhead each, a third of an hour at 800K conversations."""
    pending: list[list[dict[str, str]]] = []
    for conversation in itertools.chain(conversations, [None]):
        if conversation is not None:
            pending.append(conversation)
        if pending and (conversation is None or len(pending) == chunk):
            texts = [m["content"] for conv in pending for m in conv]
            ids = iter(chat.texts(texts)) if texts else iter(())
            yield from (Example([(m["role"], next(ids)) for m in conv]) for conv in pending)
            pending = []


def prompt_ids(example: Example, chat: ChatFormat, upto_turn: int) -> list[int]:
    """Ids of every turn before `upto_turn`, then the assistant header: what the target answers."""
    ids, _ = chat.encode(example.turns[:upto_turn])
    return ids + chat.header("assistant")


@torch.no_grad()
def regenerate(
    examples: list[Example],
    target,
    chat: ChatFormat,
    max_new_tokens: int,
    batch_size: int,
    device: torch.device,
    should_stop: Callable[[], bool] = lambda: False,
) -> list[Example] | None:
    """Replace every assistant turn by the target's greedy answer (turn by turn, so later turns see
    the regenerated earlier ones). Prompts are grouped by length so no padding changes a result.
    Returns None if stopped."""
    examples = [Example(list(e.turns)) for e in examples]
    max_turns = max(len(e.turns) for e in examples)
    for turn in range(max_turns):
        todo = [i for i, e in enumerate(examples) if len(e.turns) > turn and e.turns[turn][0] == "assistant"]
        by_length: dict[int, list[tuple[int, list[int]]]] = {}
        for i in todo:
            prompt = prompt_ids(examples[i], chat, turn)
            by_length.setdefault(len(prompt), []).append((i, prompt))
        for group in by_length.values():
            for chunk_start in range(0, len(group), batch_size):
                if should_stop():
                    return None
                chunk = group[chunk_start : chunk_start + batch_size]
                prompts = torch.tensor([p for _, p in chunk], device=device)
                output = target.generate(
                    input_ids=prompts,
                    attention_mask=torch.ones_like(prompts),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=chat.end_id,
                    pad_token_id=chat.end_id,
                )
                for (i, _), row in zip(chunk, output[:, prompts.shape[1] :].tolist(), strict=True):
                    answer = row[: row.index(chat.end_id)] if chat.end_id in row else row
                    examples[i].turns[turn] = ("assistant", answer)
    return examples
