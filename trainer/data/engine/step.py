"""The target's forward over the paged KV cache: its own embedding, rotary embedding, decoder layers,
final norm and LM head, called here one after the other, each layer handed its view of the pages
(kv_pages.LayerPages) and a mask of the positions each query sees. The attention is the layers'
own (sdpa or eager), so the arithmetic is the model's.

Two shapes: a prefill chunk, up to `chunk` prompt tokens of one or more sequences packed in one
row, each reading its own pages (eager, its shape varies), and the decode step, every slot x one
token over max_pages pages a slot: one shape for a whole run, so it is compiled once and, on a
GPU, replayed as a CUDA graph (DecodeStep)."""

from __future__ import annotations

import torch

from ..decode import cache_keyword
from .kv_pages import LayerPages, PagedKV


def visible(positions: torch.Tensor, keys: int) -> torch.Tensor:
    """[rows, 1, queries, keys]: a query at position p sees the keys at positions 0..p of its own
    row's pages. Every later position is hidden, whatever a page handed out again still holds."""
    key_index = torch.arange(keys, device=positions.device)
    return (key_index <= positions[:, :, None])[:, None]


def packed_visible(positions: torch.Tensor, owners: torch.Tensor, keys_per_table: int, tables: int):
    """visible() for sequences packed in one row [1, queries], their tables one after another:
    a query sees positions 0..p of its own sequence's (owners [1, queries]) table only."""
    key_index = torch.arange(keys_per_table * tables, device=positions.device)
    own = key_index // keys_per_table == owners[:, :, None]
    return (own & (key_index % keys_per_table <= positions[:, :, None]))[:, None]


def as_attention_mask(target, seen: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The mask in the form the target's attention takes: boolean (sdpa), or added to the scores."""
    if target.config._attn_implementation == "sdpa":
        return seen
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)


def paged_forward(target, pages: list[LayerPages], tokens: torch.Tensor, positions: torch.Tensor,
                  seen: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """tokens, positions [rows, n]; pages: each layer's view (where these tokens are written, which
    pages each row reads); seen: visible(...). Writes the tokens' keys and values into their pages
    and returns the final hidden states [rows, n, hidden]."""
    base = getattr(target, target.base_model_prefix)
    hidden = base.embed_tokens(tokens)
    rotary = base.rotary_emb(hidden, positions)
    mask = as_attention_mask(target, seen, hidden.dtype)
    cache_name = cache_keyword(target)
    for layer, layer_pages in zip(base.layers, pages, strict=True):
        hidden = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary,
                       **{cache_name: layer_pages})  # fmt: skip
    return base.norm(hidden)


def greedy(target, hidden: torch.Tensor) -> torch.Tensor:
    return target.lm_head(hidden).argmax(-1)


def layer_pages(kv: PagedKV, table: torch.Tensor, where: torch.Tensor) -> list[LayerPages]:
    """Every layer's view of the pages: rows read this table's pages, tokens are written at `where`.
    Made outside the compiled step (the decode step's once, over its buffers): Dynamo would guard
    on their class being made inside, a guard torch's precompile cannot keep."""
    return [LayerPages(kv, layer, table, where) for layer in range(len(kv.keys))]


def decode_step(target, pages: list[LayerPages], tokens: torch.Tensor, positions: torch.Tensor):
    """One token of every slot, over the decode table (idle slots write to the scratch page)."""
    seen = visible(positions, pages[0].keys_seen)
    return greedy(target, paged_forward(target, pages, tokens, positions, seen)[:, -1])


class DecodeStep:
    """The decode step at its one shape, on input buffers of its own: the host loads the slots'
    tokens, positions and tables into them in place before each step. graphed (compiled, on a
    GPU): the first step runs the compiled step as it is, the second records it as a CUDA graph,
    and every later step replays it, one launch a step."""

    def __init__(self, step, target, kv: PagedKV, slots: int, graphed: bool):
        device = kv.decode_table.device
        self.step, self.target, self.kv, self.graphed = step, target, kv, graphed
        self.tokens = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.following = torch.zeros(slots, dtype=torch.long, device=device)
        self.where = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.pages = layer_pages(kv, kv.decode_table, self.where)
        self.ran = False
        self.graph = None

    def load(self, tokens: list[int], positions: list[int], where: list[int], table: list[list[int]]) -> None:
        """The slots' last tokens, their positions, where their keys go (page x page size + offset)
        and their tables, into the step's buffers: one copy to the device."""
        rows = torch.tensor([tokens, positions, where], dtype=torch.long).T.to(self.tokens.device)
        self.tokens.copy_(rows[:, :1])
        self.positions.copy_(rows[:, 1:2])
        self.where.copy_(rows[:, 2:])
        self.kv.decode_table.copy_(torch.tensor(table, dtype=torch.long).to(self.tokens.device))

    def run(self) -> None:
        self.following.copy_(self.step(self.target, self.pages, self.tokens, self.positions))

    def next(self) -> torch.Tensor:
        """The next token of every slot [slots], in the step's own buffer."""
        if self.graph is not None:
            self.graph.replay()
        elif not self.graphed:
            self.run()
        elif not self.ran:
            self.first_run()
        else:
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.run()
            self.graph.replay()  # recording ran nothing: this is the step itself
        return self.following

    def first_run(self) -> None:
        # On a side stream, as recording wants: the libraries' first-call setup happens outside it.
        device = self.tokens.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.run()
        torch.cuda.current_stream(device).wait_stream(side)
        self.ran = True
