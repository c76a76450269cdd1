"""Typed configuration of a training run: dataclasses, layered loading and validation.

Layers, later wins: dataclass defaults (the embedded CPU run) -> run profile (``runs/<name>.yml``:
the experiment: ``run``, ``compile``, ``train``, ``drafter``, and of ``data`` and ``model`` only
what the recipe needs, PROFILE_KEYS) -> machine config (``--config``: the machine: ``model``, ``data``,
``parallel``) -> ``--set section.field=value`` -> ``--steps``/``--seed``.

Every problem found is collected (not just the first), so ``--check`` can list them all.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

RUNS_DIR = Path(__file__).resolve().parent / "runs"
RUN_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")

# torch.compile modes and whether they turn CUDA graphs on (torch._inductor.list_mode_options:
# reduce-overhead = {'triton.cudagraphs': True}; max-autotune also sets it; the others do not).
COMPILE_MODES = ("none", "default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
MODES_WITH_CUDAGRAPHS = ("reduce-overhead", "max-autotune")

# Upper bounds of the numbers no real run reaches: past them a value is a typo, and it would
# otherwise fail deep inside the run (an overflowing ETA, a seed torch refuses, a timeout
# that the queue cannot wait for).
MAX_STEPS = 10**9
MAX_SEED = 2**63 - 1
CHECKPOINT_WRITERS = ("thread", "process")
MAX_LR = 1.0
MAX_TIMEOUT_S = 7 * 24 * 3600
# Checkpoints kept beyond this many are every one a long run writes in practice: 0 says that plainly.
MAX_KEEP_CHECKPOINTS = 1000

CUDAGRAPHS_IN_THREADS = (
    "CUDA graphs cannot be used in the threaded topology: CUDA Graph Trees keep their state in "
    "thread-local storage that exists only in the thread that imported torch (a worker thread fails "
    "with a bare AssertionError in cudagraph_trees, pytorch issue 123177), and with "
    "cudagraph_trees=false two threads capturing concurrently invalidate each other's stream capture. "
    "Use the 'nographs' profile (compile.mode=default, cudagraphs=false) or "
    "compile.mode=max-autotune-no-cudagraphs, or run.topology=process (one process per GPU), "
    "where CUDA graphs work"
)


class ConfigError(Exception):
    """Bad input: carries every problem found, one line each."""

    def __init__(self, problems: list[str], partial: Config | None = None):
        super().__init__("\n".join(problems))
        self.problems = problems
        self.partial = partial
        """The config with every valid setting applied (bad ones left at their defaults), so that
        machine checks can still run and report their problems too."""


# The shortest sequence compiled flex attention is used for: under it, torch 2.11's Inductor finds
# no flex kernel (NoValidChoicesError; seen on an H200 with the embedded model's 96-token rows, in
# float32 and bfloat16 alike, and with regeneration's shorter prompts).
FLEX_MIN_LEN = 128


@dataclass
class RunConfig:
    """What the run is: its name (the profile's file stem), a description and the topology."""

    name: str = "nographs"
    description: str = ""
    topology: Literal["threaded", "process"] = "threaded"
    """threaded: one process, one worker thread per device; process: one process per GPU (torchrun)."""
    log_name: str = ""
    """Log file name Ansible uses; empty means train_<name>.log."""
    requires_target: bool = False
    """The run is sized for a real target: the machine config must name it (model.target_path) and
    its data (data.train_file); never the embedded tiny target in its place."""

    def problems(self) -> list[str]:
        out = []
        if not RUN_NAME_RE.match(self.name):
            out.append(f"run.name {self.name!r} must match {RUN_NAME_RE.pattern}")
        if self.log_name and ("/" in self.log_name or not self.log_name.endswith(".log")):
            out.append(f"run.log_name {self.log_name!r} must be a plain file name ending in .log")
        return out


@dataclass
class CompileConfig:
    """torch.compile settings for the drafter's training forward."""

    mode: Literal["none", "default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"] = (
        "default"
    )
    dynamic: bool = False
    """False keeps shapes static (the anchor count is padded), so nothing recompiles."""
    fullgraph: bool = False
    cudagraphs: bool = False
    """Inductor's triton.cudagraphs; also turned on by the modes reduce-overhead and max-autotune."""
    cudagraph_trees: bool = False
    """Inductor's triton.cudagraph_trees (only matters when CUDA graphs are on)."""
    scope: Literal["layers", "objective"] = "layers"
    """layers: compile one drafter layer (its compiled code serves every layer, so the cold start
    does not grow with the layer count), one loss chunk and, where the target is compiled, one
    target layer the same way; objective: the whole training forward as one graph, and the
    target's feature forward as another (more fusion across layers, but compile time grows with
    every layer: measured on an H200 at the Qwen3-8B shape, 232 s to the first step for 5 layers)."""
    target: Literal["auto", "on", "off"] = "auto"
    """Compile the target's feature forward too (with this mode's options, never CUDA graphs).
    auto: on CUDA devices only; on the CPU its compile costs more than it saves for the small
    models run there, and eager keeps the CPU's arithmetic as it was. Measured on one H200 at the
    Qwen3-8B shape: 102 ms eager against 89 ms compiled per 3,072-token forward."""

    target_attention: Literal["auto", "sdpa", "flex", "causal"] = "auto"
    """The attention of the compiled target forward. Traced by torch.compile, transformers hands
    SDPA an explicit mask (causal, or one conversation at a time in packed rows), which keeps it
    off its causal kernels: every tile of the score matrix is computed, the masked ones too. flex
    (flex_attention with a block mask) skips them. causal: SDPA told the rows are causal, with no
    mask (cuDNN's kernel for bfloat16 and float16 on CUDA), which is right only when every row is
    one conversation from position 0 (train.packing false; padding after it sees nothing the
    conversation does not). auto, when the target is compiled on CUDA and rows are at least
    FLEX_MIN_LEN tokens: causal for rows of one conversation, flex for packed rows; sdpa (the
    target's own) otherwise. Measured on one H200 at the Qwen3-8B shape, 8 rows of 3,072 tokens:
    the attention alone 58.4 ms a step with flex, 36.3 with cuDNN's causal kernel; the whole step
    1.605 s against 1.611 and 1.606 with flex (the card's power limit takes most of it back)."""

    def compiles_target(self, device_type: str) -> bool:
        wanted = self.target == "on" or (self.target == "auto" and device_type == "cuda")
        return self.mode != "none" and wanted

    def target_attention_of(self, device_type: str, seq_len: int, packing: bool) -> str:
        """The attention the target's feature forward runs with on this device type, row length and
        row layout (packed rows hold several conversations)."""
        if self.target_attention != "auto":
            return self.target_attention
        if self.compiles_target(device_type) and device_type == "cuda" and seq_len >= FLEX_MIN_LEN:
            return "flex" if packing else "causal"
        return "sdpa"

    @property
    def uses_cudagraphs(self) -> bool:
        return self.mode != "none" and (self.cudagraphs or self.mode in MODES_WITH_CUDAGRAPHS)

    def inductor_options(self) -> dict[str, Any]:
        """The options handed to torch.compile: the mode's own options plus the explicit switches."""
        from torch._inductor import list_mode_options

        options = dict(list_mode_options(self.mode))
        options["triton.cudagraphs"] = self.uses_cudagraphs
        options["triton.cudagraph_trees"] = self.cudagraph_trees
        return options

    def problems(self) -> list[str]:
        return []


@dataclass
class TrainConfig:
    """The optimisation: steps, batch, schedule, and the cadence of logging, evaluation, checkpoints."""

    steps: int = 150
    seed: int = 0
    batch_size: int = 8
    """Sequences per worker per step."""
    seq_len: int = 96
    """Tokens per row (static shapes); a longer conversation is cut to it."""
    packing: bool = True
    """Fill each row with several whole conversations (each keeps its own positions and attention,
    deterministic from the seed); false: one conversation per row, padded (for comparison)."""
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    log_every: int = 10
    """A progress line and a metrics row every log_every steps and at the last; the first step of
    every start gets a progress line too (what launch.yml waits for)."""
    eval_every: int = 50
    """Evaluate tau at step 0, every eval_every steps and at the end (0: only at 0 and the end)."""
    eval_prompts: int = 16
    eval_max_new_tokens: int = 32
    checkpoint_every: int = 50
    """Periodic checkpoints (0: only on a signal and at the end)."""
    checkpoint_every_s: float = 0.0
    """Also a checkpoint once this many seconds have passed since the last one (0: off), so a crash
    loses at most about this much work whatever the step time; the log gives each checkpoint's
    write time and size, to choose it by."""
    keep_checkpoints: int = 3
    """Keep the newest this many checkpoints (at most 1000), and always the one of the best tau (0:
    keep every one).
    An older one is removed only once a newer one is complete on disk, and never while a resume or
    an export reads it. The best-tau one is that of the step of the best evaluation: a new best
    tau is checkpointed at its step."""
    async_checkpoints: bool = True
    """Write checkpoints in the background: training waits only for the copy of the state to host
    memory (pinned on a GPU), then goes on while a thread hashes and writes it; one write at a time.
    false: training waits for the whole write."""
    checkpoint_writer: str = "process"
    """Who writes a background checkpoint (train.async_checkpoints): a process of its own (process),
    which shares no interpreter lock with the training loop, its host copy one shared memory file
    (memfd) the size of a checkpoint; or a thread of the trainer (thread), into buffers of that
    size. On one H100 at the recipe's shape both paused training 0.24-0.25 s a checkpoint, and the
    process wrote 11.72 GiB in 12.6-13.2 s against the thread's 17.4-19.1 s (docs/PERFORMANCE.md)."""

    def problems(self) -> list[str]:
        out = []
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_prompts", "eval_max_new_tokens"):
            if getattr(self, name) < 1:
                out.append(f"train.{name} must be at least 1, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every", "seed", "keep_checkpoints"):
            if getattr(self, name) < 0:
                out.append(f"train.{name} must not be negative, got {getattr(self, name)}")
        for name in ("steps", "log_every", "eval_every", "checkpoint_every"):
            if getattr(self, name) > MAX_STEPS:
                out.append(f"train.{name} must be at most {MAX_STEPS}, got {getattr(self, name)}")
        if self.seed > MAX_SEED:
            out.append(f"train.seed must be at most {MAX_SEED}, got {self.seed}")
        if self.checkpoint_writer not in CHECKPOINT_WRITERS:
            out.append(
                f"train.checkpoint_writer must be one of {', '.join(CHECKPOINT_WRITERS)}, "
                f"got {self.checkpoint_writer!r}"
            )
        if self.keep_checkpoints > MAX_KEEP_CHECKPOINTS:
            out.append(
                f"train.keep_checkpoints must be at most {MAX_KEEP_CHECKPOINTS}, got {self.keep_checkpoints} "
                "(0 keeps every checkpoint)"
            )
        if not 0 < self.lr <= MAX_LR:
            out.append(f"train.lr must be positive and at most {MAX_LR:g}, got {self.lr}")
        if not 0 <= self.warmup_frac < 1:
            out.append(f"train.warmup_frac must be in [0, 1), got {self.warmup_frac}")
        if not self.grad_clip >= 0:
            out.append(f"train.grad_clip must not be negative, got {self.grad_clip}")
        if not self.weight_decay >= 0:
            out.append(f"train.weight_decay must not be negative, got {self.weight_decay}")
        if not 0 <= self.checkpoint_every_s <= MAX_TIMEOUT_S:
            out.append(
                f"train.checkpoint_every_s must be in [0, {MAX_TIMEOUT_S}] seconds (0: off), "
                f"got {self.checkpoint_every_s}"
            )
        return out


@dataclass
class DrafterConfig:
    """The DFlash drafter: a few Qwen3-style layers over [fused target context | block]."""

    num_layers: int = 2
    block_size: int = 16
    num_anchors: int = 16
    """Anchors per sequence; padded to this count so shapes stay static."""
    gamma: float = 7.0
    """Loss weight of block position k is exp(-(k-1)/gamma) (7 for block size 16)."""
    num_context_layers: int = 3
    """Target layers fused into the context, spread evenly between layer 1 and n_target-3."""
    mask_token_id: int = -1
    """-1: the tokenizer's mask token."""
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    """sdpa: a dense mask; flex: flex_attention, which skips masked tiles but needs torch.compile
    to be fast; auto: flex on CUDA when compiling, else sdpa."""
    loss_chunk: int = 2048
    """Block positions per chunk of the fused LM-head cross-entropy (bounds the logits in memory)."""

    def problems(self) -> list[str]:
        out = []
        if self.num_layers < 1:
            out.append(f"drafter.num_layers must be at least 1, got {self.num_layers}")
        if self.block_size < 2:
            out.append(f"drafter.block_size must be at least 2, got {self.block_size}")
        if self.num_anchors < 1:
            out.append(f"drafter.num_anchors must be at least 1, got {self.num_anchors}")
        if not self.gamma > 0:
            out.append(f"drafter.gamma must be positive, got {self.gamma}")
        if self.loss_chunk < 1:
            out.append(f"drafter.loss_chunk must be at least 1, got {self.loss_chunk}")
        if self.num_context_layers < 1:
            out.append(f"drafter.num_context_layers must be at least 1, got {self.num_context_layers}")
        return out


@dataclass
class ModelConfig:
    """The frozen target (a Hugging Face causal LM on local disk) and the compute dtype."""

    target_path: str = ""
    """Directory of a Hugging Face causal LM; empty: the embedded tiny Qwen3 (built on first use)."""
    tokenizer_path: str = ""
    """Empty: the target's directory."""
    dtype: Literal["float32", "bfloat16"] = "float32"

    def problems(self) -> list[str]:
        if self.tokenizer_path and not self.target_path:
            return ["model.tokenizer_path is set but model.target_path is not; set both or neither"]
        return []


REGEN_ATTENTIONS = ("auto", "sdpa", "flex_attention", "eager")


# Data keys that change how fast the data is made, never what it is: a resume may change them (the
# regeneration's key leaves them out, docs/DATA.md), e.g. to fit what is left of a machine.
SPEED_ONLY_DATA_KEYS = frozenset({
    "cache_dir", "regen_batch_size", "regen_batch_tokens", "regen_min_width", "regen_compile",
    "regen_compile_scope", "regen_compile_dynamic", "regen_attention", "regen_progress_every_s",
    "regen_slots", "regen_page_size", "regen_prefill_chunk", "regen_tail_slots",
})  # fmt: skip

# The paged engine's narrower decode steps at a data set's tail (data.regen_tail_slots).
REGEN_TAIL_SLOTS = (128, 32)


@dataclass
class DataConfig:
    """Training conversations (JSONL chat format) and where built artefacts are cached."""

    train_file: str = ""
    """JSONL, one {"messages": [{"role": ..., "content": ...}, ...]} per line; empty: embedded set."""
    cache_dir: str = "~/.cache/dflash-trainer"
    """Embedded target, tokenizer and data set, the target-regenerated data, and the token stores
    (store/: the tokenized conversations, memory-mapped; about 5 bytes per token)."""
    regenerate: bool = True
    """Replace assistant turns with the target's greedy answers (the drafter imitates the target)."""
    regen_max_new_tokens: int = 64
    """The longest answer the target may give per assistant turn (in tokens)."""
    regen_batch_size: int = 512
    """The most prompts a decode batch holds (static engine); fewer for long prompts, see
    regen_batch_tokens. A decode step costs little more at 512 rows than at 256 (one H200,
    Qwen3-8B shape: 30 ms against 18 ms), so larger batches make more tokens a second."""
    regen_batch_tokens: int = 262144
    """Static engine: a batch's rows x (prompt width + new tokens) stays within this, rows a power of
    two, so long prompts go in smaller batches: a decode step reads every row's whole static cache.
    The KV cache takes this many tokens x 144 KiB at the Qwen3-8B shape (36 layers x 8 KV heads x
    128 x 2 x bf16): 36 GiB at the default, 64.4 GiB at the peak with the target's weights (one
    H200, docs/PERFORMANCE.md). A cap: on a GPU, batches are also sized to its free memory, counting
    each batch's prefill (docs/DATA.md)."""
    regen_engine: str = "paged"
    """'paged': continuous batching over a paged KV cache (trainer/data/engine/: a slot whose answer
    ends is refilled at once, KV memory taken a page at a time); 'static': `generate` with a static
    KV cache (compiled on CUDA) over length-sorted, left-padded batches, each decoded until its
    longest answer ends; 'continuous': transformers' continuous batching (`generate_batch`). With
    long-tailed answers at a cap of 2,048 the static engine decodes an answer token in about a
    fifth of its row-steps, the paged engine in over 90 % (docs/PERFORMANCE.md). All give the
    same answers in float32; the engine is part of the regenerated data's cache key."""
    regen_slots: int = 256
    """Paged engine: sequences decoded at once (the decode step's rows, one compiled shape)."""
    regen_page_size: int = 64
    """Paged engine: tokens a KV page holds. The pool is regen_batch_tokens tokens of pages. On CUDA
    flex attention reads a page as one key block: pages of 64 keep its kernel's tiles full."""
    regen_prefill_chunk: int = 1024
    """Paged engine: the most prompt tokens of one prefill chunk, run between two decode steps when
    full or when an eighth of the slots wait for it, so a long prompt does not stall the decoding
    rows. A chunk costs about as much with a few tokens as with many: on one H100 at the 8B shape
    chunks of 1,024 made 13 % more tokens a second than chunks of 512 (docs/PERFORMANCE.md)."""
    regen_tail_slots: list[int] = field(default_factory=lambda: list(REGEN_TAIL_SLOTS))
    """Paged engine: narrower decode steps for the data set's tail. Once no more sequences are left
    than one of these widths holds (none waiting, no shard to come), they move into its first slots
    and the steps run that many rows, one compiled shape and CUDA graph each; widths not below
    regen_slots are not used; []: every step runs regen_slots rows. On one H100 at the Qwen3-8B
    shape, 3,072 long-tailed answers capped at 2,048: 92 % of the row-steps decoded an answer token
    against 72 % at 256 slots alone, 9,028 answer tokens a second against 8,495
    (docs/PERFORMANCE.md); on a large data set the tail is a small share either way."""
    regen_shard_size: int = 1024
    """Conversations per shard file: the unit of resuming and of sharing work among devices."""
    regen_min_width: int = 64
    """Static engine: a batch's prompt width is padded up to this times a power of two (64, 128, 256,
    ...), so only a few shapes compile; a batch that is not full is filled up when compiled. With
    flex attention widths start at 128 at least (a shorter prefill has no flex kernel on CUDA)."""
    regen_compile: bool = True
    """On CUDA: compile the decode step (static engine: trainer/data/decode.py; paged engine: its
    decode step and its prefill chunks' layers, trainer/data/engine/), in every worker process (one
    per device), over the compile cache under data.cache_dir (docs/DATA.md)."""
    regen_compile_scope: str = "auto"
    """What regen_compile compiles: 'step', the target's whole forward and the argmax as one graph;
    'layers', one decoder layer that every layer calls (one layer traced and compiled, not each);
    'auto', 'step' for the static engine and 'layers' for the paged one.
    Static engine: 'step' is replayed as one CUDA graph per batch shape (60-90 s to compile each
    shape at the Qwen3-8B shape on an H200); 'layers' runs without CUDA graphs (18-32 s a shape,
    but decoding 2.4x slower: each step waits on the host; docs/PERFORMANCE.md), so it pays off
    only for a data set that decodes in less time than its shapes compile. Paged engine: either is
    replayed as one CUDA graph of the whole step; 'layers' traces one layer in a fresh process
    instead of the whole step: on one H100 at the 8B shape its decode step as fast (16.3 against
    16.5 ms), a warm start 2.3 s over its steady pass (17.9 s for the whole step, another day), a
    cold first pass 37.8 s against 72.8 s (docs/PERFORMANCE.md)."""
    regen_compile_dynamic: bool = False
    """Compile the decode once for every batch shape, the rows and the cache length symbolic,
    instead of once per shape ('step' still records a CUDA graph per shape, a few steps' time).
    On a CPU (a 36-layer small Qwen3): one compile of 144 s served five shapes where each shape
    took 50 s, the steady step as fast. On an H200 (Qwen3-8B shape) the one compile took 135 s,
    but a batch then decoded 2.5-3 times slower than with a compile per shape (docs/PERFORMANCE.md),
    hence off."""
    regen_attention: str = "auto"
    """Static engine: the attention the target decodes with ('auto', 'sdpa', 'flex_attention',
    'eager'). 'auto' is flex attention when compiled on CUDA (it reads the grouped-query KV cache
    once a step; transformers' sdpa path copies it four times when a batch is padded: 2.1x the
    tokens/s on an H200, docs/PERFORMANCE.md), the target's own (sdpa) otherwise. Paged engine:
    'flex_attention' (and 'auto' when compiled on CUDA) reads each slot's pages in place in the
    pool; 'sdpa' and 'eager' (and 'auto' otherwise) gather each slot's pages first. 'auto' whose
    flex step fails to compile says so once and gathers."""
    regen_progress_every_s: float = 30.0
    """Seconds between progress lines (conversations and tokens done, tokens/s, ETA)."""

    def problems(self) -> list[str]:
        out = []
        if self.regen_max_new_tokens < 1:
            out.append(f"data.regen_max_new_tokens must be at least 1, got {self.regen_max_new_tokens}")
        sizes = ("regen_batch_size", "regen_batch_tokens", "regen_shard_size", "regen_min_width",
                 "regen_slots", "regen_page_size", "regen_prefill_chunk")  # fmt: skip
        for name in sizes:
            if getattr(self, name) < 1:
                out.append(f"data.{name} must be at least 1, got {getattr(self, name)}")
        if any(width < 1 for width in self.regen_tail_slots):
            widths = self.regen_tail_slots
            out.append(f"data.regen_tail_slots must be widths of at least 1 slot ([] for none), got {widths}")
        if self.regen_attention not in REGEN_ATTENTIONS:
            names = ", ".join(REGEN_ATTENTIONS)
            out.append(f"data.regen_attention must be one of {names}, got {self.regen_attention!r}")
        if self.regen_compile_scope not in ("auto", "step", "layers"):
            scope = self.regen_compile_scope
            out.append(f"data.regen_compile_scope must be 'auto', 'step' or 'layers', got {scope!r}")
        if self.regen_engine not in ("static", "continuous", "paged"):
            engine = self.regen_engine
            out.append(f"data.regen_engine must be 'static', 'continuous' or 'paged', got {engine!r}")
        elif self.regen_engine == "paged" and self.regen_page_size >= 1:
            pages = self.regen_batch_tokens // self.regen_page_size
            one_answer = -(-(self.regen_max_new_tokens + 1) // self.regen_page_size)
            if pages - 1 < one_answer:
                out.append(
                    f"data.regen_batch_tokens={self.regen_batch_tokens} makes {pages} KV pages of "
                    f"{self.regen_page_size} tokens (one kept as scratch), too few for one answer of "
                    f"{self.regen_max_new_tokens} tokens; raise data.regen_batch_tokens"
                )
        if not self.regen_progress_every_s > 0:
            out.append(f"data.regen_progress_every_s must be positive, got {self.regen_progress_every_s}")
        return out


@dataclass
class ParallelConfig:
    """Devices of this machine: 'auto' (every CUDA device, else cpu), 'cpu', or 'cuda:0,cuda:1'."""

    devices: str = "auto"
    step_timeout_s: float = 1800.0
    """A step whose workers do not all answer within this time stops the run."""
    cpu_threads: int = 1
    """torch intra-op threads (0: torch's default, one per core). 1 suits the tiny embedded model on
    a shared machine: its ops are too small to split, and OpenMP threads that spin-wait stall
    badly when another process holds a core (measured here: regeneration 36 s with 2, 6 s with 1)."""
    cpu_workers: int = 1
    """Workers on CPU (no CUDA device): processes under torchrun in the process topology, worker
    threads in the threaded one. Mostly for tests of the multi-worker code paths on CPU."""
    shutdown_timeout_s: int = 120
    """Process topology: how long torchrun waits for the ranks after forwarding SIGTERM (rank 0
    writes its checkpoint meanwhile) before it kills them; also bounds the wait after a rank dies."""
    rendezvous_timeout_s: int = 600
    """Process topology on several hosts: how long torchrun waits for every host to join the
    rendezvous before it gives up (exit 1), so a host whose start failed cannot leave the others
    waiting forever."""
    bucket_mb: int = 256
    """Gradient bucket size in MiB, both topologies: the exchange sums a bucket across devices as
    soon as every replica's backward has finished it, overlapping the rest of the backward (DDP's
    bucket_cap_mb in the process topology). Larger buckets mean fewer, larger transfers and less
    overlap; one bucket larger than the gradients means no overlap at all."""
    shard_optimizer: bool = False
    """Threaded topology with several workers: each worker updates only its own slice of every
    gradient bucket (the buckets are reduce-scattered instead of all-reduced, gradients are clipped
    by the global norm, the optimizer state is split across workers), then the updated slices are
    all-gathered into every replica while the next step's target forward runs. Checkpoints keep the
    unsharded optimizer state, so a run may resume with this on or off. No effect with one worker
    or in the process topology."""

    def problems(self) -> list[str]:
        out = []
        if self.bucket_mb < 1:
            out.append(f"parallel.bucket_mb must be at least 1, got {self.bucket_mb}")
        for name in ("step_timeout_s", "shutdown_timeout_s", "rendezvous_timeout_s"):
            value = getattr(self, name)
            if value > MAX_TIMEOUT_S:
                out.append(f"parallel.{name} must be at most {MAX_TIMEOUT_S} (a week), got {value}")
        if not self.step_timeout_s > 0:
            out.append(f"parallel.step_timeout_s must be positive, got {self.step_timeout_s}")
        if self.cpu_threads < 0:
            out.append(f"parallel.cpu_threads must not be negative, got {self.cpu_threads}")
        if self.cpu_workers < 1:
            out.append(f"parallel.cpu_workers must be at least 1, got {self.cpu_workers}")
        if self.shutdown_timeout_s < 1:
            out.append(f"parallel.shutdown_timeout_s must be at least 1, got {self.shutdown_timeout_s}")
        if self.rendezvous_timeout_s < 1:
            out.append(f"parallel.rendezvous_timeout_s must be at least 1, got {self.rendezvous_timeout_s}")
        return out


# The trackers log.report_to may name (Hugging Face Trainer's word and names).
TRACKERS = ("tensorboard", "mlflow", "wandb")


@dataclass
class LogConfig:
    """What the run writes beside train.log and metrics.jsonl."""

    report_to: list[str] = field(default_factory=list)
    """Experiment trackers that also receive the run (any of tensorboard, mlflow, wandb; empty: none).
    tensorboard: event files under <out>/tensorboard. mlflow: a SQLite database, <out>/mlflow.db
    (MLflow's default store), or the server or database MLFLOW_TRACKING_URI names. wandb: offline
    under <out>/wandb without WANDB_API_KEY, online with it. Each gets the config at the start, every
    metric row and the run's events; a resumed run continues the same tracker run
    (<out>/trackers.json)."""
    tensorboard: bool = False
    """The same as naming tensorboard in report_to (kept for machine configs that say it this way)."""

    def trackers(self) -> list[str]:
        """The trackers this run reports to: report_to, with tensorboard where log.tensorboard says so."""
        wanted = set(self.report_to) | ({"tensorboard"} if self.tensorboard else set())
        return [name for name in TRACKERS if name in wanted]

    def problems(self) -> list[str]:
        unknown = [name for name in self.report_to if name not in TRACKERS]
        if unknown:
            names = ", ".join(map(repr, unknown))
            return [f"log.report_to: unknown tracker(s) {names} (known: {', '.join(TRACKERS)})"]
        return []


@dataclass
class Config:
    """The resolved configuration of one run."""

    run: RunConfig = field(default_factory=RunConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def log_name(self) -> str:
        return self.run.log_name or f"train_{self.run.name}.log"

    def problems(self) -> list[str]:
        """Every section's own problems, then the cross-section rules (the compile guard)."""
        out: list[str] = []
        for section in dataclasses.fields(self):
            out.extend(non_finite(section.name, getattr(self, section.name)))
        for section in dataclasses.fields(self):
            out.extend(getattr(self, section.name).problems())
        out.extend(compile_guard(self.run, self.compile))
        out.extend(missing_target(self))
        if self.compile.target_attention == "causal" and self.train.packing:
            out.append(
                "compile.target_attention=causal with train.packing=true: a packed row holds several "
                "conversations, and causal attention would let each see the ones before it; set "
                "train.packing=false, or compile.target_attention to auto or flex"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def non_finite(section_name: str, section: Any) -> list[str]:
    """Every float of a section must be a number (YAML's .inf and .nan, --set train.lr=inf are not)."""
    out = []
    for item in dataclasses.fields(section):
        value = getattr(section, item.name)
        if isinstance(value, float) and not math.isfinite(value):
            out.append(f"{section_name}.{item.name} must be a finite number, got {value}")
    return out


def missing_target(cfg: Config) -> list[str]:
    """A run sized for a real target refuses to fall back to the embedded tiny one."""
    if not cfg.run.requires_target:
        return []
    missing = [key for key, value in (("model.target_path", cfg.model.target_path),
                                      ("data.train_file", cfg.data.train_file)) if not value]  # fmt: skip
    if not missing:
        return []
    return [
        f"run {cfg.run.name} is sized for a real target and needs {' and '.join(missing)} "
        "from the machine config (the inventory's dflash_machine; trainer/machine.example.yml shows "
        "both keys); without the real weights, `python -m trainer.data.embedded --shape qwen3-8b "
        "--out DIR --conversations N --device cuda` builds a random-weights target of that shape "
        "and a chat set in DIR"
    ]


def compile_guard(run: RunConfig, compile_cfg: CompileConfig) -> list[str]:
    """Refuse, before any work starts, settings that turn CUDA graphs on in the threaded topology."""
    if run.topology != "threaded" or not compile_cfg.uses_cudagraphs:
        return []
    why = []
    if compile_cfg.mode in MODES_WITH_CUDAGRAPHS:
        why.append(f"compile.mode={compile_cfg.mode} turns CUDA graphs on")
    if compile_cfg.cudagraphs:
        why.append("compile.cudagraphs=true")
    if compile_cfg.cudagraph_trees:
        why.append("compile.cudagraph_trees=true")
    return [f"{', '.join(why)} with run.topology=threaded: {CUDAGRAPHS_IN_THREADS}"]


# Which sections each layer may set: a profile is the experiment, a machine config the machine.
PROFILE_SECTIONS = ("run", "compile", "train", "drafter", "data", "model")
# Of the data and model sections, a profile sets only what is part of the recipe: how long a
# regenerated answer may be (the recipe's answers are whole ones) and the target's compute dtype (an
# 8B target in float32 fills an 80 GB card before its first batch). The data, its cache and the
# target itself are the machine's.
PROFILE_KEYS = {"data": ("regen_max_new_tokens",), "model": ("dtype",)}
MACHINE_SECTIONS = ("model", "data", "parallel", "log")
SECTION_TYPES = {f.name: f.type for f in dataclasses.fields(Config)}


def _section_classes() -> dict[str, type]:
    hints = typing.get_type_hints(Config)
    return {name: hints[name] for name in SECTION_TYPES}


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check (and for --set strings, parse) one value against its field type; raise ValueError."""
    origin = get_origin(annotation)
    if origin is Literal:
        choices = get_args(annotation)
        if value not in choices:
            raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, choices))}")
        return value
    if origin in (typing.Union, types.UnionType):
        raise TypeError(f"unsupported annotation {annotation}")
    if origin is list and get_args(annotation) == (str,):
        return _string_list(value, where)
    if origin is list and get_args(annotation) == (int,):
        return _int_list(value, where)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"{where}: expected true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"{where}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError(f"{where}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"unsupported annotation {annotation}")


def _int_list(value: Any, where: str) -> list[int]:
    """A list of whole numbers: a YAML list, or (from --set) one string of them separated by commas,
    the empty string being the empty list."""
    if isinstance(value, str):
        parts = [part.strip() for part in value.strip().strip("[]").split(",") if part.strip()]
        value = [int(part) if re.fullmatch(r"-?\d+", part) else part for part in parts]
    elif isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise ValueError(f"{where}: expected a list of whole numbers (YAML [128, 32]; 128,32 after --set), "
                         f"got {value!r}")  # fmt: skip
    return value


def _string_list(value: Any, where: str) -> list[str]:
    """A list of names: a YAML list, or (from --set) one string of names separated by commas, the
    empty string being the empty list. Repeats are dropped, the first one's place kept."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{where}: expected a list of names (YAML [a, b]; a,b after --set), got {value!r}")
    return list(dict.fromkeys(value))


def _apply_layer(
    values: dict[str, dict[str, Any]],
    layer: Any,
    source: str,
    allowed_sections: tuple[str, ...],
    problems: list[str],
    allowed_keys: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """allowed_keys: for a section named there, the only keys this layer may set."""
    if layer is None:
        return
    if not isinstance(layer, dict):
        problems.append(f"{source}: expected a mapping of sections, got {type(layer).__name__}")
        return
    classes = _section_classes()
    for section, entries in layer.items():
        if section not in classes:
            problems.append(f"{source}: unknown section {section!r} (known: {', '.join(classes)})")
            continue
        if section not in allowed_sections:
            problems.append(
                f"{source}: section {section!r} does not belong here (allowed: {', '.join(allowed_sections)})"
            )
            continue
        if not isinstance(entries, dict):
            problems.append(f"{source}: section {section!r} must be a mapping")
            continue
        hints = typing.get_type_hints(classes[section])
        for key, value in entries.items():
            where = f"{source}: {section}.{key}"
            if key not in hints or key.startswith("_"):
                problems.append(f"{where}: unknown key (known: {', '.join(hints)})")
                continue
            only = (allowed_keys or {}).get(section)
            if only is not None and key not in only:
                problems.append(
                    f"{where}: does not belong here (allowed of {section}: {', '.join(only)}); set it "
                    "in the machine config (--config) or with --set"
                )
                continue
            try:
                values[section][key] = _coerce(value, hints[key], where)
            except ValueError as exc:
                problems.append(str(exc))


def parse_set(item: str, problems: list[str]) -> tuple[str, str, Any] | None:
    """Parse one ``--set section.field=value`` into a value of the field's type (checked later)."""
    if "=" not in item or "." not in item.split("=", 1)[0]:
        problems.append(f"--set {item!r}: expected section.field=value, e.g. train.lr=3e-4")
        return None
    key, raw = item.split("=", 1)
    section, name = key.split(".", 1)
    annotation = None
    if section in SECTION_TYPES:
        annotation = typing.get_type_hints(_section_classes()[section]).get(name)
    value: Any = raw
    try:
        if annotation is int:
            value = int(raw)
        elif annotation is float:
            value = float(raw)
        elif annotation is bool and raw.lower() in ("true", "false", "yes", "no", "1", "0"):
            value = raw.lower() in ("true", "yes", "1")
    except ValueError:
        value = raw  # left as text; the type check names the problem
    return section, name, value


def known_runs() -> dict[str, str]:
    """Shipped run profiles: name -> description."""
    runs = {}
    for path in sorted(RUNS_DIR.glob("*.yml")):
        try:
            data = yaml.safe_load(path.read_text()) or {}
            runs[path.stem] = str((data.get("run") or {}).get("description", ""))
        except (yaml.YAMLError, AttributeError):
            runs[path.stem] = "(unreadable profile)"
    return runs


def _read_yaml(path: Path, what: str, problems: list[str]) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        problems.append(f"{what} {path} does not exist")
    except (OSError, yaml.YAMLError) as exc:
        problems.append(f"{what} {path} cannot be read: {exc}".replace("\n", " "))
    return None


def load_config(
    run: str,
    machine_config: str | None = None,
    sets: list[str] | tuple[str, ...] = (),
    steps: int | None = None,
    seed: int | None = None,
) -> Config:
    """Resolve the layers into a Config; raise ConfigError with every problem found."""
    problems: list[str] = []
    classes = _section_classes()
    values: dict[str, dict[str, Any]] = {name: {} for name in classes}

    runs = known_runs()
    if run not in runs:
        listing = ", ".join(f"{name} ({desc})" if desc else name for name, desc in runs.items())
        raise ConfigError([f"unknown run {run!r}; known runs: {listing}"])
    values["run"]["name"] = run
    profile = _read_yaml(RUNS_DIR / f"{run}.yml", "run profile", problems)
    _apply_layer(values, profile, f"run profile {run}", PROFILE_SECTIONS, problems, PROFILE_KEYS)
    if isinstance(profile, dict) and "name" in (profile.get("run") or {}):
        problems.append(f"run profile {run}: run.name is the file stem; remove it")

    if machine_config:
        machine = _read_yaml(Path(machine_config), "machine config (--config)", problems)
        _apply_layer(values, machine, f"machine config {machine_config}", MACHINE_SECTIONS, problems)

    for item in sets:
        parsed = parse_set(item, problems)
        if parsed:
            section, name, value = parsed
            _apply_layer(values, {section: {name: value}}, "--set", tuple(classes), problems)
    if steps is not None:
        _apply_layer(values, {"train": {"steps": steps}}, "--steps", ("train",), problems)
    if seed is not None:
        _apply_layer(values, {"train": {"seed": seed}}, "--seed", ("train",), problems)

    cfg = Config(**{name: cls(**values[name]) for name, cls in classes.items()})
    problems.extend(cfg.problems())
    if problems:
        raise ConfigError(problems, cfg)
    return cfg


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from its to_dict() form (e.g. from a checkpoint)."""
    classes = _section_classes()
    return Config(**{name: cls(**data.get(name, {})) for name, cls in classes.items()})


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
