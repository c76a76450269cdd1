"""The paged engine's loop with its device work taken out: what the host spends an iteration on
(scheduling, building and loading a step's inputs, appending its outputs), at the product's slots,
pages and pool, over long-tailed answers.

    python bench/paged_host_bench.py                   # 256 slots, 1,500 prompts, answers to 2,048
    python bench/paged_host_bench.py --slots 512 --prompts 3000

The decode step's forward is replaced by random tokens and the prefill by marking its sequences
prefilled, so the figure is the host's alone: set beside a GPU's step time (the regeneration bench's
`the loop's ...` line), it says whether the loop waits on the host or on the device.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trainer_bench import SHAPES, build_target
from trainer.data.engine import PagedEngine, PagedSettings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--pages", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=1500)
    parser.add_argument("--cap", type=int, default=2048)
    parser.add_argument("--median", type=int, default=231, help="the answers' lognormal median")
    parser.add_argument("--attention", choices=("flex", "gather"), default="flex")
    args = parser.parse_args()
    if min(args.slots, args.pages, args.prompts, args.cap, args.median) < 1:
        parser.error("--slots, --pages, --prompts, --cap and --median must be at least 1")
    target = build_target(SHAPES["tiny"], torch.device("cpu"), torch.float32)
    settings = PagedSettings(
        slots=args.slots,
        page_size=args.page_size,
        pages=args.pages,
        max_tokens=args.cap + 512,
        chunk=1024,
        attention=args.attention,
    )
    engine = PagedEngine(target, settings)
    following = torch.zeros(args.slots, dtype=torch.long)
    vocab = target.config.vocab_size
    engine.next_tokens = lambda: following.random_(2, vocab)

    def prefill(scheduler, end_id):  # every admitted prompt prefilled at once, its first token 2
        for sequence in scheduler.prefilling():
            sequence.computed, sequence.decoding = len(sequence.tokens), True
            sequence.answer.append(2)
        return []

    engine.prefill = prefill
    draw = random.Random(0)
    prompts = [[5] * draw.randint(50, 300) for _ in range(args.prompts)]
    mu = math.log(args.median)
    lengths = [max(2, min(args.cap, int(draw.lognormvariate(mu, 1.0)))) for _ in prompts]
    began = time.perf_counter()
    engine.generate(list(enumerate(prompts)), args.cap, end_id=1, answer_limit=lambda key: lengths[key])
    seconds = time.perf_counter() - began
    steps = engine.decode_steps
    parts = ", ".join(
        f"{part} {1000 * spent / steps:.2f} ms" for part, spent in sorted(engine.seconds.items())
    )
    print(
        f"{args.slots} slots, {args.prompts} prompts: {steps} decode steps in {seconds:.1f} s, "
        f"{1000 * seconds / steps:.2f} ms an iteration on the host ({parts})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
