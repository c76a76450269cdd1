"""The paged engine's decode attention alone, one layer: how fast each way of reading the pages is,
against what moving the KV in use through the device's memory costs.

    python3 bench/paged_attention_bench.py                       # GPU: the 8B shape, 256 slots
    python3 bench/paged_attention_bench.py --options SPLIT_KV=4,BLOCK_N=32 --options num_warps=8
    python bench/paged_attention_bench.py --slots 8 --pages 64 --lengths 20:100   # CPU: the harness

One decoder layer's attention at the decode step's shape (--slots queries of one token, 32 query
and 8 key-value heads of 128 at the 8B shape) over a pool of --pages pages of --page-size tokens,
each slot holding a sequence of a lognormal length (--lengths MEDIAN:CAP) on pages handed out in
a shuffled order, as a long run leaves them. Rows:

  flex            flex attention over the pool in place with the engine's own block mask
                  (trainer/data/engine/step.PoolMask), compiled; one row per --options set
                  (its defaults, then each --options set of flex attention's kernel options:
                  SPLIT_KV, BLOCK_N, num_warps, num_stages, ...)
  gather          each slot's table of pages copied in order, then sdpa (data.regen_attention=sdpa)

Per row: the time of one call (the median of --repeats after a warm-up), the KV bytes in use over
that time (an effective bandwidth), and whether its output equals the gathered sdpa's (bfloat16:
within a tolerance)."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data.engine.kv_pages import PagedKV, gathered, whole
from trainer.data.engine.step import PoolMask


def kernel_options(text: str) -> dict:
    options = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if not value:
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {item!r}")
        options[name] = value == "true" if value in ("true", "false") else int(value)
    return options


def lengths_spec(text: str) -> tuple[int, int]:
    try:
        median, cap = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MEDIAN:CAP, got {text!r}") from None
    if not 0 < median <= cap:
        raise argparse.ArgumentTypeError(f"expected 0 < MEDIAN <= CAP, got {text!r}")
    return median, cap


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(call, device: torch.device, repeats: int) -> tuple[float, torch.Tensor]:
    out = call()  # warm-up: compiles
    synchronize(device)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        out = call()
        synchronize(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times), out


def layout(args, generator: random.Random) -> tuple[list[int], list[list[int]]]:
    """Each slot's sequence length and its pages, handed out from a shuffled free list."""
    median, cap = args.lengths
    lengths = [max(1, min(cap, round(generator.lognormvariate(0, 1) * median))) for _ in range(args.slots)]
    needed = sum(-(-n // args.page_size) for n in lengths)
    if needed > args.pages - 1:
        sys.exit(
            f"--pages {args.pages} hold {args.pages - 1} pages (one is scratch); the lengths need {needed}"
        )
    free = list(range(1, args.pages))
    generator.shuffle(free)
    tables = []
    for n in lengths:
        count = -(-n // args.page_size)
        tables.append(free[:count])
        del free[:count]
    return lengths, tables


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--pages", type=int, default=4096, help="the pool's pages (one is scratch)")
    parser.add_argument("--lengths", type=lengths_spec, default=(349, 2048 + 118), metavar="MEDIAN:CAP")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--options",
        type=kernel_options,
        action="append",
        default=None,
        help="flex attention's kernel options, NAME=VALUE,...: a flex row each, after the defaults' row",
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--bandwidth-tbs", type=float, default=3.35, help="device memory bandwidth (H100: 3.35)"
    )
    args = parser.parse_args()
    from torch.nn.attention.flex_attention import flex_attention

    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lengths, tables = layout(args, random.Random(0))
    width = max(map(len, tables))
    config = SimpleNamespace(
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_hidden_layers=1,
        num_attention_heads=args.heads,
        hidden_size=args.heads * args.head_dim,
    )
    kv = PagedKV(config, args.pages, args.page_size, width, device, dtype)
    torch.manual_seed(0)
    kv.keys[0].normal_()
    kv.values[0].normal_()
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=device)
    positions = torch.tensor([[n - 1] for n in lengths], dtype=torch.long, device=device)
    query = torch.randn(args.slots, args.heads, 1, args.head_dim, device=device, dtype=dtype)
    in_use = sum(lengths) * 2 * args.kv_heads * args.head_dim * kv.keys[0].element_size()
    print(
        f"{args.slots} slots, sequences median {statistics.median(lengths):.0f} tokens, longest "
        f"{max(lengths)}, {sum(lengths):,} in all; KV in use {in_use / 2**20:.0f} MiB a layer, moved in "
        f"{in_use / (args.bandwidth_tbs * 1e12) * 1e3:.3f} ms at {args.bandwidth_tbs} TB/s",
        flush=True,
    )

    def gathered_sdpa():
        keys, values = gathered(kv.keys[0], table), gathered(kv.values[0], table)
        seen = (torch.arange(keys.shape[2], device=device) <= positions[:, :, None])[:, None]
        return torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=seen, enable_gqa=True
        )

    gather_s, reference = timed(gathered_sdpa, device, args.repeats)
    rows = [("gather (sdpa over each slot's pages copied)", gather_s, reference)]
    pool_mask = PoolMask(kv, args.slots)
    pool_mask.load(table, positions)
    for options in [{}] + (args.options or []):
        compiled = torch.compile(flex_attention, dynamic=False)

        def flex(options=options, compiled=compiled):
            return compiled(
                query,
                whole(kv.keys[0]),
                whole(kv.values[0]),
                block_mask=pool_mask.block_mask,
                enable_gqa=True,
                kernel_options=options or None,
            )

        try:
            seconds, out = timed(flex, device, args.repeats)
        except Exception as exc:  # an option set the kernel refuses: said, and the next row runs
            print(
                f"flex {options}: failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})", flush=True
            )
            continue
        rows.append((f"flex {options or '(defaults)'}", seconds, out))
    for name, seconds, out in rows:
        equal = torch.allclose(out.float(), reference.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
        print(
            f"{name:60s} {seconds * 1e3:8.3f} ms  {in_use / seconds / 1e12:6.2f} TB/s effective  "
            f"equal to gather: {equal}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
