"""What holds the GPU's memory while the trainer starts: `python -m trainer` run in this process with
CUDA's memory history recorded. At an out-of-memory, the allocations live at that moment, grouped by
where they were made (the innermost frames of the trainer or of Inductor's generated code); at the
end, the history replayed to its peak and the live set there, grouped the same way.

    python3 bench/start_memory.py [--limit-gib 89.4] -- --run qwen3-8b --out DIR --set train.batch_size=5 \
        --set data.cache_dir=EMPTY_DIR ...      # a first start into an empty compile cache

--limit-gib caps this process's allocator (torch.cuda.set_per_process_memory_fraction): a card of
another size, e.g. CT 200's 96 GB on a 141 GB H200. Recording every allocation's Python stack slows
the run after its start many times over (on one H100 the steps after the first did not end in four
minutes): give it few steps, and read the startup figures only. A GPU machine's bench: on the CPU it
says so and exits 2.
"""

from __future__ import annotations

import argparse
import collections
import runpy
import sys
import time
from pathlib import Path

import torch

GIB = 2**30
REPO = Path(__file__).resolve().parents[1]
KEPT_FRAMES = 3  # of the trainer's and Inductor's own, innermost first
SHOWN_GROUPS = 25


def origin(frames: list[dict]) -> str:
    """Where an allocation was made: its innermost frames in the trainer or in generated code."""
    kept = []
    for frame in frames:
        name = frame.get("filename", "?")
        if "/trainer/" in name or "torchinductor" in name:
            short = name.split("/trainer/")[-1] if "/trainer/" in name else name.rsplit("/", 1)[-1]
            kept.append(f"{short}:{frame.get('line')}:{frame.get('name')}")
            if len(kept) == KEPT_FRAMES:
                break
    if not kept and frames:
        frame = frames[0]
        kept.append(
            f"{frame.get('filename', '?').rsplit('/', 1)[-1]}:{frame.get('line')}:{frame.get('name')}"
        )
    return " <- ".join(kept) or "no frames (made before the history began, or by the CUDA caching allocator)"


def print_grouped(tag: str, allocations) -> None:
    sizes: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for size, frames in allocations:
        key = origin(frames)
        sizes[key] += size
        counts[key] += 1
    print(
        f"{tag}: {sum(sizes.values()) / GIB:.2f} GiB live in {sum(counts.values())} allocations", flush=True
    )
    for key, size in sizes.most_common(SHOWN_GROUPS):
        print(f"{tag}: {size / GIB:8.2f} GiB x{counts[key]:<5} {key}", flush=True)


def live_now():
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                yield block["size"], block.get("frames", [])


def on_out_of_memory(device: int, asked: int, allocated: int, free: int) -> None:
    print(
        f"out of memory on cuda:{device}: {asked / GIB:.2f} GiB asked, {allocated / GIB:.2f} GiB allocated, "
        f"{free / GIB:.2f} GiB free",
        flush=True,
    )
    print_grouped("live at the out-of-memory", live_now())


def print_peak() -> None:
    """The history replayed: its highest total of live allocations, and what was live then."""
    events = torch.cuda.memory._snapshot()["device_traces"][0]
    live: dict = {}
    total = top = 0
    top_at = -1
    for index, event in enumerate(events):
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
            total += event["size"]
            if total > top:
                top, top_at = total, index
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])
    print(f"peak: {top / GIB:.2f} GiB over the history's start (event {top_at} of {len(events)}); "
          f"max_memory_allocated {torch.cuda.max_memory_allocated() / GIB:.2f} GiB", flush=True)  # fmt: skip
    at_peak: dict = {}
    for event in events[: top_at + 1]:
        if event["action"] == "alloc":
            at_peak[event["addr"]] = (event["size"], event.get("frames", []))
        elif event["action"] == "free_completed":
            at_peak.pop(event["addr"], None)
    print_grouped("live at the peak", at_peak.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-gib", type=float, help="cap the allocator at this many GiB (a smaller card)")
    parser.add_argument("--max-entries", type=int, default=3_000_000, help="allocation events kept")
    parser.add_argument(
        "trainer_args", nargs=argparse.REMAINDER, help="-- then python -m trainer's arguments"
    )
    args = parser.parse_args()
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    if not torch.cuda.is_available():
        print("start_memory: no CUDA device here; run it on a GPU machine", file=sys.stderr)
        return 2
    card = torch.cuda.get_device_properties(0)
    if args.limit_gib:
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.limit_gib * GIB / card.total_memory), 0)
    print(f"{card.name}, {card.total_memory / GIB:.1f} GiB; allocator capped at "
          f"{f'{args.limit_gib} GiB' if args.limit_gib else 'the card'}", flush=True)  # fmt: skip
    torch.cuda.memory._record_memory_history(max_entries=args.max_entries, stacks="python")
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        attach(on_out_of_memory)
    sys.path.insert(0, str(REPO))
    sys.argv = ["trainer", *trainer_args]
    began, code = time.perf_counter(), 0
    try:
        runpy.run_module("trainer", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    print(f"the trainer ended with {code} after {time.perf_counter() - began:.1f} s", flush=True)
    print_peak()
    return code


if __name__ == "__main__":
    sys.exit(main())
