"""What the regeneration's batches take on a GPU beyond the target's weights, shape by shape: the
static KV cache and the peak of the uncompiled prefill above it, measured (torch.cuda's peak of
allocated memory) beside trainer.data.regen's estimates (kv_cache_bytes, prefill_peak_bytes), which
size the batches to the card.

    python3 bench/prefill_memory_bench.py                       # Qwen3-8B shape, random weights, bf16
    python3 bench/prefill_memory_bench.py --shapes 128x1024,512x128 --attention flex_attention
"""

from __future__ import annotations

import argparse
import dataclasses
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
    args = parser.parse_args()
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


if __name__ == "__main__":
    sys.exit(main())
