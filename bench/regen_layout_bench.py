"""What regenerating a chat data set costs in decode passes, with and without leaving out the turns a
training row never sees (data.regen's max_prompt_tokens = train.seq_len), on the CPU, no target.

    python bench/regen_layout_bench.py CHAT_JSONL TOKENIZER_DIR [--seq-len 3072] [--new-tokens 256]
    python bench/regen_layout_bench.py CHAT_JSONL TOKENIZER_DIR --batches 256:131072,512:262144

The data set is read, tokenized and cut into shards as the product does (data.regen_shard_size),
and each shard's turns are laid out in the static engine's batches (trainer.data.regen's
static_batches at the product's defaults, flex attention's 128-token minimum width). A batch costs
a decode step per new token whatever its rows, so batches x new tokens is the decoding's length;
prompt tokens are the prefill's work. Each earlier answer is counted at min(its original length,
new tokens), as a regenerated one would be at most.
--batches ROWS:TOKENS,...: the layout at each (data.regen_batch_size, data.regen_batch_tokens),
side by side: its batches, decode steps and distinct compiled shapes (rows filled x width): each
shape is a compile of the decode step in every worker process, once per machine with the compile
cache (docs/PERFORMANCE.md gives what a shape costs cold and warm). Each row also says what the
batches cost if every regenerated answer ends where the file's does: a batch decodes until its
longest answer has ended (read every 16 tokens), so with a large --new-tokens the rows whose
answers ended early wait for it; "row-steps used" is the share of rows x steps that are answers.
--paged SLOTS:CHUNK[:TAIL[/TAIL...]],...: the paged engine's scheduler over the same shards, one
stream (a conversation's next turn queued when its answer is done), TAIL the narrower steps' slots at
the data set's tail (data.regen_tail_slots; none unless given here, e.g. 256:1024:128/32);
--answers-at-cap: every answer as long as
--new-tokens (what a random-weights target gives, as in the GPU benches), and beside the stream
every turn queued at once, as regen_bench's paged row runs a chat file's prompts: the two differ
by the steps a next turn waits for the answer before it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import FLEX_MIN_LEN, DataConfig
from trainer.data.chat import ChatFormat, prompt_ids, tokenize_stream
from trainer.data.decode import STOP_CHECK_EVERY
from trainer.data.engine.conversations import longest_sequence, slot_tokens
from trainer.data.engine.scheduler import Scheduler, Sequence
from trainer.data.regen import DataIndex, RegenSettings, compiled_rows, static_batches, turns_seen_in_training
from trainer.model.target import load_tokenizer


def shard_prompts(examples, chat, new_tokens: int, limit: int | None, lengths: list | None = None,
                  owners: list | None = None):  # fmt: skip
    """Each round's prompts (turn by turn), answers cut to new_tokens; turns past limit left out as
    the product leaves them out (turns_seen_in_training). Returns (rounds, turns left out); each
    round's answer lengths in the file (cut to new_tokens) are appended to `lengths` if given, and
    the conversations the round's prompts belong to to `owners`."""
    header = len(chat.header("assistant"))
    answers = sum(role == "assistant" for example in examples for role, _ in example.turns)
    rounds = []
    for turn in range(max(len(e.turns) for e in examples)):
        todo = [i for i, e in enumerate(examples) if len(e.turns) > turn and e.turns[turn][0] == "assistant"]
        prompts = [prompt_ids(examples[i], chat, turn) for i in todo]
        todo, prompts = turns_seen_in_training(examples, todo, prompts, turn, header, limit)
        for i in todo:
            examples[i].turns[turn] = ("assistant", examples[i].turns[turn][1][:new_tokens])
        rounds.append(prompts)
        if lengths is not None:
            lengths.append([len(examples[i].turns[turn][1]) for i in todo])
        if owners is not None:
            owners.append(list(todo))
    return rounds, answers - sum(map(len, rounds))


def conversation_turns(rounds, lengths, owners, conversations: int) -> list[list[tuple[int, int]]]:
    """Each conversation's generated turns in order: (prompt tokens, answer tokens in the file)."""
    turns: list[list[tuple[int, int]]] = [[] for _ in range(conversations)]
    for prompts, answer_lengths, who in zip(rounds, lengths, owners, strict=True):
        for prompt, answer, i in zip(prompts, answer_lengths, who, strict=True):
            turns[i].append((len(prompt), answer))
    return turns


@dataclass
class PagedLayout:
    """What the paged engine's loop does over some conversations, in token counts."""

    iterations: int = 0
    decode_steps: int = 0
    slot_steps: int = 0  # decode steps x slots
    decoding: int = 0  # slot-steps that decode an answer token
    prefill_chunks: int = 0
    prefill_tokens: int = 0
    answer_tokens: int = 0
    preemptions: int = 0

    def add(self, other: PagedLayout) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


LayoutShard = tuple[list[list[tuple[int, int]]], int]  # each conversation's turns, the longest sequence


def paged_layout(shards: list[LayoutShard], new_tokens: int, slots: int, chunk: int, page_size: int,
                 pages: int, tail: tuple[int, ...] = ()) -> PagedLayout:  # fmt: skip
    """The paged stage's stream (conversations.paged_shards: PagedEngine.run fed shard after shard)
    over shards of (each conversation's turns, the shard's longest sequence), each answer ending
    where the file's does (its end token the last of it, or cut at new_tokens), without a model:
    the scheduler is the product's, each decode step gives every decoding slot one token, each
    prefill chunk computes its tokens, a conversation's next turn is queued when its answer is
    done, the next shard when no turn waits, and a shard needing longer slots waits for a drain."""
    layout = PagedLayout()
    following = 0
    while following < len(shards):
        following = one_engine(shards, following, layout, new_tokens, slots, chunk, page_size, pages, tail)
    return layout


def one_engine(shards: list[LayoutShard], following: int, layout: PagedLayout, new_tokens: int, slots: int,
               chunk: int, page_size: int, pages: int, tail: tuple[int, ...] = ()) -> int:  # fmt: skip
    """paged_layout's engine from shard `following` until a shard needs longer slots or none is left;
    its figures added to `layout`. Returns the next shard's index."""
    max_tokens = slot_tokens(shards[following][1], page_size, pages)
    scheduler = Scheduler(slots, pages, page_size, max_tokens // page_size, chunk)

    def queue(key: tuple[int, int, int]) -> bool:
        shard, conversation, turn = key
        turns = shards[shard][0][conversation]
        if turn >= len(turns):
            return False
        prompt, answer = turns[turn]
        scheduler.add(Sequence(key, [0] * prompt, limit=min(new_tokens, answer + 1)))
        return True

    def begin(shard: int) -> int:
        return sum(queue((shard, conversation, 0)) for conversation in range(len(shards[shard][0])))

    begin(following)
    following += 1
    feeding = True
    while True:
        if feeding and not scheduler.waiting:
            added = 0
            while not added and following < len(shards) and shards[following][1] <= max_tokens:
                added = begin(following)
                following += 1
            feeding = added > 0
        if not scheduler.busy:
            break
        width = scheduler.fit_width(() if feeding else tail)
        scheduler.admit()
        scheduler.grow()
        decoding = scheduler.decoding()
        if decoding:
            layout.decode_steps += 1
            layout.slot_steps += width
            layout.decoding += len(decoding)
            for sequence in decoding:
                sequence.computed += 1
                sequence.answer.append(0)
        ended = [s for s in decoding if len(s.answer) == s.limit]
        chunks = scheduler.next_chunk() if scheduler.prefill_due() else []
        if chunks:
            layout.prefill_chunks += 1
            layout.prefill_tokens += sum(len(c.tokens) for c in chunks)
        for c in chunks:
            c.sequence.computed += len(c.tokens)
            if c.last:
                c.sequence.decoding = True
                c.sequence.answer.append(0)
                if len(c.sequence.answer) == c.sequence.limit:
                    ended.append(c.sequence)
        for sequence in ended:
            scheduler.release(sequence)
            layout.answer_tokens += len(sequence.answer)
            shard, conversation, turn = sequence.key
            queue((shard, conversation, turn + 1))
        layout.iterations += 1
    layout.preemptions += scheduler.preemptions
    return following


def paged_settings(text: str) -> tuple[int, int, tuple[int, ...]]:
    """SLOTS:CHUNK[:TAIL/TAIL...] as (slots, chunk, tail widths)."""
    slots, chunk, *tail = text.split(":")
    return int(slots), int(chunk), tuple(int(width) for width in (tail[0].split("/") if tail else []))


def steps_to_end(answer_lengths: list[int], new_tokens: int) -> int:
    """Decode steps a batch takes if each row's answer ends where the file's does: the engine reads
    whether every row has ended every STOP_CHECK_EVERY tokens, and a row ends with its end token."""
    longest = max(answer_lengths) + 1  # the end token
    return min(new_tokens, -(-longest // STOP_CHECK_EVERY) * STOP_CHECK_EVERY)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("chat_file")
    parser.add_argument("tokenizer_dir")
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--conversations", type=int, help="only the first N")
    parser.add_argument(
        "--batches", help="ROWS:TOKENS,...: batch sizes and KV budgets side by side (default: the product's)"
    )
    parser.add_argument(
        "--paged", help="SLOTS:CHUNK[:TAIL/TAIL...],...: the paged engine's scheduler at these settings"
    )
    parser.add_argument(
        "--pool-tokens", type=int, default=DataConfig.regen_batch_tokens,
        help="--paged: the KV pool in tokens (data.regen_batch_tokens; default the product's)",
    )  # fmt: skip
    parser.add_argument(
        "--by-shard", action="store_true", help="--paged: also each shard alone, through an engine of its own"
    )
    parser.add_argument(
        "--answers-at-cap", action="store_true",
        help="--paged: every answer --new-tokens long (a random-weights target's), every turn at once beside",
    )  # fmt: skip
    args = parser.parse_args()
    d = DataConfig()
    settings_pairs = [pair for pair in (args.paged or "").split(",") if pair]
    paged = {paged_settings(pair): PagedLayout() for pair in settings_pairs}
    if args.pool_tokens < 2 * d.regen_page_size:
        parser.error(f"--pool-tokens must hold two pages of {d.regen_page_size} tokens at least")
    pool_pages = args.pool_tokens // d.regen_page_size
    paged_shards: list = []
    pairs = [tuple(map(int, pair.split(":"))) for pair in (args.batches or "").split(",") if pair]
    layouts = {
        (rows, tokens): RegenSettings(
            max_new_tokens=args.new_tokens, batch_size=rows, batch_tokens=tokens,
            min_width=max(d.regen_min_width, FLEX_MIN_LEN),
        )
        for rows, tokens in pairs or [(d.regen_batch_size, d.regen_batch_tokens)]
    }
    chat = ChatFormat(load_tokenizer(Path(args.tokenizer_dir)))
    began = time.monotonic()
    index = DataIndex.build(Path(args.chat_file))
    total = min(len(index), args.conversations or len(index))
    indexed = time.monotonic() - began
    print(f"{total:,} conversations indexed in {indexed:.0f} s; shards of {d.regen_shard_size}")
    figures = {None: [0, 0, 0], args.seq_len: [0, 0, 0]}  # turns, dropped, prompt tokens
    # batches, shapes, and if answers end where the file's do: steps, answer tokens, row-steps
    batches = {(limit, key): [0, set(), 0, 0, 0] for limit in figures for key in layouts}
    for start in range(0, total, d.regen_shard_size):
        conversations = index.read(start, min(start + d.regen_shard_size, total))
        examples = list(tokenize_stream((m for _, m in conversations), chat))
        for limit, counts in figures.items():
            copies = [type(e)(list(e.turns)) for e in examples]
            lengths: list[list[int]] = []
            owners: list[list[int]] = []
            rounds, dropped = shard_prompts(copies, chat, args.new_tokens, limit, lengths, owners)
            counts[0] += sum(map(len, rounds))
            counts[1] += dropped
            counts[2] += sum(len(p) for prompts in rounds for p in prompts)
            for key, settings in layouts.items():
                figure = batches[limit, key]
                for prompts, answer_lengths in zip(rounds, lengths, strict=True):
                    for width, chunk in static_batches(prompts, settings) if prompts else []:
                        rows = compiled_rows(len(chunk), width, settings)
                        steps = steps_to_end([answer_lengths[i] for i in chunk], args.new_tokens)
                        figure[0] += 1
                        figure[1].add((rows, width))
                        figure[2] += steps
                        figure[3] += sum(answer_lengths[i] for i in chunk)
                        figure[4] += steps * rows
            if limit == args.seq_len and paged:  # the product leaves the turns past the rows out
                turns = conversation_turns(rounds, lengths, owners, len(examples))
                if args.answers_at_cap:
                    turns = [[(prompt, args.new_tokens) for prompt, _ in turn_list] for turn_list in turns]
                paged_shards.append((turns, longest_sequence(examples, chat, args.new_tokens, limit)))
    by_shard = {key: PagedLayout() for key in paged} if args.by_shard else {}
    at_once = {key: PagedLayout() for key in paged} if args.answers_at_cap else {}
    apart = [([[turn] for conversation in turns for turn in conversation], longest)
             for turns, longest in paged_shards] if at_once else []  # fmt: skip
    for (slots, chunk, tail), layout in at_once.items():  # each turn a conversation of its own
        layout.add(paged_layout(apart, args.new_tokens, slots, chunk, d.regen_page_size, pool_pages, tail))
    for (slots, chunk, tail), layout in paged.items():  # one worker's stream over every shard
        layout.add(paged_layout(paged_shards, args.new_tokens, slots, chunk, d.regen_page_size, pool_pages,
                                tail))  # fmt: skip
        for shard in paged_shards if args.by_shard else []:
            by_shard[slots, chunk, tail].add(paged_layout([shard], args.new_tokens, slots, chunk,
                                                          d.regen_page_size, pool_pages, tail))  # fmt: skip
    print(f"read and laid out in {time.monotonic() - began:.0f} s")
    every, seen = figures[None], figures[args.seq_len]
    for limit, name in ((None, "every turn"), (args.seq_len, f"turns before {args.seq_len} tokens")):
        counts = figures[limit]
        print(f"{name}: {counts[0]:,} turns generated ({counts[1]:,} left out), {counts[2]:,} prompt tokens")
        for rows, tokens in layouts:
            laid, shapes, steps, answered, row_steps = batches[limit, (rows, tokens)]
            print(
                f"{'':>8}batches of {rows:>4} rows, {tokens:>7,} cache tokens: {laid:>7,} batches = "
                f"{laid * args.new_tokens:>10,} decode steps, {len(shapes):>3} compiled shapes; answers "
                f"ending as the file's: {steps:,} steps, {answered / max(1, row_steps):.0%} of row-steps used"
            )
    rows = [(key, layout, "one stream") for key, layout in paged.items()]
    rows += [(key, layout, "shard by shard") for key, layout in by_shard.items()]
    rows += [(key, layout, "every turn at once") for key, layout in at_once.items()]
    for (slots, chunk, tail), layout, how in rows:
        narrower = f" ({'/'.join(map(str, tail))} at the tail)" if tail else ""
        print(
            f"{'':>8}paged engine {how}, {slots:>4} slots{narrower}, prefill chunks of {chunk:>5}, "
            f"{pool_pages * d.regen_page_size:,} tokens of pages: {layout.iterations:,} iterations, "
            f"{layout.decode_steps:,} decode steps, "
            f"{layout.decoding / max(1, layout.slot_steps):.0%} of slot-steps used, "
            f"{layout.prefill_tokens:,} prefill tokens in {layout.prefill_chunks:,} chunks, "
            f"{layout.preemptions:,} preemptions"
        )
    first = next(iter(layouts))
    steps_every, steps_seen = batches[None, first][0], batches[args.seq_len, first][0]
    print(
        f"left out: {1 - seen[0] / every[0]:.2%} of turns, {1 - seen[2] / every[2]:.2%} of prompt tokens, "
        f"{1 - steps_seen / steps_every:.2%} of decode steps"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
