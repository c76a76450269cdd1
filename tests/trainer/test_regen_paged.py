"""The paged regeneration engine (trainer/data/engine/): continuous batching over a paged KV cache.
Every answer equals plain greedy `generate` of its prompt alone in float32, whatever its neighbours,
whatever its slot and pages held before, chunked prefills and preemptions included; the scheduler
refills a slot at once and preempts the newest sequence when the pages run out."""

from __future__ import annotations

import errno
import json
import pathlib
import sys

import pytest
import torch

from trainer.data.chat import ChatFormat, DataError, iter_conversations
from trainer.data.engine import PagedEngine, PagedSettings, conversations
from trainer.data.engine import step as paged_step
from trainer.data.engine.scheduler import Scheduler, Sequence
from trainer.data.regen import DataIndex, Progress, Regeneration, RegenSettings, run_workers
from trainer.model.target import load_target, load_tokenizer
from trainer.run.regen import slot_steps_text

pytestmark = pytest.mark.unit

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def tiny(embedded):
    """(target on cpu in float32, chat format) of the embedded default."""
    target_path, _ = embedded
    return load_target(target_path, "cpu", "float32"), ChatFormat(load_tokenizer(target_path))


def greedy(target, prompt: list[int], end_id: int, new_tokens: int = NEW_TOKENS) -> list[int]:
    ids = torch.tensor([prompt])
    output = target.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
        eos_token_id=end_id, pad_token_id=0,
    )[0, len(prompt) :].tolist()  # fmt: skip
    return output[: output.index(end_id)] if end_id in output else output


@pytest.fixture(scope="module")
def prompts_and_answers(embedded, tiny):
    """Twelve prompts of 3 to 58 tokens, an end token that ends some answers after 0 to 6 tokens
    (the commonest early token of the free-running answers), and each prompt's answer alone."""
    target, chat = tiny
    texts = [" ".join(m["content"] for m in messages) for _, messages in iter_conversations(embedded[1])]
    prompts = [(chat.text(texts[i]) * 8)[: 3 + 5 * i] for i in range(12)]
    free_running = [greedy(target, p, end_id=-1) for p in prompts]
    early = [token for answer in free_running for token in answer[:8]]
    end_id = max(set(early), key=early.count)
    answers = [greedy(target, p, end_id) for p in prompts]
    assert any(len(a) < NEW_TOKENS for a in answers) and any(len(a) == NEW_TOKENS for a in answers)
    return prompts, end_id, answers


def engine(target, **changes) -> PagedEngine:
    base = {"slots": 3, "page_size": 4, "pages": 64, "max_tokens": 80, "chunk": 8}
    return PagedEngine(target, PagedSettings(**{**base, **changes}))


@pytest.mark.parametrize(
    "pages, tail", [(64, ()), (26, ()), (64, (2, 1)), (26, (2,))],
    ids=["roomy", "preempting", "narrower-tail", "narrower-tail-preempting"],
)  # fmt: skip
def test_every_answer_equals_greedy_generate_of_its_prompt_alone(tiny, prompts_and_answers, pages, tail):
    """More prompts than slots (each slot runs several in turn), prompts longer than a prefill chunk,
    answers that end early; with a pool of 25 pages the newest sequences are preempted and
    recomputed; with narrower steps at the tail the last sequences move to the first slots
    mid-answer (their pages where they were) and decode in steps of fewer rows."""
    prompts, end_id, reference = prompts_and_answers
    paged = engine(tiny[0], pages=pages, tail_slots=tail)
    answers = paged.generate(list(enumerate(prompts)), NEW_TOKENS, end_id)
    assert [answers[i] for i in range(len(prompts))] == reference
    assert (paged.preemptions > 0) == (pages == 26)
    assert paged.prefill_chunks > len(prompts)  # chunked
    assert sorted(paged.widths) == sorted({3, *tail})  # each narrower step ran at the tail


def test_the_loop_s_time_is_told_by_part_and_adds_up_to_no_more_than_the_wall_time(tiny, prompts_and_answers):
    import time

    prompts, end_id, _ = prompts_and_answers
    paged = engine(tiny[0])
    began = time.perf_counter()
    paged.generate(list(enumerate(prompts)), NEW_TOKENS, end_id)
    wall = time.perf_counter() - began
    parts = {"decode inputs", "decode wait", "decode outputs", "prefill", "scheduling"}
    assert set(paged.seconds) == parts
    assert all(paged.seconds[part] > 0 for part in ("decode inputs", "prefill"))
    assert sum(paged.seconds.values()) <= wall


def test_a_flex_step_that_fails_is_said_once_and_the_engine_gathers_with_the_same_answers(
    tiny, prompts_and_answers, monkeypatch
):
    """A flex step that fails (as Inductor failed to compile an earlier form of it): with
    gather_if_flex_fails (data.regen_attention=auto) one line says so and every answer is still
    greedy generate's; asked for flex by name, the failure stops the engine."""
    from trainer.data.engine import engine as paged_engine

    def failing(*args):
        raise RuntimeError("LoweringException: cannot lower this block mask\n(the rest of a long report)")

    monkeypatch.setitem(paged_engine.DECODE_STEPS, "flex", failing)
    prompts, end_id, reference = prompts_and_answers
    notices = []
    settings = PagedSettings(slots=3, page_size=4, pages=26, max_tokens=80, chunk=8, attention="flex",
                             gather_if_flex_fails=True)  # fmt: skip
    paged = PagedEngine(tiny[0], settings, notice=notices.append)
    assert paged.attention == "flex"
    for _ in range(2):  # a second shard on the same engine tries nothing again
        answers = paged.generate(list(enumerate(prompts)), NEW_TOKENS, end_id)
        assert [answers[i] for i in range(len(prompts))] == reference
    assert paged.attention == "gather" and paged.preemptions > 0
    assert notices == [
        "paged engine: flex attention's decode step failed (RuntimeError: LoweringException: cannot lower "
        "this block mask); the decode steps read gathered pages instead, more slowly "
        "(data.regen_attention=sdpa skips this attempt)"
    ]
    named = PagedEngine(tiny[0], PagedSettings(**{**settings.__dict__, "gather_if_flex_fails": False}))
    with pytest.raises(RuntimeError, match="cannot lower"):
        named.generate(list(enumerate(prompts)), NEW_TOKENS, end_id)


def test_a_compiled_prefill_that_fails_is_said_once_and_the_chunks_run_eagerly_with_the_same_answers(
    tiny, prompts_and_answers, monkeypatch
):
    """The compiled prefill's failure on its third chunk (after two chunks' keys were written by
    it), as a shape Inductor cannot lower would fail: one line says so, that chunk and every later
    one run eagerly, and every answer is still greedy generate's, across a second call too."""
    from trainer.data.engine import engine as paged_engine

    calls = []

    def compiled_layer(*args):
        calls.append(1)
        if len(calls) > 2 * len(tiny[0].model.layers):
            raise RuntimeError("InductorError: cannot lower this shape\n(the rest of a long report)")
        return paged_step.call_layer(*args)

    monkeypatch.setattr(paged_engine, "compiled_prefill_layer", lambda: compiled_layer)
    prompts, end_id, reference = prompts_and_answers
    notices = []
    settings = PagedSettings(slots=3, page_size=4, pages=64, max_tokens=80, chunk=8, compile_prefill=True)
    paged = PagedEngine(tiny[0], settings, notice=notices.append)
    for _ in range(2):
        answers = paged.generate(list(enumerate(prompts)), NEW_TOKENS, end_id)
        assert [answers[i] for i in range(len(prompts))] == reference
    assert paged.prefill_chunks > 3 and not paged.prefill_compiled
    assert len(calls) == 2 * len(tiny[0].model.layers) + 1  # nothing compiled was tried after the failure
    assert notices == [
        "paged engine: the compiled prefill failed (RuntimeError: InductorError: cannot lower this shape); "
        "the prefill chunks run eagerly from now on, more slowly"
    ]


@pytest.mark.parametrize("tail", [(), (2, 1)], ids=["every-slot", "narrower-tail"])
def test_the_layout_bench_s_paged_engine_follows_the_engine_step_for_step(tiny, tail):
    """The layout bench's paged stream (token counts, no model) against the engine itself on the
    tiny target, each answer ended at a given length, a second turn queued after the first and a
    second shard fed when no turn waits: the same iterations, decode steps, slot-steps, prefill
    chunks and preemptions, the pool small enough to preempt; with narrower steps at the tail too."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
    from regen_layout_bench import paged_layout

    from trainer.data.engine.conversations import slot_tokens

    new_tokens, extra, longest = 20, [5, 6, 7], 73  # a second turn: 25 + 20 + 3 prompt tokens, 20 new
    prompts = [[(3 * i + j) % 50 + 1 for j in range(4 + 3 * i)] for i in range(8)]
    answers = [[2 + (5 * i) % 19, 1 + (7 * i) % 25] for i in range(8)]  # in the file; 24 is cut at 20

    def limit(key) -> int:
        conversation, turn = key
        return min(new_tokens, answers[conversation][turn] + 1)  # the answer, then its end token

    done = {}

    def follow_up(key, answer):
        done[key] = answer
        conversation, turn = key
        return [((conversation, 1), prompts[conversation] + answer + extra)] if turn == 0 else []

    settings = PagedSettings(slots=3, page_size=4, pages=26, max_tokens=slot_tokens(longest, 4, 26), chunk=8,
                             tail_slots=tail)  # fmt: skip
    engine = PagedEngine(tiny[0], settings)
    feeds = [[((i, 0), prompts[i]) for i in range(5, 8)]]  # the second shard
    with torch.no_grad():
        engine.generate([((i, 0), prompts[i]) for i in range(5)], new_tokens, end_id=-1, follow_up=follow_up,
                        answer_limit=limit, more=lambda: feeds.pop() if feeds else [])  # fmt: skip
    assert len(done) == 16
    turns = [
        [(len(p), a[0]), (len(p) + min(new_tokens, a[0] + 1) + len(extra), a[1])]
        for p, a in zip(prompts, answers, strict=True)
    ]
    layout = paged_layout([(turns[:5], longest), (turns[5:], longest)], new_tokens, slots=3, chunk=8,
                          page_size=4, pages=26, tail=tail)  # fmt: skip
    assert engine.preemptions > 0
    assert (layout.iterations, layout.decode_steps, layout.slot_steps, layout.prefill_chunks,
            layout.preemptions) == (engine.iterations, engine.decode_steps, engine.slot_steps,
                                    engine.prefill_chunks, engine.preemptions)  # fmt: skip
    assert (engine.slot_steps < 3 * engine.decode_steps) == bool(tail)  # the tail ran narrower
    assert layout.answer_tokens == sum(map(len, done.values()))


def test_the_next_requests_are_fed_while_the_last_long_answer_still_decodes(tiny, prompts_and_answers):
    """A stream of two shards: the second's requests come in (`more`) as soon as none of the first's
    waits, so its answers are done before the first shard's long answer ends, in fewer decode steps
    than the two shards one after the other; every answer still greedy generate's."""
    prompts = prompts_and_answers[0]
    first = [(i, prompts[i]) for i in range(4)]
    second = [(i, prompts[i]) for i in range(4, 8)]
    lengths = {0: NEW_TOKENS, 1: 2, 2: 2, 3: 2, 4: 3, 5: 3, 6: 3, 7: 3}  # one long answer, the rest short

    def limit(key) -> int:
        return lengths[key]

    def run(requests, more=None):
        done = []
        paged = engine(tiny[0], chunk=64)  # prefills keep up: the decode steps are what is counted
        paged.generate(requests, NEW_TOKENS, end_id=-1, answer_limit=limit, more=more,
                       follow_up=lambda key, answer: done.append((key, answer)) or [])  # fmt: skip
        return paged, done

    feeds = [second]
    streamed, done = run(first, more=lambda: feeds.pop() if feeds else [])
    assert [key for key, _ in done].index(0) > max([key for key, _ in done].index(i) for i in range(4, 8))
    apart = [run(first)[0].decode_steps, run(second)[0].decode_steps]
    assert streamed.decode_steps < sum(apart)
    free_running = {i: greedy(tiny[0], prompts[i], end_id=-1)[: lengths[i]] for i in range(8)}
    assert dict(done) == free_running


def test_a_query_that_sees_past_its_own_positions_changes_the_answers(tiny, prompts_and_answers, monkeypatch):
    """The exactness test has teeth: with a mask that shows the rest of a sequence's last page (a
    reused page's old keys, a fresh page's zeros) the answers are no longer greedy generate's."""
    prompts, end_id, reference = prompts_and_answers
    page_size = 4

    def whole_last_page(positions, keys):
        key_positions = torch.arange(keys, device=positions.device)
        return (key_positions <= (positions[:, :, None] | (page_size - 1)))[:, None]

    monkeypatch.setattr(paged_step, "visible", whole_last_page)
    answers = engine(tiny[0], page_size=page_size).generate(list(enumerate(prompts)), NEW_TOKENS, end_id)
    assert [answers[i] for i in range(len(prompts))] != reference


def test_a_packed_prefill_that_lets_a_sequence_see_its_neighbours_changes_the_answers(
    tiny, prompts_and_answers, monkeypatch
):
    """The prefill's mask has teeth too: prompts packed in one chunk that see each other's keys
    (only the position checked, not the sequence) no longer give greedy generate's answers."""
    prompts, end_id, reference = prompts_and_answers

    def any_sequence(positions, owners, key_owners, key_positions):
        return (key_positions <= positions[:, :, None])[:, None]

    def packed_answers() -> list[list[int]]:
        answers = engine(tiny[0], chunk=24).generate(list(enumerate(prompts)), NEW_TOKENS, end_id)
        return [answers[i] for i in range(len(prompts))]

    assert packed_answers() == reference
    monkeypatch.setattr("trainer.data.engine.engine.packed_visible", any_sequence)
    assert packed_answers() != reference


def test_a_next_turn_is_queued_when_its_answer_is_done_and_sees_that_answer(tiny, prompts_and_answers):
    prompts, end_id, reference = prompts_and_answers
    target, chat = tiny
    follow = chat.text(" and then")
    queued_after: dict = {}

    def next_turn(key, answer):
        if isinstance(key, tuple):
            return []
        queued_after[key] = paged.decode_steps
        return [((key, 2), prompts[key] + answer + follow)]

    paged = engine(target, pages=40, max_tokens=120)
    answers = paged.generate(list(enumerate(prompts[:6])), NEW_TOKENS, end_id, follow_up=next_turn)
    for i in range(6):
        assert answers[i] == reference[i]
        assert answers[(i, 2)] == greedy(target, prompts[i] + reference[i] + follow, end_id)
    # the first turns end at different steps, and their next turns start then, not after them all
    assert len(set(queued_after.values())) > 1


def test_a_stop_between_iterations_returns_none(tiny, prompts_and_answers):
    prompts, end_id, _ = prompts_and_answers
    calls = iter(range(100))
    paged = engine(tiny[0])
    stop = lambda: next(calls) == 5  # noqa: E731
    stopped = paged.generate(list(enumerate(prompts)), NEW_TOKENS, end_id, should_stop=stop)
    assert stopped is None and paged.iterations == 5


def test_bad_settings_and_a_prompt_too_long_for_a_slot_are_refused_with_the_way_out(tiny):
    with pytest.raises(ValueError, match=r"pool holds 9 .*raise data\.regen_batch_tokens"):
        PagedSettings(slots=2, page_size=16, pages=10, max_tokens=1024, chunk=64)
    with pytest.raises(ValueError, match="page_size must be at least 1, got 0"):
        PagedSettings(slots=2, page_size=0, pages=10, max_tokens=64, chunk=64)
    with pytest.raises(ValueError, match="a prompt of 70 tokens and 20 new ones do not fit a slot of 80"):
        engine(tiny[0]).generate([(0, [1] * 70)], NEW_TOKENS, end_id=2)


# ---- the scheduler alone ----


def decode_once(scheduler: Scheduler) -> None:
    """What the engine does to the decoding sequences in a step (without a model)."""
    for sequence in scheduler.decoding():
        sequence.computed += 1
        sequence.answer.append(7)


def prefill_all(scheduler: Scheduler) -> list[list[tuple[str, int, int]]]:
    """Every prefill chunk (the engine's part without a model): [(key, start, tokens)] of each."""
    chunks = []
    while parts := scheduler.next_chunk():
        chunks.append([(part.sequence.key, part.start, len(part.tokens)) for part in parts])
        for part in parts:
            part.sequence.computed += len(part.tokens)
            if part.last:
                part.sequence.decoding = True
                part.sequence.answer.append(7)
    return chunks


def test_a_slot_that_ends_is_refilled_at_the_next_iteration_without_waiting_for_the_others():
    scheduler = Scheduler(slots=2, pages=32, page_size=4, max_pages=8, chunk=4)
    for key in "abc":
        scheduler.add(Sequence(key, [1, 2, 3]))
    scheduler.admit()
    assert prefill_all(scheduler) == [[("a", 0, 3), ("b", 0, 1)], [("b", 1, 2)]]
    a, b = scheduler.slots
    assert (a.key, b.key) == ("a", "b") and [s.key for s in scheduler.waiting] == ["c"]
    decode_once(scheduler)
    scheduler.release(a)  # "a" ended; "b" goes on decoding
    scheduler.admit()
    assert scheduler.slots[0].key == "c" and scheduler.slots[1] is b
    assert prefill_all(scheduler) == [[("c", 0, 3)]]


def test_at_the_tail_the_last_sequences_move_to_the_first_slots_and_more_widen_it_again():
    """fit_width: the sequences left move into the first slots of the narrowest width they fit, with
    their pages and progress, admission keeps to them, and once more are left than fit, every slot is
    in use again."""
    scheduler = Scheduler(slots=4, pages=32, page_size=4, max_pages=8, chunk=16)
    for key in "abcd":
        scheduler.add(Sequence(key, [1, 2, 3]))
    assert scheduler.fit_width((2,)) == 4  # four left: all the slots
    scheduler.admit()
    prefill_all(scheduler)
    a, b, c, d = scheduler.slots
    decode_once(scheduler)
    pages = {s.key: list(s.pages) for s in (c, d)}
    scheduler.release(a)
    scheduler.release(b)
    assert scheduler.fit_width(()) == 4  # no narrower step: every slot, nothing moves
    assert scheduler.fit_width((3, 2)) == 2  # the narrowest that holds the two left
    assert scheduler.slots[:2] == [c, d] and scheduler.slots[2:] == [None, None]
    assert (c.slot, d.slot) == (0, 1) and {s.key: s.pages for s in (c, d)} == pages
    assert c.decoding and c.computed == 4  # its progress is its own, not its slot's
    scheduler.release(c)
    scheduler.add(Sequence("e", [1, 2]))
    assert scheduler.fit_width((3, 2)) == 2
    scheduler.admit()
    assert scheduler.slots[0].key == "e" and scheduler.slots[2:] == [None, None]  # within its width
    for key in "fg":
        scheduler.add(Sequence(key, [1]))
    assert scheduler.fit_width((3, 2)) == 4  # four left again (d, e and two waiting): every slot
    scheduler.admit()
    assert [s.key if s else None for s in scheduler.slots] == ["e", "d", "f", "g"]


def test_a_long_prompt_is_prefilled_a_chunk_an_iteration_and_short_ones_share_a_chunk():
    scheduler = Scheduler(slots=4, pages=32, page_size=4, max_pages=8, chunk=4)
    scheduler.add(Sequence("long", list(range(10))))
    for key in "ab":
        scheduler.add(Sequence(key, [1, 2]))
    chunks = []
    for _ in range(4):
        scheduler.admit()  # a prompt is admitted once the chunks ahead leave it room
        chunks += prefill_all_one(scheduler)
    assert chunks == [[("long", 0, 4)], [("long", 4, 4)], [("long", 8, 2), ("a", 0, 2)], [("b", 0, 2)]]


def prefill_all_one(scheduler: Scheduler) -> list:
    """One iteration's chunk only."""
    parts = scheduler.next_chunk()
    for part in parts:
        part.sequence.computed += len(part.tokens)
        part.sequence.decoding = part.last
    return [[(part.sequence.key, part.start, len(part.tokens)) for part in parts]] if parts else []


def test_while_slots_decode_a_prefill_waits_until_it_is_full_or_an_eighth_of_the_slots_wait_for_it():
    scheduler = Scheduler(slots=16, pages=200, page_size=4, max_pages=16, chunk=12)
    for key in range(16):
        scheduler.add(Sequence(key, [1] * 5))
    for key in ("later", "last", "after"):
        scheduler.add(Sequence(key, [1] * 5))
    while scheduler.prefilling() or len(scheduler.decoding()) < 16:
        scheduler.admit()
        assert scheduler.prefill_due()  # nothing decodes yet: every slot waits for a prefill
        prefill_all_one(scheduler)
    first, second = scheduler.slots[:2]
    scheduler.release(first)
    scheduler.admit()  # "later" (5 tokens) takes the free slot; a chunk holds 12
    assert [s.key for s in scheduler.prefilling()] == ["later"]
    assert not scheduler.prefill_due()  # one slot of 16 waits, and more prompts may join its chunk
    scheduler.release(second)
    scheduler.admit()
    assert [s.key for s in scheduler.prefilling()] == ["later", "last"]
    assert scheduler.waiting and scheduler.prefill_due()  # two of 16 slots wait: an eighth
    # a chunk that can be full is run at once, one slot waiting or not
    full = Scheduler(slots=16, pages=200, page_size=4, max_pages=16, chunk=4)
    full.add(Sequence("a", [1] * 5))
    full.add(Sequence("b", [1] * 5))
    full.admit()
    assert len(full.prefilling()) == 1 and full.waiting and full.prefill_due()
    # no prompt waits to join it: run it now
    alone = Scheduler(slots=16, pages=200, page_size=4, max_pages=16, chunk=12)
    alone.add(Sequence("a", [1] * 5))
    alone.admit()
    assert not alone.waiting and alone.prefill_due()


def test_a_prefill_chunk_reads_each_sequence_s_pages_up_to_its_last_token_only(
    tiny, prompts_and_answers, monkeypatch
):
    """The chunk's keys are its sequences' pages up to the chunk's end, not each whole slot (80
    tokens, 20 pages): the answers stay greedy generate's."""
    prompts, end_id, reference = prompts_and_answers
    widths = []
    plain = paged_step.paged_forward

    def recorded(target, pages, tokens, positions, seen, run_layer=paged_step.call_layer):
        if tokens.shape[1] > 1 or pages[0].table.shape[0] == 1:  # a prefill chunk: one packed row
            widths.append((pages[0].table.shape[1], seen.shape[-1]))
        return plain(target, pages, tokens, positions, seen, run_layer)

    needed = []  # each chunk's pages: its sequences' up to the chunk's end
    next_chunk = Scheduler.next_chunk

    def recorded_chunk(self):
        chunks = next_chunk(self)
        needed.append(sum(-(-(c.start + len(c.tokens)) // 4) for c in chunks))
        return chunks

    monkeypatch.setattr("trainer.data.engine.engine.paged_forward", recorded)
    monkeypatch.setattr(Scheduler, "next_chunk", recorded_chunk)
    paged = engine(tiny[0], chunk=24)
    answers = paged.generate(list(enumerate(prompts)), NEW_TOKENS, end_id)
    assert [answers[i] for i in range(len(prompts))] == reference
    assert len(widths) == len(needed) > 1
    assert [pages for pages, _ in widths] == needed
    assert all(keys == pages * 4 for pages, keys in widths)
    assert sum(needed) < 20 * len(prompts)  # each sequence's whole slot (80 tokens) at least once


def test_a_dry_pool_preempts_the_newest_sequence_back_to_the_front_of_the_queue():
    # 6 pages to hand out, pages of 2 tokens: "old" (3 tokens) takes 2, "new" (3 tokens) takes 2
    scheduler = Scheduler(slots=3, pages=7, page_size=2, max_pages=6, chunk=8)
    scheduler.add(Sequence("old", [1, 2, 3]))
    scheduler.add(Sequence("new", [1, 2, 3]))
    scheduler.add(Sequence("later", [1] * 7))
    scheduler.admit()
    prefill_all(scheduler)
    scheduler.admit()  # "later" needs 4 pages + a reserve of 2: it waits
    assert [s.key for s in scheduler.waiting] == ["later"] and scheduler.allocator.free == 2
    for _ in range(5):  # each sequence grows a page every 2 tokens
        scheduler.grow()
        decode_once(scheduler)
    old, new = scheduler.slots[0], next((s for s in scheduler.waiting if s.key == "new"), None)
    assert old.key == "old" and new is not None and scheduler.waiting[0] is new
    assert new.pages == [] and new.computed == 0 and not new.decoding and scheduler.preemptions == 1
    assert len(old.pages) * 2 >= old.computed  # every position written has its page


# ---- the regeneration stage with data.regen_engine=paged ----

MULTI_TURN = {
    "messages": [
        {"role": "system", "content": "count"},
        {"role": "user", "content": "count from 3 to 9"},
        {"role": "assistant", "content": "3 4 5"},
        {"role": "user", "content": "reverse a b c"},
        {"role": "assistant", "content": "c b a"},
        {"role": "user", "content": "and once more"},
        {"role": "assistant", "content": "a b c"},
    ]
}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory, embedded) -> pathlib.Path:
    """Ten conversations, two of them of three turns."""
    rows = [json.dumps({"messages": m}) for _, m in iter_conversations(embedded[1])][:8]
    rows[2:2] = [json.dumps(MULTI_TURN)]
    rows[6:6] = [json.dumps(MULTI_TURN)]
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def stage(root: pathlib.Path, data, tiny, engine_name: str, tail_slots: tuple[int, ...] = ()) -> Regeneration:
    chat = tiny[1]
    settings = RegenSettings(max_new_tokens=12, engine=engine_name, shard_size=4, batch_size=3, min_width=8,
                             slots=3, page_size=4, batch_tokens=160, prefill_chunk=16,
                             tail_slots=tail_slots)  # fmt: skip
    regen = Regeneration(DataIndex.build(data), settings, root, "key", chat, chat.end_id, None)
    regen.prepare()
    return regen


def shard_bytes(regen: Regeneration) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(regen.directory.glob("shard-*"))}


@pytest.fixture(scope="module")
def static_shards(tmp_path_factory, chat_data, tiny) -> dict[str, bytes]:
    regen = stage(tmp_path_factory.mktemp("static"), chat_data, tiny, "static")
    assert run_workers(regen, [tiny[0]], Progress(len(regen.index)), lambda: False, lambda: None, 60.0)
    return shard_bytes(regen)


def test_a_paged_stage_writes_the_static_stage_s_shards_byte_for_byte(
    tmp_path, chat_data, tiny, static_shards
):
    # The data set's tail decoded one row at a time: the same bytes, its steps one slot-step each.
    regen = stage(tmp_path, chat_data, tiny, "paged", tail_slots=(1,))
    progress = Progress(len(regen.index))
    assert run_workers(regen, [tiny[0]], progress, lambda: False, lambda: None, 60.0)
    assert shard_bytes(regen) == static_shards and len(static_shards) == 6  # 3 shards, 3 seals
    assert progress.done == 10 and progress.tokens > 0
    answers = [content for e in regen.examples() for role, content in e.turns if role == "assistant"]
    cut = sum(len(answer) >= 12 for answer in answers)  # max_new_tokens: the cap decided their end
    assert (progress.answers, progress.cut) == (len(answers), cut)  # the data line says how many hit the cap
    # every decode step is counted once, each of its width's slot-steps (3, or 1 at the tail): at
    # least one answer token a step and at most one a slot-step, the first token of each answer
    # coming from its prefill
    assert progress.decode_steps < progress.slot_steps < 3 * progress.decode_steps  # the tail ran narrower
    assert progress.decode_steps <= progress.tokens - len(answers) <= progress.slot_steps
    line = slot_steps_text(progress.snapshot())
    used = (progress.tokens - len(answers)) / progress.slot_steps
    assert line == (
        f", {progress.decode_steps:,} decode steps, {used:.0%} of "
        "their slot-steps decoding an answer token"
    )
    turns = [[role for role, _ in e.turns] for e in regen.examples()]
    assert turns[2] == turns[6] == [m["role"] for m in MULTI_TURN["messages"]]


def test_a_stopped_paged_stage_keeps_its_shards_and_the_next_start_finishes_them_the_same(
    tmp_path, chat_data, tiny, static_shards
):
    regen = stage(tmp_path, chat_data, tiny, "paged")
    assert not run_workers(
        regen, [tiny[0]], Progress(10), lambda: len(regen.missing()) < 3, lambda: None, 60.0
    )
    assert len(regen.missing()) == 2  # one shard done: the stream's shards end in any order
    kept = shard_bytes(regen)
    assert len(kept) == 2 and all(static_shards[name] == body for name, body in kept.items())
    again = stage(tmp_path, chat_data, tiny, "paged")
    assert run_workers(again, [tiny[0]], Progress(10), lambda: False, lambda: None, 60.0)
    assert shard_bytes(again) == static_shards


def test_a_full_disk_in_the_stream_keeps_the_shards_written_and_the_next_start_finishes_them_the_same(
    tmp_path, chat_data, tiny, static_shards, monkeypatch
):
    """The second shard the stream writes meets a full disk: the run stops with the disk-full error
    (a shard is written from inside the engine's loop), the first stays, no partial file is left,
    and the next start writes the static stage's shards."""
    from trainer.data.regen import DiskFull

    regen = stage(tmp_path, chat_data, tiny, "paged")
    real_replace = pathlib.os.replace
    shards_written = []

    def disk_full_on_the_second_shard(source, destination):
        if str(destination).endswith(".jsonl"):
            shards_written.append(destination)
            if len(shards_written) == 2:
                raise OSError(errno.ENOSPC, "No space left on device", str(source))
        return real_replace(source, destination)

    monkeypatch.setattr(pathlib.os, "replace", disk_full_on_the_second_shard)
    full = r"disk full writing .*shard-.*\.jsonl: No space left on device; [24] of 10 conversations"
    with pytest.raises(DiskFull, match=full):
        run_workers(regen, [tiny[0]], Progress(10), lambda: False, lambda: None, 60.0)
    monkeypatch.setattr(pathlib.os, "replace", real_replace)
    assert len(regen.missing()) == 2 and not list(regen.directory.glob(".*.tmp"))
    again = stage(tmp_path, chat_data, tiny, "paged")
    assert run_workers(again, [tiny[0]], Progress(10), lambda: False, lambda: None, 60.0)
    assert shard_bytes(again) == static_shards


def test_a_pool_too_small_for_a_shard_s_longest_conversation_is_one_clear_error_before_decoding(
    tmp_path, chat_data, tiny
):
    chat = tiny[1]
    settings = RegenSettings(max_new_tokens=12, engine="paged", shard_size=4, slots=3, page_size=4,
                             batch_tokens=48, prefill_chunk=16)  # fmt: skip
    regen = Regeneration(DataIndex.build(chat_data), settings, tmp_path, "key", chat, chat.end_id, None)
    regen.prepare()
    kept = r"68 tokens takes 17 pages of 4 tokens, and the pool holds 11 .*regen_batch_tokens.*are kept"
    with pytest.raises(DataError, match=kept):
        run_workers(regen, [tiny[0]], Progress(10), lambda: False, lambda: None, 60.0)
    assert not list(regen.directory.glob("shard-*"))


def test_a_pool_the_gpu_s_free_memory_cannot_hold_is_one_clear_error_naming_the_memory(
    tmp_path, chat_data, tiny, monkeypatch
):
    chat = tiny[1]
    settings = RegenSettings(max_new_tokens=12, engine="paged", shard_size=4, slots=3, page_size=4,
                             prefill_chunk=16)  # fmt: skip
    regen = Regeneration(DataIndex.build(chat_data), settings, tmp_path, "key", chat, chat.end_id, None)
    regen.prepare()
    monkeypatch.setattr(conversations, "fitting_pool_pages", lambda target, settings: 12)
    said = r"and the pool holds 11 .*the pool is what the GPU's free memory holds.*free the GPU of other"
    with pytest.raises(DataError, match=said):
        run_workers(regen, [tiny[0]], Progress(10), lambda: False, lambda: None, 60.0)
    assert not list(regen.directory.glob("shard-*"))


def test_the_pool_is_the_configured_one_where_the_gpu_holds_it_and_what_fits_where_not():
    from transformers import Qwen3Config

    qwen3_8b = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128)  # fmt: skip
    settings = RegenSettings(engine="paged")  # 262,144 tokens in pages of 64: 4,096 pages, 36 GiB
    gib, said = 1 << 30, []
    pages = lambda free: conversations.pool_pages(  # noqa: E731
        qwen3_8b, torch.bfloat16, settings, free, "cuda:0", said.append
    )
    assert pages(None) == 4096 and said == []  # a CPU: no device memory to count
    assert pages(62 * gib) == 4096 and said == []  # an 80 GB card, the target's 16 GB loaded
    fewer = pages(30 * gib)  # a card shared with another process
    assert 0 < fewer < 4096 and len(said) == 1
    page = 36 * 8 * 128 * 2 * 2 * 64  # layers x KV heads x head size x keys and values x bf16 x tokens
    assert fewer * page <= 30 * gib - 3 * gib - 2 * gib  # within the free memory, less what is held back
    assert f"a pool of {fewer * 64:,} tokens" in said[0] and "not data.regen_batch_tokens 262,144" in said[0]
    assert "cuda:0 has 30.0 GiB free with the target loaded" in said[0]
    assert pages(1 * gib) == 0


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"regen_engine": "pagd"}, "data.regen_engine must be 'static', 'continuous' or 'paged', got 'pagd'"),
        ({"regen_engine": "paged", "regen_page_size": 0}, "data.regen_page_size must be at least 1, got 0"),
        ({"regen_engine": "paged", "regen_slots": 0}, "data.regen_slots must be at least 1, got 0"),
        ({"regen_engine": "paged", "regen_prefill_chunk": -1}, "data.regen_prefill_chunk must be at least 1"),
        ({"regen_tail_slots": [64, 0]}, "data.regen_tail_slots must be widths of at least 1 slot"),
        (
            {
                "regen_engine": "paged",
                "regen_batch_tokens": 64,
                "regen_page_size": 16,
                "regen_max_new_tokens": 64,
            },
            "data.regen_batch_tokens=64 makes 4 KV pages of 16 tokens (one kept as scratch), too few for one "
            "answer of 64 tokens; raise data.regen_batch_tokens",
        ),
    ],
)
def test_bad_paged_settings_in_the_config_are_named(changes, problem):
    from trainer.config import DataConfig

    assert problem in " | ".join(DataConfig(**changes).problems())
    assert DataConfig(regen_engine="paged").problems() == []


def test_a_slot_holds_a_power_of_two_pages_within_the_pool():
    from trainer.data.engine.conversations import slot_tokens

    assert slot_tokens(70, 4, pool_pages=64) == 32 * 4  # 18 pages needed: 32, a shape shared by more
    assert slot_tokens(70, 4, pool_pages=26) == 25 * 4  # 32 do not fit: what the pool holds
    assert slot_tokens(70, 4, pool_pages=12) == 18 * 4  # not even 18: the engine refuses it, naming both


def test_the_paged_settings_change_only_the_speed_so_a_resume_may_change_them():
    from trainer.config import SPEED_ONLY_DATA_KEYS

    some = RegenSettings(engine="paged", slots=2, page_size=4, prefill_chunk=8, tail_slots=())
    other = RegenSettings(engine="paged", slots=64, page_size=32, prefill_chunk=1024, tail_slots=(16,))
    assert some.key_fields() == other.key_fields() != RegenSettings(engine="static").key_fields()
    speed_only = {"regen_slots", "regen_page_size", "regen_prefill_chunk", "regen_tail_slots"}
    assert speed_only <= SPEED_ONLY_DATA_KEYS


def test_the_tail_widths_the_engine_gets_are_those_below_its_slots_narrowest_last():
    settings = RegenSettings(engine="paged", slots=64, tail_slots=(128, 32, 8, 32))
    assert conversations.paged_settings(settings, 256, compiled=False).tail_slots == (8, 32)
    narrow = RegenSettings(slots=16, tail_slots=(128, 32))
    assert conversations.paged_settings(narrow, 256, compiled=False).tail_slots == ()
    with pytest.raises(ValueError, match="tail_slots must each be at least 1 and fewer than the 3 slots"):
        PagedSettings(slots=3, page_size=4, pages=64, max_tokens=80, chunk=8, tail_slots=(3,))


@pytest.mark.parametrize(
    ("attention", "compiled", "reads", "falls_back"),
    [
        ("auto", True, "flex", True),  # on CUDA: the pool in place, gathering if flex fails
        ("auto", False, "gather", True),  # uncompiled flex would score every key of the pool
        ("flex_attention", True, "flex", False),  # asked by name: a failure is the run's
        ("flex_attention", False, "flex", False),
        ("sdpa", True, "gather", False),
        ("eager", True, "gather", False),
    ],
)
def test_how_a_paged_step_reads_the_pages_follows_the_setting(attention, compiled, reads, falls_back):
    from trainer.data.engine.conversations import paged_settings

    settings = paged_settings(RegenSettings(engine="paged", attention=attention), 4096, compiled)
    assert (settings.attention, settings.gather_if_flex_fails) == (reads, falls_back)


def test_the_data_stage_gives_the_kept_engine_s_pool_back_before_training(tiny):
    """The engine kept for the next shards lives as long as its target, which training goes on using:
    the data stage's end drops it, so its KV pool is freed before training allocates (at the 8B
    shape a first start on an 80 GB card ran out of memory with the 36 GiB pool still held)."""
    import gc
    import weakref

    from trainer.run.train import release_data_stage_memory

    target = tiny[0]
    settings = PagedSettings(slots=2, page_size=4, pages=16, max_tokens=32, chunk=8)
    kept = conversations.engine_for(target, settings)
    pool = weakref.ref(kept.kv.keys[0])
    del kept
    gc.collect()
    assert pool() is not None  # kept for the next stream while the target lives

    class Lines:
        def line(self, text: str) -> None:
            raise AssertionError(f"a CPU run says nothing of GPU memory: {text}")

    release_data_stage_memory([torch.device("cpu")], Lines())
    gc.collect()
    assert pool() is None and not conversations._ENGINES


def test_an_engine_run_again_reads_none_of_its_last_run_s_tables(tiny, prompts_and_answers):
    """A kept engine (the next shards', the bench's second pass) starts its next run's decode rows
    anew: in the last run slot 0 held the first sequence admitted, with as many pages as the next
    run's first holds, but other pages; a row kept from it would read them."""
    prompts = prompts_and_answers[0]
    target = tiny[0]
    paged = engine(target, slots=3, page_size=4, chunk=32)  # every prompt prefilled in one chunk
    first = [p[:5] for p in prompts[2:5]]  # 2 pages each, then a third as their answers grow
    paged.generate(list(enumerate(first)), 6, end_id=-1)
    second = [prompts[6][:9], prompts[7][:5], prompts[8][:5]]  # the first takes pages 1-3 at once
    answers = paged.generate(list(enumerate(second)), 6, end_id=-1)
    assert [answers[i] for i in range(3)] == [greedy(target, p, end_id=-1, new_tokens=6) for p in second]
