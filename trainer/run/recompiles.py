"""A warning of ours when compiled code recompiles more than a few times.

Static shapes (compile.dynamic=false) mean one compiled version per function: a function that
Dynamo compiles again and again is fed changing shapes or changing Python values, and each new
version costs a compile. Dynamo warns only when it gives up (at its recompile limit, 8 by default)
and then silently runs the function eagerly. This watch reads Dynamo's compilation records (one per
compile, with the function and the failed guard that caused it) and says in the run's log, once per
function, when one recompiled more than RECOMPILE_BOUND times, naming it and the last reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

RECOMPILE_BOUND = 2
"""Recompiles of one function tolerated silently: a second shape (say, a last smaller chunk) is
normal; a third new shape already means a shape that changes with the data."""

COMPILE_ID_RE = re.compile(r"(\d+)/(\d+)")


@dataclass
class FunctionRecompiles:
    name: str = "?"
    where: str = "?"
    count: int = 0
    last_reason: str = ""


def compilation_records() -> list:
    try:
        from torch._dynamo.utils import get_compilation_metrics
    except ImportError:  # a torch without these records: nothing to watch
        return []
    return list(get_compilation_metrics())


@dataclass
class RecompileWatch:
    """Counts the compiles made after it was created (Dynamo keeps the latest 64 records; the
    watch is polled at every progress line, far more often than that many compiles happen)."""

    bound: int = RECOMPILE_BOUND
    seen: list = field(default_factory=compilation_records)
    """The records already counted, kept by identity: compile ids repeat after torch._dynamo.reset()."""
    functions: dict[str, FunctionRecompiles] = field(default_factory=dict)
    warned: set[str] = field(default_factory=set)

    def poll(self) -> list[str]:
        """Warnings for functions that crossed the bound since the last poll (each warned once)."""
        records = compilation_records()
        counted = {id(record) for record in self.seen}
        for record in records:
            if id(record) in counted:
                continue
            compile_id = str(record.compile_id)
            frame = COMPILE_ID_RE.search(compile_id)
            key = frame.group(1) if frame else compile_id
            function = self.functions.setdefault(key, FunctionRecompiles())
            if record.co_name:
                function.name = record.co_name
                function.where = f"{record.co_filename}:{record.co_firstlineno}"
            if record.recompile_reason:
                function.count += 1
                function.last_reason = str(record.recompile_reason).strip()
        self.seen = records
        lines = []
        for key, function in self.functions.items():
            if function.count > self.bound and key not in self.warned:
                self.warned.add(key)
                lines.append(
                    f"warning: compiled function {function.name} ({function.where}) recompiled "
                    f"{function.count} times (more than {self.bound}); last reason: {function.last_reason}. "
                    "Each recompile costs a compile, and past torch._dynamo.config.recompile_limit the "
                    "function runs uncompiled: keep its input shapes static"
                )
        return lines
