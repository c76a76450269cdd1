"""The token store and the rows: built once and atomically, damage detected and rebuilt, packed
rows that hold every conversation once, and a loader that resumes exactly from a small state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.data.chat import DataError, Example
from trainer.data.rows import Loader, assemble, build_train_set, pack, valid_anchor_count
from trainer.data.store import STORE_FORMAT, open_or_build, store_key

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)
REPO = Path(__file__).resolve().parents[2]


class TinyChat:
    """The framing of ChatFormat with a fixed vocabulary: start 1, end 2, newline 3, role ids 4/5."""

    start, end, newline = [1], [2], [3]

    def header(self, role: str) -> list[int]:
        return [*self.start, 4 if role == "assistant" else 5, *self.newline]

    def encode(self, turns):
        from trainer.data.chat import ChatFormat

        return ChatFormat.encode(self, turns)


def examples(count: int, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    return [
        Example(
            [
                ("user", rng.integers(10, 100, rng.integers(1, 6)).tolist()),
                ("assistant", rng.integers(10, 100, rng.integers(1, 30)).tolist()),
            ]
        )
        for _ in range(count)
    ]


def test_store_holds_every_conversation_as_the_chat_format_encodes_it(tmp_path):
    data = examples(50)
    store = open_or_build(tmp_path, "source-a", TinyChat(), lambda: iter(data), log=lambda _: None)
    assert isinstance(store.tokens, np.memmap) and store.conversations == 50
    for index in (0, 17, 49):
        ids, mask = TinyChat().encode(data[index].turns)
        tokens, loss_mask = store.conversation(index)
        assert tokens.tolist() == ids and loss_mask.tolist() == mask
    assert store.manifest["supervised_tokens"] == int(store.mask.sum())

    def must_not_build():
        raise AssertionError("an intact store was built again")

    again = open_or_build(tmp_path, "source-a", TinyChat(), must_not_build, log=lambda _: None)
    assert again.path == store.path


def damage_flip_a_byte(directory: Path) -> None:
    with (directory / "tokens.bin").open("r+b") as handle:
        handle.seek(5)
        byte = handle.read(1)
        handle.seek(5)
        handle.write(bytes([byte[0] ^ 0xFF]))


def damage_older_format(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps({**manifest, "format": STORE_FORMAT - 1}))


def damage_interrupted_build(directory: Path) -> None:
    (directory / "manifest.json").unlink()


def damage_truncated_file(directory: Path) -> None:
    os.truncate(directory / "mask.bin", 7)


def damage_edited_counts(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps({**manifest, "supervised_tokens": 0}))


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (damage_flip_a_byte, "checksum"),
        (damage_older_format, "format"),
        (damage_interrupted_build, "no manifest"),
        (damage_truncated_file, "sizes"),
        (damage_edited_counts, "manifest does not match its arrays (supervised_tokens 0"),
    ],
)
def test_a_damaged_or_older_store_is_rebuilt_never_read(tmp_path, damage, reason):
    data = examples(20)
    store = open_or_build(tmp_path, "src", TinyChat(), lambda: data, log=lambda _: None)
    damage(store.path)
    said: list[str] = []
    rebuilt = open_or_build(tmp_path, "src", TinyChat(), lambda: data, log=said.append)
    assert reason in said[0] and "rebuilding" in said[0], said
    assert (
        rebuilt.tokens.tolist() == open_or_build(tmp_path, "src", TinyChat(), None, log=print).tokens.tolist()
    )
    assert rebuilt.conversation(0)[0].tolist() == TinyChat().encode(data[0].turns)[0]


def test_a_store_built_from_a_short_source_is_never_used_once_the_source_is_whole(tmp_path):
    data = examples(20)
    short = open_or_build(tmp_path, "src", TinyChat(), lambda: data[:15], log=lambda _: None)
    assert short.conversations == 15  # nothing said how many there should be
    said: list[str] = []
    whole = open_or_build(tmp_path, "src", TinyChat(), lambda: data, log=said.append, total=20)
    assert whole.conversations == 20
    assert "holds 15 conversations, the data has 20" in said[0] and "rebuilding" in said[0], said


def test_a_source_that_gives_fewer_conversations_than_it_has_is_never_stored(tmp_path):
    data = examples(20)
    with pytest.raises(DataError, match="the data gave 15 conversations of 20; nothing is stored"):
        open_or_build(tmp_path, "src", TinyChat(), lambda: data[:15], log=lambda _: None, total=20)
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_two_builders_at_once_build_once(tmp_path):
    builds = []
    gate = threading.Event()

    def slow_examples():
        builds.append(1)
        gate.wait(timeout=10)
        return examples(30)

    stores = []
    workers = [
        threading.Thread(
            target=lambda: stores.append(open_or_build(tmp_path, "k", TinyChat(), slow_examples, log=str))
        )
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    gate.set()
    for worker in workers:
        worker.join(timeout=30)
    assert len(builds) == 1 and len(stores) == 2
    assert stores[0].path == stores[1].path


def test_a_build_killed_midway_leaves_nothing_half_built_and_the_next_run_builds_it(tmp_path):
    """SIGKILL in the middle of writing: no store appears under its name, and the next open
    removes the leftover and builds a complete one."""
    script = f"""
import os, signal, sys
sys.path.insert(0, {str(REPO)!r})
from tests.trainer.test_store import TinyChat, examples
from trainer.data.store import open_or_build
def dying():
    for number, example in enumerate(examples(40)):
        if number == 20:
            os.kill(os.getpid(), signal.SIGKILL)
        yield example
open_or_build(__import__('pathlib').Path({str(tmp_path)!r}), "k", TinyChat(), dying)
"""
    result = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True, text=True)
    assert result.returncode == -9, result.stderr
    key = store_key("k", TinyChat())
    assert not (tmp_path / key).exists()
    assert list(tmp_path.glob(f".{key}.building.*"))  # what the killed build left
    store = open_or_build(tmp_path, "k", TinyChat(), lambda: examples(40), log=lambda _: None)
    assert store.conversations == 40
    assert not list(tmp_path.glob(f".{key}.building.*"))


def test_an_unwritable_store_place_is_one_clear_error(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    with pytest.raises(DataError, match=r"cannot build the token store under .*cache.*data.cache_dir"):
        open_or_build(blocker / "store", "k", TinyChat(), lambda: examples(3), log=lambda _: None)


def test_an_empty_data_set_is_refused_and_leaves_no_store(tmp_path):
    with pytest.raises(DataError, match="no conversation"):
        open_or_build(tmp_path, "k", TinyChat(), lambda: [], log=lambda _: None)
    assert [p.name for p in tmp_path.iterdir()] == [f"{store_key('k', TinyChat())}.lock"]


def test_packing_places_every_conversation_once_within_rows_and_is_fixed_by_the_seed():
    lengths = np.random.default_rng(1).lognormal(np.log(24), 0.8, 2000).astype(np.int64).clip(1, 200)
    pieces, offsets = pack(lengths, 96, seed=3)
    assert sorted(pieces.tolist()) == list(range(len(lengths)))
    used = np.add.reduceat(np.minimum(lengths[pieces], 96), offsets[:-1])
    assert (used <= 96).all()
    assert used.sum() / (len(used) * 96) > 0.95  # best fit leaves little padding
    again = pack(lengths, 96, seed=3)
    assert np.array_equal(pieces, again[0]) and np.array_equal(offsets, again[1])
    assert not np.array_equal(pieces, pack(lengths, 96, seed=4)[0])


def test_a_packed_row_restarts_positions_per_conversation_and_cuts_the_long_ones(tmp_path):
    data = [*examples(40), Example([("user", [11] * 5), ("assistant", [12] * 80)])]
    store = open_or_build(tmp_path, "k", TinyChat(), lambda: data, log=lambda _: None)
    train_set = build_train_set(store, seq_len=48, pad_id=0, packing=True, seed=0)
    assert train_set.cut == 1 and train_set.rows < store.conversations
    batch = assemble(train_set, list(range(train_set.rows)))
    assert batch.real_tokens == int(np.minimum(store.lengths(), 48).sum())
    for row in range(train_set.rows):
        starts = (batch.position_ids[row] == 0).nonzero().flatten().tolist()
        pieces = train_set.pieces[train_set.row_offsets[row] : train_set.row_offsets[row + 1]]
        for start, piece in zip(starts, pieces, strict=False):
            tokens, mask = store.conversation(int(piece))
            length = min(len(tokens), 48 - start)
            assert batch.input_ids[row, start : start + length].tolist() == tokens[:length].tolist()
            assert batch.loss_mask[row, start : start + length].tolist() == mask[:length].tolist()
    padded = build_train_set(store, seq_len=48, pad_id=0, packing=False, seed=0)
    assert padded.rows == store.conversations and padded.real_token_share() < train_set.real_token_share()
    assert valid_anchor_count(batch.loss_mask, batch.position_ids, 4) <= 4 * train_set.rows


def test_loader_resumes_exactly_from_a_small_state(tmp_path):
    store = open_or_build(tmp_path, "k", TinyChat(), lambda: examples(60), log=lambda _: None)
    train_set = build_train_set(store, seq_len=32, pad_id=0, packing=True, seed=0)
    loader = Loader(train_set, batch_size=7, seed=5)
    for _ in range(train_set.rows // 7 + 2):  # past an epoch's end
        loader.next_batch()
    state = loader.state_dict()
    size = sum(v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 8 for v in state.values())
    assert size < 10_000  # no table the size of the data set
    expected = [loader.next_batch().input_ids for _ in range(train_set.rows // 7 + 2)]
    resumed = Loader(train_set, batch_size=7, seed=5)
    resumed.load_state_dict(torch.load(_saved(tmp_path, state), weights_only=True))
    assert all(torch.equal(resumed.next_batch().input_ids, ids) for ids in expected)

    other = build_train_set(store, seq_len=32, pad_id=0, packing=False, seed=0)
    with pytest.raises(ValueError, match=r"train\.packing"):
        Loader(other, 7, 5).load_state_dict(state)


def test_a_loader_on_data_prepared_again_goes_on_from_the_same_share_of_the_epoch(tmp_path):
    """The checkpoint's data and this start's differ (another key, other rows: the data made again):
    the same epoch, the same share of it, an order from the same generator; and it says so."""
    before = open_or_build(tmp_path, "before", TinyChat(), lambda: examples(60), log=lambda _: None)
    after = open_or_build(tmp_path, "after", TinyChat(), lambda: examples(90), log=lambda _: None)
    old_set = build_train_set(before, seq_len=32, pad_id=0, packing=True, seed=0)
    new_set = build_train_set(after, seq_len=32, pad_id=0, packing=True, seed=0)
    assert new_set.rows > old_set.rows
    loader = Loader(old_set, batch_size=2, seed=5)
    for _ in range(old_set.rows // 2 + old_set.rows // 4):  # into the second epoch
        loader.next_batch()
    state = torch.load(_saved(tmp_path, loader.state_dict()), weights_only=True)
    assert (state["epoch"], state["data"]) == (1, before.path.name)

    resumed = Loader(new_set, batch_size=2, seed=5)
    resumed.load_state_dict(state)
    assert resumed.changed_data == {"data": before.path.name, "rows": old_set.rows}
    assert resumed.epoch == 1
    assert resumed.cursor == round(state["cursor"] * new_set.rows / old_set.rows)
    generator = torch.Generator()
    generator.set_state(state["epoch_start_generator"])
    assert torch.equal(resumed.order, torch.randperm(new_set.rows, generator=generator))
    resumed.next_batch()  # rows of the new data

    unchanged = Loader(old_set, batch_size=2, seed=5)
    unchanged.load_state_dict(state)
    assert unchanged.changed_data is None and unchanged.cursor == state["cursor"]
    earlier = {key: value for key, value in state.items() if key != "data"}  # an earlier version's
    resumed = Loader(new_set, batch_size=2, seed=5)
    resumed.load_state_dict(earlier)
    assert resumed.changed_data == {"data": None, "rows": old_set.rows} and resumed.epoch == 1


def _saved(tmp_path: Path, state: dict) -> Path:
    path = tmp_path / "loader.pt"
    torch.save(state, path)
    return path


def test_a_checkpoint_from_before_the_store_resumes_its_order(tmp_path):
    store = open_or_build(tmp_path, "k", TinyChat(), lambda: examples(10), log=lambda _: None)
    train_set = build_train_set(store, seq_len=64, pad_id=0, packing=False, seed=0)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(10, generator=generator)
    loader = Loader(train_set, batch_size=2, seed=0)
    loader.load_state_dict({"epoch": 0, "cursor": 4, "order": order, "generator": generator.get_state()})
    rows = [int(order[4]), int(order[5])]
    assert torch.equal(loader.next_batch().input_ids, assemble(train_set, rows).input_ids)

    packed = build_train_set(store, seq_len=64, pad_id=0, packing=True, seed=0)
    old = {"epoch": 0, "cursor": 4, "order": order, "generator": generator.get_state()}
    with pytest.raises(ValueError, match=r"--set train\.packing=false"):
        Loader(packed, batch_size=2, seed=0).load_state_dict(old)


def test_a_full_disk_during_the_build_is_one_clear_error_and_leaves_nothing(tmp_path):
    """A file size limit stands in for a full disk: the write fails part-way (EFBIG, as ENOSPC)."""
    script = f"""
import resource, signal, sys
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from tests.trainer.test_store import TinyChat, examples
from trainer.data.chat import DataError
from trainer.data.store import open_or_build
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failing write, not a killed process
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
try:
    open_or_build(Path({str(tmp_path)!r}), "k", TinyChat(), lambda: examples(2000))
except DataError as exc:
    print(exc)
"""
    result = subprocess.run([sys.executable, "-c", script], timeout=120, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "cannot build the token store under" in result.stdout and "free space there" in result.stdout
    key = store_key("k", TinyChat())
    assert not (tmp_path / key).exists() and not list(tmp_path.glob(f".{key}.building.*"))


def test_a_long_build_says_how_far_it_is_and_a_stop_keeps_nothing(tmp_path):
    """Progress lines with an ETA while the store builds; a stop during the build ends it at the
    next check (every 256 conversations) with nothing left on disk, and the next start builds it."""
    from trainer.data.store import BuildStopped, BuildWatch, write_store

    said = []
    write_store(
        tmp_path / "watched", examples(600), TinyChat(), "k", BuildWatch(said.append, total=600, every_s=0)
    )
    assert (
        said and said[0].startswith("data: token store: 256/600 conversations, ") and "eta 0:00:" in said[0]
    )

    asked = []

    def stop_on_the_second_check() -> bool:
        asked.append(True)
        return len(asked) >= 2

    with pytest.raises(BuildStopped):
        open_or_build(
            tmp_path / "store",
            "k",
            TinyChat(),
            lambda: examples(600),
            log=str,
            should_stop=stop_on_the_second_check,
        )
    assert len(asked) == 2 and [p.name for p in (tmp_path / "store").iterdir()] == [
        f"{store_key('k', TinyChat())}.lock"
    ]
    assert (
        open_or_build(tmp_path / "store", "k", TinyChat(), lambda: examples(600), log=str).conversations
        == 600
    )
