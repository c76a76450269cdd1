"""Greedy decoding of one left-padded batch over a static KV cache, in a loop of our own.

transformers' `generate` spends host time on every token: it rebuilds the attention mask, grows
the inputs, runs its logits processors and stopping criteria and reads two device flags (whether
every row has ended), so the GPU waits for the host a quarter to half of each decode step
(docs/PERFORMANCE.md: 22.4 ms a token at 256 rows x 128 with 16.2 ms of kernels). Here a decode
step is the target's forward and the argmax, compiled one of two ways (data.regen_compile_scope):
"step", the whole step as one CUDA graph per (rows, cache length), about a minute to compile
each shape at the Qwen3-8B shape; or "layers", each decoder layer compiled on its own with one
compile shared by them all and no CUDA graphs: a shape compiles in a third of the time, but each
step then waits on the host (one H200, Qwen3-8B shape: 2.4x slower; docs/PERFORMANCE.md). Either
compiles once per batch shape, or, with data.regen_compile_dynamic, once for every shape (the rows
and the cache length symbolic; in "step" a CUDA graph is still recorded per shape, which takes a
few of its steps, not a compile; on an H200 it decodes 2.5-3x slower, hence off). The mask
covers the whole cache from the start (the cache's own position makes it causal), so nothing
between steps depends on the step; on flex attention the masks are made here (FlexMasks), one a
batch moved on in place. Whether every row has ended is read once every STOP_CHECK_EVERY tokens.
The host queues steps ahead of the GPU.

Answers equal `generate`'s greedy ones: the same forward, the same argmax (of the same logits),
and a row that has ended keeps decoding tokens that cut_answer drops at its end token.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import weakref

import torch
import torch.fx.experimental._config as fx_config

# A batch ends this many steps at most after its last row has: each check waits for the GPU.
STOP_CHECK_EVERY = 16
SCOPES = ("step", "layers")


def greedy_step(target, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: dict):
    """One decode step: the next token of every row. Compiled whole (CUDA graphs) on a GPU."""
    logits = target(input_ids=tokens, position_ids=positions, attention_mask=mask, use_cache=True,
                    logits_to_keep=1, **cache).logits  # fmt: skip
    return logits[:, -1].argmax(-1)


class StaticDecoder:
    """Decodes batch after batch with one target. Keeps the compiled step (compiled once per
    process and shape) and the static cache of the last shape (reused, so the step's CUDA graph
    is not recorded again for each batch of that shape). scope: "step" or "layers" (the module's
    docstring; data.regen_compile_scope); dynamic: one compile for every shape
    (data.regen_compile_dynamic)."""

    def __init__(self, target, compiled: bool, scope: str = "step", dynamic: bool = False):
        if scope not in SCOPES:
            raise ValueError(f"decode compile scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        self.target = target
        self.cache_name = cache_keyword(target)
        self.cache = None
        self.cache_shape: tuple[int, int] | None = None
        self.graphed = compiled and scope == "step"
        self.dynamic = compiled and dynamic
        self.step = compiled_step(dynamic) if self.graphed else greedy_step
        # The model each step runs: the target, or its view with compiled layers.
        layered = compiled and scope == "layers"
        self.stepper = layers_compiled(target, self.cache_name, dynamic) if layered else target

    def static_cache(self, rows: int, length: int):
        from transformers import StaticCache

        if self.cache_shape == (rows, length):
            self.cache.reset()
        else:
            self.cache = None  # the last shape's memory is given back before the new one is taken
            self.cache = StaticCache(config=self.target.config, max_cache_len=length)
            self.cache_shape = (rows, length)
        return self.cache

    @torch.no_grad()
    def decode(self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, end_id: int) -> torch.Tensor:
        """ids, mask: [rows, width], left-padded (mask 0 on padding). Returns [rows, new_tokens] (or
        fewer columns once every row has produced end_id); tokens after a row's end_id are noise."""
        with symbolic_sizes() if self.dynamic else contextlib.nullcontext():
            return self.decode_tokens(ids, mask, new_tokens, end_id)

    def decode_tokens(self, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, end_id: int):
        rows, width = ids.shape
        cache = {self.cache_name: self.static_cache(rows, width + new_tokens)}
        # The mask of the whole cache: padding off, the rest on; causality comes from the cache's
        # position, so the same tensor serves the prefill and every step (one shape, no rebuild).
        full_mask = torch.cat([mask, mask.new_ones(rows, new_tokens)], dim=1)
        flex = FlexMasks(full_mask, width) if FlexMasks.fit(self.target) else None
        prompt_positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as `generate` numbers them
        prompt_mask = flex.prefill if flex else full_mask
        logits = self.target(input_ids=ids, position_ids=prompt_positions, attention_mask=prompt_mask,
                             use_cache=True, logits_to_keep=1, **cache).logits  # fmt: skip
        step_mask = flex.step if flex else full_mask
        out = torch.empty(rows, new_tokens, dtype=torch.long, device=ids.device)
        out[:, 0] = logits[:, -1].argmax(-1)
        del logits
        positions = mask.sum(-1, keepdim=True)
        for i in range(1, new_tokens):
            if i % STOP_CHECK_EVERY == 0 and bool((out[:, :i] == end_id).any(-1).all()):
                return out[:, :i]
            if self.graphed:
                torch.compiler.cudagraph_mark_step_begin()
            out[:, i] = self.step(self.stepper, out[:, i - 1 : i], positions, step_mask, cache)
            positions = positions + 1
            if flex:
                flex.advance()
        return out


class FlexMasks:
    """The flex-attention masks of one batch, made here and handed to the model ready-made: the
    prefill's, and the decode steps' (built once a batch, moved on in place at each step).

    transformers (5.17 at least) makes them from the static cache's fill level, a tensor that the
    first layer's cache write has already moved on when the kernel reads it: a decode step's query
    also sees the empty slot after its own, and the prefill of a batch in a cache used before sees
    every later prompt token (its answers are noise; on a fresh cache the level is still the number
    0). Its per-step mask code also breaks the compiled step into about eight graphs a shape, with
    the host waiting on the GPU at a check of the mask's values each step.

    Slots are filled left to right, the same for every row: the prefill's query i sits at slot i,
    decode step i's at slot width + i - 1. A query sees the slots up to its own that are not
    padding; the kernel visits only the key blocks up to its own block."""

    def __init__(self, full_mask: torch.Tensor, width: int):
        from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE

        rows = full_mask.shape[0]
        self.block = _DEFAULT_SPARSE_BLOCK_SIZE
        self.keep = full_mask.bool()
        self.slot = torch.tensor(width, dtype=torch.int32, device=full_mask.device)
        keep, slot = self.keep, self.slot

        def prompt_visible(batch, head, query, key):
            return keep[batch, key] & (key <= query)

        def step_visible(batch, head, query, key):
            return keep[batch, key] & (key <= slot)

        query_blocks = -(-width // self.block)
        prompt_blocks = torch.arange(1, query_blocks + 1)  # query block j: the key blocks up to j
        self.prefill = {"full_attention": self.block_mask(prompt_visible, prompt_blocks, width)}
        first = width // self.block + 1
        self.visited = torch.full((rows, 1, 1), first, dtype=torch.int32, device=self.slot.device)
        self.step = {"full_attention": self.block_mask(step_visible, self.visited, 1)}

    def block_mask(self, visible, visited: torch.Tensor, queries: int):
        """visited: the key blocks each query block visits, the first ones (every row alike, or
        [rows, 1, query blocks] to move on in place)."""
        from torch.nn.attention.flex_attention import BlockMask

        rows, length = self.keep.shape
        key_blocks = -(-length // self.block)
        device = self.keep.device
        if visited.dim() == 1:
            visited = visited.clamp(max=key_blocks).to(device, torch.int32).expand(rows, 1, -1).contiguous()
        order = torch.arange(key_blocks, dtype=torch.int32, device=device)
        order = order.expand(rows, 1, visited.shape[-1], key_blocks).contiguous()
        return BlockMask.from_kv_blocks(visited, order, BLOCK_SIZE=self.block, mask_mod=visible,
                                        seq_lengths=(queries, length))  # fmt: skip

    @staticmethod
    def fit(target) -> bool:
        """A target on flex attention whose layers all attend to the whole past."""
        config = target.config
        layer_types = getattr(config, "layer_types", None) or ["full_attention"]
        return config._attn_implementation == "flex_attention" and set(layer_types) == {"full_attention"}

    def advance(self):
        """The next step's slot, and the blocks up to it: device work, no wait on the host."""
        self.slot.add_(1)
        self.visited.copy_((self.slot // self.block + 1).expand_as(self.visited))


@contextlib.contextmanager
def symbolic_sizes():
    """How Dynamo traces the step for every shape at once. Its own symbol for each size: with
    "duck shapes" sizes that are equal share one, so a batch of 8 rows would share the symbol of
    the 8 KV heads, which the model fixes, and compile its rows as a constant (every other row
    count compiled again). The model's float constants (each attention layer's scale) as plain
    numbers: as symbols, the attention call, which takes a Python float, fixes them only once the
    whole step is traced, and Dynamo traces it all again (a warm start's first trace is thrown
    away: 20 s against 8 s for 12 layers on the CPU, docs/PERFORMANCE.md)."""
    with fx_config.patch(use_duck_shape=False), torch._dynamo.config.patch(specialize_float=True):
        yield


_COMPILED_STEPS: dict = {}


def compiled_step(dynamic: bool = False):
    """greedy_step compiled once a process (for each of static and dynamic shapes): a new
    torch.compile wrapper would trace again."""
    if dynamic not in _COMPILED_STEPS:
        _COMPILED_STEPS[dynamic] = torch.compile(
            greedy_step, mode="reduce-overhead", dynamic=dynamic, fullgraph=False
        )
    return _COMPILED_STEPS[dynamic]


class LayerCache:
    """One layer's part of a KV cache, as a decoder layer uses it: its `update` (transformers'
    Cache.update without the layer index, which picks the part). Each compiled layer is handed its
    own, so no compiled code reads the layer index, and Dynamo's one trace serves every layer; with
    the whole cache each layer would compile again for its index."""

    def __init__(self, layer):
        self.layer = layer

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layer.update(key_states, value_states, *args, **kwargs)


class CompiledLayer(torch.nn.Module):
    """A decoder layer compiled on its own, handed its part of the KV cache."""

    def __init__(self, layer, index: int, cache_name: str, dynamic: bool = False):
        super().__init__()
        self.compiled = torch.compile(layer, dynamic=dynamic)
        self.index = index
        self.cache_name = cache_name

    def forward(self, hidden_states, **kwargs):
        cache = kwargs.get(self.cache_name)
        if cache is not None:
            kwargs[self.cache_name] = LayerCache(cache.layers[self.index])
        return self.compiled(hidden_states, **kwargs)


_LAYER_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def layers_compiled(target, cache_name: str, dynamic: bool = False):
    """A view of the target whose decoder layers run compiled, sharing its weights; one per target,
    process and dynamic (a new torch.compile wrapper would trace again). The target's own layers
    stay uncompiled: the prefill runs them."""
    views = _LAYER_VIEWS.setdefault(target, {})
    view = views.get(dynamic)
    if view is None:
        base = getattr(target, target.base_model_prefix)
        layers = [CompiledLayer(layer, i, cache_name, dynamic) for i, layer in enumerate(base.layers)]
        inner = copy.copy(base)  # shallow: parameters, buffers and config are shared, not copied
        inner._modules = dict(base._modules)
        inner._modules["layers"] = torch.nn.ModuleList(layers)
        view = copy.copy(target)
        view._modules = dict(target._modules)
        view._modules[target.base_model_prefix] = inner
        views[dynamic] = view
    return view


def cache_keyword(target) -> str:
    """The forward's name for the KV cache: `past_key_values` (transformers up to 5.17 at least) or
    `cache` (5.24)."""
    parameters = inspect.signature(target.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
