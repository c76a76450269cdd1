"""Start a run the way its profile says: `python -m trainer.launch [TORCHRUN OPTIONS] -- TRAINER ARGS`.

run.topology threaded: exec `python -m trainer.supervise ... -m trainer -- TRAINER ARGS`, which
runs the trainer as its child and restarts it after a crash (--max-restarts, trainer/supervise.py).
run.topology process: exec torchrun
(`python -m trainer.torchrun`: torch.distributed.run, the `torchrun` script's program, with SIGTERM
handled so that a clean stop exits 0) with one process per device of this host: its GPUs
(parallel.devices), or parallel.cpu_workers on CPU. One host:
`--standalone`; several hosts: `--nnodes M --node-rank R --rdzv-endpoint HOST:PORT --rdzv-id ID`,
one launch per host, the same endpoint and id on every host. The rendezvous is torchrun's static
one: the host of node rank 0 serves it at HOST:PORT, so HOST must be that host's address, and the
global ranks follow the node ranks (rank 0, which alone writes the run's output and checkpoints,
is always on node rank 0). torchrun's dynamic c10d rendezvous would ignore --node-rank and order
the hosts by name and process id instead, putting rank 0 (and the checkpoints) on any host.
Every host waits at most parallel.rendezvous_timeout_s for the others to join.

exec keeps the PID, so what a caller recorded (run.sh's PID, Ansible's fact) is torchrun itself:
the process group leader, which forwards SIGTERM/SIGINT to every rank. torchrun waits
parallel.shutdown_timeout_s for the ranks after forwarding (rank 0 checkpoints meanwhile), then
kills them. The trainer arguments go after `--`: torchrun's own parser would otherwise take the
trainer's `--run` for an abbreviation of its `--run-path`.

The config is resolved here first (profile, machine config, --set), so bad settings fail before any
process starts; the machine checks (paths, devices) run in every rank as in `python -m trainer`.
No torch import here (it takes seconds; launch.yml waits only briefly for the exec chain): GPUs are
counted from parallel.devices, CUDA_VISIBLE_DEVICES or the /dev/nvidiaN device nodes.
`--dry-run` prints the command instead of running it.

Before it execs, it takes the output's lock and writes the run record (trainer/run/runrecord.py): a
second start on the same --out fails here at once (exit 2), naming the PID that holds it; the lock's
file descriptor is inherited across exec, so it lives exactly as long as the trainer (or torchrun).
Temporary files a killed checkpoint save left behind are removed then, under the lock.
`--check` (run.sh --check) only validates: no lock, no record.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import sys
from pathlib import Path

from .cli import fail
from .cli import parse_args as parse_trainer_args
from .run import runrecord
from .run.events import RUN_ID_ENV

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


USAGE = (
    "python -m trainer.launch [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT --rdzv-id ID] "
    "[--nproc-per-node N] [--max-restarts N] [--restart-backoff-s S] [--dry-run] -- --run NAME "
    "[trainer options]"
)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.launch", usage=USAGE, description=__doc__.split("\n")[0]
    )
    parser.add_argument("--nnodes", type=int, default=1, help="hosts in the run (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this host's rank, 0..nnodes-1")
    parser.add_argument(
        "--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous, served by node rank 0 (nnodes > 1)"
    )
    parser.add_argument("--rdzv-id", default="", help="a run id every host of the run shares (nnodes > 1)")
    parser.add_argument("--nproc-per-node", type=int, default=0, help="processes on this host (0: auto)")
    parser.add_argument(
        "--max-restarts", type=int, default=0, help="restarts with --resume after a crash (default 0)"
    )
    parser.add_argument("--restart-backoff-s", type=float, default=10.0, help="wait before a restart")
    parser.add_argument("--dry-run", action="store_true", help="print the command, start nothing")
    if "--" not in argv:
        if "-h" in argv or "--help" in argv:
            parser.parse_args(["--help"])  # prints the help, exits 0
        raise SystemExit(f"usage: {USAGE}")
    split = argv.index("--")
    return parser.parse_args(argv[:split]), argv[split + 1 :]


def gpus_on_this_host(devices: str) -> int:
    """The GPUs parallel.devices means here, counted without CUDA: a list names them; auto means
    every visible one (CUDA_VISIBLE_DEVICES if set, else the /dev/nvidiaN nodes); cpu none."""
    devices = devices.strip()
    if devices == "cpu":
        return 0
    if devices != "auto":
        return len([name for name in devices.split(",") if name.strip().startswith("cuda")])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([name for name in visible.split(",") if name.strip() and name.strip() != "-1"])
    return len([node for node in Path("/dev").glob("nvidia[0-9]*") if node.name[6:].isdigit()])


def workers_on_this_host(cfg) -> int:
    """One process per GPU of parallel.devices; parallel.cpu_workers where there is none."""
    return gpus_on_this_host(cfg.parallel.devices) or cfg.parallel.cpu_workers


ENDPOINT_RE = re.compile(r"^(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9._-]*):([0-9]{1,5})$")


def endpoint_problem(endpoint: str) -> str | None:
    """Why `endpoint` is not HOST:PORT (port 1..65535), or None."""
    match = ENDPOINT_RE.match(endpoint)
    if match and 1 <= int(match.group(1)) <= 65535:
        return None
    return f"--rdzv-endpoint {endpoint!r} must be HOST:PORT (an address of node rank 0's host, port 1..65535)"


def command(launch: argparse.Namespace, trainer_argv: list[str], cfg) -> list[str]:
    if cfg.run.topology == "threaded":
        # The supervisor (trainer/supervise.py) runs the trainer as its child: it records how the
        # run goes in <out>/events.jsonl, sends the notices and restarts a crashed trainer.
        supervise = [
            sys.executable,
            "-m",
            "trainer.supervise",
            f"--max-restarts={launch.max_restarts}",
            f"--backoff-s={launch.restart_backoff_s:g}",
            "-m",
            "trainer",
            "--",
        ]
        return [*supervise, *trainer_argv]
    nproc = launch.nproc_per_node or workers_on_this_host(cfg)
    torchrun = [sys.executable, "-m", "trainer.torchrun"]
    if launch.nnodes == 1:
        torchrun.append("--standalone")
    else:
        torchrun += [
            f"--nnodes={launch.nnodes}",
            f"--node-rank={launch.node_rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={launch.rdzv_endpoint}",
            f"--rdzv-id={launch.rdzv_id}",
            f"--rdzv-conf=timeout={cfg.parallel.rendezvous_timeout_s}",
        ]
    torchrun += [
        f"--nproc-per-node={nproc}",
        f"--max-restarts={launch.max_restarts}",
        f"--restart-backoff-s={launch.restart_backoff_s:g}",
        f"--shutdown-timeout={cfg.parallel.shutdown_timeout_s}",
        "-m",
        "trainer",
        "--",
    ]
    return [*torchrun, *trainer_argv]


def main(argv: list[str] | None = None) -> int:
    launch, trainer_argv = parse_args(sys.argv[1:] if argv is None else argv)
    problems = []
    if launch.nnodes < 1 or not 0 <= launch.node_rank < launch.nnodes:
        problems.append(f"--node-rank {launch.node_rank} must be in 0..{launch.nnodes - 1} (--nnodes)")
    if launch.nnodes > 1 and (not launch.rdzv_endpoint or not launch.rdzv_id):
        problems.append("--nnodes > 1 needs --rdzv-endpoint HOST:PORT and --rdzv-id (the same on every host)")
    elif launch.nnodes > 1 and (problem := endpoint_problem(launch.rdzv_endpoint)):
        problems.append(problem)
    if launch.max_restarts < 0:
        problems.append(f"--max-restarts (recover_max_restarts) must not be negative: {launch.max_restarts}")
    if launch.restart_backoff_s < 0:
        problems.append(f"--restart-backoff-s must not be negative, got {launch.restart_backoff_s}")
    if launch.nproc_per_node < 0:
        problems.append(f"--nproc-per-node must not be negative, got {launch.nproc_per_node}")
    args = parse_trainer_args(trainer_argv)
    from .config import ConfigError, load_config

    try:
        cfg = load_config(args.run, args.config, args.sets, args.steps, args.seed)
    except ConfigError as exc:
        return fail(problems + exc.problems)
    if problems:
        return fail(problems)
    cmd = command(launch, trainer_argv, cfg)
    if launch.dry_run:
        print(shlex.join(cmd), flush=True)
        return 0
    if not args.check:
        out = Path(args.out or f"runs/{args.run}").expanduser().absolute()
        # From the moment the record names this PID a stop may come; blocked (the mask survives
        # exec) it waits until the supervisor or torchrun has its handler, which then closes the
        # record. Unblocked, it would kill the process before Python installs any handler.
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            record = take_output(out, cfg, args, cmd)
            # The events and notices of the run carry the record's own run id (trainer/run/events.py).
            os.environ[RUN_ID_ENV] = record["run_id"]
        except runrecord.OutputBusy as exc:
            return fail([str(exc)])
        except OSError as exc:
            print(
                f"error: cannot record the run in {out}: {exc}; nothing was started",
                file=sys.stderr,
                flush=True,
            )
            return 1
    sys.stdout.flush()
    os.execv(cmd[0], cmd)
    return 1  # not reached: exec replaces this process


def log_of_this_process() -> str | None:
    """Where stdout goes (the run's log, as the starter opened it), or None for a terminal or pipe."""
    try:
        target = os.readlink("/proc/self/fd/1")
    except OSError:
        return None
    return target if target.startswith("/") and not target.startswith("/dev/") else None


def metrics_size(out: Path) -> int:
    try:
        return (out / "metrics.jsonl").stat().st_size
    except OSError:
        return 0


def take_output(out: Path, cfg, args: argparse.Namespace, cmd: list[str]) -> dict:
    """Lock the output for this process's life (and its exec's), clear a killed save's temporary
    files, and write the run record before the trainer starts. Raises OutputBusy or OSError."""
    inherited = os.environ.pop(runrecord.LOCK_FD_ENV, None)
    runrecord.acquire_lock(out, int(inherited) if inherited and inherited.isdigit() else None)
    for leftover in list((out / "checkpoints").glob(".step_*.tmp")) + list(out.glob(".run.json.*.tmp")):
        leftover.unlink(missing_ok=True)
        print(f"removed {leftover} (left by a save that was killed)", flush=True)
    pid = os.getpid()
    record = {
        "format": runrecord.RECORD_FORMAT,
        "run": cfg.run.name,
        "run_id": runrecord.new_run_id(cfg.run.name, pid),
        "pid": pid,
        "start_time": runrecord.proc_start_time(pid),
        "boot_id": runrecord.boot_id(),
        "host": os.uname().nodename,
        "out": str(out),
        "log": log_of_this_process(),
        "started_at": runrecord.utc_now(),
        "steps": cfg.train.steps,
        "topology": cfg.run.topology,
        "resume": bool(args.resume),
        "cmdline": cmd,
        "state": "running",
        "restarts": [],
        # Where this start's rows of metrics.jsonl begin (a resume appends to the run's file): the
        # history tells this start's figures from the earlier starts' by it.
        "metrics_from": metrics_size(out),
    }
    earlier = runrecord.read_record(out) if args.resume else None
    if earlier and isinstance(earlier.get("stretches"), list):
        # What status shows until the trainer, once its checkpoint is restored, writes the stretches
        # anew (from the checkpoint, with this start's): a data stage may come first and take hours.
        record["stretches"] = earlier["stretches"]
    runrecord.write_record(out, record)
    runrecord.reserve_space(out)  # so that the record can say how the run ended on a full disk
    return record


if __name__ == "__main__":
    sys.exit(main())
