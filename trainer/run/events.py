"""How a run went, as structured lines: `<out>/events.jsonl`, and a notice for each event.

One JSON object per line: `{"time", "event", "run", "run_id", "host", "exit_status", "step",
"tau", "restarts", "reason", "text"}` with event one of start, restart, crash, finish, stop, failed.
The process that watches the trainer writes them (the supervisor in the threaded topology,
trainer.torchrun in the process topology): it is the one that sees how the trainer ended, even a
SIGKILL that leaves the trainer no time to say anything. status, history and the notices read
these lines, not the log, which is for people.

Notices: when the file named by DFLASH_NOTIFY_URL_FILE (mode 0600, written by the workspace role)
holds a URL, every event is also POSTed there as JSON (run, run_id, host, event, exit_status,
step, tau, text). The URL may carry credentials (user:pass@ or a token in its path or query):
it never appears in a log line or a command line; a notice that fails is one log line and
changes nothing about the run.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import signal
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from .runrecord import jsonl_rows

EVENTS_FILE = "events.jsonl"
NOTIFY_URL_FILE_ENV = "DFLASH_NOTIFY_URL_FILE"
RUN_ID_ENV = "DFLASH_RUN_ID"
HOST_ENV = "DFLASH_HOST"
NOTICE_TIMEOUT_S = 5.0
NOTICE_FIELDS = ("run", "run_id", "host", "event", "exit_status", "step", "tau", "text")


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def default_run_id(run: str, pid: int) -> str:
    """The id launch.yml gives a run (<run>-<UTC start>-<pid>) when none is passed in the environment."""
    return f"{run}-{datetime.datetime.now(datetime.UTC).strftime('%Y%m%dT%H%M%SZ')}-{pid}"


def progress(out_dir: Path) -> tuple[int | None, float | None]:
    """The last logged step and the last tau in <out>/metrics.jsonl (None where there is none)."""
    step = tau = None
    for row in jsonl_rows(out_dir / "metrics.jsonl"):
        if row.get("kind") == "train" and isinstance(row.get("step"), int):
            step = row["step"]
        elif row.get("kind") == "eval" and isinstance(row.get("tau"), (int, float)):
            tau = float(row["tau"])
            if step is None or row.get("step", 0) > step:
                step = row.get("step", step)
    return step, tau


def read_events(out_dir: Path) -> list[dict]:
    """Every well-formed event of <out>/events.jsonl, oldest first ([] where there is none)."""
    return [row for row in jsonl_rows(out_dir / EVENTS_FILE) if "event" in row]


def describe_status(status: int) -> str:
    """A subprocess return code in words: `exit status 1` or `killed by SIGKILL`."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exit status {status}"


def read_notify_url() -> str | None:
    path = os.environ.get(NOTIFY_URL_FILE_ENV)
    if not path:
        return None
    try:
        url = Path(path).read_text().strip()
    except OSError as exc:
        print(f"notice: cannot read the notice URL file {path}: {exc.strerror}", file=sys.stderr, flush=True)
        return None
    return url or None


def post_notice(url: str, payload: dict, timeout: float = NOTICE_TIMEOUT_S) -> str | None:
    """POST payload as JSON; None on success, else why not, in words that never contain the URL."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # a port out of range raises here, not at the split
    except ValueError as exc:
        # urllib's messages quote no URL, but a port's text is the user's: say what is wrong only.
        what = "port out of range" if "Port" in str(exc) else "cannot be parsed"
        return f"the notice URL is not valid ({what})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "the notice URL is not an http(s) URL"
    headers = {"Content-Type": "application/json", "User-Agent": "dflash-trainer"}
    if parts.username is not None:
        # urllib does not use credentials in the URL itself: send them as Basic auth and take them
        # out of the URL, so no error message can ever quote them.
        userinfo = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(userinfo.encode()).decode()
        netloc = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        if port:
            netloc += f":{port}"
        url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))
    request = urllib.request.Request(url, data=json.dumps(payload).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read(4096)
        return None
    except urllib.error.HTTPError as exc:
        return f"the server answered HTTP {exc.code}"
    except urllib.error.URLError as exc:
        reason = exc.reason
        return f"{type(reason).__name__}: {getattr(reason, 'strerror', None) or 'no connection'}"
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}"


def process_identity() -> dict:
    """This process's start time (field 22 of /proc/self/stat) and the boot id: with the PID they
    identify it even after the PID is reused (what the launch records too)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return {}
    return {"start_time": int(stat[stat.rindex(")") + 2 :].split()[19]), "boot_id": boot_id}


class EventLog:
    """Appends events of one run to <out>/events.jsonl and sends its notices."""

    def __init__(
        self, out_dir: Path, run: str, run_id: str | None = None, notify_url: str | None = None,
        pid: int | None = None,
    ):  # fmt: skip
        """pid: the launch's PID the events belong to (history groups them by it), when not this
        process's: the trainer's data stage writes under its supervisor's or torchrun's."""
        self.pid = pid or os.getpid()
        self.out_dir = out_dir
        self.run = run
        self.run_id = run_id or os.environ.get(RUN_ID_ENV) or default_run_id(run, os.getpid())
        # The inventory's name for this host where the launch gave it (run.sh), as the docs show it.
        self.host = os.environ.get(HOST_ENV) or socket.gethostname()
        self.notify_url = notify_url if notify_url is not None else read_notify_url()
        self.identity = process_identity()

    def record(
        self,
        event: str,
        text: str,
        exit_status: int | None = None,
        reason: str | None = None,
        restarts: int = 0,
    ) -> dict:
        step, tau = progress(self.out_dir)
        step = self.checkpointed_step(step)
        row = {
            "time": utc_now(),
            "event": event,
            "run": self.run,
            "run_id": self.run_id,
            "host": self.host,
            "pid": self.pid,
            "exit_status": exit_status,
            "step": step,
            "tau": tau,
            "restarts": restarts,
            "reason": reason,
            "text": f"{self.run} on {self.host}: {text}",
        }
        if event == "start":
            row.update(self.identity)
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with (self.out_dir / EVENTS_FILE).open("a") as handle:
                handle.write(json.dumps(row) + "\n")
        except OSError as exc:
            print(
                f"events: cannot write {self.out_dir / EVENTS_FILE}: {exc.strerror}",
                file=sys.stderr,
                flush=True,
            )
        self.note_in_run_record(row)
        self.notify(row)
        return row

    def checkpointed_step(self, step: int | None) -> int | None:
        """The step the run is at: the metrics' last row, or the record's last checkpoint (or end)
        where that is further (a stop checkpoints the step it was at, often after the last row)."""
        from . import runrecord

        record = runrecord.read_record(self.out_dir) or {}
        last = record.get("last_step")
        if record.get("run_id") != self.run_id or not isinstance(last, int) or isinstance(last, bool):
            return step
        return last if step is None or last > step else step

    def note_in_run_record(self, row: dict) -> None:
        """Keep the run record (<out>/run.json, trainer/run/runrecord.py) in step: each restart appended
        to its `restarts`, and the state a crash, a restart or the supervisor's verdict leaves.
        Only the recorded process (this one: the supervisor or torchrun) writes it."""
        from . import runrecord

        record = runrecord.own_record(self.out_dir, (os.getpid(),))  # a damaged one rewritten whole
        if record is None:
            return
        event = row["event"]
        if event == "restart":
            restart = {key: row[key] for key in ("time", "step", "reason")}
            record.update(state="running", restarts=[*record.get("restarts", []), restart])
            for key in ("exit_status", "exit_reason", "ended_at", "exiting"):
                record.pop(key, None)
            if record.get("stage") == "exiting":  # the crashed process's way out, not the new one's
                record.pop("stage")
        elif event in ("crash", "failed") and row["exit_status"] is not None:
            # The trainer's own verdict (noted in the record as it ended) is the better reason.
            own = record.get("exit_reason") if record.get("state") in ("crashed", "failed") else None
            if event == "failed" and row["exit_status"] == 2 and own:
                return  # bad input, in the trainer's own words
            if event == "crash":
                reason, status = (
                    own or row["reason"],
                    record.get("exit_status", row["exit_status"]) if own else row["exit_status"],
                )
            else:
                reason = row["reason"] + (f" ({own})" if own and own not in row["reason"] else "")
                status = row["exit_status"]
            state = "failed" if event == "failed" else "crashed"
            record.update(state=state, exit_status=status, exit_reason=reason, ended_at=row["time"])
        elif event == "stop" and record.get("state") == "crashed":
            record.update(state="stopped", exit_reason=row["text"].split(": ", 1)[-1], ended_at=row["time"])
        elif event in ("stop", "finish") and record.get("state") == "running":
            # The trainer ended before it could close the record: the process that ends the run
            # closes it. Killed by the stop's own signal (before its handlers were installed) it
            # stopped cleanly, 0; killed by another (the OOM killer while it wrote the stop's
            # checkpoint) it wrote none, and the record keeps that signal.
            status = row["exit_status"]
            clean = status is None or status in (0, -signal.SIGTERM, -signal.SIGINT)
            record.update(
                state="stopped" if event == "stop" else "finished",
                exit_status=0 if clean else status,
                exit_reason=row["text"].split(": ", 1)[-1],
                ended_at=row["time"],
            )
        else:
            return
        try:
            runrecord.write_record(self.out_dir, record)
        except OSError as exc:
            print(
                f"events: cannot update the run record in {self.out_dir}: {exc.strerror}",
                file=sys.stderr,
                flush=True,
            )

    def notify(self, row: dict) -> None:
        if not self.notify_url:
            return
        problem = post_notice(self.notify_url, {key: row.get(key) for key in NOTICE_FIELDS})
        if problem:
            print(
                f"notice: the {row['event']} notice was not delivered ({problem})",
                file=sys.stderr,
                flush=True,
            )
