"""Where a start's time goes, from the trainer's entry to its first progress line.

A start (or a resume) spends a minute and more at the recipe's shape before its first step; the
breakdown names the parts (`StartupClock.part`), and whatever no part covers is `other`, so the
parts add up to the measured time. Printed once, after the first step's progress line, and kept in
the run record (`startup`), where scripts read it.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator

ORDER = (
    "imports",
    "config and machine check",
    "workers placed",
    "checkpoint read",
    "target load",
    "drafter build",
    "compile and warm-up",
    "data preparation",
    "data store open and pack",
    "state restore",
    "weights for the first evaluation",
    "first step",
)
"""The parts in the order a start goes through them (the breakdown lists them so, `other` last)."""


class StartupClock:
    """Seconds spent in named parts of a start since `began` (time.perf_counter() at the entry)."""

    def __init__(self, began: float):
        self.began = began
        self.seconds: dict[str, float] = {}
        self.graphs: dict[str, int] = {}  # graphs Dynamo compiled (or loaded from its cache) in a part
        # seconds a part spent in torch.compile, and of those in Dynamo's tracing: what a warm cache
        # saves (the compiling) and what it cannot (the tracing, the run of the warm-up itself)
        self.compiling: dict[str, tuple[float, float]] = {}
        self.reported = False

    def count_graphs(self, name: str, before: int) -> None:
        """Note the graphs Dynamo compiled in part `name` since it had compiled `before`
        (compiled_graphs()): a part that compiles where a warm start should not names the cause."""
        if compiled_graphs() > before:
            self.graphs[name] = self.graphs.get(name, 0) + compiled_graphs() - before

    def add(self, name: str, seconds: float) -> None:
        if name not in ORDER:
            raise ValueError(f"no startup part {name!r}; the parts are {', '.join(ORDER)}")
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, seconds)

    def count_compiling(self, name: str, before: tuple[float, float]) -> None:
        """Note the seconds part `name` spent in torch.compile since compile_seconds() was `before`."""
        now = compile_seconds()
        spent = (now[0] - before[0], now[1] - before[1])
        if spent[0] > 0:
            known = self.compiling.get(name, (0.0, 0.0))
            self.compiling[name] = (known[0] + spent[0], known[1] + spent[1])

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        began, graphs, compiling = time.perf_counter(), compiled_graphs(), compile_seconds()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - began)
            self.count_graphs(name, graphs)
            self.count_compiling(name, compiling)

    def breakdown(self, now: float | None = None) -> dict[str, float]:
        """{part: seconds, ..., "other": the rest, "total": entry to now}, rounded to 0.01 s; the
        parts and other add up to the total (to the rounding)."""
        total = (time.perf_counter() if now is None else now) - self.began
        parts = {name: self.seconds[name] for name in ORDER if name in self.seconds}
        parts["other"] = max(0.0, total - sum(parts.values()))
        parts["total"] = total
        return {name: round(seconds, 2) for name, seconds in parts.items()}


def describe(
    breakdown: dict[str, float],
    resumed: bool,
    graphs: dict[str, int] | None = None,
    compiling: dict[str, tuple[float, float]] | None = None,
) -> str:
    """One log line: `startup: 86.4 s from the trainer's start to the first step: target load 20.1 s, ...`;
    the parts as printed add up to the total as printed. `graphs`: the graphs Dynamo compiled in a
    part (StartupClock.graphs), said after the parts; `compiling`: a part's seconds in torch.compile
    and in Dynamo's tracing (StartupClock.compiling), said last."""
    what = "a resume" if resumed else "a start"
    total = round(breakdown["total"] * 10)
    tenths = in_tenths({name: seconds for name, seconds in breakdown.items() if name != "total"}, total)
    parts = ", ".join(f"{name} {count / 10:.1f} s" for name, count in tenths.items())
    line = f"startup: {total / 10:.1f} s from the trainer's start to the first step ({what}): {parts}"
    if graphs:
        counted = ", ".join(f"{count} in {name}" for name, count in graphs.items())
        line += f"; Dynamo compiled graphs (or took them from its cache): {counted}"
    spent = {name: seconds for name, seconds in (compiling or {}).items() if seconds[0] >= 0.05}
    if spent:
        said = ", ".join(
            f"{total:.1f} s of {name} (Dynamo's tracing {tracing:.1f} s of it)"
            for name, (total, tracing) in spent.items()
        )
        line += f"; in torch.compile (tracing, and compiling or loading from the cache): {said}"
    return line


def in_tenths(seconds: dict[str, float], total: int) -> dict[str, int]:
    """Each part in tenths of a second, summing to `total` tenths: rounded down, and the tenths left
    over given to the parts with the largest remainders (rounding each part alone could miss the
    total by half a tenth a part)."""
    counts = {name: math.floor(value * 10) for name, value in seconds.items()}
    by_remainder = sorted(seconds, key=lambda name: seconds[name] * 10 - counts[name], reverse=True)
    for name in by_remainder[: max(0, total - sum(counts.values()))]:
        counts[name] += 1
    return counts


def compile_seconds() -> tuple[float, float]:
    """Seconds in torch.compile so far, and of them in Dynamo's tracing (compile_cache.compile_seconds)."""
    from ..model.compile_cache import compile_seconds as seconds_in_compile

    return seconds_in_compile()


def compiled_graphs() -> int:
    """The graphs Dynamo has compiled in this process so far (0 before torch._dynamo is imported:
    importing it here would cost seconds of a start)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    return int(dynamo_utils.counters["stats"]["unique_graphs"]) if dynamo_utils is not None else 0
