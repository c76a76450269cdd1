"""Where a run's lines and metrics go, by rank.

Rank 0 writes the run's files (`FileOutput`: stdout and `<out>/train.log`, `<out>/metrics.jsonl`).
In the process topology on several hosts, local rank 0 of every other host prints the same lines to
its stdout, which is that host's run log (`ConsoleOutput`: launch.yml waits for its progress line);
the values in them are global ones (losses and token counts summed over every rank, rank 0's tau),
so every host's log shows the same numbers. Every other rank is silent (`SilentOutput`).
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

from ..config import Config, dump_config
from .runrecord import note


class SilentOutput:
    """Lines and metrics go nowhere (ranks other than the first of each host)."""

    def line(self, text: str) -> None:
        pass

    def metric(self, row: dict[str, Any]) -> None:
        pass

    def close(self, stopped: bool = False) -> None:
        pass


class ConsoleOutput(SilentOutput):
    """Lines to stdout only (the first rank of a host other than rank 0's)."""

    def __init__(self):
        self.lock = threading.Lock()  # workers log their compile lines from their own threads

    def line(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)


class FileOutput(ConsoleOutput):
    """Lines to stdout and <out>/train.log, flushed line by line; rows of <out>/metrics.jsonl, and
    with tensorboard the same scalars as TensorBoard event files under <out>/tensorboard; with
    mlflow or wandb in log.report_to, rows and events to those trackers too (trackers.py)."""

    def __init__(self, out_dir: Path, cfg: Config | None = None):
        super().__init__()
        self.out_dir = out_dir  # the data stage notes its progress in the run's record there
        wanted = cfg.log.trackers() if cfg is not None else []
        self.board = open_board(out_dir / "tensorboard") if "tensorboard" in wanted else None
        self.log_file: TextIO = (out_dir / "train.log").open("a")
        self.metrics: TextIO = (out_dir / "metrics.jsonl").open("a")
        self.trackers = None
        if any(name != "tensorboard" for name in wanted):
            from .trackers import Trackers

            self.trackers = Trackers(wanted, out_dir, cfg.to_dict(), self.line)

    def line(self, text: str) -> None:
        with self.lock:
            print(text, flush=True)
            if not self.log_file.closed:  # a library's thread may still speak after the end
                self.log_file.write(text + "\n")
                self.log_file.flush()

    def metric(self, row: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        if self.board is not None:
            for key, value in row.items():
                if key not in ("kind", "step") and isinstance(value, (int, float)):
                    self.board.add_scalar(f"{row['kind']}/{key}", value, row["step"])
            self.board.flush()
        if self.trackers is not None:
            self.trackers.metric(row)

    def note_exiting(self, what: str) -> None:
        note(self.out_dir, stage="exiting", exiting=what)

    def close(self, stopped: bool = False) -> None:
        """stopped: the run ends on a stop signal (else it finished, or crashed where an exception
        is on its way out): what the trackers are told. While the run waits for them, its record
        says `stage: exiting` (status: `exiting`)."""
        if self.trackers is not None:
            error = sys.exc_info()[1]
            crashed = f"crashed: {type(error).__name__}: {error}" if error is not None else ""
            outcome = crashed or ("stopped" if stopped else "finished")
            self.trackers.close(outcome, waiting=self.note_exiting)
        self.log_file.close()
        self.metrics.close()
        if self.board is not None:
            self.board.close()


def open_board(directory: Path):
    """A TensorBoard writer (tensorboard in log.report_to, or log.tensorboard: true), or bad input
    where the package is missing: TensorBoard's files are part of the run's output, not a service."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        from .resume import BadInput

        raise BadInput(
            "log.report_to names tensorboard (or log.tensorboard is true) but the tensorboard package "
            "is missing: install it (pip install tensorboard==2.21.0) or leave tensorboard out"
        ) from None
    return SummaryWriter(str(directory))


Output = SilentOutput | ConsoleOutput | FileOutput


def open_output(cfg: Config, out_dir: Path, writes_files: bool, prints_lines: bool) -> Output:
    """This rank's output; the rank that writes files also writes <out>/config.yml first."""
    if writes_files:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.yml").write_text(dump_config(cfg))
        return FileOutput(out_dir, cfg)
    return ConsoleOutput() if prints_lines else SilentOutput()
