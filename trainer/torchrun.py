"""torchrun for the trainer: `python -m trainer.torchrun TORCHRUN ARGS` is torch.distributed.run
itself, except for what SIGTERM/SIGINT do.

Stock torchrun answers SIGTERM by forwarding it to the ranks, waiting --shutdown-timeout, then
raising SignalException: it exits non-zero with a traceback even when every rank checkpointed and
exited 0, so its log (which status.yml reads) says "crashed". Here SIGTERM/SIGINT are only
forwarded to the ranks (torchrun starts them in sessions of their own, so a signal to torchrun's
process group does not reach them), and torchrun's monitor sees them finish: exit 0 when every
rank exited 0 (stopped after the checkpoint), its usual failure report otherwise. Ranks still
alive --shutdown-timeout seconds after the first signal are killed, as torchrun would. A signal
that comes while no rank runs (a multi-host rendezvous still waiting for its hosts, or the exit
barrier waiting for the other hosts after this host's ranks finished) ends torchrun at once:
there is nothing to checkpoint.

Recovery: torchrun's own --max-restarts restarts every rank of this host after a rank crashed
(the ranks see TORCHELASTIC_RESTART_COUNT > 0 and resume from the newest checkpoint, see
trainer/cli.py), after --restart-backoff-s seconds (an option of this wrapper, not torchrun's).
Stock torchrun restarts after any failure; here a failure never restarts when it is bad input
(a rank exited 2) or comes after our stop signal (a rank killed at the end of the grace), so a
stop is for good. Node rank 0 records start, crash, restart, finish, stop and failed in
<out>/events.jsonl and sends the notices (trainer/run/events.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

OWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def child_pids() -> list[int]:
    """This process's children (the ranks), from /proc."""
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return pids


def send_to_children(signum: int) -> None:
    for pid in child_pids():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def shutdown_timeout(argv: list[str]) -> float:
    for i, arg in enumerate(argv):
        if arg.startswith("--shutdown-timeout="):
            return float(arg.split("=", 1)[1])
        if arg == "--shutdown-timeout" and i + 1 < len(argv):
            return float(argv[i + 1])
    return 30.0


def without_option(argv: list[str], option: str) -> list[str]:
    """argv less `option=value` or `option value`."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            kept.append(arg)
    return kept


def watch_signals(signals: tuple[signal.Signals, ...], act: Callable[[int], None]) -> None:
    """Call act(signum) for these signals from a thread of its own, as soon as they arrive.

    A Python signal handler runs in the main thread between bytecodes, and torchrun's main thread
    can sit in C++ for minutes: a multi-host rendezvous waits inside TCPStore until every host has
    joined or the rendezvous timeout passes, and a SIGTERM would wait just as long. The interpreter's
    own C-level handler still writes the signal number to the wakeup fd at once; this thread reads it.
    """
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    for sig in signals:
        signal.signal(sig, lambda _signum, _frame: None)  # a Python handler, so the wakeup fd is written
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    wanted = {int(sig) for sig in signals}

    def watch() -> None:
        while True:
            for signum in os.read(read_fd, 512):
                if signum in wanted:
                    act(signum)

    threading.Thread(target=watch, name="signal-watch", daemon=True).start()


def option_value(argv: list[str], option: str, default: str) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
    return default


def run_events(argv: list[str]):
    """The event log of this run on node rank 0 (where the run's output is), else None."""
    if int(option_value(argv, "--node-rank", "0")) != 0 or "--" not in argv:
        return None
    from .cli import parse_args as parse_trainer_args
    from .run.events import EventLog

    trainer_args = parse_trainer_args(argv[argv.index("--") + 1 :])
    out_dir = Path(trainer_args.out or f"runs/{trainer_args.run}").expanduser().absolute()
    return EventLog(out_dir, trainer_args.run)


def failed_ranks(run_result) -> str:
    """`rank 1 killed by SIGKILL, rank 0 exit status 1`: the failed ranks of torchrun's RunResult,
    ranks killed by a signal first (the others usually failed because that one vanished)."""
    from .run.events import describe_status

    failures = sorted(run_result.failures.items(), key=lambda item: (item[1].exitcode >= 0, item[0]))
    return ", ".join(f"rank {rank} {describe_status(f.exitcode)}" for rank, f in failures) or "a rank failed"


def decide_restarts(events, stopping: list[int], backoff_s: float) -> None:
    """Wrap torchrun's monitor so that a failure is recorded, and restarted only when it may be."""
    import time

    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers  # the agent torchrun runs

    def monitored(agent, worker_group):
        result = monitor(agent, worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return result
        max_restarts = worker_group.spec.max_restarts
        crashes = max_restarts - agent._remaining_restarts + 1
        what = failed_ranks(result)
        bad_input = any(failure.exitcode == 2 for failure in result.failures.values())
        if stopping or bad_input:
            agent._remaining_restarts = 0  # a stop is for good; bad input fails the same way again
        if events is None or stopping:
            return result
        if bad_input:
            events.record(
                "failed",
                f"bad input ({what})",
                exit_status=2,
                reason=f"bad input: {what}",
                restarts=crashes - 1,
            )
            return result
        events.record("crash", f"crashed ({what})", exit_status=1, reason=what, restarts=crashes - 1)
        if agent._remaining_restarts > 0:
            print(
                f"torchrun: {what}; restart {crashes}/{max_restarts} with --resume in {backoff_s:g}s",
                flush=True,
            )
            time.sleep(backoff_s)
            events.record(
                "restart",
                f"restart {crashes}/{max_restarts} with --resume after {what}",
                exit_status=1,
                reason=what,
                restarts=crashes,
            )
        elif max_restarts > 0:  # with none allowed, the crash itself is how the run ended
            why = f"crashed {crashes} time(s), more than recover_max_restarts={max_restarts} allows"
            why += f"; last: {what}"
            events.record("failed", why, exit_status=1, reason=why, restarts=crashes - 1)
        return result

    LocalElasticAgent._monitor_workers = monitored


def main() -> None:
    argv = sys.argv[1:]
    grace = shutdown_timeout(argv)
    backoff_s = float(option_value(argv, "--restart-backoff-s", "10"))
    argv = without_option(argv, "--restart-backoff-s")
    events = run_events(argv)
    first: list[int] = []  # the first stop signal, once one came
    watch_signals(OWN_SIGNALS, signal_forwarder(events, first, grace))
    # trainer.launch blocked them before exec (a stop in the first instant waits for the handler).
    signal.pthread_sigmask(signal.SIG_UNBLOCK, OWN_SIGNALS)
    # torchrun handles the other signals as usual; these two are ours (read by torchrun at start).
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import main as torchrun_main

    argv = [arg for arg in argv if not arg.startswith("--signals-to-handle")]
    if "--shutdown-timeout" not in get_args_parser()._option_string_actions:
        # Older torchrun (torch 2.11 has none) refuses the option; the timer above keeps the grace.
        argv = without_option(argv, "--shutdown-timeout")
    decide_restarts(events, first, backoff_s)
    if events is not None:
        events.record("start", "started under torchrun")
    try:
        torchrun_main([f"--signals-to-handle={os.environ['TORCHELASTIC_SIGNALS_TO_HANDLE']}", *argv])
    except BaseException as exc:
        record_failure(events, first, exc)
        raise
    if events is not None:
        if first:
            events.record("stop", f"stopped by {signal.Signals(first[0]).name}", exit_status=0)
        else:
            events.record("finish", "finished", exit_status=0)


def signal_forwarder(events, first: list[int], grace: float):
    """SIGTERM/SIGINT to every rank (SIGKILL after the grace); with no rank running, exit now."""

    def forward(signum: int) -> None:
        name = signal.Signals(signum).name
        if not first and not child_pids():
            # No rank running: not started yet (still in the rendezvous, e.g. waiting for a host
            # that never came), or all done (then torchrun may wait for the other hosts in its exit
            # barrier). Nothing to checkpoint, nobody to forward to: end now, not at a timeout.
            print(f"torchrun: {name} while no rank runs (rendezvous or exit barrier): exiting", flush=True)
            if events is not None:
                events.record("stop", f"stopped by {name} while no rank ran", exit_status=128 + signum)
            os._exit(128 + signum)
        send_to_children(signum)
        if not first:
            first.append(signum)
            print(f"torchrun: {name} forwarded to the ranks; waiting up to {grace:.0f}s", flush=True)
            timer = threading.Timer(grace, send_to_children, args=(signal.SIGKILL,))
            timer.daemon = True
            timer.start()

    return forward


def record_failure(events, first: list[int], exc: BaseException) -> None:
    """torchrun raised: a stop whose rank failed on its way out, or the run failed (unless the
    events already say how it ended)."""
    if events is None:
        return
    if first:
        events.record(
            "stop", f"stopped by {signal.Signals(first[0]).name}, a rank failed on its way out", exit_status=1
        )
    elif not isinstance(exc, KeyboardInterrupt) and events_end(events) is None:
        events.record(
            "failed", f"torchrun ended: {type(exc).__name__}", exit_status=1, reason=type(exc).__name__
        )


def events_end(events) -> dict | None:
    """The run's last event when it already says how the run ended (failed, crash), else None."""
    from .run.events import read_events

    recorded = read_events(events.out_dir)
    return recorded[-1] if recorded and recorded[-1]["event"] in ("failed", "crash") else None


if __name__ == "__main__":
    main()
