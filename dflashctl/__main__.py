"""python -m dflashctl {launch RUN | status | stop | export} [--by-host]: print the result as JSON.
python -m dflashctl logs [--lines N] [--follow]: print the recorded run's log (and follow it).
python -m dflashctl runs [--run NAME] [--json]: the history of runs, a table (or JSON rows).
python -m dflashctl report RUN [RUN ...]: render their curves into one PNG, print its path.

`launch RUN [--resume | --fresh] [--steps N]`: continue the run's output, or start over (the
earlier output is moved aside, never deleted); --steps sets the run's step count (train.steps).

Without --by-host: the first host's result (the only host of a one-host inventory); with it:
{host: result} for every host of group trainers, in inventory order."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from dflashctl.api import Controller, PlaybookFailed, Settings


def left_running(state_dir, run: str, since: str) -> str:
    """What an interrupted launch or regen left running, from the ledger (the launch writes its line
    before it waits for the first progress line), and how to watch and stop it."""
    started = []
    try:
        lines = (Path(state_dir) / "runs.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(record, dict)
            and record.get("run") == run
            and str(record.get("started_at", "")) >= since
        ):
            started.append(record)
    how = "watch it with python -m dflashctl status, stop it with python -m dflashctl stop"
    if not started:
        return f"interrupted; a trainer it started, if any, is found by python -m dflashctl status ({how})"
    words = [
        f"{r.get('host')}: run {run} as PID {r.get('pid')}, log {r.get('log')}"
        for r in started
        if r.get("pid")
    ]
    return "interrupted; the trainer started keeps running: " + "; ".join(words) + f" ({how})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflashctl", description=__doc__)
    parser.add_argument("--inventory", help="inventory path (default: inventory/local)")
    parser.add_argument("--state-dir", help="controller state (default: .state of the checkout)")
    parser.add_argument("--limit", help="ansible-playbook --limit: only these hosts of group trainers")
    sub = parser.add_subparsers(dest="command", required=True)
    every = argparse.ArgumentParser(add_help=False)
    every.add_argument("--by-host", action="store_true", help="every host's result: {host: result}")
    launch = sub.add_parser("launch", parents=[every], help="launch a run (playbooks/launch.yml)")
    launch.add_argument("run", help="run name, a profile in trainer/runs/")
    launch.add_argument("--resume", action="store_true", help="continue the run from its checkpoint")
    launch.add_argument("--fresh", action="store_true", help="start over; the earlier output is moved aside")
    launch.add_argument("--steps", type=int, help="the run's step count (train.steps), e.g. with --resume")
    regen = sub.add_parser(
        "regen", parents=[every], help="prepare a run's data, no training (playbooks/regen.yml)"
    )
    regen.add_argument("run", help="run name, a profile in trainer/runs/")
    sub.add_parser("status", parents=[every], help="report the recorded run (playbooks/status.yml)")
    sub.add_parser("stop", parents=[every], help="stop the recorded run (playbooks/stop.yml)")
    export = sub.add_parser(
        "export", help="export a run's checkpoint to the DFlash format (playbooks/export.yml)"
    )
    export.add_argument("--run", help="the run to export (default: the recorded run)")
    export.add_argument("--step", type=int, help="the checkpoint's step (default: the newest valid one)")
    export.add_argument(
        "--dtype", choices=["bfloat16", "float16", "float32"], help="weights dtype (default bfloat16)"
    )
    export.add_argument(
        "--dest", help="where to put it on the controller (default: <state>/exports/<run_id>)"
    )
    logs = sub.add_parser("logs", help="print the recorded run's log (playbooks/logs.yml)")
    logs.add_argument("--lines", type=int, default=20, help="how many of the last lines (default 20)")
    logs.add_argument("--follow", action="store_true", help="then every new line until the trainer exits")
    runs = sub.add_parser("runs", help="the history of runs (playbooks/runs.yml)")
    runs.add_argument("--run", help="only this run's launches")
    runs.add_argument("--json", action="store_true", help="the rows as JSON instead of a table")
    report = sub.add_parser("report", help="one PNG of the runs' curves (playbooks/report.yml)")
    report.add_argument("runs", nargs="+", help="run names")
    args = parser.parse_args(argv)
    controller = Controller(Settings(inventory=args.inventory, state_dir=args.state_dir, limit=args.limit))
    began = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        if args.command == "logs":
            try:
                for line in controller.logs(lines=args.lines, follow=args.follow):
                    print(line, flush=True)
            except KeyboardInterrupt:
                print(
                    "interrupted; the run itself is not affected (python -m dflashctl status)",
                    file=sys.stderr,
                )
                return 130
            return 0
        if args.command == "runs" and not args.json:
            print("\n".join(controller.runs_table(run=args.run)))
            return 0
        if args.command == "runs":
            result = controller.runs(run=args.run)
        elif args.command == "report":
            result = controller.report(args.runs)
            print(result["path"])
            return 0
        elif args.command == "launch":
            extravars: dict = {key: True for key in ("resume", "fresh") if getattr(args, key)}
            if args.steps is not None:
                extravars["steps"] = args.steps
            launch_run = controller.launch_by_host if args.by_host else controller.launch
            result = launch_run(args.run, **extravars)
        elif args.command == "regen":
            result = controller.regen_by_host(args.run) if args.by_host else controller.regen(args.run)
        elif args.command == "status":
            result = controller.status_by_host() if args.by_host else controller.status()
        elif args.command == "export":
            result = controller.export(run=args.run, step=args.step, dest=args.dest, dtype=args.dtype)
        else:
            result = controller.stop_by_host() if args.by_host else controller.stop()
    except PlaybookFailed as failure:
        print(failure, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.command in ("launch", "regen"):
            print(left_running(controller.settings.state_dir, args.run, began), file=sys.stderr)
        return 130
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
