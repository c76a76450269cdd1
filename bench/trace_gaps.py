"""Where a profiled GPU step's time goes, per device, from a Chrome trace of torch.profiler.

    python bench/trace_gaps.py trace.json [--steps 2]

Per device, over the span from its first to its last kernel: the time some kernel (or copy) ran
(busy), the time nothing ran (idle, with the longest gaps and the kernels on either side), the
time communication kernels (NCCL) ran alone (exposed) and beside compute kernels (overlapped),
and the sum of compute kernel durations (which grows when NCCL kernels take SMs from them).
Figures are per step: the totals divided by --steps.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: dict) -> dict[int, list[tuple[float, float, str]]]:
    """(start µs, end µs, name) of every kernel, copy and memset, by device."""
    by_device: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or event.get("cat") not in DEVICE_CATEGORIES:
            continue
        device = (event.get("args") or {}).get("device")
        if device is None:
            continue
        start = float(event["ts"])
        by_device[int(device)].append((start, start + float(event.get("dur", 0)), event.get("name", "")))
    return {device: sorted(events) for device, events in by_device.items()}


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two merged, sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, high - low)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def is_communication(name: str) -> bool:
    return "nccl" in name.lower()


def summarise_device(events: list[tuple[float, float, str]], steps: int, gaps_shown: int = 5) -> list[str]:
    span = events[-1][1] - events[0][0]
    busy = union([(s, e) for s, e, _ in events])
    comm = union([(s, e) for s, e, n in events if is_communication(n)])
    compute = union([(s, e) for s, e, n in events if not is_communication(n)])
    compute_sum = sum(e - s for s, e, n in events if not is_communication(n))
    overlapped = intersect(comm, compute)
    per = 1000.0 * steps  # µs -> ms per step
    lines = [
        f"span {span / per:.1f} ms/step: busy {length(busy) / per:.1f} ({length(busy) / span:.1%}), "
        f"idle {(span - length(busy)) / per:.1f}",
        f"compute kernels {compute_sum / per:.1f} ms/step (union {length(compute) / per:.1f}); "
        f"NCCL {length(comm) / per:.1f}: beside compute {overlapped / per:.1f}, "
        f"alone {(length(comm) - overlapped) / per:.1f}",
    ]
    gaps = []
    for (_, end), (start, _) in itertools.pairwise(busy):
        gaps.append((start - end, end))
    for gap, at in sorted(gaps, reverse=True)[:gaps_shown]:
        before = max((e for e in events if e[1] <= at + 1e-3), key=lambda e: e[1], default=None)
        after = min((e for e in events if e[0] >= at + gap - 1e-3), key=lambda e: e[0], default=None)
        lines.append(
            f"  gap {gap / 1000:.2f} ms at +{(at - events[0][0]) / 1000:.1f} ms: after "
            f"{(before[2] if before else '?')[:50]!r}, before {(after[2] if after else '?')[:50]!r}"
        )
    return lines


def summarise(trace_path: Path, steps: int) -> str:
    trace = json.loads(Path(trace_path).read_text())
    lines = []
    for device, events in sorted(device_events(trace).items()):
        if events:
            lines.append(f"device {device}:")
            lines += ["  " + line for line in summarise_device(events, steps)]
    return "\n".join(lines) if lines else "no device events in the trace"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--steps", type=int, default=2, help="steps the trace holds")
    args = parser.parse_args()
    print(summarise(args.trace, args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
