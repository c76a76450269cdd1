"""Training rows from a token store: packed (several conversations per row) or padded (one per row),
and the resumable loader of fixed-shape batches.

A row plan is two small arrays: `pieces` (conversation indices, row by row) and `row_offsets` (row
r holds pieces[row_offsets[r]:row_offsets[r + 1]]): 16 bytes per conversation, whatever the length
of a row. Batches are cut from the store's memory maps when they are asked for.

In a packed row every conversation keeps its own positions (position ids restart at 0), which is
how the target and the drafter tell conversations apart: the target gets the position ids and no
attention mask (transformers then masks each conversation to itself), the drafter's blocks see
only the context of their own conversation (objective.py). The padding at a row's end is a
conversation of its own with no supervised token.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from .chat import DataError
from .store import TokenStore


@dataclass
class TrainSet:
    """The rows of a run: the store and the plan of which conversations fill which row."""

    store: TokenStore
    seq_len: int
    pad_id: int
    packed: bool
    pieces: np.ndarray  # [conversations] int64: conversation indices, row after row
    row_offsets: np.ndarray  # [rows + 1] int64
    cut: int
    """Conversations longer than seq_len, cut to it."""

    @property
    def rows(self) -> int:
        return len(self.row_offsets) - 1

    def supervised_fraction(self) -> float:
        return self.store.manifest["supervised_tokens"] / max(self.store.manifest["tokens"], 1)

    def real_token_share(self) -> float:
        """Share of the rows' slots that hold a conversation's token (not padding)."""
        used = np.minimum(self.store.lengths(), self.seq_len).sum()
        return float(used) / (self.rows * self.seq_len)


def pack(lengths: np.ndarray, seq_len: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Best fit in a shuffled order: each conversation goes into the open row whose free space fits
    it most tightly, or starts a new row. Deterministic from the seed; the order of conversations
    inside a row is the shuffled order. Returns (pieces, row_offsets)."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    row_of = np.empty(len(lengths), dtype=np.int64)
    free_sizes: list[int] = []  # sorted free spaces of open rows
    rows_with_free: dict[int, list[int]] = {}
    rows = 0
    for position, index in enumerate(order):
        need = int(min(lengths[index], seq_len))
        at = bisect.bisect_left(free_sizes, need)
        if at < len(free_sizes):
            free = free_sizes[at]
            row = rows_with_free[free].pop()
            if not rows_with_free[free]:
                del rows_with_free[free]
                free_sizes.pop(at)
        else:
            row, free = rows, seq_len
            rows += 1
        row_of[position] = row
        left = free - need
        if left > 0:
            if left not in rows_with_free:
                bisect.insort(free_sizes, left)
                rows_with_free[left] = []
            rows_with_free[left].append(row)
    by_row = np.argsort(row_of, kind="stable")
    pieces = order[by_row]
    row_offsets = np.searchsorted(row_of[by_row], np.arange(rows + 1)).astype(np.int64)
    return pieces.astype(np.int64), row_offsets


def build_train_set(store: TokenStore, seq_len: int, pad_id: int, packing: bool, seed: int) -> TrainSet:
    """The rows of a run: packed (several conversations a row) or padded (one a row)."""
    lengths = store.lengths()
    if store.manifest["supervised_tokens"] == 0:
        raise DataError("the data set has no supervised (assistant) token")
    if packing:
        pieces, row_offsets = pack(lengths, seq_len, seed)
    else:
        pieces = np.arange(len(lengths), dtype=np.int64)
        row_offsets = np.arange(len(lengths) + 1, dtype=np.int64)
    return TrainSet(store, seq_len, pad_id, packing, pieces, row_offsets, int((lengths > seq_len).sum()))


@dataclass
class Batch:
    """A batch of rows, [batch, seq_len] each."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    """Restart at 0 with every conversation (and with the padding at a row's end) in packed rows;
    0..seq_len-1 in padded rows (the padding continues its conversation's positions, as before)."""
    real: torch.Tensor
    """[batch, seq_len] bool: a conversation's token, not padding."""

    @property
    def real_tokens(self) -> int:
        return int(self.real.sum())


def assemble(train_set: TrainSet, rows: list[int]) -> Batch:
    """The rows, cut from the store's memory maps."""
    size, seq_len = len(rows), train_set.seq_len
    ids = np.full((size, seq_len), train_set.pad_id, dtype=np.int64)
    mask = np.zeros((size, seq_len), dtype=np.int64)
    positions = np.zeros((size, seq_len), dtype=np.int64)
    real = np.zeros((size, seq_len), dtype=bool)
    offsets, store = train_set.store.offsets, train_set.store
    for slot, row in enumerate(rows):
        filled = 0
        for piece in train_set.pieces[train_set.row_offsets[row] : train_set.row_offsets[row + 1]]:
            start = int(offsets[piece])
            length = min(int(offsets[piece + 1]) - start, seq_len - filled)
            ids[slot, filled : filled + length] = store.tokens[start : start + length]
            mask[slot, filled : filled + length] = store.mask[start : start + length]
            positions[slot, filled : filled + length] = np.arange(length)
            real[slot, filled : filled + length] = True
            filled += length
        tail = seq_len - filled
        if train_set.packed:
            positions[slot, filled:] = np.arange(tail)
        else:
            positions[slot, filled:] = np.arange(filled, seq_len)
    return Batch(
        torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(positions), torch.from_numpy(real)
    )


def valid_anchor_count(loss_mask: torch.Tensor, position_ids: torch.Tensor, num_anchors: int) -> int:
    """Anchors a batch's rows can fill out of num_anchors each (the rest are padded, no loss)."""
    from ..model.objective import anchor_candidates

    candidates = anchor_candidates(loss_mask, position_ids).sum(dim=1)
    return int(candidates.clamp(max=num_anchors).sum())


class Loader:
    """Endless shuffled batches of rows; its position is part of every checkpoint.

    The state is the epoch, the cursor, and the generator's state at the start of the epoch (the
    epoch's order is drawn again from it): a few kilobytes, whatever the size of the data set.
    """

    def __init__(self, train_set: TrainSet, batch_size: int, seed: int):
        self.train_set = train_set
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self.cursor = 0
        self.changed_data: dict | None = None  # set by load_state_dict: the checkpoint's other data
        self._new_order()

    def _new_order(self) -> None:
        self.epoch_start_state = self.generator.get_state()
        self.order = torch.randperm(self.train_set.rows, generator=self.generator)

    def next_batch(self) -> Batch:
        picked = []
        for _ in range(self.batch_size):
            if self.cursor == len(self.order):
                self.epoch += 1
                self.cursor = 0
                self._new_order()
            picked.append(int(self.order[self.cursor]))
            self.cursor += 1
        return assemble(self.train_set, picked)

    def position(self) -> dict:
        """Where the loader is in its epoch: the epoch (from 0), the rows and the conversations
        consumed of it, and how many it has."""
        sizes = np.diff(self.train_set.row_offsets)
        done = int(sizes[self.order[: self.cursor].numpy()].sum())
        return {
            "epoch": self.epoch,
            "rows_done": self.cursor,
            "rows": self.train_set.rows,
            "conversations_done": done,
            "conversations": int(sizes.sum()),
        }

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "rows": self.train_set.rows,
            "data": self.train_set.store.path.name,  # the token store's key: which data the rows are
            "epoch_start_generator": self.epoch_start_state.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        """The checkpoint's position. Where the data is not the checkpoint's (made again: a newer
        regeneration format, or the data file changed in place), the run continues at the same
        epoch and the same share of it, its order drawn from the same generator over the new rows;
        `changed_data` then says so."""
        if "order" in state:  # a checkpoint from before the token store: the order itself is saved
            rows, order = len(state["order"]), state["order"].clone()
        else:
            rows, order = int(state["rows"]), None
        if order is not None and self.train_set.packed:
            raise ValueError(
                "the checkpoint was written before packed rows, with one conversation per row: "
                "resume it with --set train.packing=false"
            )
        # The data's key, absent in checkpoints of earlier versions: there other rows mean other data
        # (check_resumable refuses another train.seq_len or train.packing before this).
        data, ours = state.get("data"), self.train_set.store.path.name
        same = rows == self.train_set.rows and data in (None, ours)
        if (order is not None or data == ours) and not same:
            raise ValueError(
                f"the checkpoint's data has {rows} rows and this run's has {self.train_set.rows}: "
                "resume with the data, train.seq_len and train.packing the run started with"
            )
        self.changed_data = None if same else {"data": data, "rows": rows}
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])
        if order is not None:
            self.order = order
            self.generator.set_state(state["generator"])
            return
        if not same:
            self.cursor = min(round(self.cursor * self.train_set.rows / max(rows, 1)), self.train_set.rows)
        self.generator.set_state(state["epoch_start_generator"])
        self._new_order()
