"""Regeneration (trainer/data/regen.py, trainer/run/regen.py): answers equal plain greedy `generate`'s
in float32, shards shared by workers and written atomically, resumable, a key computed by streaming,
and bad input refused with the file and line. The embedded tiny target on CPU; small files, few
tokens, so the whole module stays quick."""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import pathlib
import re
import threading
import tracemalloc

import pytest
import torch

from trainer.data.chat import (
    MAX_LINE_BYTES,
    ChatFormat,
    DataError,
    DiskFull,
    Example,
    iter_conversations,
    prompt_ids,
)
from trainer.data.regen import (
    DataIndex,
    Progress,
    Regeneration,
    RegenSettings,
    ShardDamaged,
    cut_answer,
    export_chat_jsonl,
    file_digest,
    raw_key,
    regen_key,
    run_workers,
    shard_seal,
)
from trainer.model.target import load_target, load_tokenizer

pytestmark = pytest.mark.unit

NEW_TOKENS = 10
MULTI_TURN = {
    "messages": [
        {"role": "system", "content": "count"},
        {"role": "user", "content": "count from 3 to 9"},
        {"role": "assistant", "content": "3 4 5"},
        {"role": "user", "content": "reverse a b c"},
        {"role": "assistant", "content": "c b a"},
    ]
}


@pytest.fixture(scope="module")
def tiny(embedded):
    """(target on cpu in float32, tokenizer, chat format) of the embedded default."""
    target_path, _ = embedded
    tokenizer = load_tokenizer(target_path)
    return load_target(target_path, "cpu", "float32"), tokenizer, ChatFormat(tokenizer)


def write_data(path: pathlib.Path, embedded, count: int) -> pathlib.Path:
    """The first `count` embedded conversations, one of them multi-turn (third from the start)."""
    rows = [json.dumps({"messages": m}) for _, m in iter_conversations(embedded[1])][:count]
    rows.insert(2, json.dumps(MULTI_TURN))
    path.write_text("\n".join(rows[:count]) + "\n")
    return path


def settings(**changes) -> RegenSettings:
    base = {"max_new_tokens": NEW_TOKENS, "shard_size": 4, "batch_size": 3, "min_width": 8}
    return RegenSettings(**{**base, **changes})


def regeneration(tmp_path, data, tiny, max_positions=None, **changes) -> Regeneration:
    _, tokenizer, chat = tiny
    return Regeneration(
        DataIndex.build(data), settings(**changes), tmp_path / "cache", "key", chat,
        tokenizer.pad_token_id, max_positions,
    )  # fmt: skip


def tokenized(messages, chat) -> Example:
    """One conversation tokenized message by message: the reference for the batched tokenizer."""
    return Example([(m["role"], chat.text(m["content"])) for m in messages])


def plain_greedy(target, chat, data) -> list[list[tuple[str, list[int]]]]:
    """The reference: each conversation alone, turn by turn, through plain greedy `generate`."""
    results = []
    for _, messages in iter_conversations(data):
        example = tokenized(messages, chat)
        for turn, (role, _) in enumerate(example.turns):
            if role != "assistant":
                continue
            prompt = torch.tensor([prompt_ids(example, chat, turn)])
            output = target.generate(
                input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                do_sample=False, eos_token_id=chat.end_id, pad_token_id=chat.end_id,
            )[0, prompt.shape[1] :].tolist()  # fmt: skip
            example.turns[turn] = (
                "assistant",
                output[: output.index(chat.end_id)] if chat.end_id in output else output,
            )
        results.append(example.turns)
    return results


@pytest.fixture(scope="module")
def data_and_reference(tmp_path_factory, embedded, tiny):
    data = write_data(tmp_path_factory.mktemp("data") / "chat.jsonl", embedded, 10)
    return data, plain_greedy(tiny[0], tiny[2], data)


def regenerated(regen: Regeneration) -> list[list[tuple[str, list[int]]]]:
    return [example.turns for example in regen.examples()]


def generate_all(regen: Regeneration, targets, should_stop=lambda: False) -> bool:
    return run_workers(regen, targets, Progress(len(regen.index)), should_stop, lambda: None, 60.0)


@pytest.mark.parametrize(
    ("engine", "compile"),
    [("static", True), ("static", False), ("continuous", True)],
    ids=["static", "static-several-threads", "continuous"],
)
def test_answers_equal_plain_greedy_generate_in_float32(tmp_path, tiny, data_and_reference, engine, compile):
    data, reference = data_and_reference
    # One shard for continuous batching: each call sets up its paged cache, slow on a shared CPU.
    shard_size = 4 if engine == "static" else 10
    regen = regeneration(tmp_path, data, tiny, engine=engine, shard_size=shard_size, compile=compile)
    regen.prepare()
    assert generate_all(regen, [tiny[0]])
    assert regenerated(regen) == reference
    multi_turn = regenerated(regen)[2]
    assert [role for role, _ in multi_turn] == ["system", "user", "assistant", "user", "assistant"]


def test_continuous_batching_on_a_cpu_sizes_its_cache_for_the_call_not_the_machine(
    tmp_path, tiny, data_and_reference, monkeypatch
):
    """A machine whose free RAM is 1 GB: left to size itself, the paged cache took a share of it too
    small for its fixed tensors and refused to start (num_sectors < 0); sized for the call's requests,
    the answers are plain greedy generate's."""
    from transformers.generation.continuous_batching import cache

    gib = 1 << 30
    monkeypatch.setattr(
        cache, "get_device_and_memory_breakdown", lambda: (torch.device("cpu"), 2 * gib, gib, gib)
    )
    data, reference = data_and_reference
    regen = regeneration(tmp_path, data, tiny, engine="continuous", shard_size=10)
    regen.prepare()
    assert generate_all(regen, [tiny[0]])
    assert regenerated(regen) == reference


def test_two_workers_share_the_shards_and_merge_in_the_input_order(
    tmp_path, embedded, tiny, data_and_reference
):
    data, reference = data_and_reference
    second = load_target(embedded[0], "cpu", "float32")
    calls = {id(tiny[0]): 0, id(second): 0}
    threads_seen = set()

    embeddings = {id(tiny[0].model.embed_tokens): id(tiny[0]), id(second.model.embed_tokens): id(second)}

    def counted(embedding, _args):
        calls[embeddings[id(embedding)]] += 1
        threads_seen.add(threading.get_ident())

    # the embedding: every engine calls it (the paged engine runs the layers without the model's forward)
    hooks = [target.model.embed_tokens.register_forward_pre_hook(counted) for target in (tiny[0], second)]
    try:
        regen = regeneration(tmp_path, data, tiny)
        regen.prepare()
        assert generate_all(regen, [tiny[0], second])
    finally:
        for hook in hooks:
            hook.remove()
    assert all(count > 0 for count in calls.values()), calls
    assert len(threads_seen) == 2
    assert regenerated(regen) == reference
    assert len(list(regen.directory.glob("shard-*.jsonl"))) == 3  # 10 conversations, 4 a shard


def test_the_first_finished_shard_is_reported_at_once_not_after_the_reporting_interval(
    tmp_path, tiny, data_and_reference
):
    data, _ = data_and_reference
    regen = regeneration(tmp_path, data, tiny)
    regen.prepare()
    progress = Progress(len(regen.index))
    reports: list[int] = []
    assert run_workers(
        regen, [tiny[0]], progress, lambda: False, lambda: reports.append(progress.done), 600.0
    )
    assert reports and reports[0] >= 4  # long before 600 s: once the first shard of 4 was done


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_a_stop_keeps_finished_shards_and_the_next_start_continues(
    tmp_path, tiny, data_and_reference, engine
):
    data, reference = data_and_reference
    regen = regeneration(tmp_path, data, tiny, engine=engine)
    regen.prepare()

    def stop_once_a_shard_is_written() -> bool:
        return len(regen.missing()) < 3

    assert not generate_all(regen, [tiny[0]], stop_once_a_shard_is_written)
    # one shard is on disk: the first (static), or whichever ended first (paged: one stream)
    assert len(regen.missing()) == 2 and (engine == "paged" or regen.missing() == [1, 2])
    (regen.directory / ".shard-000000004-000000008.99.1.tmp").write_text('{"half": ')  # a killed writer's
    again = regeneration(tmp_path, data, tiny, engine=engine)
    again.prepare()
    assert not list(again.directory.glob(".shard-*.tmp"))
    assert generate_all(again, [tiny[0]])
    assert regenerated(again) == reference


def test_the_key_streams_the_file_and_covers_what_decides_the_answers(tmp_path, embedded, monkeypatch):
    target_path = embedded[0]
    data = tmp_path / "big.jsonl"
    data.write_bytes(b"x" * (3 << 20) + b"\n")
    assert file_digest(data).hexdigest() == hashlib.sha256(data.read_bytes()).hexdigest()

    def no_whole_file_reads(self, *args, **kwargs):
        if self == data:
            raise AssertionError("read the whole data file into memory")
        return original_read_bytes(self, *args, **kwargs)

    original_read_bytes = pathlib.Path.read_bytes
    monkeypatch.setattr(pathlib.Path, "read_bytes", no_whole_file_reads)
    monkeypatch.setattr(pathlib.Path, "read_text", no_whole_file_reads)
    key = regen_key(data, target_path, target_path, settings())
    assert key == regen_key(data, target_path, target_path, settings(batch_size=7, min_width=64))
    changes = ({"max_new_tokens": 11}, {"dtype": "bfloat16"}, {"engine": "continuous"})
    for changed in (*changes, {"max_prompt_tokens": 64}):
        assert regen_key(data, target_path, target_path, settings(**changed)) != key, changed
    # Shards of an earlier format (answers made with transformers' flex masks) are never current.
    from trainer.data import regen as regen_module

    current = regen_module.REGEN_FORMAT
    monkeypatch.setattr(regen_module, "REGEN_FORMAT", current - 1)
    assert regen_key(data, target_path, target_path, settings()) != key
    monkeypatch.setattr(regen_module, "REGEN_FORMAT", current)
    assert regen_key(data, target_path, target_path, settings()) == key
    with data.open("ab") as handle:
        handle.write(b"y")
    assert regen_key(data, target_path, target_path, settings()) != key
    assert raw_key(data, target_path).startswith("raw-") and raw_key(data, target_path) != key


def test_bad_data_files_name_the_file_and_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=f"{empty}: no conversation with an assistant turn"):
        DataIndex.build(empty)
    broken = tmp_path / "broken.jsonl"
    good = json.dumps(MULTI_TURN)
    broken.write_text(f"{good}\n{good}\n{{not json\n")
    with pytest.raises(DataError, match=f"{broken}:3: not JSON"):
        DataIndex.build(broken)


def test_a_conversation_longer_than_the_context_is_named_and_finished_shards_stay(tmp_path, embedded, tiny):
    data = write_data(tmp_path / "chat.jsonl", embedded, 8)
    long_line = 6
    lines = data.read_text().splitlines()
    lines[long_line - 1] = json.dumps(
        {"messages": [{"role": "user", "content": "one " * 60}, {"role": "assistant", "content": "x"}]}
    )
    data.write_text("\n".join(lines) + "\n")
    regen = regeneration(tmp_path, data, tiny, max_positions=60)
    regen.prepare()
    named = rf"{data}:{long_line}: .*more than the target's context of 60"
    with pytest.raises(DataError, match=named):  # the check before anything is generated
        regen.check_contexts_before_generating(regen.missing())
    assert regen.missing() == [0, 1]
    with pytest.raises(DataError, match=named):  # the check of each batch, should the first miss one
        generate_all(regen, [tiny[0]])
    assert regen.missing() == [1]  # conversations 0-3 are kept


def test_a_later_turn_that_may_not_fit_is_refused_before_generating(tmp_path, tiny):
    """The first prompt fits; the second would not if the first answer took all its new tokens."""
    data = tmp_path / "chat.jsonl"
    fits = {"messages": [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "x"}]}
    two_turns = {
        "messages": [*fits["messages"], {"role": "user", "content": "one " * 20}, fits["messages"][1]]
    }
    data.write_text(f"{json.dumps(fits)}\n{json.dumps(two_turns)}\n")
    regen = regeneration(tmp_path, data, tiny, max_positions=40)  # 10 new tokens an answer
    with pytest.raises(DataError, match=rf"{data}:2: the conversation needs up to 43 prompt tokens"):
        regen.check_contexts_before_generating(regen.missing())


def past_the_rows(tmp_path, limit: int) -> pathlib.Path:
    """Three conversations for a run whose rows hold `limit` tokens: a second turn that starts past
    them, a first one that does, and a short one."""
    short = [{"role": "user", "content": "one two"}, {"role": "assistant", "content": "x"}]
    second_past = [*short, {"role": "user", "content": "one " * limit}, {"role": "assistant", "content": "y"}]
    first_past = [{"role": "user", "content": "one " * (2 * limit)}, {"role": "assistant", "content": "z"}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (second_past, first_past, short)))
    return data


def test_turns_past_the_training_rows_are_not_generated_and_the_rows_stay_the_same(tmp_path, tiny):
    """Training cuts every conversation to train.seq_len: a turn whose conversation before it already
    holds that many tokens is left out, with every turn after it, and what a row takes of each
    conversation (its first seq_len ids and loss mask) is what regenerating every turn gives."""
    limit = 24
    target, _, chat = tiny
    data = past_the_rows(tmp_path, limit)
    regen = regeneration(tmp_path, data, tiny, max_prompt_tokens=limit)
    regen.prepare()
    assert generate_all(regen, [target])
    limited, reference = regenerated(regen), plain_greedy(target, chat, data)
    assert [len(turns) for turns in limited] == [3, 1, 2]  # cut before the turn past the rows
    assert [len(turns) for turns in reference] == [4, 2, 2]
    for turns, full in zip(limited, reference, strict=True):
        ids, mask = chat.encode(turns)
        full_ids, full_mask = chat.encode(full)
        assert len(ids) >= limit or turns == full
        assert (ids[:limit], mask[:limit]) == (full_ids[:limit], full_mask[:limit])


def test_a_conversation_longer_than_the_context_is_generated_up_to_the_rows(tmp_path, tiny):
    """With train.seq_len + new tokens within the target's context no conversation is too long: the
    one whose first prompt exceeds the context is kept without answers, and the chat JSONL export
    leaves it out."""
    data = past_the_rows(tmp_path, 40)  # its first turn: 80 words, past a context of 60
    regen = regeneration(tmp_path, data, tiny, max_positions=60, max_prompt_tokens=40)
    regen.prepare()
    regen.check_contexts_before_generating(regen.missing())
    assert generate_all(regen, [tiny[0]])
    assert [[role for role, _ in turns] for turns in regenerated(regen)][1] == ["user"]
    out = tmp_path / "regenerated.jsonl"
    assert export_chat_jsonl(regen.index, regen.examples(), tiny[1], out) == 2
    exported = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    assert [[m["role"] for m in messages] for messages in exported] == [
        ["user", "assistant", "user"], ["user", "assistant"],
    ]  # fmt: skip
    too_close = regeneration(tmp_path / "b", data, tiny, max_positions=45, max_prompt_tokens=40)
    with pytest.raises(DataError, match=rf"{data}:1: the conversation needs up to"):
        too_close.check_contexts_before_generating(too_close.missing())


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_a_data_file_changed_in_place_during_the_regeneration_is_refused_before_its_shard_is_stored(
    tmp_path, embedded, tiny, engine
):
    data = write_data(tmp_path / "chat.jsonl", embedded, 8)
    before = data.stat()
    regen = regeneration(tmp_path, data, tiny, engine=engine)
    regen.prepare()
    lines = data.read_bytes().split(b"\n")
    at = lines[5].index(b'"content": "') + len(b'"content": "')
    edited = (
        lines[5][:at] + (b"Y" if lines[5][at : at + 1] == b"X" else b"X") + lines[5][at + 1 :]
    )  # same size
    assert len(edited) == len(lines[5]) and edited != lines[5]

    def edit_line_6_keeping_size_and_mtime() -> bool:  # conversation 5: the second shard
        data.write_bytes(b"\n".join([*lines[:5], edited, *lines[6:]]))
        os.utime(data, ns=(before.st_atime_ns, before.st_mtime_ns))
        return False

    with pytest.raises(DataError, match=f"{data}:6 changed while the run was reading the file"):
        generate_all(regen, [tiny[0]], edit_line_6_keeping_size_and_mtime)
    # nothing generated from the new contents is stored under the key (the paged stream reads the
    # second shard before the first is done, so the first may be unfinished too)
    assert 1 in regen.missing() and (engine == "paged" or regen.missing() == [1])


def test_a_rewrite_that_changes_nothing_or_an_appended_line_does_not_stop_a_regeneration(
    tmp_path, embedded, tiny, data_and_reference
):
    data, reference = data_and_reference
    copy = tmp_path / "chat.jsonl"
    copy.write_bytes(data.read_bytes())
    regen = regeneration(tmp_path, copy, tiny)
    regen.prepare()

    def rewrite_the_same_bytes_then_append() -> bool:
        copy.write_bytes(copy.read_bytes() + json.dumps(MULTI_TURN).encode() + b"\n")
        return False

    assert generate_all(regen, [tiny[0]], rewrite_the_same_bytes_then_append)
    assert regenerated(regen) == reference  # what was indexed, under the key of what was indexed


def seal_a_shard(regen: Regeneration, damage) -> pathlib.Path:
    shard = regen.shard_path(*regen.ranges[1])
    damage(shard)
    return shard


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (
            lambda shard: shard.write_bytes(b"\n".join(shard.read_bytes().split(b"\n")[:2]) + b"\n"),
            "cut short",
        ),
        (lambda shard: shard.write_bytes(b""), "cut short or emptied"),
        (lambda shard: shard.with_suffix(".sha256").unlink(), "no checksum"),
    ],
    ids=["cut-at-a-line", "emptied", "no-checksum"],
)
def test_a_short_or_unsealed_shard_is_named_and_regenerated_never_read_short(
    tmp_path, tiny, data_and_reference, damage, said
):
    data, reference = data_and_reference
    regen = regeneration(tmp_path, data, tiny)
    regen.prepare()
    assert generate_all(regen, [tiny[0]])
    shard = seal_a_shard(regen, damage)
    assert regen.missing() == [1]
    assert [(path, said in why) for path, why in regen.damaged()] == [(shard, True)]
    assert generate_all(regen, [tiny[0]])
    assert regen.damaged() == [] and regenerated(regen) == reference


def test_the_other_regenerations_in_the_cache_are_named_with_their_size_never_touched(
    tmp_path, tiny, data_and_reference
):
    """A start says what else the cache's regenerated folder holds (another key: an earlier format,
    data file or target) and how big it is, so the space can be given back; it removes nothing."""
    from trainer.run.regen import others_line

    data, _ = data_and_reference
    regen = regeneration(tmp_path, data, tiny)
    assert others_line(regen) is None  # nothing in the cache yet
    regen.prepare()
    assert others_line(regen) is None  # only this run's own
    older = regen.directory.parent / "an-earlier-key"
    older.mkdir()
    (older / "shard-000000-000004.jsonl").write_bytes(b"x" * 1_500_000)
    (older / "shard-000000-000004.sha256").write_text("0" * 64)
    assert regen.others() == [(older, 1_500_064)]
    line = others_line(regen)
    assert line.startswith(f"data: {regen.directory.parent} also holds 1 other regeneration(s), 1.5 MB")
    assert "(an-earlier-key)" in line and "delete them to free the space" in line
    kept = ["shard-000000-000004.jsonl", "shard-000000-000004.sha256"]
    assert sorted(p.name for p in older.iterdir()) == kept


def test_garbage_inside_a_shard_is_named_never_a_traceback_and_the_next_start_regenerates_it(
    tmp_path, tiny, data_and_reference
):
    data, reference = data_and_reference
    regen = regeneration(tmp_path, data, tiny)
    regen.prepare()
    assert generate_all(regen, [tiny[0]])

    def garbage_in_the_middle(shard: pathlib.Path) -> None:
        body = bytearray(shard.read_bytes())
        body[len(body) // 2 : len(body) // 2 + 5] = b"\x00#!@%"
        shard.write_bytes(bytes(body))

    shard = seal_a_shard(regen, garbage_in_the_middle)
    assert regen.damaged() == []  # the same size: only a read of the whole contents can tell
    damaged = rf"{shard} is damaged: its contents do not match the checksum .* run again"
    with pytest.raises(ShardDamaged, match=damaged):
        export_chat_jsonl(regen.index, regen.examples(), tiny[1], tmp_path / "out.jsonl")
    assert regen.missing() == [1]  # moved aside, its checksum gone: the next start regenerates it
    os.replace(shard.with_name(shard.name + ".damaged"), shard)  # back, beside a seal of other bytes
    shard.with_suffix(".sha256").write_text(json.dumps(shard_seal(b"x" * shard.stat().st_size, 4)))
    with pytest.raises(ShardDamaged, match=damaged):  # the store's build reads it the same way
        regenerated(regen)
    assert generate_all(regen, [tiny[0]])
    assert regenerated(regen) == reference


def test_a_line_longer_than_the_bound_is_refused_with_its_line_in_bounded_memory(tmp_path):
    data = tmp_path / "chat.jsonl"
    huge = {
        "messages": [
            {"role": "user", "content": "x" * (MAX_LINE_BYTES + 10)},
            {"role": "assistant", "content": "y"},
        ]
    }
    data.write_text(json.dumps(MULTI_TURN) + "\n" + json.dumps(huge) + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=f"{data}:2: the line is longer than 8 MiB"):
            DataIndex.build(data)  # the regeneration's index, and data.regenerate: false's alike
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 3 * MAX_LINE_BYTES, peak  # the line's bound, not the parsed line's gigabytes


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_bytes(json.dumps(MULTI_TURN).encode() + b"\n" + b'{"messages": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=rf"{data}:2: not UTF-8 text \(byte 0xff at column 15\)"):
        DataIndex.build(data)


@pytest.mark.parametrize("engine", ["static", "paged"])
def test_a_full_disk_loses_no_finished_shard_and_leaves_no_partial_one(tmp_path, tiny, data_and_reference,
                                                                      monkeypatch, engine):  # fmt: skip
    data, reference = data_and_reference
    regen = regeneration(tmp_path, data, tiny, engine=engine)
    regen.prepare()
    real_replace = pathlib.os.replace
    writes = []

    def disk_full_on_the_second_shard(source, destination):
        writes.append(destination)
        if len([w for w in writes if str(w).endswith(".jsonl")]) == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(source))
        return real_replace(source, destination)

    monkeypatch.setattr(pathlib.os, "replace", disk_full_on_the_second_shard)
    with pytest.raises(DiskFull) as failed:  # a crash (exit status 1), as a full disk while training
        generate_all(regen, [tiny[0]])
    monkeypatch.setattr(pathlib.os, "replace", real_replace)
    # the second shard written is named, and the one written before it is kept and counted (the
    # first and the second of the file with the static engine; the paged stream's in the order
    # they ended)
    kept = [i for i in range(3) if i not in regen.missing()]
    assert len(kept) == 1 and (engine == "paged" or kept == [0])
    kept_conversations = min(10, 4 * kept[0] + 4) - 4 * kept[0]  # shards of 4 conversations
    named = rf"disk full writing .*shard-\d+-\d+\.jsonl.* {kept_conversations} of 10 conv"
    assert re.search(named, str(failed.value))
    assert not list(regen.directory.glob(".*.tmp"))
    assert generate_all(regen, [tiny[0]])
    assert regenerated(regen) == reference


def test_a_second_regeneration_of_the_same_data_is_refused(tmp_path, tiny, data_and_reference):
    data, _ = data_and_reference
    first, second = regeneration(tmp_path, data, tiny), regeneration(tmp_path, data, tiny)
    with (
        first.lock(),
        pytest.raises(DataError, match=r"another regeneration \(pid \d+\) is filling"),
        second.lock(),
    ):
        pass
    with second.lock():  # free again once the first is done
        pass


def test_the_chat_jsonl_export_keeps_the_input_and_replaces_the_answers(tmp_path, tiny, data_and_reference):
    data, reference = data_and_reference
    regen = regeneration(tmp_path, data, tiny)
    regen.prepare()
    assert generate_all(regen, [tiny[0]])
    out = tmp_path / "out" / "regenerated.jsonl"
    assert export_chat_jsonl(regen.index, regen.examples(), tiny[1], out) == 10
    exported = [json.loads(line)["messages"] for line in out.read_text().splitlines()]
    originals = [m for _, m in iter_conversations(data)]
    for messages, original, turns in zip(exported, originals, reference, strict=True):
        assert [m["role"] for m in messages] == [m["role"] for m in original]
        for message, before, (role, ids) in zip(messages, original, turns, strict=True):
            expected = tiny[1].decode(ids) if role == "assistant" else before["content"]
            assert message["content"] == expected


def test_a_cache_that_cannot_be_written_is_one_clear_error(tmp_path, tiny, data_and_reference):
    data, _ = data_and_reference
    regen = regeneration(tmp_path, data, tiny)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "regenerated").write_text("a file where the cache's directory goes")
    expected = r"cannot write the regeneration cache .*point data.cache_dir at a"
    with pytest.raises(DataError, match=expected), regen.lock():
        pass


def test_a_batch_the_device_cannot_hold_names_the_kv_budget_to_lower(tiny, monkeypatch):
    """Out of memory while decoding is a setting too large for this GPU, not a crash: one line
    naming the batch, data.regen_batch_tokens and a value to try, and that finished shards stay."""
    from trainer.data.decode import StaticDecoder
    from trainer.data.regen import static_generate

    target, tokenizer, chat = tiny

    def too_big(self, ids, *args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 36.00 GiB")

    monkeypatch.setattr(StaticDecoder, "decode", too_big)
    expected = (
        r"^cpu ran out of memory decoding a batch of 2 prompts of 8 tokens and 4 new \(a KV cache of 24 "
        r"tokens; data.regen_batch_tokens is 4,096, data.regen_batch_size 2\). Lower "
        r"data.regen_batch_tokens \(e.g. to 2,048\) and run again: the finished shards are kept$"
    )
    chosen = settings(batch_size=2, batch_tokens=4096, max_new_tokens=4)
    with pytest.raises(DataError, match=expected):
        static_generate(target, [[5, 6], [7]], chosen, chat, tokenizer.pad_token_id, lambda: False)


def test_each_batch_gets_a_static_cache_of_its_own_width(tiny, monkeypatch):
    """A long prompt does not make later batches attend over its cache: every batch decodes over a
    static cache of its own width plus the new tokens, and a batch of the same shape as the one
    before reuses that cache (emptied) instead of taking more memory."""
    from trainer.data.decode import StaticDecoder
    from trainer.data.regen import bucket_width, static_generate

    target, tokenizer, chat = tiny
    prompts = [[5] * 40, [6] * 3, [7] * 4]  # one long, two short; batches of one
    caches = []
    static_cache = StaticDecoder.static_cache

    def recording_static_cache(self, rows, length):
        cache = static_cache(self, rows, length)
        caches.append((rows, length, cache, int(cache.get_seq_length())))
        return cache

    monkeypatch.setattr(StaticDecoder, "static_cache", recording_static_cache)
    pad_id = tokenizer.pad_token_id
    answers = static_generate(target, prompts, settings(batch_size=1), chat, pad_id, lambda: False)
    assert len(answers) == 3 and all(answers)
    short, long = bucket_width(4, 8) + NEW_TOKENS, bucket_width(40, 8) + NEW_TOKENS
    assert [(rows, length) for rows, length, _, _ in caches] == [(1, short), (1, short), (1, long)]
    assert caches[0][2] is caches[1][2] and caches[2][2] is not caches[0][2]  # the same shape's reused
    assert [seen for *_, seen in caches] == [0, 0, 0]  # each batch starts from an empty cache


def test_a_batch_whose_rows_have_all_ended_stops_decoding_at_the_next_check(tiny):
    """Whether every row has ended is read every STOP_CHECK_EVERY tokens, not every token: a batch
    whose rows all ended early stops at the next check, and its answers are greedy generate's."""
    from trainer.data.decode import STOP_CHECK_EVERY, StaticDecoder

    target, _, chat = tiny
    prompt = chat.text("count to five")
    ids = torch.tensor([prompt])
    never = -1
    decoder = StaticDecoder(target, compiled=False)
    free_run = decoder.decode(ids, torch.ones_like(ids), 3 * STOP_CHECK_EVERY, never)[0].tolist()
    assert len(free_run) == 3 * STOP_CHECK_EVERY
    end_id = free_run[3]  # a token this row makes early on
    first_end = free_run.index(end_id)
    out = decoder.decode(ids, torch.ones_like(ids), 3 * STOP_CHECK_EVERY, end_id)
    assert out.shape[1] == STOP_CHECK_EVERY * (first_end // STOP_CHECK_EVERY + 1)
    reference = target.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3 * STOP_CHECK_EVERY,
        do_sample=False, eos_token_id=end_id, pad_token_id=end_id,
    )[0, ids.shape[1] :].tolist()  # fmt: skip
    assert cut_answer(out[0].tolist(), end_id) == reference[: reference.index(end_id)]


def test_layer_compiled_decoding_gives_the_uncompiled_answers_with_one_compile_for_all_layers(tiny):
    """data.regen_compile_scope: layers: each decoder layer compiled on its own, handed its part of
    the KV cache, so Dynamo's one trace of a shape serves every layer (with the whole cache each
    layer compiled again for its index, past Dynamo's limit). Left-padded rows get the uncompiled
    loop's answers; the target's own layers stay uncompiled."""
    from torch._dynamo.utils import counters

    from trainer.data.decode import StaticDecoder

    target, tokenizer, chat = tiny
    layers = len(target.model.layers)
    assert layers >= 2
    short, long = chat.text("count to five"), chat.text("name three colours and then count to ten")
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (len(long) - len(short)) + short, long])
    mask = (ids != pad).long()
    mask[1] = 1
    never = -1
    expected = StaticDecoder(target, compiled=False).decode(ids, mask, 6, never)
    graphs = counters["stats"]["unique_graphs"]
    decoder = StaticDecoder(target, compiled=True, scope="layers")
    assert torch.equal(decoder.decode(ids, mask, 6, never), expected)
    assert torch.equal(decoder.decode(ids, mask, 6, never), expected)  # a second batch: no compile
    assert counters["stats"]["unique_graphs"] - graphs == 1  # one decode-step shape, every layer
    compiled = torch._dynamo.eval_frame.OptimizedModule
    assert not any(isinstance(layer, compiled) for layer in target.model.layers)  # the target's own
    with pytest.raises(ValueError, match="decode compile scope must be one of step, layers, got 'all'"):
        StaticDecoder(target, compiled=True, scope="all")


def left_padded_batches(tiny) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two batches (ids, mask) of chat prompts left-padded to widths 24 and 40: 2 and 4 rows."""
    _, tokenizer, chat = tiny
    pad = tokenizer.pad_token_id
    questions = ["count to five", "name three colours and then count to ten", "say hello", "spell cat"]
    batches = []
    for rows, width in ((2, 24), (4, 40)):
        texts = [chat.text(question) for question in questions[:rows]]
        ids = torch.tensor([[pad] * (width - len(text)) + text for text in texts])
        batches.append((ids, (ids != pad).long()))
    return batches


@pytest.mark.parametrize("scope", ["step", "layers"])
def test_decoding_compiled_for_every_shape_compiles_once_and_gives_the_uncompiled_answers(tiny, scope):
    """data.regen_compile_dynamic: batches of other rows and widths run the one compile (rows and
    cache length symbolic) and get the uncompiled loop's answers, left padding included; Dynamo
    traces the step once (no trace thrown away and done again, which a warm start would pay)."""
    from torch._dynamo.utils import clear_compilation_metrics, counters, get_compilation_metrics

    from trainer.data.decode import StaticDecoder

    target, _, _ = tiny
    batches, never = left_padded_batches(tiny), -1
    uncompiled = StaticDecoder(target, compiled=False)
    expected = [uncompiled.decode(ids, mask, 5, never) for ids, mask in batches]
    graphs = counters["stats"]["unique_graphs"]
    clear_compilation_metrics()
    decoder = StaticDecoder(target, compiled=True, scope=scope, dynamic=True)
    for (ids, mask), answers in zip(batches, expected, strict=True):
        assert torch.equal(decoder.decode(ids, mask, 5, never), answers)
    assert counters["stats"]["unique_graphs"] - graphs == 1  # one compile, both shapes
    compiles = get_compilation_metrics()
    assert compiles, "no compile recorded"
    assert [c.restart_reasons for c in compiles if c.restart_reasons] == []


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flex_attention_decoding_gives_the_sdpa_answers_also_in_a_cache_used_before(tiny, compiled):
    """On flex attention (the compiled regeneration's) the decoder makes the prefill's and the
    steps' masks itself: left-padded batches get SDPA's answers, a batch of the same shape again
    too (its cache reused), where transformers' own flex masks read the cache's fill level after
    the first layer has moved it on (the reused cache's prefill saw later prompt tokens)."""
    from trainer.data.decode import StaticDecoder
    from trainer.model.target import attention_of

    target, _, _ = tiny
    batches, never = left_padded_batches(tiny), -1
    batches.append(batches[0])  # the first shape again: its cache reused
    sdpa = StaticDecoder(target, compiled=False)
    expected = [sdpa.decode(ids, mask, 12, never) for ids, mask in batches]
    decoder = StaticDecoder(target, compiled=compiled)
    with attention_of(target, "flex_attention"):
        answers = [decoder.decode(ids, mask, 12, never) for ids, mask in batches]
    assert target.config._attn_implementation != "flex_attention"  # its own attention back
    for got, want in zip(answers, expected, strict=True):
        assert torch.equal(got, want)


def test_batched_tokenizing_equals_tokenizing_message_by_message(tmp_path, embedded, tiny):
    """tokenize_stream encodes a chunk of conversations per tokenizer call: the same ids, in the
    same order, as one call per message, across chunk boundaries, for an empty message and for one
    that holds the chat's special tokens as text (the tokenizer's backend, without offsets, and
    the tokenizer's own call agree)."""
    from trainer.data.chat import tokenize_stream

    _, _, chat = tiny
    data = write_data(tmp_path / "chat.jsonl", embedded, 30)
    conversations = [messages for _, messages in iter_conversations(data)]
    conversations.append([{"role": "user", "content": ""}, {"role": "assistant", "content": "ok"}])
    special = "say <|im_end|> then <|im_start|>assistant\n twice  "
    conversations.append([{"role": "user", "content": special}, {"role": "assistant", "content": special}])
    texts = [m["content"] for messages in conversations for m in messages]
    assert chat.texts(texts) == chat.tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert chat.texts(texts) == [chat.text(text) for text in texts]
    batched = list(tokenize_stream(iter(conversations), chat, chunk=7))
    assert [e.turns for e in batched] == [tokenized(m, chat).turns for m in conversations]
    assert list(tokenize_stream(iter([]), chat)) == []


def test_part_full_batches_are_carried_up_into_wider_ones():
    """Three widths each leaving a part-full batch (3 + 2 + 1 prompts, batches of 4): two batches,
    the shorter prompts padded up, every prompt once, none wider than its batch."""
    from trainer.data.regen import rows_per_batch, static_batches

    lengths = [3, 9, 4, 20, 5, 10]
    prompts = [[7] * n for n in lengths]
    chosen = settings(batch_size=4)
    batches = list(static_batches(prompts, chosen))
    assert len(batches) == 2
    assert sorted(i for _, batch in batches for i in batch) == list(range(6))
    for width, batch in batches:
        assert len(batch) <= rows_per_batch(width, chosen)
        assert all(lengths[i] <= width for i in batch)
    assert any(len({lengths[i] > 8 for i in batch}) == 2 for _, batch in batches)  # widths mixed


def test_the_fewest_batches_at_the_bench_shape_leave_one_part_full_at_most():
    """512 long-tailed prompts at the 8B bench's settings: the per-width batching made six batches,
    four part full; carried up, five, each full at its compiled size."""
    import math
    import random

    from trainer.data.regen import compiled_rows, static_batches

    rng = random.Random(0)
    prompts = [[0] * max(16, min(1500, int(math.exp(rng.gauss(math.log(120), 0.9))))) for _ in range(512)]
    chosen = RegenSettings(max_new_tokens=256, batch_size=256, batch_tokens=131072, min_width=128)
    batches = list(static_batches(prompts, chosen))
    assert len(batches) == 5
    part_full = [b for w, b in batches if len(b) < compiled_rows(len(b), w, chosen)]
    assert len(part_full) <= 1


def test_answers_of_carried_up_batches_equal_plain_greedy_generate(tiny):
    """Prompts padded to a wider batch than their own width give plain greedy generate's answers
    (float32, left padding)."""
    from trainer.data.regen import bucket_width, static_batches, static_generate

    target, tokenizer, chat = tiny
    texts = [
        "count to five", "hi", "name three colours of the rainbow, then three animals that live in the sea",
        "reverse the word stressed and then spell it backwards",
    ]  # fmt: skip
    prompts = [chat.text(t) for t in texts]
    chosen = settings(batch_size=4)
    batches = list(static_batches(prompts, chosen))
    assert len(batches) == 1 and len({bucket_width(len(p), chosen.min_width) for p in prompts}) > 1
    answers = static_generate(target, prompts, chosen, chat, tokenizer.pad_token_id, lambda: False)
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = torch.tensor([prompt])
        output = target.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=chat.end_id, pad_token_id=chat.end_id,
        )[0, ids.shape[1] :].tolist()  # fmt: skip
        assert answer == (output[: output.index(chat.end_id)] if chat.end_id in output else output)


def test_a_full_disk_in_the_data_stage_ends_the_run_crashed_exit_1_in_one_line(tmp_path, monkeypatch, capsys):
    """The same end as a full disk while training (docs/OPERATING.md): crashed, exit status 1."""
    import trainer.cli
    import trainer.regen
    import trainer.run.train
    from trainer.run import runrecord

    full = DiskFull(
        "disk full writing /c/shard-000000004-000000008.jsonl: No space left on device; 4 of 10 kept"
    )

    def fills_the_disk(*_args, **_kwargs):
        raise full

    out = tmp_path / "out"
    record = {"run": "eager", "run_id": "eager-1", "pid": os.getpid(), "state": "running"}
    runrecord.write_record(out, record)
    monkeypatch.setattr(trainer.run.train, "train", fills_the_disk)
    assert trainer.cli.main(["--run", "eager", "--out", str(out), "--set", "parallel.devices=cpu"]) == 1
    ended = runrecord.read_record(out)
    assert (ended["state"], ended["exit_status"], ended["exit_reason"]) == ("crashed", 1, str(full))
    monkeypatch.setattr(trainer.regen, "regenerate", fills_the_disk)
    assert trainer.regen.main(["--run", "eager", "--dir", str(out), "--set", "parallel.devices=cpu"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == f"error: {full}"


def test_a_batch_compiled_for_every_shape_holds_two_rows_at_least():
    """A size of one compiles on its own even with symbolic sizes: a last prompt alone is paired."""
    from trainer.data.regen import compiled_rows

    by_shape = RegenSettings(max_new_tokens=256, batch_size=512, batch_tokens=262144, min_width=64)
    dynamic = RegenSettings(**{**by_shape.__dict__, "compile_dynamic": True})
    assert [compiled_rows(rows, 128, by_shape) for rows in (1, 2, 3)] == [1, 2, 4]
    assert [compiled_rows(rows, 128, dynamic) for rows in (1, 2, 3)] == [2, 2, 4]


def batches_of_two_shapes(tiny, widths=(24, 40)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four left-padded batches: two of one shape (other prompts, other padding), one of another
    shape, then the first shape again."""
    _, tokenizer, chat = tiny
    pad = tokenizer.pad_token_id
    questions = ["count to five", "name three colours and then count to ten", "say hello", "spell cat"]
    batches = []
    narrow, wide = widths
    for rows, width, first in ((2, narrow, 0), (2, narrow, 2), (3, wide, 1), (2, narrow, 1)):
        texts = [chat.text(question) for question in questions[first : first + rows]]
        ids = torch.tensor([[pad] * (width - len(text)) + text for text in texts])
        batches.append((ids, (ids != pad).long()))
    return batches


def test_a_shape_s_batches_reuse_its_cache_masks_and_steps_and_get_a_fresh_decoder_s_answers(tiny):
    """A shape keeps its cache, masks and decode steps (on a GPU, their CUDA graph) from batch to
    batch, each batch loading its own tokens and padding into them in place: every batch gets the
    answers of a decoder that never saw another, and another shape between them changes nothing."""
    from trainer.data.decode import StaticDecoder

    target, _, _ = tiny
    never = -1
    decoder = StaticDecoder(target, compiled=False)
    kept = []
    for ids, mask in batches_of_two_shapes(tiny):
        answers = decoder.decode(ids, mask, 6, never)
        assert torch.equal(answers, StaticDecoder(target, compiled=False).decode(ids, mask, 6, never))
        kept.append((decoder.cache, decoder.masks, decoder.steps))
    assert kept[1] == kept[0]  # the same shape: the same objects, loaded again
    assert all(a is not b for a, b in zip(kept[2], kept[1], strict=True))  # another shape, its own
    assert all(a is not b for a, b in zip(kept[3], kept[2], strict=True))


def test_the_stage_says_how_many_answers_the_cap_cut(tmp_path, tiny, data_and_reference):
    """The count of answers that reached data.regen_max_new_tokens, from the engine's answers, is
    the reference's (plain greedy generate: an answer of the cap's length never reached its end
    token), and the stage's closing line (and the event it records) says it."""
    from trainer.run.regen import stage_ended

    # The embedded target never says <|im_end|> within the cap: here a token it often says ends an answer.
    target, tokenizer, chat = tiny
    ending = copy.copy(chat)
    ending.__class__ = type("EndsAtFive", (ChatFormat,), {"end_id": property(lambda self: 5)})
    data, _ = data_and_reference
    reference = plain_greedy(target, ending, data)
    answers = [ids for turns in reference for role, ids in turns if role == "assistant"]
    cut = sum(len(ids) == NEW_TOKENS for ids in answers)
    assert 0 < cut < len(answers), [len(ids) for ids in answers]  # some end, some are cut
    regen = regeneration(tmp_path, data, (target, tokenizer, ending))
    regen.prepare()
    progress = Progress(len(regen.index))
    assert run_workers(regen, [tiny[0]], progress, lambda: False, lambda: None, 60.0)
    assert (progress.answers, progress.cut) == (len(answers), cut)

    lines: list[str] = []

    class Out:
        line = staticmethod(lines.append)

    stage_ended(regen, progress, Out, None, None, None)
    assert f", {cut} of {len(answers)} answers cut at the cap of {NEW_TOKENS} tokens" in lines[-1], lines


def test_a_shard_whose_contents_changed_is_set_aside_and_regenerated_before_the_data_is_read(
    tmp_path, tiny, data_and_reference
):
    data, reference = data_and_reference
    regen = regeneration(tmp_path, data, tiny)
    regen.prepare()
    assert generate_all(regen, [tiny[0]])

    def flip_bytes(shard: pathlib.Path) -> None:
        body = bytearray(shard.read_bytes())
        body[len(body) // 2 : len(body) // 2 + 3] = b"@#!"
        shard.write_bytes(bytes(body))

    shard = seal_a_shard(regen, flip_bytes)
    assert regen.damaged() == []  # the same size: only the contents tell
    aside = shard.with_name(shard.name + ".damaged")
    assert regen.set_aside_damaged() == [
        (shard, f"its contents do not match its checksum (moved to {aside.name})")
    ]
    assert aside.exists() and not shard.exists()
    # Missing now, and said so truly: no false "no checksum beside it".
    assert regen.missing() == [1] and regen.damaged() == []
    assert generate_all(regen, [tiny[0]])
    assert regen.set_aside_damaged() == [] and regenerated(regen) == reference
