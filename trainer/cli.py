"""python -m trainer --run NAME [--config FILE] [--set key=value ...] [--out DIR] [--steps N]
[--seed S] [--resume] [--check] [--data-only]"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from .config import ConfigError, load_config
from .exits import ended, error_line, fail, guarded

__all__ = ["ended", "error_line", "fail", "main", "parse_args"]


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


def main(argv: list[str] | None = None, began: float | None = None) -> int:
    """`began`: time.perf_counter() at the process's entry (python -m trainer), where the startup
    breakdown counts from; this call's start otherwise."""
    began = time.perf_counter() if began is None else began
    args = parse_args(argv)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        args.resume = True  # torchrun restarted the ranks after a crash (--max-restarts): resume
    from .model.torch_log import quiet_repeated_torch_warnings
    from .run.environment import check_machine  # imports torch: after argparse so --help stays quick

    quiet_repeated_torch_warnings()

    out_dir = Path(args.out or f"runs/{args.run}").expanduser().absolute()
    checking = time.perf_counter()
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

    if args.data_only:
        from .regen import regenerate

        return guarded(out_dir, lambda: regenerate(cfg, out_dir, None))
    checked_s = time.perf_counter() - checking
    from .run.train import train

    return guarded(out_dir, lambda: train(cfg, out_dir, args.resume, began, checked_s))
