"""Greedy decoding of one left-padded batch over a static KV cache, in a loop of our own.

transformers' `generate` spends host time on every token: it rebuilds the attention mask, grows
the inputs, runs its logits processors and stopping criteria and reads two device flags (whether
every row has ended), so the GPU waits for the host a quarter to half of each decode step
(docs/PERFORMANCE.md: 22.4 ms a token at 256 rows x 128 with 16.2 ms of kernels). Here a decode
step is the target's forward and the argmax, compiled one of two ways (data.regen_compile_scope):
"step", the whole step compiled, about a minute each shape at the Qwen3-8B shape, and replayed on
a GPU as a CUDA graph of our own (DecodeSteps); or "layers", each decoder layer compiled on its own
with one compile shared by them all and no CUDA graphs: a shape compiles in a third of the time,
but each step then waits on the host (one H200, Qwen3-8B shape: 2.4x slower; docs/PERFORMANCE.md).
Either compiles once per batch shape, or, with data.regen_compile_dynamic, once for every shape
(the rows and the cache length symbolic; in "step" a CUDA graph is still recorded per shape, one
step's time, not a compile; on an H200 it decodes 2.5-3x slower, hence off).

The CUDA graph is ours, not torch.compile's ("reduce-overhead"), so that a process over the
compile cache can load Dynamo's output too (torch's precompile, trainer.model.compile_cache), which
torch does not do for its own CUDA graphs: a warm start then traces nothing. A shape keeps its
cache, masks, input buffers and graph from batch to batch; a batch loads its own values into them
in place, and each step's graph reads the last step's token, writes the next, and moves the
positions and the masks on.

The mask covers the whole cache from the start (the cache's own position makes it causal), so
nothing between steps depends on the step; on flex attention the masks are made here (FlexMasks),
moved on in place at each step. Whether every row has ended is read once every STOP_CHECK_EVERY
tokens. The host queues steps ahead of the GPU.

Answers equal `generate`'s greedy ones: the same forward, the same argmax (of the same logits),
and a row that has ended keeps decoding tokens that cut_answer drops at its end token.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import weakref
from collections.abc import Callable

import torch
import torch.fx.experimental._config as fx_config

from ..model.compile_cache import keeping_traces

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
    process and shape) and what the last shape's batches share: its static cache (reused, emptied),
    masks and decode steps (on a GPU their CUDA graph, recorded once a shape). scope: "step" or
    "layers" (the module's docstring; data.regen_compile_scope); dynamic: one compile for every
    shape (data.regen_compile_dynamic)."""

    def __init__(self, target, compiled: bool, scope: str = "step", dynamic: bool = False):
        if scope not in SCOPES:
            raise ValueError(f"decode compile scope must be one of {', '.join(SCOPES)}, got {scope!r}")
        self.target = target
        self.cache_name = cache_keyword(target)
        self.cache = None
        self.cache_shape: tuple[int, int] | None = None
        self.masks = None  # the last shape's FlexMasks or PlainMask
        self.steps = None  # the last shape's DecodeSteps
        self.whole_step = compiled and scope == "step"
        self.dynamic = compiled and dynamic
        # The model each step runs: the target, or its view with compiled layers.
        layered = compiled and scope == "layers"
        self.stepper = layers_compiled(target, self.cache_name, dynamic) if layered else target

    def static_cache(self, rows: int, length: int):
        from transformers import StaticCache

        if self.cache_shape == (rows, length):
            self.cache.reset()
        else:
            # The last shape's memory (its cache, and the CUDA graph that holds on to it) is given
            # back before the new one is taken.
            self.cache = self.steps = None
            self.cache = StaticCache(config=self.target.config, max_cache_len=length)
            self.cache_shape = (rows, length)
        return self.cache

    def batch_masks(self, full_mask: torch.Tensor, width: int):
        """This batch's masks, in the shape's buffers (a new shape: new buffers)."""
        if self.masks is None or not self.masks.fits(full_mask, width):
            flex = FlexMasks.fit(self.target)
            self.masks = FlexMasks(full_mask, width) if flex else PlainMask(full_mask)
        self.masks.load(full_mask)
        return self.masks

    def decode_steps(self, cache: dict, masks, tokens: torch.Tensor, positions: torch.Tensor):
        """The decode steps of this batch, started at its first token: the shape's own when its
        cache and masks are the ones they were made over."""
        steps = self.steps
        if steps is None or steps.cache is not cache[self.cache_name] or steps.masks is not masks:
            # The compiled step is made at a first decode, not before: inside the regeneration's
            # compile cache block, where torch's precompile finds the traces it kept.
            step = compiled_step(self.dynamic) if self.whole_step else greedy_step
            graphed = self.whole_step and tokens.device.type == "cuda"
            self.steps = steps = DecodeSteps(step, self.stepper, self.cache_name, cache, masks, graphed)
        steps.start(tokens, positions)
        return steps

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
        masks = self.batch_masks(full_mask, width)
        prompt_positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as `generate` numbers them
        logits = self.target(input_ids=ids, position_ids=prompt_positions, attention_mask=masks.prefill,
                             use_cache=True, logits_to_keep=1, **cache).logits  # fmt: skip
        out = torch.empty(rows, new_tokens, dtype=torch.long, device=ids.device)
        out[:, 0] = logits[:, -1].argmax(-1)
        del logits
        steps = self.decode_steps(cache, masks, out[:, :1], mask.sum(-1, keepdim=True))
        for i in range(1, new_tokens):
            if i % STOP_CHECK_EVERY == 0 and bool((out[:, :i] == end_id).any(-1).all()):
                return out[:, :i]
            out[:, i] = steps.next()
        return out


class RecordedStep:
    """A step (`run`, in place on buffers of its own) replayed as a CUDA graph: the first call runs
    it as it is (compiling it, or loading it from the compile cache), the second records it, every
    later call replays the recording: one launch a step, and no Python, guard or CUDA Graph Tree
    check between steps. Not graphed: every call runs it."""

    def __init__(self, run: Callable[[], None], graphed: bool):
        self.run, self.graphed = run, graphed
        self.ran = False
        self.graph = None

    def __call__(self, device: torch.device) -> None:
        if self.graph is not None:
            self.graph.replay()
        elif not self.graphed:
            self.run()
        elif not self.ran:
            self.first_run(device)
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.run()
            graph.replay()  # recording ran nothing: this is the step itself
            self.graph = graph  # only once recorded: a failed recording is not replayed
        self.ran = True

    def first_run(self, device: torch.device) -> None:
        # On a side stream, as recording wants: what the libraries set up on a first call (cuBLAS'
        # workspace, Triton's kernels loaded) is then done outside the recording.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.run()
        torch.cuda.current_stream(device).wait_stream(side)


class DecodeSteps:
    """The decode steps of one batch shape, on input buffers of their own: each step reads the last
    token and the positions from them and writes the next token and positions back, and moves the
    masks on, all on the device. graphed (the whole step compiled, on a GPU): a shape's first step
    runs the compiled step as it is (compiling it, or loading it from the compile cache), the
    second records it as a CUDA graph, and every later step of the shape's batches replays that
    graph: one launch a step, and no Python, guard or CUDA Graph Tree check between steps."""

    def __init__(self, step, model, cache_name: str, cache: dict, masks, graphed: bool):
        self.step, self.model, self.masks = step, model, masks
        self.cache, self.cache_arguments = cache[cache_name], cache
        self.recorded = RecordedStep(self.run, graphed)
        self.tokens = self.positions = None

    def start(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        if self.tokens is None:
            self.tokens, self.positions = tokens.clone(), positions.clone()
        else:
            self.tokens.copy_(tokens)
            self.positions.copy_(positions)

    def run(self) -> None:
        """One step, in place."""
        following = self.step(self.model, self.tokens, self.positions, self.masks.step, self.cache_arguments)
        self.tokens.copy_(following[:, None])
        self.positions.add_(1)
        self.masks.advance()

    def next(self) -> torch.Tensor:
        """The next token of every row: [rows], in the steps' own buffer (read before the next)."""
        self.recorded(self.tokens.device)
        return self.tokens[:, 0]

    @property
    def graph(self):
        return self.recorded.graph


class PlainMask:
    """The whole cache's mask, one buffer for the prefill and every step (not moved on: the
    cache's position makes it causal)."""

    def __init__(self, full_mask: torch.Tensor):
        self.mask = torch.zeros_like(full_mask)
        self.prefill = self.step = self.mask

    def fits(self, full_mask: torch.Tensor, width: int) -> bool:
        return self.mask.shape == full_mask.shape

    def load(self, full_mask: torch.Tensor) -> None:
        self.mask.copy_(full_mask)

    def advance(self) -> None:
        pass


class FlexMasks:
    """The flex-attention masks of one batch shape, made here and handed to the model ready-made:
    the prefill's, and the decode steps' (moved on in place at each step); a batch loads its rows'
    padding into them.

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
        self.width = width
        self.block = _DEFAULT_SPARSE_BLOCK_SIZE
        self.keep = torch.zeros(full_mask.shape, dtype=torch.bool, device=full_mask.device)
        self.slot = torch.tensor(width, dtype=torch.int32, device=full_mask.device)
        keep, slot = self.keep, self.slot

        def prompt_visible(batch, head, query, key):
            return keep[batch, key] & (key <= query)

        def step_visible(batch, head, query, key):
            return keep[batch, key] & (key <= slot)

        query_blocks = -(-width // self.block)
        prompt_blocks = torch.arange(1, query_blocks + 1)  # query block j: the key blocks up to j
        self.prefill = {"full_attention": self.block_mask(prompt_visible, prompt_blocks, width)}
        self.first_block = width // self.block + 1
        self.visited = torch.full((rows, 1, 1), self.first_block, dtype=torch.int32, device=self.slot.device)
        self.step = {"full_attention": self.block_mask(step_visible, self.visited, 1)}

    def fits(self, full_mask: torch.Tensor, width: int) -> bool:
        return self.keep.shape == full_mask.shape and self.width == width

    def load(self, full_mask: torch.Tensor) -> None:
        """A batch's padding, and the steps back at the first slot after the prompt."""
        self.keep.copy_(full_mask)
        self.slot.fill_(self.width)
        self.visited.fill_(self.first_block)

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
    torch.compile wrapper would trace again. Without torch's CUDA graphs (DecodeSteps records its
    own), so that torch's precompile can keep its traces in the compile cache."""
    if dynamic not in _COMPILED_STEPS:
        _COMPILED_STEPS[dynamic] = keeping_traces(greedy_step, dynamic=dynamic, fullgraph=False)
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
