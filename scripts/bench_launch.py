"""Time launch.yml (up to the recorded PID), status.yml and stop.yml next to a bare nohup start.

    python scripts/bench_launch.py [--run nographs] [--rounds 3]

Every round, on the local default inventory with its own temporary state:
  launch   ansible-playbook playbooks/launch.yml -e run=RUN -e run_wait_enabled=false
           (validation, preflight, sync, templates, detached start, PID check, facts, ledger;
           not the trainer's own warm-up)
  status   ansible-playbook playbooks/status.yml (while that trainer runs)
  stop     ansible-playbook playbooks/stop.yml (includes the trainer's checkpoint and exit)
  bare     sh -c 'nohup <workspace>/run.sh > <log> 2>&1 & echo $!': a start by hand, with no
           checks and no record (and here without an ssh/pct hop), then that PID is stopped
           with SIGTERM.
Round 1 syncs into an empty workspace (cold); later rounds find it in place (warm).
Prints one line per measurement and the medians.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(
            f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
        )
    return elapsed, done.stdout


def stop_pid(pid: int, timeout: float = 120.0) -> None:
    """Stop a trainer this script started, by its PID, and wait until it is gone."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", default="nographs")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not 1 <= args.rounds <= 20:
        sys.exit("--rounds must be between 1 and 20")

    bin_dir = str(Path(sys.executable).parent)
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:
        state = Path(tmp) / "state"
        env = {
            **os.environ,
            "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
            "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"),
            "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(state / "facts"),
        }
        playbook = [f"{bin_dir}/ansible-playbook", "-e", f"dflash_state_dir={state}"]
        workspace = state / "workspace"
        times: dict[str, list[float]] = {"launch": [], "status": [], "stop": [], "bare": []}
        for round_no in range(1, args.rounds + 1):
            label = "cold" if round_no == 1 else "warm"
            launch_s, _ = timed(
                [*playbook, "playbooks/launch.yml", "-e", f"run={args.run}", "-e", "run_wait_enabled=false"],
                env,
            )
            status_s, _ = timed([*playbook, "playbooks/status.yml"], env)
            stop_s, _ = timed([*playbook, "playbooks/stop.yml"], env)
            log = workspace / "train_bare.log"
            started = time.perf_counter()
            out = subprocess.run(
                ["/bin/sh", "-c", 'nohup "$0" > "$1" 2>&1 & echo $!', str(workspace / "run.sh"), str(log)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            bare_s = time.perf_counter() - started
            stop_pid(int(out.strip()))
            if round_no > 1:
                times["launch"].append(launch_s)
            times["status"].append(status_s)
            times["stop"].append(stop_s)
            times["bare"].append(bare_s)
            print(
                f"round {round_no} ({label}): launch {launch_s:.2f} s  status {status_s:.2f} s  "
                f"stop {stop_s:.2f} s  bare start {bare_s:.3f} s",
                flush=True,
            )
        print(f"cpus {os.cpu_count()}, load average {os.getloadavg()[0]:.2f}")
        for name, values in times.items():
            if values:
                print(f"median {name:9s} {statistics.median(values):6.2f} s  over {len(values)} round(s)")
        if times["launch"]:
            gap = statistics.median(times["launch"]) - statistics.median(times["bare"])
            print(f"launch.yml minus bare start (warm medians): {gap:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
