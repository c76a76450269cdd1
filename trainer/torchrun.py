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


def main() -> None:
    argv = sys.argv[1:]
    grace = shutdown_timeout(argv)
    first: list[int] = []

    def forward(signum: int) -> None:
        name = signal.Signals(signum).name
        if not first and not child_pids():
            # No rank running: not started yet (still in the rendezvous, e.g. waiting for a host
            # that never came), or all done (then torchrun may wait for the other hosts in its exit
            # barrier). Nothing to checkpoint, nobody to forward to: end now, not at a timeout.
            print(f"torchrun: {name} while no rank runs (rendezvous or exit barrier): exiting", flush=True)
            os._exit(128 + signum)
        send_to_children(signum)
        if not first:
            first.append(signum)
            print(f"torchrun: {name} forwarded to the ranks; waiting up to {grace:.0f}s", flush=True)
            timer = threading.Timer(grace, send_to_children, args=(signal.SIGKILL,))
            timer.daemon = True
            timer.start()

    watch_signals(OWN_SIGNALS, forward)
    # torchrun handles the other signals as usual; these two are ours (read by torchrun at start).
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGHUP,SIGQUIT"
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import main as torchrun_main

    argv = [arg for arg in argv if not arg.startswith("--signals-to-handle")]
    if "--shutdown-timeout" not in get_args_parser()._option_string_actions:
        # Older torchrun (torch 2.11 has none) refuses the option; the timer above keeps the grace.
        argv = without_option(argv, "--shutdown-timeout")
    torchrun_main([f"--signals-to-handle={os.environ['TORCHELASTIC_SIGNALS_TO_HANDLE']}", *argv])


if __name__ == "__main__":
    main()
