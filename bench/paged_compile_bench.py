"""What compiling the paged engine's decode step costs, cold and in a fresh process over the compile
cache, compiled whole or layer by layer (data.regen_compile_scope), on any device.

    python bench/paged_compile_bench.py                            # CPU: a small 36-layer Qwen3
    python3 bench/paged_compile_bench.py --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 \
        --intermediate 12288 --vocab 151936

Each scope runs in two fresh processes over one new compile cache (trainer.model.compile_cache):
"cold" compiles into it, "warm" loads it, as a restart or the next GPU's worker does. Per process:
the first generate (the compile, or the trace and the load, and on a GPU the CUDA graph's
recording), a second one (steady), the graphs Dynamo compiled, torch.compile's own time split into
Dynamo's tracing and the rest, and whether the answers equal the uncompiled engine's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trainer_bench import Shape, build_target


def one_process(args) -> dict:
    """The child: build the target, run the engine twice over the prompts, report as JSON."""
    import torch._dynamo.utils as dynamo_utils
    from torch._dynamo.utils import counters

    from trainer.data.engine import PagedEngine, PagedSettings
    from trainer.model import compile_cache

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = Shape(
        args.hidden,
        args.layers,
        args.heads,
        args.kv_heads,
        args.head_dim,
        args.intermediate,
        args.vocab,
        2,
        3,
        8,
        8,
        64,
        2,
    )
    target = build_target(shape, device, dtype)
    prompts = [[5 + i % 50] * (8 + 3 * i) for i in range(args.prompts)]

    def engine(compile: bool) -> PagedEngine:
        settings = PagedSettings(
            slots=args.slots,
            page_size=16,
            pages=args.slots * 16 + 1,
            max_tokens=256,
            chunk=64,
            compile=compile,
            attention=args.attention,
            compile_scope=args.scope,
        )
        return PagedEngine(target, settings)

    requests = list(enumerate(prompts))
    with compile_cache.persisted(compile_cache.cache_directory(Path(args.child), device), lambda line: None):
        compiled = engine(True)
        began = time.perf_counter()
        answers = compiled.generate(requests, args.new_tokens, end_id=-1)
        first = time.perf_counter() - began
        began = time.perf_counter()
        compiled.generate(requests, args.new_tokens, end_id=-1)
        second = time.perf_counter() - began
    eager = engine(False).generate(requests, args.new_tokens, end_id=-1)
    metrics = dynamo_utils.compilation_time_metrics
    return {
        "first": first,
        "second": second,
        "graphs": counters["stats"]["unique_graphs"],
        "compile": sum(metrics.get("_compile.compile_inner", [])),
        "tracing": sum(metrics.get("bytecode_tracing", [])),
        "equal": answers == eager,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=192)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--attention", choices=("flex", "gather"), default="flex")
    parser.add_argument(
        "--scopes", default="step,layers", help="comma list of data.regen_compile_scope values"
    )
    parser.add_argument("--scope", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the compile cache of a child process
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_process(args)))
        return 0
    scopes = args.scopes.split(",")
    for scope in scopes:
        if scope not in ("step", "layers"):
            parser.error(f"unknown scope {scope!r}; scopes are step, layers")
    print(
        f"{args.layers} layers, hidden {args.hidden}, {args.slots} slots, {args.prompts} prompts, "
        f"{args.new_tokens} new tokens, attention {args.attention}",
        flush=True,
    )
    names = (
        "layers",
        "hidden",
        "heads",
        "kv_heads",
        "head_dim",
        "intermediate",
        "vocab",
        "slots",
        "prompts",
        "new_tokens",
        "attention",
    )
    passed = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in names]
    for scope in scopes:
        cache = tempfile.mkdtemp(prefix=f"paged-compile-{scope}-")
        for process in ("cold", "warm"):
            result = subprocess.run(
                [sys.executable, __file__, *passed, "--scope", scope, "--child", cache],
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                print(result.stdout + result.stderr, file=sys.stderr)
                return 1
            row = json.loads(result.stdout.strip().splitlines()[-1])
            print(
                f"{scope:6s} {process}: first generate {row['first']:6.1f} s, second {row['second']:5.2f} s; "
                f"{row['graphs']} graph(s); torch.compile {row['compile']:5.1f} s (Dynamo's tracing "
                f"{row['tracing']:.1f} s); answers equal the uncompiled engine's: {row['equal']}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
