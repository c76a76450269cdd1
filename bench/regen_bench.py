"""Regeneration benchmark: today's loop, continuous batching at its defaults, and the engine as the
product runs it, side by side on one device, on a Qwen3-shaped target with random weights.

    python bench/regen_bench.py --shape 8b                      # one H200: 512 prompts x 256 new tokens
    python bench/regen_bench.py --shape 8b --rows static,continuous --batch-size 128,256
    python bench/regen_bench.py --shape 8b --rows static --profile   # where a static pass's time goes
    python bench/regen_bench.py --shape 8b --rows static --warm --compile-cache out/regen-compile
    python bench/regen_bench.py --shape 8b --rows workers --workers 1,2 --compile-cache out/regen-compile
    python bench/regen_bench.py --shape tiny                    # CPU: checks the harness only
    python bench/regen_bench.py --rows static,shards --chat CHAT_JSONL --target TARGET_DIR

Prompts have long-tailed lengths (log-normal, median --median, 16..1500 tokens), like chat data.
Rows:
  today       the loop trainer.data.chat.regenerate (prompts grouped by exact length, batches of 64)
              on the first --today-prompts prompts only (it is slow)
  continuous  transformers' continuous batching (`generate_batch`, paged attention) at its defaults:
              what trainer.data.regen runs with data.regen_engine=continuous
  static      `generate` with a static KV cache (compiled on CUDA) over length-sorted left-padded
              batches of at most --batch-size (fewer for long prompts: --batch-tokens), widths padded to
              --min-width x 2^k: data.regen_engine=static, the product's default; timed twice (the
              first pass compiles every new shape), then the second pass's time per width
  shards      with --chat: the same prompts in the engine calls the product's stage makes, shard by
              shard (--shard-size) and turn by turn within a shard, each call its own batches
  workers     the product's stage machinery (trainer/data/regen_worker.py): N worker processes on the
              one device, the prompts split N ways (prompt i to worker i mod N), each building the
              target and compiling over the compile cache, timed twice; one row per --workers entry
--decode-scope step,layers: a static (and --warm) row for each of data.regen_compile_scope's
              values: the whole decode step compiled as CUDA graphs, or each target layer compiled
              on its own (one compile shared by the layers, no CUDA graphs); SCOPE+dynamic compiles
              it once for every batch shape (data.regen_compile_dynamic), e.g. step,step+dynamic;
              each pass says how many graphs Dynamo compiled in it
--warm: after the rows, a fresh process over the same compile cache (--compile-cache, default a new
temporary directory, so the first compile is cold) runs the static pass twice (--warm-passes 1:
once): its first pass is what a restart or the next GPU's worker pays. The static row's pass 1 is
the cold figure, its pass 2 the steady one.
--chat FILE --target DIR: the prompts of a chat JSONL as the product's stage builds them with that
target's tokenizer (turns past --seq-len left out; a later turn's prompt holds the file's earlier
answers cut to the new tokens), answered by that target until its end token: the product's own
regeneration of that file (regen.yml, its log's tok/s) is the row to set beside these.
Per row: generated tokens/s, conversations/s, peak device memory, and the memory-bound limit of the
workload: sequences in flight x bandwidth / bytes read per decode step (the weights once, plus the
KV cache of every sequence in flight at its mean length).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import random
import re
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._dynamo.utils import compilation_time_metrics, counters

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trainer_bench import SHAPES, build_target
from trainer.config import DataConfig
from trainer.data.chat import ChatFormat, Example, regenerate, tokenize_stream
from trainer.data.decode import StaticDecoder
from trainer.data.regen import DataIndex, RegenSettings, continuous_generate, static_generate
from trainer.data.regen_worker import Job, run_worker_processes
from trainer.model import compile_cache
from trainer.model.target import load_target, load_tokenizer

END_ID = 2  # a token a random target rarely picks: answers run to --new-tokens, as real ones often do
PAD_ID = 0
DEFAULTS = {"8b": (512, 256, 120, 16), "tiny": (24, 16, 24, 6)}  # prompts, new tokens, median, today


class BenchChat:
    """The chat format's surface the old loop uses, over bare prompt ids; `end_id` ends an answer
    (a chat file's own with --chat, as the product's stage stops there)."""

    def __init__(self, end_id: int = END_ID):
        self.end_id = end_id

    def encode(self, turns):
        ids = [token for _, content in turns for token in content]
        return ids, [0] * len(ids)

    def header(self, role):
        return []


def make_prompts(count: int, median: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [max(16, min(1500, int(math.exp(rng.gauss(math.log(median), 0.9))))) for _ in range(count)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def chat_prompts(path: Path, target_dir: Path, new_tokens: int, seq_len: int, shard_size: int,
                 count: int | None) -> tuple[int, list[list[list[int]]]]:  # fmt: skip
    """(the chat's end id, each call's prompts): a chat JSONL's prompts as the product's stage
    builds them, shard by shard (data.regen_shard_size) and within a shard turn by turn, each a
    call of the engine; turns past seq_len left out. A later turn's prompt holds the file's earlier
    answers cut to new_tokens, where the stage holds the regenerated ones (at most as long)."""
    from bench.regen_layout_bench import shard_prompts

    chat = ChatFormat(load_tokenizer(target_dir))
    index = DataIndex.build(path)
    total = min(len(index), count or len(index))
    calls = []
    for start in range(0, total, shard_size):
        conversations = index.read(start, min(start + shard_size, total))
        examples = list(tokenize_stream((messages for _, messages in conversations), chat))
        rounds, _ = shard_prompts(examples, chat, new_tokens, seq_len)
        calls += [prompts for prompts in rounds if prompts]
    return chat.end_id, calls


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # CPU: the process's peak resident memory since it started (KiB -> GiB), not per row.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def memory_bound_tokens_per_s(
    target, prompts, new_tokens: int, in_flight: int, bandwidth_tbs: float
) -> float:
    """in_flight sequences advance one token per decode step; a step reads every weight once and
    the KV cache of every sequence in flight (at its mean length over the answer)."""
    config = target.config
    dtype_bytes = next(target.parameters()).element_size()
    weight_bytes = sum(p.numel() for p in target.parameters()) * dtype_bytes
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * dtype_bytes
    mean_length = sum(map(len, prompts)) / len(prompts) + new_tokens / 2
    step_bytes = weight_bytes + in_flight * mean_length * kv_per_token
    return in_flight * bandwidth_tbs * 1e12 / step_bytes


def profiled(device, run):
    """run() under torch.profiler; prints the operators that took the most time (device time on
    CUDA), so a slow row shows whether it waits on kernels, launches or the host."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        answers = run()
        synchronize(device)
    sort = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=15), flush=True)
    return answers


def timed(name, device, run, prompts, limit, profile=False) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    began = time.perf_counter()
    answers = profiled(device, run) if profile else run()
    synchronize(device)
    seconds = time.perf_counter() - began
    tokens = sum(map(len, answers))
    print(
        f"{name:24s} {len(prompts):5d} prompts {seconds:8.1f} s {tokens:8d} tokens "
        f"{tokens / seconds:9.0f} tok/s {len(prompts) / seconds:7.2f} conv/s "
        f"peak {peak_memory_gib(device):6.1f} GiB  memory-bound limit {limit:9.0f} tok/s",
        flush=True,
    )


@contextlib.contextmanager
def batch_times(device):
    """Records (rows, width, seconds) of every batch the static engine decodes inside the block."""
    batches: list[tuple[int, int, float]] = []
    plain = StaticDecoder.decode

    def timed_decode(self, ids, *args, **kwargs):
        synchronize(device)
        began = time.perf_counter()
        output = plain(self, ids, *args, **kwargs)
        synchronize(device)
        batches.append((*ids.shape, time.perf_counter() - began))
        rows, width, seconds = batches[-1]
        # A first pass can outlast a machine's time: each batch as it ends shows how far it got.
        print(f"      batch {len(batches)}: {rows} rows x width {width} in {seconds:.1f} s", flush=True)
        return output

    StaticDecoder.decode = timed_decode
    try:
        yield batches
    finally:
        StaticDecoder.decode = plain


def compile_seconds() -> dict[str, float]:
    """Seconds spent so far in each of torch.compile's timed phases (nested: a phase's time holds
    its parts')."""
    return {name: sum(times) for name, times in compilation_time_metrics.items()}


def print_compile_phases(before: dict[str, float], top: int = 8) -> None:
    """The compile phases that took longest since `before`: where a warm start's time goes (Dynamo's
    tracing, AOTAutograd, Inductor's cache loads)."""
    spent = {name: seconds - before.get(name, 0.0) for name, seconds in compile_seconds().items()}
    longest = sorted((item for item in spent.items() if item[1] >= 0.5), key=lambda item: -item[1])[:top]
    if longest:
        print("    compile phases: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in longest))


def print_batches(batches) -> None:
    """Per prompt width: batches, rows each, seconds in all: where a static pass spends its time."""
    widths: dict[tuple[int, int], list[float]] = {}
    for rows, width, seconds in batches:
        widths.setdefault((width, rows), []).append(seconds)
    for (width, rows), times in sorted(widths.items()):
        print(f"    width {width:5d}: {len(times):3d} batches of {rows:4d} rows, {sum(times):7.1f} s")


def today(target, prompts, new_tokens, device):
    examples = [Example([("user", p), ("assistant", [])]) for p in prompts]
    done = regenerate(examples, target, BenchChat(), new_tokens, 64, device)
    return [e.turns[1][1] for e in done]


@dataclass
class Source:
    """What the rows generate from: the target (a random one of `shape`, or `target_path`), the id
    that ends an answer, and the prompts of each of the product's engine calls (--chat; else None)."""

    shape: str
    target_path: str = ""
    end_id: int = END_ID
    calls: list | None = None


def bench_target(shape: str, target_path: str, device: torch.device):
    """The target a row runs: the directory --target names (bfloat16 on a GPU, as the product loads
    it), or a random one of the shape."""
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    if target_path:
        target = load_target(Path(target_path), device, dtype)
    else:
        target = build_target(SHAPES[shape], device, getattr(torch, dtype))
    target.generation_config.eos_token_id = None  # the engine is given the end id itself
    return target


@dataclass
class BenchJob(Job):
    """A worker process of the workers row (and of --warm): its share of the prompts through the
    static engine, over the compile cache, timed `passes` times; results as log lines."""

    shape: str = "tiny"
    prompts: list = field(default_factory=list)
    settings: RegenSettings = field(default_factory=RegenSettings)
    compile_dir: str = ""
    passes: int = 2
    target_path: str = ""  # a target directory (--target); empty: a random one of `shape`
    end_id: int = END_ID

    def run(self, send, should_stop) -> bool:
        began = time.perf_counter()
        device = torch.device(self.device)
        if device.type == "cpu":
            torch.set_num_threads(1)
        target = bench_target(self.shape, self.target_path, device)
        send({"line": f"target built in {time.perf_counter() - began:.1f} s"})
        cache = compile_cache.persisted(Path(self.compile_dir), lambda text: send({"line": text}))
        with cache, torch.no_grad():
            for attempt in range(1, self.passes + 1):
                synchronize(device)
                began = time.perf_counter()
                chat = BenchChat(self.end_id)
                answers = static_generate(target, self.prompts, self.settings, chat, PAD_ID, should_stop)
                synchronize(device)
                seconds, tokens = time.perf_counter() - began, sum(map(len, answers))
                done = f"pass {attempt}: {len(self.prompts)} prompts {seconds:.2f} s {tokens} tokens"
                send({"line": done})
        return True


def worker_rows(prompts, settings, workers: int, source: Source, device, compile_dir: Path, passes: int,
                name: str) -> None:  # fmt: skip
    """`workers` fresh worker processes on `device`, the prompts split between them: each pass's
    tokens/s counts every worker's tokens over the slowest worker's time."""
    from bench.regen_bench import BenchJob as Importable  # pickled by a name the workers can import

    jobs = [
        Importable(
            str(device), str(compile_dir), source.shape, prompts[n::workers], settings, str(compile_dir),
            passes, source.target_path, source.end_id,
        )
        for n in range(workers)
    ]
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        print(f"    {line}", flush=True)

    began = time.perf_counter()
    run_worker_processes(jobs, NoProgress(), lambda: False, lambda: None, 3600.0, log)
    wall = time.perf_counter() - began
    for attempt in range(1, passes + 1):
        found = [re.search(rf"pass {attempt}: \d+ prompts ([\d.]+) s (\d+) tokens", line) for line in lines]
        done = [(float(m[1]), int(m[2])) for m in found if m]
        seconds, tokens = max(s for s, _ in done), sum(t for _, t in done)
        print(
            f"{name} pass {attempt:<6d} {len(prompts):5d} prompts {seconds:8.1f} s {tokens:8d} tokens "
            f"{tokens / seconds:9.0f} tok/s {len(prompts) / seconds:7.2f} conv/s",
            flush=True,
        )
    print(f"{name} wall {wall:.1f} s from the processes' start to their end", flush=True)


class NoProgress:
    def add(self, conversations: int, tokens: int) -> None:
        pass


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["8b", "tiny"], default="8b")
    parser.add_argument(
        "--rows", default="today,continuous,static",
        help="comma-separated: today, continuous, static, shards (needs --chat), workers",
    )  # fmt: skip
    parser.add_argument(
        "--prompts", type=int, help="default: 512 (8b), 24 (tiny); --chat: its first N conversations"
    )
    parser.add_argument("--new-tokens", type=int, help="new tokens per answer; default 256 (8b), 16 (tiny)")
    parser.add_argument("--median", type=int, help="median prompt length; default 120 (8b), 24 (tiny)")
    parser.add_argument(
        "--today-prompts", type=int, help="prompts for the slow row; default 16 (8b), 6 (tiny)"
    )
    parser.add_argument(
        "--batch-size", default=str(DataConfig.regen_batch_size),
        help="static: the most prompts per generate call; a comma list runs a static row for each",
    )  # fmt: skip
    parser.add_argument(
        "--batch-tokens", type=int, default=DataConfig.regen_batch_tokens,
        help="static: rows x (width + new tokens) per batch at most (long prompts: smaller batches)",
    )  # fmt: skip
    parser.add_argument("--min-width", type=int, default=64, help="static: widths padded to this x 2^k")
    parser.add_argument("--no-compile", action="store_true", help="static: no compiled decode step")
    parser.add_argument(
        "--decode-scope", default=DataConfig.regen_compile_scope,
        help="static: what compiles, 'step' or 'layers' (data.regen_compile_scope), '+dynamic' once for "
        "every shape (data.regen_compile_dynamic); a comma list: each",
    )  # fmt: skip
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile each row's last pass: the top operators by device time",
    )
    parser.add_argument(
        "--bandwidth-tbs", type=float, default=4.8, help="device memory bandwidth (H200: 4.8)"
    )
    parser.add_argument("--workers", default="2", help="workers row: worker processes, a comma list")
    parser.add_argument("--warm", action="store_true", help="then a fresh process over the compile cache")
    parser.add_argument(
        "--warm-passes", type=int, default=2, choices=(1, 2),
        help="--warm: the fresh process's passes (1: its first only, set beside the static row's pass 2)",
    )  # fmt: skip
    parser.add_argument("--compile-cache", help="compile cache root (default: a new temporary directory)")
    parser.add_argument("--chat", help="prompts from this chat JSONL, as the product's stage builds them")
    parser.add_argument("--target", help="a target directory (weights, tokenizer) instead of a random one")
    parser.add_argument("--seq-len", type=int, default=3072, help="--chat: train.seq_len (turns past it out)")
    parser.add_argument(
        "--shard-size", type=int, default=DataConfig.regen_shard_size, help="--chat: data.regen_shard_size"
    )
    args = parser.parse_args()
    rows = args.rows.split(",")
    unknown = set(rows) - {"today", "continuous", "static", "shards", "workers", ""}
    if unknown:
        known = "today, continuous, static, shards, workers"
        parser.error(f"unknown row {sorted(unknown)[0]!r}; rows are {known}")
    if args.chat and not args.target:
        parser.error("--chat needs --target: the target directory whose tokenizer builds the prompts")
    known_scopes = [f"{scope}{dynamic}" for scope in ("step", "layers") for dynamic in ("", "+dynamic")]
    for scope in args.decode_scope.split(","):
        if scope not in known_scopes:
            parser.error(f"unknown --decode-scope {scope!r}; scopes are {', '.join(known_scopes)}")
    if "shards" in rows and not args.chat:
        parser.error("the shards row needs --chat: the chat file whose shards and turns it lays out")
    return args


def main() -> int:
    args = parse_args()
    count, new_tokens, median, today_count = DEFAULTS[args.shape]
    count, new_tokens = args.prompts or count, args.new_tokens or new_tokens
    median, today_count = args.median or median, args.today_prompts or today_count
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    import transformers

    shape = args.target or args.shape
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device}, target {shape}")
    source = Source(args.shape, args.target or "")
    if args.chat:
        source.end_id, source.calls = chat_prompts(
            Path(args.chat), Path(args.target), new_tokens, args.seq_len, args.shard_size, args.prompts
        )
        prompts = [prompt for call in source.calls for prompt in call]
        print(f"{args.chat}: {len(source.calls)} engine calls (shards x turns) of the product's stage")
    else:
        prompts = make_prompts(count, median, SHAPES[args.shape].vocab)
    lengths = sorted(map(len, prompts))
    print(
        f"{len(prompts)} prompts, lengths median {lengths[len(lengths) // 2]} max {lengths[-1]}; "
        f"{new_tokens} new tokens each"
    )
    batch_sizes = [int(size) for size in args.batch_size.split(",")]

    scopes = args.decode_scope.split(",")

    def settings_for(batch_size: int, scope: str = scopes[0]) -> RegenSettings:
        compile_scope, _, dynamic = scope.partition("+")
        return RegenSettings(
            max_new_tokens=new_tokens, batch_size=batch_size, batch_tokens=args.batch_tokens,
            min_width=args.min_width, compile=not args.no_compile, compile_scope=compile_scope,
            compile_dynamic=dynamic == "dynamic",
        )  # fmt: skip

    root = Path(args.compile_cache or tempfile.mkdtemp(prefix="regen-compile-")).absolute()
    compile_dir = compile_cache.cache_directory(root, device)
    rows = args.rows.split(",")
    if set(rows) & {"today", "continuous", "static", "shards"}:
        with compile_cache.persisted(compile_dir, print):
            in_process_rows(args, rows, prompts, source, device, settings_for, batch_sizes, today_count)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    settings = settings_for(batch_sizes[0])
    if "workers" in rows:
        for workers in [int(n) for n in args.workers.split(",")]:
            print(f"workers: {workers} process(es) on {device}, compile cache {compile_dir}", flush=True)
            worker_rows(prompts, settings, workers, source, device, compile_dir, 2, f"workers x{workers}")
    for scope in scopes if args.warm else []:
        print(f"warm: a fresh process over the compile cache {compile_dir}", flush=True)
        name = "warm (fresh process)" if len(scopes) == 1 else f"warm {scope} (fresh process)"
        settings = settings_for(batch_sizes[0], scope)
        worker_rows(prompts, settings, 1, source, device, compile_dir, args.warm_passes, name)
    return 0


def in_process_rows(args, rows, prompts, source: Source, device, settings_for, batch_sizes, today_count):
    """The rows that run in this process: today, continuous, static, shards (the module's docstring)."""
    if device.type == "cpu":
        torch.set_num_threads(1)
    target = bench_target(source.shape, source.target_path, device)
    new_tokens = settings_for(batch_sizes[0]).max_new_tokens
    chat = BenchChat(source.end_id)

    def never() -> bool:
        return False

    with torch.no_grad():
        for row in rows:
            if row == "today":
                subset = prompts[:today_count]
                limit = memory_bound_tokens_per_s(target, subset, new_tokens, 1, args.bandwidth_tbs)
                run = lambda subset=subset: today(target, subset, new_tokens, device)  # noqa: E731
                timed("today (chat.regenerate)", device, run, subset, limit)
            elif row == "continuous":
                limit = memory_bound_tokens_per_s(
                    target, prompts, new_tokens, len(prompts), args.bandwidth_tbs
                )
                run = lambda: continuous_generate(  # noqa: E731
                    target, prompts, settings_for(batch_sizes[0]), chat, PAD_ID, never
                )
                timed("continuous (defaults)", device, run, prompts, limit, args.profile)
            elif row in ("static", "shards"):
                scopes = args.decode_scope.split(",")
                for scope, batch_size in itertools.product(scopes, batch_sizes):
                    static = settings_for(batch_size, scope)
                    calls = source.calls if row == "shards" else [prompts]
                    limit = memory_bound_tokens_per_s(
                        target, prompts, new_tokens, min(batch_size, len(prompts)), args.bandwidth_tbs
                    )

                    def run(static=static, calls=calls):
                        answers = []
                        for call in calls:  # one engine call each, as the product's stage makes them
                            answers += static_generate(target, call, static, chat, PAD_ID, never)
                        return answers

                    for attempt in (1, 2):  # the first pass compiles each new shape
                        name = f"{row} B{batch_size}{'' if len(scopes) == 1 else ' ' + scope} pass {attempt}"
                        graphs, phases = counters["stats"]["unique_graphs"], compile_seconds()
                        with batch_times(device) as batches:
                            timed(name, device, run, prompts, limit, args.profile and attempt == 2)
                        print(f"    Dynamo compiled {counters['stats']['unique_graphs'] - graphs} graph(s)")
                        print_compile_phases(phases)
                        if attempt == 2:
                            print_batches(batches)


if __name__ == "__main__":
    sys.exit(main())
