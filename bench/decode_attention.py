"""One decode shape of the static engine, side by side per attention: `generate` with a static KV
cache, compiled with static shapes, on a Qwen3-shaped target with random weights.

    python bench/decode_attention.py --shape 8b --attention sdpa,flex_attention   # one H200
    python bench/decode_attention.py --shape tiny --attention sdpa,eager          # CPU: the harness

Batch --batch of --width-token prompts (half of the rows left-padded by half the width, as in a
length-bucketed batch), --new-tokens each. Per attention: the first call (it compiles), then the
second call's tokens/s and ms a token, peak memory, and the share of rows whose answers equal
the first attention's (in bfloat16 on random weights kernels' rounding often changes a greedy
path; in float32 they agree).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trainer_bench import SHAPES, build_target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["8b", "tiny"], default="8b")
    parser.add_argument("--attention", default="sdpa,flex_attention", help="comma-separated")
    parser.add_argument("--batch", type=int, help="default: 256 (8b), 4 (tiny)")
    parser.add_argument("--width", type=int, help="default: 128 (8b), 16 (tiny)")
    parser.add_argument("--new-tokens", type=int, help="default: 256 (8b), 8 (tiny)")
    args = parser.parse_args()
    from transformers import CompileConfig, GenerationConfig

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    big = args.shape == "8b"
    batch, width = args.batch or (256 if big else 4), args.width or (128 if big else 16)
    new_tokens = args.new_tokens or (256 if big else 8)
    target = build_target(SHAPES[args.shape], device, dtype)
    target.generation_config.eos_token_id = None
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, target.config.vocab_size - 1, (batch, width), generator=generator).to(device)
    mask = torch.ones_like(ids)
    mask[: batch // 2, : width // 2] = 0
    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=2,
        pad_token_id=0, cache_implementation="static", compile_config=CompileConfig(dynamic=False),
    )  # fmt: skip

    def generate():
        target._previous_max_cache_length = -1
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        with torch.no_grad():
            output = target.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - began, output[:, width:]

    print(
        f"torch {torch.__version__}, {device}, {args.shape}: batch {batch}, width {width}, {new_tokens} new"
    )
    first_answers = None
    for attention in args.attention.split(","):
        try:
            target.set_attn_implementation(attention)
            torch._dynamo.reset()
            target.__dict__.pop("_compiled_call", None)
            compile_s, _ = generate()
            seconds, answers = generate()
        except Exception as error:  # one attention failing leaves the others' figures
            print(f"{attention:16s} failed: {error!r}"[:2000], flush=True)
            continue
        first_answers = answers if first_answers is None else first_answers
        same = (answers == first_answers).all(dim=1).float().mean().item()
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        print(
            f"{attention:16s} first call {compile_s:6.1f} s, then {seconds:6.2f} s: "
            f"{seconds / new_tokens * 1000:6.1f} ms a token, {batch * new_tokens / seconds:8.0f} tok/s; "
            f"rows equal to the first attention's {same:.0%}; peak {peak:.1f} GiB",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
