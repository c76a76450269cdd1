"""python -m trainer --run NAME [--config FILE] [--set key=value ...] [--out DIR] [--steps N]
[--seed S] [--resume] [--check] [--data-only]"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import sys
import traceback
from pathlib import Path

from .config import ConfigError, load_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="Train a DFlash drafter.")
    parser.add_argument("--run", required=True, help="run profile name (trainer/runs/<name>.yml)")
    parser.add_argument("--config", help="machine config YAML (model, data, parallel)")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one setting, e.g. train.lr=3e-4 (repeatable)",
    )
    parser.add_argument("--out", help="output directory (default runs/<run>)")
    parser.add_argument("--steps", type=int, help="shorthand for --set train.steps=N")
    parser.add_argument("--seed", type=int, help="shorthand for --set train.seed=S")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    parser.add_argument("--check", action="store_true", help="validate everything, print ok or every problem")
    parser.add_argument(
        "--data-only", action="store_true", help="prepare the data (regenerate it) and exit without training"
    )
    return parser.parse_args(argv)


def fail(problems: list[str]) -> int:
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr, flush=True)
    return 2


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        args.resume = True  # torchrun restarted the ranks after a crash (--max-restarts): resume
    from .run.environment import check_machine  # imports torch: after argparse so --help stays quick

    out_dir = Path(args.out or f"runs/{args.run}").expanduser().absolute()
    try:
        cfg = load_config(args.run, args.config, args.sets, args.steps, args.seed)
        # Preparing the data leaves checkpoints alone: an output holding some is no problem then.
        problems = check_machine(cfg, out_dir, args.resume or args.data_only)
    except ConfigError as exc:
        problems = exc.problems
        if exc.partial is not None:
            problems += [p for p in check_machine(exc.partial, out_dir, args.resume) if p not in problems]
        return fail(problems if args.check else problems[:1])
    if args.check:
        if problems:
            return fail(problems)
        print(f"ok: {cfg.run.name}", flush=True)
        return 0
    if problems:
        # A normal run names the first problem in one line (--check lists them all).
        return ended(out_dir, fail(problems[:1]), f"bad input: {problems[0]}")

    from .parallel.topology import WorkerFailed
    from .run.checkpoint import CheckpointWriteError
    from .run.train import BadInput, Diverged, train

    try:
        if args.data_only:
            from .regen import regenerate

            return regenerate(cfg, out_dir, None)
        return train(cfg, out_dir, args.resume)
    except Diverged as exc:
        return ended(out_dir, fail([f"diverged: {exc}"]), f"diverged: {exc}")
    except BadInput as exc:
        return ended(out_dir, fail([str(exc)]), f"bad input: {exc}")
    except CheckpointWriteError as exc:
        return ended(out_dir, error_line(str(exc)), str(exc))
    except WorkerFailed as exc:
        print(
            f"error: worker {exc.rank} failed; the run stopped. Its traceback:\n{exc.trace}",
            file=sys.stderr,
            flush=True,
        )
        return ended(out_dir, 1, f"crashed: worker {exc.rank} failed")
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            traceback.print_exc()
            return ended(out_dir, 1, f"crashed: {exc}")
        return ended(out_dir, error_line(disk_full(out_dir, exc)), disk_full(out_dir, exc))
    except Exception as exc:
        traceback.print_exc()
        return ended(out_dir, 1, f"crashed: {type(exc).__name__}: {exc}")


def disk_full(out_dir: Path, exc: OSError) -> str:
    """The full disk's line: what was being written, and what is kept."""
    from .data.chat import DiskFull
    from .run.runrecord import checkpoints

    if isinstance(exc, DiskFull):  # the data stage's, saying what of the data is kept
        return str(exc)
    intact = checkpoints(out_dir)
    last = f"{intact[-1][1]} (step {intact[-1][0]})" if intact else "none"
    return (
        f"disk full writing {exc.filename or out_dir}: {exc.strerror}; the last intact checkpoint is {last}"
    )


def error_line(message: str) -> int:
    """One `error: ...` line (the log may be on the full disk itself: then stderr is all there is); exit 1."""
    with contextlib.suppress(OSError):
        print(f"error: {message}", file=sys.stderr, flush=True)
    return 1


def ended(out_dir: Path, code: int, reason: str) -> int:
    """Note how the run ended in its record (trainer/run/runrecord.py): one process per host writes it."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        from .run.runrecord import note, utc_now

        state = "failed" if code == 2 else "crashed"
        note(out_dir, state=state, exit_status=code, exit_reason=reason, ended_at=utc_now())
    return code
