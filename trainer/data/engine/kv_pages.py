"""The KV cache in fixed-size pages: one pool of pages per layer, shared by every slot, and the block
table that lists each slot's pages in position order. Memory is taken as sequences grow, a page at
a time, not prompt + cap for every row.

Page 0 is never handed out: it is the scratch page that idle slots (and a slot's table past its
last page) point at, so a fixed-shape decode step can write every slot's key and value somewhere
harmless. A page handed out again may still hold its last owner's keys: nothing reads them, since
a query sees only the positions its own sequence has written (step.visible)."""

from __future__ import annotations

import torch

SCRATCH_PAGE = 0


class PageAllocator:
    """Which pages are free (host only). Pages 1..pages-1 are handed out; page 0 is scratch."""

    def __init__(self, pages: int):
        if pages < 2:
            raise ValueError(f"a paged KV cache needs 2 pages at least (one is scratch), got {pages}")
        # Lowest first, so a run hands out the same pages in the same order (reproducible).
        self.free_pages = list(range(pages - 1, SCRATCH_PAGE, -1))

    @property
    def free(self) -> int:
        return len(self.free_pages)

    def take(self, count: int) -> list[int]:
        if count > len(self.free_pages):
            raise RuntimeError(f"{count} KV pages asked for, {len(self.free_pages)} free")
        return [self.free_pages.pop() for _ in range(count)]

    def give_back(self, pages: list[int]) -> None:
        self.free_pages.extend(reversed(pages))


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


class PagedKV:
    """The device side: for each layer a key pool and a value pool [kv heads, pages, page size, head
    dim] (so that the whole pool is one sequence of keys for flex attention, without a copy). The
    block tables the steps read (a row of page ids per slot, max_pages wide) are each step's own:
    a decode step's (step.DecodeStep.table), a prefill chunk's."""

    def __init__(self, config, pages: int, page_size: int, max_pages: int, device, dtype):
        heads = config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (heads, pages, page_size, head_dim)
        layers = config.num_hidden_layers
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.pages, self.page_size, self.max_pages, self.device = pages, page_size, max_pages, device

    @property
    def bytes(self) -> int:
        """The pool's device memory: every layer's keys and values."""
        return sum(pool.numel() * pool.element_size() for pool in (*self.keys, *self.values))

    def table_row(self, pages: list[int]) -> list[int]:
        return pages + [SCRATCH_PAGE] * (self.max_pages - len(pages))


class LayerPages:
    """One layer's view of the paged cache, as a decoder layer calls it (`update`): writes this
    forward's keys and values at `where` [rows, tokens] (page x page size + place in the page),
    then returns what the attention reads: each row's table of pages in order [rows, kv heads,
    table width x page size, head dim] (a slot's own pages, or a packed prefill's tables one after
    another), or, `whole_pool`, the whole pool as one row of keys [1, kv heads, pages x page size,
    head dim], for flex attention to read each slot's pages in place (step.PoolMask). It holds its
    layer's pools themselves, not the layer's number: a step compiled layer by layer then traces
    one layer for all of them (Dynamo would guard on the number, and trace each layer again)."""

    def __init__(self, kv: PagedKV, layer: int, table: torch.Tensor, where: torch.Tensor, whole_pool=False):
        self.keys, self.values, self.page_size = kv.keys[layer], kv.values[layer], kv.page_size
        self.table, self.where, self.whole_pool = table, where, whole_pool
        self.keys_seen = table.shape[1] * kv.page_size  # every key position of a row's table

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = self.keys, self.values
        pages, offsets = self.where // self.page_size, self.where % self.page_size
        # key_states [rows, heads, tokens, dim]; pool[:, page, offset] takes [heads, rows, tokens, dim]
        keys[:, pages, offsets] = key_states.transpose(0, 1).to(keys.dtype)
        values[:, pages, offsets] = value_states.transpose(0, 1).to(values.dtype)
        if self.whole_pool:
            return whole(keys), whole(values)
        return gathered(keys, self.table), gathered(values, self.table)


def whole(pool: torch.Tensor) -> torch.Tensor:
    heads, pages, page_size, dim = pool.shape
    return pool.view(1, heads, pages * page_size, dim)


def gathered(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[rows, heads, max_pages x page size, dim]: each row's pages, in its table's order."""
    rows, max_pages = table.shape
    heads, _, page_size, dim = pool.shape
    return pool[:, table].transpose(0, 1).reshape(rows, heads, max_pages * page_size, dim)
