"""python -m dflashctl {launch RUN | status | stop}: print the result as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from dflashctl.api import Controller, PlaybookFailed, Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dflashctl", description=__doc__)
    parser.add_argument("--inventory", help="inventory path (default: inventory/local)")
    parser.add_argument("--state-dir", help="controller state (default: .state of the checkout)")
    parser.add_argument("--limit", help="ansible-playbook --limit: only these hosts of group trainers")
    sub = parser.add_subparsers(dest="command", required=True)
    launch = sub.add_parser("launch", help="launch a run (playbooks/launch.yml)")
    launch.add_argument("run", help="run name, a profile in trainer/runs/")
    sub.add_parser("status", help="report the recorded run (playbooks/status.yml)")
    sub.add_parser("stop", help="stop the recorded run (playbooks/stop.yml)")
    args = parser.parse_args(argv)
    controller = Controller(Settings(inventory=args.inventory, state_dir=args.state_dir, limit=args.limit))
    try:
        if args.command == "launch":
            result = controller.launch(args.run)
        elif args.command == "status":
            result = controller.status()
        else:
            result = controller.stop()
    except PlaybookFailed as failure:
        print(failure, file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
