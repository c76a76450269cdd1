"""The target's forward over the paged KV cache: its own embedding, rotary embedding, decoder layers,
final norm and LM head, called here one after the other, each layer handed its view of the pages
(kv_pages.LayerPages) and a mask of the positions each query sees. The attention is the layers'
own (sdpa or eager), so the arithmetic is the model's.

Two shapes: a prefill chunk, up to `chunk` prompt tokens of one or more sequences packed in one
row, each reading its own pages up to the chunk's last (its shape varies: eager, or its layers
compiled at dynamic shapes, call_prefill_layer), and the decode
step, every slot x one token over max_pages pages a slot: one shape for a whole run, so it is
compiled once and, on a GPU, replayed as a CUDA graph (DecodeStep)."""

from __future__ import annotations

import functools
import inspect

import torch

from ..decode import RecordedStep, cache_keyword
from .kv_pages import LayerPages, PagedKV

# The attention the decode step reads the pool through in place (flex attention): registered with
# transformers under this name; any other mask (a prefill's) goes to transformers' own sdpa.
FLEX_QUERY_BLOCK = 128
PAGED_ATTENTION = "paged_pool"  # no "flash" in it: transformers takes such a name for a flash kernel
# On a GPU, flex attention's decoding kernel splits each sequence's keys among this many blocks of
# threads (its SPLIT_KV): at 256 slots x 8 KV heads its own choice is 1, and 4 read the pool's pages
# in 0.319 ms a layer against 0.388 ms on one H100 (bench/paged_attention_bench.py,
# docs/PERFORMANCE.md). 0: the kernel's own choice.
FLEX_SPLIT_KV = 4


def visible(positions: torch.Tensor, keys: int) -> torch.Tensor:
    """[rows, 1, queries, keys]: a query at position p sees the keys at positions 0..p of its own
    row's pages. Every later position is hidden, whatever a page handed out again still holds."""
    key_index = torch.arange(keys, device=positions.device)
    return (key_index <= positions[:, :, None])[:, None]


def packed_visible(positions: torch.Tensor, owners: torch.Tensor, key_owners: torch.Tensor,
                   key_positions: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """visible() for sequences packed in one row [1, queries], their pages one after another (each
    sequence's only up to its chunk's last: key_owners and key_positions [keys] say whose key each
    is and at which position): a query sees positions 0..p of its own sequence (owners [1, queries])."""
    own = key_owners == owners[:, :, None]
    return (own & (key_positions <= positions[:, :, None]))[:, None]


def as_attention_mask(target, seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mask in the form the target's attention takes: boolean (sdpa, and the paged attention's
    sdpa), or added to the scores (eager); a block mask as it is."""
    attention = target.config._attn_implementation
    if attention == "sdpa" or attention.startswith(PAGED_ATTENTION) or not isinstance(seen, torch.Tensor):
        return seen
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)


def call_layer(layer, hidden, mask, positions, rotary, cache_name: str, layer_pages):
    """One decoder layer over its pages (paged_forward's calls; compiled_layer's, compiled)."""
    return layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary,
                 **{cache_name: layer_pages})  # fmt: skip


def call_prefill_layer(layer, hidden, mask, positions, rotary, cache_name: str, layer_pages):
    """call_layer for a prefill chunk: a function of its own, so that its compiled form (at dynamic
    shapes: a chunk's tokens and keys vary) keeps its traces apart from the decode step's layer,
    compiled at its one static shape."""
    return call_layer(layer, hidden, mask, positions, rotary, cache_name, layer_pages)


def paged_forward(target, pages: list[LayerPages], tokens: torch.Tensor, positions: torch.Tensor,
                  seen: torch.Tensor, run_layer=call_layer) -> torch.Tensor:  # fmt: skip
    """tokens, positions [rows, n]; pages: each layer's view (where these tokens are written, which
    pages each row reads); seen: visible(...). Writes the tokens' keys and values into their pages
    and returns the final hidden states [rows, n, hidden]. run_layer: call_layer, or its compiled
    form (a step compiled layer by layer)."""
    base = getattr(target, target.base_model_prefix)
    hidden = base.embed_tokens(tokens)
    rotary = base.rotary_emb(hidden, positions)
    mask = as_attention_mask(target, seen, hidden.dtype)
    cache_name = cache_keyword(target)
    for layer, layer_pages in zip(base.layers, pages, strict=True):
        hidden = run_layer(layer, hidden, mask, positions, rotary, cache_name, layer_pages)
    return base.norm(hidden)


def greedy(target, hidden: torch.Tensor) -> torch.Tensor:
    return target.lm_head(hidden).argmax(-1)


def layer_pages(kv: PagedKV, table: torch.Tensor, where: torch.Tensor, whole_pool=False) -> list[LayerPages]:
    """Every layer's view of the pages: rows read this table's pages, tokens are written at `where`.
    Made outside the compiled step (the decode step's once, over its buffers): Dynamo would guard
    on their class being made inside, a guard torch's precompile cannot keep."""
    return [LayerPages(kv, layer, table, where, whole_pool) for layer in range(len(kv.keys))]


def decode_step(target, pages: list[LayerPages], tokens: torch.Tensor, positions: torch.Tensor,
                run_layer=call_layer):  # fmt: skip
    """One token of every slot, over the decode table (idle slots write to the scratch page): each
    slot's pages gathered in order, read by the target's own attention."""
    seen = visible(positions, pages[0].keys_seen)
    return greedy(target, paged_forward(target, pages, tokens, positions, seen, run_layer)[:, -1])


def flex_decode_step(target, pages: list[LayerPages], tokens: torch.Tensor, positions: torch.Tensor, mask,
                     run_layer=call_layer):  # fmt: skip
    """decode_step with flex attention reading each slot's pages where they lie in the pool: a
    step reads the pages in use, not every slot's whole table, and copies none. mask: the step's
    PoolMask.block_mask, made outside the compiled step (on torch 2.11 Inductor could not lower a
    block mask built inside it) and loaded in place before each step."""
    return greedy(target, paged_forward(target, pages, tokens, positions, mask, run_layer)[:, -1])


class PoolMask:
    """The flex-attention block mask of the decode step over the whole pool, on buffers of its own
    (a CUDA graph reads them at fixed addresses): slot b visits the pages of its table up to its
    position's, and sees in them the positions 0..p of its own sequence (a page's owner and place
    in its table, taken from the tables). An idle slot sees nothing."""

    def __init__(self, kv: PagedKV, slots: int):
        from torch.nn.attention.flex_attention import BlockMask

        device, page_size = kv.device, kv.page_size
        self.kv = kv
        self.owner = torch.full((kv.pages,), -1, dtype=torch.long, device=device)
        self.place = torch.zeros(kv.pages, dtype=torch.long, device=device)
        self.last = torch.zeros(slots, dtype=torch.long, device=device)
        owner, place, last = self.owner, self.place, self.last

        def own_positions(b, h, q, key):
            key_page = key // page_size
            return (owner[key_page] == b) & (place[key_page] * page_size + key % page_size <= last[b])

        visited = torch.zeros(slots, 1, 1, dtype=torch.int32, device=device)
        order = torch.zeros(slots, 1, 1, kv.pages, dtype=torch.int32, device=device)
        options = {"compute_q_blocks": False} if COMPUTE_Q_BLOCKS_OPTIONAL else {}
        # Query blocks of flex attention's usual size (a decode step has one): its decoding kernel
        # takes key blocks as small as a page, not query blocks smaller than its own tile. The query
        # blocks (only a backward reads them) are not kept up to date.
        self.block_mask = BlockMask.from_kv_blocks(
            visited, order, BLOCK_SIZE=(FLEX_QUERY_BLOCK, page_size), mask_mod=own_positions,
            seq_lengths=(1, kv.pages * page_size), **options,
        )  # fmt: skip

    def load(self, table: torch.Tensor, positions: torch.Tensor) -> None:
        """This step's tables [slots, width] and positions [slots, 1], into the buffers (on the device)."""
        slots, width = table.shape
        page_size, device = self.kv.page_size, table.device
        in_use = torch.arange(width, device=device) <= positions // page_size  # [slots, width]
        page = torch.where(in_use, table, 0).flatten()
        self.owner.fill_(-1)
        self.owner.scatter_(
            0, page, torch.where(in_use, torch.arange(slots, device=device)[:, None], -1).flatten()
        )
        self.owner[0] = -1  # the scratch page: every idle slot's, and no sequence's
        self.place.scatter_(0, page, torch.arange(width, device=device).expand(slots, width).flatten())
        self.last.copy_(positions[:, 0])
        self.block_mask.kv_num_blocks.copy_((positions // page_size + 1).view(slots, 1, 1))
        self.block_mask.kv_indices[:, 0, 0, :width].copy_(table)


def _compute_q_blocks_optional() -> bool:
    from torch.nn.attention.flex_attention import BlockMask

    return "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


COMPUTE_Q_BLOCKS_OPTIONAL = _compute_q_blocks_optional()


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, split_kv=0,
                    **kwargs):  # fmt: skip
    """transformers' attention interface: a block mask (the decode step's over the pool) is flex
    attention's, with the key and value heads shared by query groups in the kernel (its keys split
    among split_kv blocks of threads on a GPU, FLEX_SPLIT_KV); any other mask is transformers'
    sdpa's."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not isinstance(attention_mask, BlockMask):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    options = {"SPLIT_KV": split_kv} if split_kv and query.is_cuda else None
    out = flex_attention(query, key, value, block_mask=attention_mask, scale=scaling, enable_gqa=True,
                         kernel_options=options)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def register_paged_attention(split_kv: int = 0) -> str:
    """The paged attention registered with transformers, for this split of the keys; its name."""
    from transformers import AttentionInterface

    name = f"{PAGED_ATTENTION}_split{split_kv}" if split_kv else PAGED_ATTENTION
    AttentionInterface.register(name, functools.partial(paged_attention, split_kv=split_kv))
    return name


class DecodeStep:
    """The decode step at its one shape, on input buffers of its own: the host loads the slots'
    tokens, positions and tables into them in place before each step. graphed (compiled, on a
    GPU): the first step runs the compiled step as it is, the second records it as a CUDA graph,
    and every later step replays it, one launch a step."""

    def __init__(self, step, target, kv: PagedKV, slots: int, graphed: bool, whole_pool: bool = False):
        device = kv.device
        self.step, self.target, self.kv = step, target, kv
        # Each slot's table of pages, loaded in place before each step (a CUDA graph reads it at a
        # fixed address).
        self.table = torch.zeros(slots, kv.max_pages, dtype=torch.long, device=device)
        self.tokens = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.following = torch.zeros(slots, dtype=torch.long, device=device)
        self.where = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.pages = layer_pages(kv, self.table, self.where, whole_pool)
        # Reading the whole pool in place: the step takes the block mask too (flex_decode_step).
        self.pool_mask = PoolMask(kv, slots) if whole_pool else None
        self.recorded = RecordedStep(self.run, graphed)

    def load(self, tokens: list[int], positions: list[int], where: list[int], table: torch.Tensor) -> None:
        """The slots' last tokens, their positions, where their keys go (page x page size + offset)
        and their tables (a host tensor), into the step's buffers."""
        rows = torch.tensor([tokens, positions, where], dtype=torch.long).T.to(self.tokens.device)
        self.tokens.copy_(rows[:, :1])
        self.positions.copy_(rows[:, 1:2])
        self.where.copy_(rows[:, 2:])
        self.table.copy_(table)
        if self.pool_mask is not None:
            self.pool_mask.load(self.table, self.positions)

    def run(self) -> None:
        mask = () if self.pool_mask is None else (self.pool_mask.block_mask,)
        self.following.copy_(self.step(self.target, self.pages, self.tokens, self.positions, *mask))

    def next(self) -> torch.Tensor:
        """The next token of every slot [slots], in the step's own buffer."""
        self.recorded(self.tokens.device)
        return self.following

    @property
    def graph(self):
        return self.recorded.graph
