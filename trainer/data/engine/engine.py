"""The loop: admit, grow, one decode step of every decoding slot, one prefill chunk, retire.

A request is (key, prompt); `follow_up(key, answer)` may return the requests its answer makes
possible (a conversation's next turn, whose prompt holds this answer), queued at once. Answers
are greedy and equal plain `generate`'s for each prompt alone (in float32): each sequence sees only
its own pages, through masks by position, whatever its neighbours and whatever its slot or pages
held before."""

from __future__ import annotations

import functools
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ...model.compile_cache import first_line
from ...model.target import attention_of
from .kv_pages import PagedKV, pages_for
from .scheduler import Scheduler, Sequence
from .step import (
    FLEX_SPLIT_KV,
    DecodeStep,
    call_layer,
    call_prefill_layer,
    decode_step,
    flex_decode_step,
    greedy,
    layer_pages,
    packed_visible,
    paged_forward,
    register_paged_attention,
)

DECODE_STEPS = {"gather": decode_step, "flex": flex_decode_step}
ATTENTIONS = tuple(DECODE_STEPS)
COMPILE_SCOPES = ("step", "layers")

Request = tuple[object, list[int]]


@dataclass(frozen=True)
class PagedSettings:
    """slots: sequences decoded at once (the decode step's rows). page_size: tokens a KV page holds.
    pages: the pool's pages (one of them scratch). max_tokens: the longest sequence (prompt +
    answer) a slot holds; the decode step reads max_tokens rounded up to pages per slot. chunk: the
    most prompt tokens prefilled in one iteration. compile: the decode step compiled (and, on a
    GPU, replayed as a CUDA graph). attention: how the decode step reads the pages, "gather" (each
    slot's whole table copied in order, read by the target's own sdpa or eager attention) or
    "flex" (flex attention over the pool in place: only the pages in use, no copy).
    gather_if_flex_fails: flex whose first step fails (its compile) says so once and gathers.
    compile_scope (compiled only): "step", the whole decode step one compiled graph, or "layers",
    the decoder layers through one compiled function that every layer shares (one layer traced and
    compiled, not 36), the embedding, norm, head and argmax eager between them; on a GPU either is
    replayed as one CUDA graph of the whole step, so the host launches a step in one call both ways.
    "layers" is the default: as fast a step, and a fresh process traces one layer, not the step.
    tail_slots: the decode step's narrower widths for the data set's tail (Scheduler.fit_width):
    once no more sequences are left than one of them holds and none are to come, the steps run
    that many rows (a compiled shape and CUDA graph each); (): every step runs all the slots.
    split_kv: flex attention's split of each sequence's keys on a GPU (step.FLEX_SPLIT_KV; 0: the
    kernel's own choice). compile_prefill: a prefill chunk's decoder layers through one compiled
    function at dynamic shapes (a chunk's tokens and keys vary from chunk to chunk), not replayed as
    a CUDA graph: eager, a layer's norms, rotary embedding and activation are some 40 small kernels
    over the chunk's tokens, compiled a few fused ones."""

    slots: int
    page_size: int
    pages: int
    max_tokens: int
    chunk: int
    compile: bool = False
    attention: str = "gather"
    gather_if_flex_fails: bool = False
    compile_scope: str = "layers"
    tail_slots: tuple[int, ...] = ()
    split_kv: int = FLEX_SPLIT_KV
    compile_prefill: bool = False

    def __post_init__(self):
        if self.attention not in ATTENTIONS:
            raise ValueError(
                f"paged engine: attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}"
            )
        if self.compile_scope not in COMPILE_SCOPES:
            raise ValueError(
                f"paged engine: compile_scope must be one of {', '.join(COMPILE_SCOPES)}, "
                f"got {self.compile_scope!r}"
            )
        if self.split_kv < 0:
            raise ValueError(
                f"paged engine: split_kv must be 0 (the kernel's own) or more, got {self.split_kv}"
            )
        for name in ("slots", "page_size", "max_tokens", "chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"paged engine: {name} must be at least 1, got {getattr(self, name)}")
        if any(not 1 <= width < self.slots for width in self.tail_slots):
            raise ValueError(
                f"paged engine: tail_slots must each be at least 1 and fewer than the {self.slots} slots, "
                f"got {list(self.tail_slots)}"
            )
        if self.pages - 1 < self.max_pages:
            raise ValueError(
                f"paged engine: a sequence of {self.max_tokens} tokens takes {self.max_pages} pages of "
                f"{self.page_size} tokens, and the pool holds {self.pages - 1} (one page is scratch); "
                "raise data.regen_batch_tokens or lower data.regen_max_new_tokens"
            )

    @property
    def max_pages(self) -> int:
        return pages_for(self.max_tokens, self.page_size)


_COMPILED_STEPS: dict = {}
_COMPILED_LAYER: list = []  # call_layer compiled once a process, shared by every layers-scope step


def compiled_decode_step(attention: str, scope: str = "step"):
    """The decode step compiled once a process (a new wrapper would trace again), at static shapes,
    without torch's CUDA graphs (DecodeStep records its own): the whole step ("step"), or the step
    eager around one compiled decoder layer that every layer calls ("layers"). Inductor's output
    is kept in the compile cache as every compile's is; Dynamo's trace is not (torch's precompile,
    which the static engine uses, refuses this step's guards with transformers 5.24: decoder
    layers look up `type(self).forward`, a class guard it cannot keep), so each process traces
    again: the whole step's 36 layers, or one layer."""
    if (attention, scope) not in _COMPILED_STEPS:
        if scope == "layers":
            if not _COMPILED_LAYER:
                _COMPILED_LAYER.append(torch.compile(call_layer, dynamic=False))
            step = functools.partial(DECODE_STEPS[attention], run_layer=_COMPILED_LAYER[0])
        else:
            step = torch.compile(DECODE_STEPS[attention], dynamic=False)
        _COMPILED_STEPS[attention, scope] = step
    return _COMPILED_STEPS[attention, scope]


@functools.cache
def compiled_prefill_layer():
    """call_prefill_layer compiled once a process, at dynamic shapes: one trace serves every chunk's
    count of tokens and keys (a chunk of one token, whose sizes Dynamo specializes, a second)."""
    return torch.compile(call_prefill_layer, dynamic=True)


def failure_text(exc: Exception) -> str:
    """`Type: the first line of its message`, for a one-line notice."""
    return f"{type(exc).__name__}: {first_line(exc, 200)}"


class PagedEngine:
    def __init__(self, target, settings: PagedSettings, notice: Callable[[str], None] | None = None):
        parameter = next(target.parameters())
        self.target, self.settings = target, settings
        self.notice = notice or (lambda line: print(line, file=sys.stderr, flush=True))
        self.kv = PagedKV(target.config, settings.pages, settings.page_size, settings.max_pages,
                          parameter.device, parameter.dtype)  # fmt: skip
        self.graphed = settings.compile and parameter.device.type == "cuda"
        # The decode step of each width in use (all the slots; the narrower ones at a data set's
        # tail), made when first needed; `width` is the one the next step runs.
        self.attention_now = settings.attention
        self.prefill_compiled = settings.compile_prefill  # False after a compiled chunk failed
        self.widths: dict[int, DecodeStep] = {}
        self.width = settings.slots
        self.iterations = self.decode_steps = self.prefill_chunks = self.preemptions = 0
        self.width_steps: Counter = Counter()  # decode steps by their width
        # Where the loop's wall time goes, in seconds (a bench prints it): "decode inputs" (the
        # host building a step's inputs and launching it), "decode wait" (until its tokens are on
        # the host: the device's step, where the host waits for it), "decode outputs", "prefill"
        # (a chunk, its tokens read back) and "scheduling" (admit, grow, release, follow-ups).
        self.seconds: Counter = Counter()
        # The decode table on the host, each slot's row written again only when its sequence
        # (admission) or its page count changes; table_rows says what each row holds.
        self.host_table = torch.zeros(settings.slots, settings.max_pages, dtype=torch.long)
        self.table_rows: list = [None] * settings.slots

    @property
    def slot_steps(self) -> int:
        """The row-steps the decode steps ran: each step's width, summed."""
        return sum(width * steps for width, steps in self.width_steps.items())

    @property
    def attention(self) -> str:
        """How the decode steps read the pages now: the settings' own, or "gather" after a fall-back."""
        return self.attention_now

    @property
    def steps(self) -> DecodeStep:
        """The decode step of the width the next step runs."""
        if self.width not in self.widths:
            self.widths[self.width] = self.decode_steps_with(self.attention_now, self.width)
        return self.widths[self.width]

    def decode_steps_with(self, attention: str, width: int) -> DecodeStep:
        s = self.settings
        step = compiled_decode_step(attention, s.compile_scope) if s.compile else DECODE_STEPS[attention]
        return DecodeStep(step, self.target, self.kv, width, self.graphed, whole_pool=attention == "flex")

    def next_tokens(self) -> torch.Tensor:
        """The decode step's next token of every slot. Flex attention's step may fail to compile
        (Inductor on torch 2.11 could not lower an earlier form of it) or to be recorded as a CUDA
        graph: with gather_if_flex_fails, such a failure is said once and the steps gather the pages
        from then on (the step again from its inputs: the keys it may have written are the same)."""
        if self.settled or not (self.settings.gather_if_flex_fails and self.attention == "flex"):
            return self.steps.next()
        try:
            return self.steps.next()
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # any failure to compile or record: the gathered step does the same work
            self.notice(
                f"paged engine: flex attention's decode step failed ({failure_text(exc)}); "
                "the decode steps read gathered pages instead, more slowly (data.regen_attention=sdpa "
                "skips this attempt)"
            )
            failed = self.steps
            self.attention_now = "gather"
            self.widths.clear()  # every width's step gathers from now on
            for name in ("tokens", "positions", "where", "table"):
                getattr(self.steps, name).copy_(getattr(failed, name))
            del failed
            return self.steps.next()

    @property
    def settled(self) -> bool:
        """The decode step has compiled and, where it is graphed, been recorded as its CUDA graph."""
        recorded = self.steps.recorded
        return recorded.graph is not None if self.graphed else recorded.ran

    @torch.no_grad()
    def generate(self, requests: Iterable[Request], max_new_tokens: int, end_id: int,
                 follow_up: Callable[[object, list[int]], Iterable[Request]] | None = None,
                 should_stop: Callable[[], bool] = lambda: False,
                 answer_limit: Callable[[object], int] | None = None,
                 more: Callable[[], list[Request]] | None = None) -> dict | None:  # fmt: skip
        """{key: answer without its end token} for every request and follow-up; None if a stop came
        (between iterations). answer_limit (a bench's, for targets that never say their end token):
        a request's answer ends after that many tokens, if fewer than max_new_tokens. more: called
        whenever no request waits, for the next ones (a stream of shards keeps every slot busy
        across their ends); its first empty answer ends the feeding. With `more` the answers are
        handed to follow_up only (a stream's would not fit in memory): the dict is empty."""

        def limit(key) -> int:
            return min(max_new_tokens, answer_limit(key)) if answer_limit else max_new_tokens

        if self.settings.attention == "flex":
            with attention_of(self.target, register_paged_attention(self.settings.split_kv)):
                return self.run(requests, max_new_tokens, end_id, follow_up, should_stop, limit, more)
        return self.run(requests, max_new_tokens, end_id, follow_up, should_stop, limit, more)

    def run(self, requests, max_new_tokens: int, end_id: int, follow_up, should_stop, limit,
            more=None) -> dict | None:  # fmt: skip
        s = self.settings
        scheduler = Scheduler(s.slots, s.pages, s.page_size, s.max_pages, s.chunk)
        # Every row anew: a row is known by its sequence's admission, which a new run counts from 0
        # again, so a row kept from the last run could pass for this one's and read its pages.
        self.host_table.zero_()
        self.table_rows = [None] * s.slots

        def add(new_requests: Iterable[Request]) -> int:
            added = 0
            for key, prompt in new_requests:
                scheduler.add(self.checked(key, prompt, max_new_tokens, limit(key)))
                added += 1
            return added

        add(requests)
        answers = {}
        feeding = more is not None
        while True:
            if feeding and not scheduler.waiting:
                feeding = add(more()) > 0
            if not scheduler.busy:
                break
            if should_stop():
                return None
            began = time.perf_counter()
            # The data set's tail: a narrower step once what is left fits it and nothing more comes.
            self.width = scheduler.fit_width(() if feeding else s.tail_slots)
            scheduler.admit()
            scheduler.grow()
            self.seconds["scheduling"] += time.perf_counter() - began
            ended = self.decode(scheduler, end_id)
            began = time.perf_counter()
            ended += self.prefill(scheduler, end_id)
            now = time.perf_counter()
            self.seconds["prefill"] += now - began
            began = now
            for sequence in ended:
                scheduler.release(sequence)
                answer = sequence.answer[:-1] if sequence.answer[-1] == end_id else sequence.answer
                if more is None:
                    answers[sequence.key] = answer
                add(follow_up(sequence.key, answer) if follow_up else ())
            self.seconds["scheduling"] += time.perf_counter() - began
            self.iterations += 1
        self.preemptions += scheduler.preemptions
        return answers

    def checked(self, key, prompt: list[int], max_new_tokens: int, limit: int) -> Sequence:
        # The last answer token is never written to the cache: prompt + max_new_tokens - 1 positions.
        if not prompt or len(prompt) + max_new_tokens - 1 > self.settings.max_tokens:
            raise ValueError(
                f"paged engine: a prompt of {len(prompt)} tokens and {max_new_tokens} new ones do not fit "
                f"a slot of {self.settings.max_tokens} tokens"
            )
        return Sequence(key, list(prompt), limit=limit)

    def decode(self, scheduler: Scheduler, end_id: int) -> list[Sequence]:
        began = time.perf_counter()
        decoding = scheduler.decoding()
        if not decoding:
            return []
        slots, page_size = self.width, self.settings.page_size
        tokens, positions, where = [0] * slots, [0] * slots, [0] * slots  # idle: the scratch page
        rows = [None] * slots
        for sequence in decoding:
            position = sequence.computed
            tokens[sequence.slot], positions[sequence.slot] = sequence.answer[-1], position
            where[sequence.slot] = sequence.pages[position // page_size] * page_size + position % page_size
            rows[sequence.slot] = (sequence.admitted, len(sequence.pages))
            if self.table_rows[sequence.slot] != rows[sequence.slot]:
                self.host_table[sequence.slot] = torch.tensor(self.kv.table_row(sequence.pages))
        for slot, row in enumerate(rows):
            if row is None and self.table_rows[slot] is not None:
                self.host_table[slot] = 0  # the scratch page
        self.table_rows[:slots] = rows
        self.steps.load(tokens, positions, where, self.host_table[:slots])
        following = self.next_tokens()
        launched = time.perf_counter()
        following = following.tolist()
        waited = time.perf_counter()
        self.decode_steps += 1
        self.width_steps[slots] += 1
        for sequence in decoding:
            sequence.computed += 1
            sequence.answer.append(following[sequence.slot])
        ended = [q for q in decoding if q.answer[-1] == end_id or len(q.answer) == q.limit]
        self.seconds["decode inputs"] += launched - began
        self.seconds["decode wait"] += waited - launched
        self.seconds["decode outputs"] += time.perf_counter() - waited
        return ended

    def prefill_forward(self, pages, tokens, positions, seen) -> torch.Tensor:
        """A chunk's forward, its layers compiled (compile_prefill) or eager. A compiled chunk that
        fails (its compile, at a shape Inductor cannot lower) is said once and runs again eagerly,
        as does every later chunk: its keys are written again whole, the same positions."""
        if not self.prefill_compiled:
            return paged_forward(self.target, pages, tokens, positions, seen)
        try:
            return paged_forward(self.target, pages, tokens, positions, seen, compiled_prefill_layer())
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # any failure to compile: the eager chunk does the same work
            self.notice(
                f"paged engine: the compiled prefill failed ({failure_text(exc)}); the "
                "prefill chunks run eagerly from now on, more slowly"
            )
            self.prefill_compiled = False
            return paged_forward(self.target, pages, tokens, positions, seen)

    def prefill(self, scheduler: Scheduler, end_id: int) -> list[Sequence]:
        """One prefill chunk, when one is due (Scheduler.prefill_due): the chunks of every sequence in
        it packed in one row, each reading its own pages; a sequence whose prompt it ends gets its
        first answer token."""
        if not scheduler.prefill_due():
            return []
        chunks = scheduler.next_chunk()
        page_size, device = self.settings.page_size, self.kv.device
        tokens, positions, owners, where, ends = [], [], [], [], []
        table, key_owners, key_positions = [], [], []
        for owner, chunk in enumerate(chunks):
            pages = chunk.sequence.pages
            span = range(chunk.start, chunk.start + len(chunk.tokens))
            tokens += chunk.tokens
            positions += span
            owners += [owner] * len(span)
            where += [pages[p // page_size] * page_size + p % page_size for p in span]
            ends.append(len(tokens) - 1)
            # Only the pages up to the chunk's last token: a chunk's keys are its own tokens and what
            # came before them, not every sequence's whole slot (which made the attention, and the
            # keys gathered for it, grow with the chunk's sequences times the slot's length).
            seen_pages = pages[: pages_for(span.stop, page_size)]
            table += seen_pages
            key_owners += [owner] * (len(seen_pages) * page_size)
            key_positions += range(len(seen_pages) * page_size)
        as_row = lambda values: torch.tensor([values], dtype=torch.long, device=device)  # noqa: E731
        positions_row, table_row = as_row(positions), as_row(table)
        seen = packed_visible(positions_row, as_row(owners), as_row(key_owners)[0], as_row(key_positions)[0])
        pages = layer_pages(self.kv, table_row, as_row(where))
        hidden = self.prefill_forward(pages, as_row(tokens), positions_row, seen)
        following = greedy(self.target, hidden[0, ends]).tolist()
        self.prefill_chunks += 1
        done = []
        for chunk, token in zip(chunks, following, strict=True):
            sequence = chunk.sequence
            sequence.computed += len(chunk.tokens)
            if not chunk.last:
                continue
            sequence.decoding = True
            sequence.answer.append(token)
            if token == end_id or len(sequence.answer) == sequence.limit:
                done.append(sequence)
        return done
