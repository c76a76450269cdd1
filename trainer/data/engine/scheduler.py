"""Which sequence decodes in which slot, and which KV pages it holds: plain Python, no tensors.

Each engine iteration is one decode step for every slot whose sequence is decoding, plus at most
one prefill chunk of at most `chunk` prompt tokens, of one or more sequences being prefilled (so a
long prompt does not stall the decoding rows, and short ones fill free slots together), run when
one is due (prefill_due: full, or an eighth of the slots waiting for it). A slot
whose sequence ends (end token or cap) is free at once; waiting sequences are admitted into free
slots while their prompts' pages are free, plus a reserve of one page for each decoding sequence
(each may need a new page soon), and while the prompts admitted and not yet prefilled hold fewer
than `chunk` tokens. When a decoding sequence
needs a page and none is free, the newest sequence is preempted: its pages are freed and it goes
back to the front of the waiting queue, to be prefilled again (prompt and answer so far) later.

The data set's tail: once no more sequences are left than a narrower width holds (none waiting
and none to come), they move into its first slots (their pages stay where they are: a slot is only
the row of the decode step a sequence is in) and the decode steps run at that width until more
come back (a next turn). A step of 256 slots that decodes a handful of answers computes 256 rows;
one of 32 does the same useful work in fewer row-steps, and sooner."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from .kv_pages import PageAllocator, pages_for


@dataclass
class Sequence:
    """A prompt and its answer so far. `computed`: the tokens whose keys and values are in its
    pages; while decoding, every token but the last (the next step's input) is computed."""

    key: object
    prompt: list[int]
    answer: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    computed: int = 0
    slot: int | None = None
    decoding: bool = False  # prefilled: in the decode steps
    admitted: int = -1  # admission order: the newest is preempted first
    limit: int = 0  # the most answer tokens: data.regen_max_new_tokens (a bench may give less)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.answer


@dataclass
class PrefillChunk:
    sequence: Sequence
    start: int  # the first position of the chunk
    tokens: list[int]

    @property
    def last(self) -> bool:
        """The chunk that ends the prefill: its last logits give the next token."""
        return self.start + len(self.tokens) == len(self.sequence.tokens)


class Scheduler:
    def __init__(self, slots: int, pages: int, page_size: int, max_pages: int, chunk: int):
        self.slots: list[Sequence | None] = [None] * slots
        self.width = slots  # the slots in use now: all, or the narrow step's at the tail (fit_width)
        self.allocator = PageAllocator(pages)
        self.page_size, self.max_pages, self.chunk = page_size, max_pages, chunk
        self.waiting: deque[Sequence] = deque()
        self.order = itertools.count()
        self.preemptions = 0

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.slots)

    def decoding(self) -> list[Sequence]:
        return [s for s in self.slots if s is not None and s.decoding]

    def prefilling(self) -> list[Sequence]:
        """The sequences admitted and not yet prefilled, oldest first."""
        return sorted((s for s in self.slots if s is not None and not s.decoding), key=lambda s: s.admitted)

    def admit(self) -> None:
        """Waiting sequences into free slots, first come first served, while their pages are free
        with the decoding sequences' reserve and the next chunk has room for their prompts."""
        while self.waiting and None in self.slots[: self.width]:
            if sum(len(s.tokens) - s.computed for s in self.prefilling()) >= self.chunk:
                return
            sequence = self.waiting[0]
            needed = pages_for(len(sequence.tokens), self.page_size)
            reserve = len(self.decoding())
            if needed + reserve > self.allocator.free and (reserve or self.prefilling()):
                return  # wait for pages: a running sequence will end and give its pages back
            self.waiting.popleft()
            sequence.pages = self.allocator.take(needed)
            sequence.slot = self.slots.index(None, 0, self.width)
            sequence.computed, sequence.decoding = 0, False
            sequence.admitted = next(self.order)
            self.slots[sequence.slot] = sequence

    def fit_width(self, narrower: tuple[int, ...] = ()) -> int:
        """The decode step's width this iteration: the narrowest of `narrower` that every sequence
        left fits (those in slots past it move into its free slots), or every slot while more are
        left than any of them holds (a caller with more requests to come passes none). Returns it."""
        occupied = [s for s in self.slots if s is not None]
        left = len(occupied) + len(self.waiting)
        fitting = [width for width in narrower if left <= width < len(self.slots)]
        self.width = min(fitting, default=len(self.slots))
        for sequence in occupied:
            if sequence.slot >= self.width:
                free = self.slots.index(None, 0, self.width)
                self.slots[sequence.slot], self.slots[free] = None, sequence
                sequence.slot = free
        return self.width

    def prefill_due(self) -> bool:
        """Whether this iteration runs a prefill chunk besides its decode step. A chunk costs about as
        much whether it holds a few prompt tokens or `chunk` of them (on an H100 at the 8B shape a
        chunk of some 200 tokens took about three decode steps), so while sequences decode, one is
        run once it can be full, or an eighth of the slots wait for it, or no other prompt can join
        it; a slot that ends waits a few steps for its successor's prefill, not every step for a
        chunk of one prompt."""
        prefilling = self.prefilling()
        if not prefilling:
            return False
        if not self.waiting or sum(len(s.tokens) - s.computed for s in prefilling) >= self.chunk:
            return True
        idle = sum(1 for s in self.slots[: self.width] if s is None or not s.decoding)
        return idle * 8 >= self.width

    def next_chunk(self) -> list[PrefillChunk]:
        """The next prefill chunk: the oldest prefilling sequences' next tokens, `chunk` in all."""
        chunks, room = [], self.chunk
        for sequence in self.prefilling():
            if room == 0:
                break
            tokens = sequence.tokens[sequence.computed : sequence.computed + room]
            chunks.append(PrefillChunk(sequence, sequence.computed, tokens))
            room -= len(tokens)
        return chunks

    def grow(self) -> list[Sequence]:
        """A page for every decoding sequence whose next token starts a new one, preempting the newest
        sequence while none is free. Returns the sequences preempted."""
        preempted = []
        for sequence in sorted(self.decoding(), key=lambda s: s.admitted):
            if sequence.slot is None or sequence.computed < len(sequence.pages) * self.page_size:
                continue  # preempted meanwhile, or room left in its last page
            while not self.allocator.free:
                newest = max((s for s in self.slots if s is not None), key=lambda s: s.admitted)
                self.preempt(newest)
                preempted.append(newest)
                if newest is sequence:
                    break
            if sequence.slot is not None:
                sequence.pages += self.allocator.take(1)
        return preempted

    def preempt(self, sequence: Sequence) -> None:
        """Pages freed, back to the front of the queue; recomputed later from its tokens."""
        self.release(sequence)
        sequence.computed, sequence.decoding = 0, False
        self.waiting.appendleft(sequence)
        self.preemptions += 1

    def release(self, sequence: Sequence) -> None:
        self.allocator.give_back(sequence.pages)
        sequence.pages = []
        self.slots[sequence.slot] = None
        sequence.slot = None
