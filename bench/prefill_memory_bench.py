"""What the regeneration's batches take on a GPU beyond the target's weights, shape by shape: the
static KV cache and the peak of the uncompiled prefill above it, measured (torch.cuda's peak of
allocated memory) beside trainer.data.regen's estimates (kv_cache_bytes, prefill_peak_bytes), which
size the batches to the card. Without a GPU, --cpu checks the estimate's model on a small one-layer
Qwen3 in float32 (its MLP the largest part, as at the 8B shape): each shape in a fresh process,
the peak resident memory the prefill adds (ru_maxrss), beside the same estimates.

    python3 bench/prefill_memory_bench.py                       # Qwen3-8B shape, random weights, bf16
    python3 bench/prefill_memory_bench.py --shapes 128x1024,512x128 --compiled --new-tokens 64
    python bench/prefill_memory_bench.py --cpu --shapes 128x256,256x256,128x512 --intermediate 1024,4096
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trainer_bench import SHAPES, build_target
from trainer.data.decode import StaticDecoder
from trainer.data.regen import kv_cache_bytes, prefill_peak_bytes
from trainer.model.target import attention_of

GIB = 1 << 30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    parser.add_argument("--shapes", default="32x1024,128x1024,512x128,64x2048", help="ROWSxWIDTH,...")
    parser.add_argument("--attention", default="flex_attention", help="the regeneration's on a GPU")
    parser.add_argument("--new-tokens", type=int, default=2, help="decoded after the prefill")
    parser.add_argument(
        "--compiled", action="store_true", help="decode as the regeneration does (compiled step, CUDA graphs)"
    )
    parser.add_argument("--cpu", action="store_true", help="the estimate's model on a small CPU target")
    parser.add_argument("--intermediate", default="1024,4096", help="--cpu: the MLP sizes, e.g. 1024,4096")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # --cpu's child: INTERMEDIATE:ROWSxWIDTH
    args = parser.parse_args()
    if args.one:
        return cpu_one(*args.one.split(":"))
    if args.cpu:
        for intermediate in args.intermediate.split(","):
            for item in args.shapes.split(","):
                child = [sys.executable, __file__, "--one", f"{intermediate}:{item}"]
                result = subprocess.run(child, capture_output=True, text=True, check=False)
                print(
                    result.stdout.strip() if result.returncode == 0 else result.stdout + result.stderr,
                    flush=True,
                )
        return 0
    if not torch.cuda.is_available():
        print("this bench measures a GPU's memory; no GPU here")
        return 1
    device = torch.device("cuda:0")
    shape = (
        SHAPES[args.shape]
        if args.layers is None
        else dataclasses.replace(SHAPES[args.shape], layers=args.layers)
    )
    target = build_target(shape, device, torch.bfloat16)
    weights = torch.cuda.memory_allocated(device)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, {shape.layers} layers, "
          f"weights {weights / GIB:.2f} GiB, attention {args.attention}")  # fmt: skip
    decoder = StaticDecoder(target, compiled=args.compiled)
    for item in args.shapes.split(","):
        rows, width = map(int, item.split("x"))
        ids = torch.randint(5, 1000, (rows, width), device=device)
        mask = torch.ones(rows, width, dtype=torch.long, device=device)
        decoder.cache = decoder.steps = decoder.masks = None
        decoder.cache_shape = None
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with attention_of(target, args.attention):
            decoder.decode(ids, mask, args.new_tokens, -1)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        cache = kv_cache_bytes(target.config, rows, width + args.new_tokens, torch.bfloat16)
        estimate = prefill_peak_bytes(target.config, rows, width, torch.bfloat16)
        print(f"{item:>9s}: peak {peak / GIB:6.2f} GiB above the weights: KV cache {cache / GIB:5.2f} GiB, "
              f"the rest (prefill) {(peak - cache) / GIB:6.2f} GiB; estimated {estimate / GIB:6.2f} GiB",
              flush=True)  # fmt: skip
    return 0


def cpu_one(intermediate: str, item: str) -> int:
    """One shape's prefill on a small CPU target, in this fresh process: the peak resident memory it
    adds beside the estimate of its prefill and KV cache."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.set_num_threads(1)
    config = Qwen3Config(
        hidden_size=256, intermediate_size=int(intermediate), num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=8192,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    target = Qwen3ForCausalLM(config).eval().requires_grad_(False)
    decoder = StaticDecoder(target, compiled=False)
    decoder.decode(torch.randint(5, 900, (2, 16)), torch.ones(2, 16, dtype=torch.long), 1, -1)  # first calls
    decoder = StaticDecoder(target, compiled=False)
    rows, width = map(int, item.split("x"))
    ids = torch.randint(5, 900, (rows, width))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    decoder.decode(ids, torch.ones_like(ids), 1, -1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    f32 = torch.float32
    estimate = prefill_peak_bytes(config, rows, width, f32) + kv_cache_bytes(config, rows, width + 1, f32)
    print(f"intermediate {intermediate:>5s}, {item:>8s}: the prefill added {peak / 2**20:6.0f} MiB at its "
          f"peak; estimated (prefill and KV cache) {estimate / 2**20:6.0f} MiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
