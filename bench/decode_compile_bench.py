"""What compiling the regeneration's decode step costs, shape by shape: compiled once per batch shape
(data.regen_compile_dynamic: false) against once for every shape (true), cold and then in a fresh
process over the same compile cache (what a restart or the next GPU's worker pays), on any device.

    python bench/decode_compile_bench.py                       # CPU: a 36-layer small Qwen3
    python bench/decode_compile_bench.py --shapes 8x64,16x128,32x128,64x256,8x512 --scopes step,layers
    python3 bench/decode_compile_bench.py --attention flex_attention --shapes 8x128,16x256 --dynamic static
    python3 bench/decode_compile_bench.py --shapes 8x128 --warm-shapes 8x128,16x256 --dynamic static

Each (scope, dynamic) runs in two fresh processes over one new compile cache (trainer.model.
compile_cache: Inductor's caches and torch's artifact bundles): "cold" compiles into it, "warm"
loads it (--warm-shapes: the warm process meets other shapes too, as the next data set or a
resumed regeneration does: it loads what the cache holds and compiles what it lacks). Per batch
shape (rows x prompt width, --new-tokens decoded): the first batch's time (the compile, or the
load and trace), another batch of the shape (steady), the graphs Dynamo compiled so
far, and whether both batches' answers equal the uncompiled loop's. On a GPU the step scope records
CUDA graphs, as the product does; bench/regen_bench.py --decode-scope step,step+dynamic measures
the Qwen3-8B shape with the product's batches.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trainer_bench import SHAPES, build_target
from trainer.model import compile_cache

CACHE_COUNTS = ("hit", "miss", "bypass")  # Inductor's FX graph cache, so far in the process


def small_target(layers: int, device: torch.device):
    """trainer_bench's tiny shape (hidden 64, 4 heads, 2 KV heads) with `layers` decoder layers."""
    target = build_target(dataclasses.replace(SHAPES["tiny"], layers=layers), device, torch.float32)
    with torch.no_grad():
        target.lm_head.weight.mul_(20)  # confident logits: ties in the argmax are unlikely
    return target


def batch(rows: int, width: int, device: torch.device, other: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows of varied lengths (other: another batch of the shape, other tokens and padding)."""
    generator = torch.Generator().manual_seed(rows * 10_000 + width + 7 * other)
    ids = torch.randint(5, 512, (rows, width), generator=generator)
    lengths = torch.tensor([width - (r * 7 + 3 * other) % (width // 2) for r in range(rows)])
    mask = (torch.arange(width) >= width - lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0).to(device), mask.to(device)


def run_one(args) -> None:
    """One process: every shape once cold or warm, printed as JSON lines."""
    from torch._dynamo.utils import counters

    from trainer.data.decode import StaticDecoder
    from trainer.model.target import attention_of

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    target = small_target(args.layers, device)
    scope, dynamic = args.one.split(":")
    uncompiled = StaticDecoder(target, compiled=False)
    compiled = StaticDecoder(target, compiled=True, scope=scope, dynamic=dynamic == "dynamic")
    with compile_cache.persisted(Path(args.cache), lambda line: print(json.dumps({"log": line}), flush=True)):
        for shape in args.shapes.split(","):
            rows, width = map(int, shape.split("x"))
            times, equal = [], []
            for other in range(2):  # another batch of the shape, in the cache (and CUDA graph) of the first
                ids, mask = batch(rows, width, device, other)
                expected = uncompiled.decode(ids, mask, args.new_tokens, -1)
                began = time.perf_counter()
                with attention_of(target, args.attention):
                    answers = compiled.decode(ids, mask, args.new_tokens, -1)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - began)
                equal.append(torch.equal(answers, expected))
            line = {
                "shape": shape, "first_s": times[0], "again_s": times[1],
                "graphs": counters["stats"]["unique_graphs"], "equal": all(equal),
                "inductor": {key: counters["inductor"][f"fxgraph_cache_{key}"] for key in CACHE_COUNTS},
            }  # fmt: skip
            print(json.dumps(line), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=36, help="decoder layers (Qwen3-8B: 36)")
    parser.add_argument("--shapes", default="8x64,16x128,32x128,64x256,8x512", help="ROWSxWIDTH,...")
    parser.add_argument(
        "--warm-shapes", help="the warm process's shapes (default: --shapes), e.g. shapes the cache lacks too"
    )
    parser.add_argument("--scopes", default="step", help="step, layers or both: data.regen_compile_scope")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--dynamic", default="static,dynamic", help="static, dynamic or both")
    parser.add_argument(
        "--attention", help="the compiled decoder's attention, e.g. flex_attention (a GPU's regeneration "
        "decodes on it; widths from 128 there); the uncompiled answers stay the target's own (SDPA)",
    )  # fmt: skip
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: SCOPE:static|dynamic
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args)
        return 0
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")  # the children's
    attention = args.attention or "the target's own"
    warm_shapes = args.warm_shapes or args.shapes
    shapes = f"shapes {args.shapes} (warm {warm_shapes}), {args.new_tokens} new tokens, attention {attention}"
    print(f"torch {torch.__version__}, {args.layers} layers, {shapes}")
    for scope in args.scopes.split(","):
        for dynamic in args.dynamic.split(","):
            root = Path(tempfile.mkdtemp(prefix="decode-compile-"))
            cache = compile_cache.cache_directory(root, device)
            for start in ("cold", "warm"):
                child = [
                    sys.executable, __file__, "--one", f"{scope}:{dynamic}", "--cache", str(cache),
                    "--layers", str(args.layers), "--shapes", args.shapes if start == "cold" else warm_shapes,
                    "--new-tokens", str(args.new_tokens),
                ] + (["--attention", args.attention] if args.attention else [])  # fmt: skip
                began = time.perf_counter()
                result = subprocess.run(child, capture_output=True, text=True, check=False)
                if result.returncode != 0:
                    print(result.stdout + result.stderr)
                    return 1
                total = 0.0
                for line in map(json.loads, result.stdout.splitlines()):
                    if "log" in line:
                        print(f"  {scope} {dynamic} {start}: {line['log']}")
                        continue
                    total += line["first_s"]
                    inductor = " ".join(f"{n} {key}" for key, n in line["inductor"].items())
                    print(
                        f"{scope:6s} {dynamic:7s} {start}  {line['shape']:>8s}: "
                        f"first batch {line['first_s']:7.2f} s, another {line['again_s']:6.2f} s, "
                        f"graphs so far {line['graphs']} (Inductor's cache: {inductor}), "
                        f"answers {'equal' if line['equal'] else 'DIFFER from'} uncompiled"
                    )
                print(
                    f"{scope:6s} {dynamic:7s} {start}  first batches {total:.1f} s in all; "
                    f"process {time.perf_counter() - began:.1f} s"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
