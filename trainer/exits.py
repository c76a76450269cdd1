"""How an entry point ends: `error: ...` lines on stderr, the exit status, and the reason noted in
the run record (trainer/run/runrecord.py). Shared by `python -m trainer` and `python -m
trainer.regen`, which import it, not each other."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path


def fail(problems: list[str]) -> int:
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr, flush=True)
    return 2


def error_line(message: str) -> int:
    """One `error: ...` line (the log may be on the full disk itself: then stderr is all there is); exit 1."""
    with contextlib.suppress(OSError):
        print(f"error: {message}", file=sys.stderr, flush=True)
    return 1


def ended(out_dir: Path, code: int, reason: str) -> int:
    """Note how the run ended in its record: one process per host writes it."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        from .run.runrecord import note, utc_now

        state = "failed" if code == 2 else "crashed"
        note(out_dir, state=state, exit_status=code, exit_reason=reason, ended_at=utc_now())
    return code


def guarded(out_dir: Path, body: Callable[[], int]) -> int:
    """body()'s exit status, or the status and record of what it raised: bad input 2, the rest 1."""
    from .data.regen_worker import RegenWorkerFailed
    from .parallel.topology import WorkerFailed
    from .run.checkpoint import CheckpointWriteError
    from .run.train import BadInput, Diverged

    try:
        return body()
    except Diverged as exc:
        return ended(out_dir, fail([f"diverged: {exc}"]), f"diverged: {exc}")
    except BadInput as exc:
        return ended(out_dir, fail([str(exc)]), f"bad input: {exc}")
    except (CheckpointWriteError, RegenWorkerFailed) as exc:
        return ended(out_dir, error_line(str(exc)), str(exc).split("\n", 1)[0])
    except WorkerFailed as exc:
        trace = f"error: worker {exc.rank} failed; the run stopped. Its traceback:\n{exc.trace}"
        print(trace, file=sys.stderr, flush=True)
        if exc.hint:
            return ended(out_dir, error_line(exc.hint), f"crashed: worker {exc.rank} failed: {exc.hint}")
        return ended(out_dir, 1, f"crashed: worker {exc.rank} failed")
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            traceback.print_exc()
            return ended(out_dir, 1, f"crashed: {exc}")
        return disk_full(out_dir, exc)
    except Exception as exc:
        traceback.print_exc()
        return ended(out_dir, 1, f"crashed: {type(exc).__name__}: {exc}")


def disk_full(out_dir: Path, exc: OSError) -> int:
    """The full disk's line (what was being written, and what is kept), recorded; exit 1."""
    from .data.chat import DiskFull
    from .run.runrecord import checkpoints

    if isinstance(exc, DiskFull):  # the data stage's, saying what of the data is kept
        return ended(out_dir, error_line(str(exc)), str(exc))
    intact = checkpoints(out_dir)
    last = f"{intact[-1][1]} (step {intact[-1][0]})" if intact else "none"
    where = exc.filename or out_dir
    message = f"disk full writing {where}: {exc.strerror}; the last intact checkpoint is {last}"
    return ended(out_dir, error_line(message), message)


def exit_process(code: int) -> None:
    """End the process with `code`. A rank under torchrun ends without the interpreter's teardown:
    its files are closed and its process group destroyed by then, and tearing down torch and gloo
    after that now and then aborted ("terminate called without an active exception", exit -6)
    when another rank had just exited; torchrun then reported a failed rank after a clean end, and
    the other hosts' torchruns waited for it in their exit barrier."""
    if all(name in os.environ for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")):
        checkpoint = sys.modules.get("trainer.run.checkpoint")
        if checkpoint is not None:
            checkpoint.wait_for_freeing()  # os._exit does not wait for the unlink of a pruned file
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
