# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters: text sparklines of a run's curves, and the worker count of each stretch, for status.yml."""

from __future__ import annotations

DOCUMENTATION = r"""
name: sparkline
short_description: A compact text sparkline of a series of numbers
description:
  - Turns a list of numbers (None and non-numbers skipped) into one line of block characters,
    lowest to highest, thinned evenly to at most O(width) characters. An empty series gives an
    empty string; a flat one a row of the middle block.
positional: width
options:
  _input:
    description: The numbers.
    type: list
    required: true
  width:
    description: At most this many characters.
    type: int
    default: 40
"""

EXAMPLES = r"""
loss_line: "{{ run.series.train | map(attribute=1) | dflash.ct200.sparkline(30) }}"
"""

RETURN = r"""
_value:
  description: The sparkline.
  type: str
"""

import math

BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values, width: int = 40) -> str:
    numbers = [
        float(value)
        for value in values or []
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ]
    if not numbers or width < 1:
        return ""
    if len(numbers) > width:
        stride = len(numbers) / width
        numbers = [numbers[int(i * stride)] for i in range(width - 1)] + [numbers[-1]]
    low, high = min(numbers), max(numbers)
    if high == low:
        return BLOCKS[len(BLOCKS) // 2] * len(numbers)
    scale = (len(BLOCKS) - 1) / (high - low)
    return "".join(BLOCKS[round((value - low) * scale)] for value in numbers)


def number(value, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def curve_lines(run: dict | None, pid=None, width: int = 40) -> list[str]:
    """status.yml's lines for one run (an entry of dflash.ct200.run_history with series): loss
    and tau as sparklines with their latest values, and the restarts of the launch with this PID."""
    if not run:
        return []
    series = run.get("series") or {}
    lines = []
    losses = [row[1] for row in series.get("train") or []]
    if losses:
        total = run.get("total_steps")
        lines.append(
            f"  loss     {sparkline(losses, width)} {number(run.get('last_loss'), 4)} "
            f"at step {run.get('last_step')}{f'/{total}' if total else ''}"
        )
    taus = [row[1] for row in series.get("eval") or []]
    if taus:
        lines.append(
            f"  tau/eval {sparkline(taus, width)} last {number(run.get('last_tau'), 3)}, "
            f"best {number(run.get('best_tau'), 3)} ({len(taus)} evaluation{'' if len(taus) == 1 else 's'})"
        )
    events = [e for e in run.get("events") or [] if pid is None or str(e.get("pid")) == str(pid)]
    restarts = [e for e in events if e.get("event") == "restart"]
    if restarts:
        last = restarts[-1]
        lines.append(
            f"  restarts {len(restarts)} (last at {last.get('time')}, step {last.get('step')}: "
            f"{last.get('reason')})"
        )
    shapes = stretches_text(run.get("stretches"))
    if shapes:
        lines.append(f"  workers  {shapes}")
    return lines


def stretches_text(stretches) -> str:
    """The worker count of each stretch of a run, as the run record's `stretches` give them:
    `2 worker threads from step 0, 1 worker thread from step 40`; "" where there are none."""
    words = []
    for stretch in stretches or []:
        if not isinstance(stretch, dict) or not isinstance(stretch.get("workers"), int):
            continue
        workers = stretch["workers"]
        unit = "torchrun rank" if stretch.get("topology") == "process" else "worker thread"
        hosts = stretch.get("hosts")
        on = f" on {hosts} hosts" if isinstance(hosts, int) and hosts > 1 else ""
        plural = "" if workers == 1 else "s"
        words.append(f"{workers} {unit}{plural}{on} from step {stretch.get('from_step', '?')}")
    return ", ".join(words)


class FilterModule:
    def filters(self):
        return {"sparkline": sparkline, "curve_lines": curve_lines}
