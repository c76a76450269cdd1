"""python -m trainer.regen --run NAME [--config FILE] [--set KEY=VALUE]... [--out FILE] [--dir DIR]

Regenerate the run's data set (the same profile, machine config and overrides as `python -m
trainer`) into the cache, every device its share, resumable: a stop (SIGTERM/SIGINT) or a crash
keeps the finished shards and the next start continues. The trainer then finds it there. With
--out, also write the whole regenerated data set, in the input's order, as chat JSONL. Under
torchrun (run.topology: process) every rank regenerates its shards.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .config import ConfigError, load_config
from .exits import error_line, exit_process, fail


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.regen", description=__doc__.split("\n\n")[1])
    parser.add_argument("--run", required=True, help="run profile name (trainer/runs/<name>.yml)")
    parser.add_argument("--config", help="machine config YAML (model, data, parallel)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="override one setting, e.g. data.regen_engine=continuous")  # fmt: skip
    parser.add_argument("--out", help="also write the regenerated data set here as chat JSONL")
    parser.add_argument("--dir", help="the run's output directory for events.jsonl (default runs/<run>)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from .model.torch_log import quiet_repeated_torch_warnings
    from .run.environment import check_machine

    quiet_repeated_torch_warnings()

    try:
        cfg = load_config(args.run, args.config, args.sets, None, None)
    except ConfigError as exc:
        return fail(exc.problems[:1])
    problems = check_machine(cfg, None, False)
    if not problems and args.out and not cfg.data.regenerate:
        problems = ["--out with data.regenerate=false: the data file is already the data set to train on"]
    if args.out and Path(args.out).is_dir():
        problems.append(f"--out {args.out} is a directory; give a file name for the chat JSONL")
    if problems:
        return fail(problems[:1])
    from .data.chat import DiskFull
    from .data.regen_worker import RegenWorkerFailed
    from .run.resume import BadInput

    run_dir = Path(args.dir or f"runs/{args.run}").expanduser().absolute()
    try:
        return regenerate(cfg, run_dir, Path(args.out).expanduser() if args.out else None)
    except BadInput as exc:
        return fail([str(exc)])
    except RegenWorkerFailed as exc:
        return error_line(str(exc))
    except DiskFull as exc:  # a crash, as a full disk while training (exit status 1), in one line
        fail([str(exc)])
        return 1


def regenerate(cfg, run_dir: Path, chat_out: Path | None) -> int:
    from .data.chat import DataError
    from .data.regen import export_chat_jsonl
    from .run.resume import BadInput
    from .run.train import StopFlag

    world, devices = world_and_devices(cfg)
    out = output_of(world, run_dir)
    stop = StopFlag()
    stop.install()
    try:
        prepared, tokenizer = prepare(cfg, world, devices, out, stop)
        if prepared is None:
            out.line("stopped: run the same command again to continue")
            ended(world, run_dir, "stopped", "stopped during the regeneration; the finished shards are kept")
            return 0
        if chat_out is not None and world.is_lead:
            examples = prepared.regeneration.examples()
            try:
                count = export_chat_jsonl(prepared.index, examples, tokenizer, chat_out)
            except DataError as exc:  # a damaged shard, or the data file changed: named, never a traceback
                raise BadInput(str(exc)) from None
            out.line(f"data: wrote {count:,} regenerated conversations to {chat_out}")
        world.any(False)  # no rank leaves before the file is written
        reason = f"data ready: {len(prepared.index):,} conversations (key {prepared.key})"
        ended(world, run_dir, "finished", reason)
        return 0
    finally:
        stop.uninstall(ignore_late_signals=cfg.run.topology == "process" and launched_by_torchrun())
        world.close()


def launched_by_torchrun() -> bool:
    from .parallel.process import launched_by_torchrun as under_torchrun

    return under_torchrun()


def world_and_devices(cfg):
    """(this process's place among the ranks, its devices): under torchrun its rank's device; else
    every device of parallel.devices (a CPU counted parallel.cpu_workers times)."""
    import torch

    from .parallel.process import ProcessSetupError, ProcessWorld
    from .parallel.topology import ThreadedWorld
    from .run.environment import resolve_devices
    from .run.resume import BadInput

    devices = resolve_devices(cfg.parallel.devices)
    if cfg.parallel.cpu_threads:
        torch.set_num_threads(cfg.parallel.cpu_threads)
    if cfg.run.topology == "process" and launched_by_torchrun():
        try:
            world = ProcessWorld(devices, cfg.parallel.step_timeout_s)
        except ProcessSetupError as exc:
            raise BadInput(str(exc)) from None
        return world, [world.device]
    if devices == [torch.device("cpu")]:
        devices = devices * cfg.parallel.cpu_workers
    return ThreadedWorld(), devices


def output_of(world, run_dir: Path):
    from .run.sinks import ConsoleOutput, SilentOutput

    out = ConsoleOutput() if world.local_rank == 0 else SilentOutput()
    out.out_dir = run_dir if world.is_lead else None
    if world.is_lead:
        run_dir.mkdir(parents=True, exist_ok=True)
    return out


def prepare(cfg, world, devices, out, stop):
    """(the prepared data or None after a stop, the tokenizer). A worker in this process loads the
    target itself; several devices each get a worker process that does."""
    from .data.chat import ChatFormat
    from .model.target import load_tokenizer
    from .run.regen import DataSource, Engines, prepare_data
    from .run.train import target_and_data_paths

    target_path, train_file = target_and_data_paths(cfg, world)
    tokenizer_path = Path(cfg.model.tokenizer_path).expanduser() if cfg.model.tokenizer_path else target_path
    tokenizer = load_tokenizer(tokenizer_path)
    source = DataSource(train_file, target_path, tokenizer_path, tokenizer, ChatFormat(tokenizer))
    engines = Engines(devices, target_path, cfg.model.dtype)
    return prepare_data(cfg, source, engines, world, out, stop, out.out_dir), tokenizer


def ended(world, run_dir: Path, state: str, reason: str) -> None:
    """Close the run record of a launched data preparation (./dev.sh regen): a stop or the end."""
    if world.local_rank == 0:
        from .run.runrecord import note, utc_now

        note(run_dir, state=state, exit_status=0, exit_reason=reason, ended_at=utc_now())


if __name__ == "__main__":
    exit_process(main())  # under torchrun: without the interpreter's teardown (trainer.exits)
