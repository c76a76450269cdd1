"""Wall times of the real-host path, side by side in one run, on a fresh test node.

    sudo .venv/bin/python tests/proxmox/measure.py      (from the checkout, after ./dev.sh setup)

provision from nothing (API create + passthrough + venv), provision again (no change), launch
nographs through pct_remote, then stop. The node is stopped at the end, also on failure.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from realhost import RealHostNode, missing_requirements


def main() -> int:
    why = missing_requirements()
    if why:
        print(f"measure: {why}", file=sys.stderr)
        return 2
    rows: list[tuple[str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="dflash-measure-") as work:
        started = time.monotonic()
        node = RealHostNode.start(Path("/run/dflash-testnode-measure"), Path(work))
        rows.append(("test node start (template cached)", time.monotonic() - started, ""))
        try:
            for label, playbook, extravars in (
                ("provision from nothing", "provision.yml", {}),
                ("provision again", "provision.yml", {}),
                ("launch nographs through pct_remote", "launch.yml", {"run": "nographs"}),
                ("stop (checkpoint)", "stop.yml", {}),
            ):
                result = node.play(playbook, extravars=extravars)
                if not result.ok:
                    problems = "\n".join(result.failure_messages())
                    print(f"measure: {label} failed:\n{problems}", file=sys.stderr)
                    return 1
                rows.append((label, result.seconds, f"changed={result.changed()}"))
        finally:
            node.stop()
    width = max(len(label) for label, _, _ in rows)
    for label, seconds, note in rows:
        print(f"{label:<{width}}  {seconds:7.1f} s  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
