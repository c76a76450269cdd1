"""The team's experiment trackers (`log.report_to`: mlflow, wandb; tensorboard is sinks.py's).

The rank that writes the run's files reports: the config when the run starts (flattened,
`train.lr`, ...), every metric row (`train/loss`, `eval/tau`, `regen/tokens_per_s`, ... at the
row's step), the lines of <out>/events.jsonl (start, regen, crash, restart, ...) and how this
process ended (finished, stopped, crashed).

- MLflow: the server or database MLFLOW_TRACKING_URI names (with MLFLOW_TRACKING_TOKEN or
  MLFLOW_TRACKING_USERNAME/PASSWORD where it needs them), else MLflow's own default, a SQLite
  database, here <out>/mlflow.db (`mlflow ui --backend-store-uri sqlite:///<out>/mlflow.db` shows
  it). A run whose output already holds the legacy file store <out>/mlruns and no database keeps
  using it, so that a resume continues the same MLflow run. Events are tags
  (`dflash.event.0001`, ...; `dflash.state` the latest); the run ends FINISHED, KILLED (stopped)
  or FAILED (crashed).
- Weights & Biases: online with WANDB_API_KEY, else offline under <out>/wandb (`wandb sync`
  uploads it later; WANDB_MODE, WANDB_PROJECT and WANDB_ENTITY are wandb's own). Events go to the
  run's summary (`event`, `event_text`), crashes, restarts and failures also as alerts.

A resumed run continues the same tracker runs: their ids are kept in <out>/trackers.json, with how
many events each one was already sent. Each tracker works on a thread of its own, so a slow or
unreachable server never holds a training step nor another tracker; a tracker that fails (package
missing, server down, a call refused) costs one warning line and is left out for the rest of this
process. At the end (after the trainer has let go of its GPU memory) the run waits at most
CLOSE_TIMEOUT_S (15 s) for the trackers to send what is left, says so in one line and notes
`stage: exiting` in its run record meanwhile (status says `exiting`); a tracker still busy then is
named with what it was doing, and the process ends without it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import queue
import re
import secrets
import string
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .events import read_events

TRACKERS_FILE = "trackers.json"
CLOSE_TIMEOUT_S = 15.0
# Trackers that end within this are waited for without a word.
QUIET_WAIT_S = 1.0
# MLflow's REST client retries a server that does not answer for about two minutes by default: a
# few tries with short timeouts tell within the end's wait that it is down, and why. The user's own
# settings of these variables win.
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
# wandb.init waits this long for its server (wandb's own default is 90 s).
WANDB_INIT_TIMEOUT_S = 10.0
QUEUE_SIZE = 10_000
# What the workspace role installs for each (roles/workspace/defaults/main.yml): MLflow's database
# stores need SQLAlchemy and alembic, which mlflow-skinny does not pull in.
PACKAGES = {"mlflow": "mlflow-skinny==3.17.2 sqlalchemy==2.1.9 alembic==1.20.1", "wandb": "wandb==0.31.0"}
# Tracking URI schemes that MLflow serves from a database through SQLAlchemy.
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
# Environment variables whose values are secrets: never in a warning, a log line or trackers.json.
SECRET_ENV = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_TOKEN", "MLFLOW_TRACKING_PASSWORD", "WANDB_API_KEY")
# How each way this process can end is said to each tracker.
MLFLOW_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "crashed": "FAILED"}
ALERT_EVENTS = ("crash", "restart", "failed")


def flat_config(config: dict[str, Any]) -> dict[str, str]:
    """{"train": {"lr": 6e-4}} -> {"train.lr": "0.0006"}: MLflow's params are flat strings."""
    out = {}
    for section, values in config.items():
        for key, value in values.items():
            out[f"{section}.{key}"] = ",".join(map(str, value)) if isinstance(value, list) else str(value)
    return out


def redact(text: str) -> str:
    """One line of a library's error with every secret the environment holds taken out of it."""
    for name in SECRET_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, f"<{name}>")
    text = re.sub(r"//[^/@\s]+@", "//<credentials>@", text)
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    # A long error's cause is at its end (`... Caused by ...: [Errno 111] Connection refused`).
    return line if len(line) <= 300 else f"{line[:150]} ... {line[-145:]}"


def metric_values(row: dict[str, Any]) -> dict[str, float]:
    """The numbers of one metrics.jsonl row, named <kind>/<key> as in TensorBoard."""
    kind = row.get("kind", "train")
    return {
        f"{kind}/{key}": float(value)
        for key, value in row.items()
        if key not in ("kind", "step") and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class MlflowTracker:
    name = "mlflow"

    def __init__(self, out_dir: Path, run_name: str):
        self.out_dir, self.run_name = out_dir, run_name

    def store_uri(self) -> str:
        """MLFLOW_TRACKING_URI, else the output's legacy file store where it has one, else its database."""
        if os.environ.get("MLFLOW_TRACKING_URI"):
            return os.environ["MLFLOW_TRACKING_URI"]
        legacy = self.out_dir / "mlruns"
        if legacy.is_dir() and not (self.out_dir / "mlflow.db").exists():
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps it only on request
            return str(legacy)
        return f"sqlite:///{self.out_dir.resolve() / 'mlflow.db'}"

    def load(self) -> None:
        """The packages the store needs, imported."""
        uri = self.store_uri()
        scheme = uri.split(":", 1)[0].split("+", 1)[0] if "://" in uri else ""
        if scheme in DATABASE_SCHEMES and not all(map(importlib.util.find_spec, ("sqlalchemy", "alembic"))):
            raise MissingPackage(f"MLflow's {scheme} store needs SQLAlchemy and alembic, which are missing")
        import mlflow.entities  # noqa: F401

    def start(self, state: dict, config: dict[str, Any]) -> dict:
        """Continue the run state names when it is in the same store, else create one; the new state."""
        uri = self.store_uri()
        for name, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        from mlflow import MlflowClient

        # MLflow says at INFO level that it creates a new database's tables: not news for the run's log.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=uri)
        # The store is kept as a hash: a tracking URI may hold credentials.
        store = hashlib.sha256(uri.encode()).hexdigest()[:16]
        if state.get("store") == store and state.get("run_id"):
            self.run_id = state["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "dflash"
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.create_experiment(experiment, uri)
            self.run_id = self.client.create_run(experiment_id, run_name=self.run_name).info.run_id
        self.log_config(flat_config(config))
        return {"store": store, "run_id": self.run_id}

    def create_experiment(self, name: str, uri: str) -> str:
        # A local database keeps no artifacts itself: MLflow's default place for them is relative to
        # the working directory; the run's output holds them instead.
        local = uri.startswith("sqlite:") and not os.environ.get("MLFLOW_TRACKING_URI")
        where = (self.out_dir.resolve() / "mlartifacts").as_uri() if local else None
        return self.client.create_experiment(name, artifact_location=where)

    def log_config(self, config: dict[str, str]) -> None:
        """The config as params; a resume that changed a setting (MLflow's params never change)
        leaves the new value as the tag `resumed.<key>`."""
        from mlflow.entities import Param, RunTag

        logged = self.client.get_run(self.run_id).data.params
        params = [Param(key, value[:6000]) for key, value in config.items() if key not in logged]
        for first in range(0, len(params), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[first : first + 100])
        changed = [RunTag(f"resumed.{key}", value[:8000]) for key, value in config.items()
                   if key in logged and logged[key] != value[:6000]]  # fmt: skip
        if changed:
            self.client.log_batch(self.run_id, tags=changed)

    def metric(self, row: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        step = int(row.get("step", 0))
        metrics = [Metric(key, value, now, step) for key, value in metric_values(row).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def event(self, index: int, row: dict[str, Any]) -> None:
        self.client.set_tag(self.run_id, f"dflash.event.{index:04d}", f"{row.get('time')} {row.get('text')}")
        self.client.set_tag(self.run_id, "dflash.state", row.get("event", ""))

    def end(self, outcome: str) -> None:
        self.client.set_tag(self.run_id, "dflash.ended", outcome)
        self.client.set_terminated(self.run_id, status=MLFLOW_STATUS[outcome.split(":", 1)[0]])


class WandbTracker:
    name = "wandb"

    def __init__(self, out_dir: Path, run_name: str):
        self.out_dir, self.run_name = out_dir, run_name
        self.kinds: set[str] = set()

    def load(self) -> None:
        import wandb  # noqa: F401

    def start(self, state: dict, config: dict[str, Any]) -> dict:
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        # wandb's own form of id: 8 lowercase letters and digits.
        run_id = state.get("id") or "".join(
            secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8)
        )
        # console off: the trainer's stdout is the run's log and stays as it is.
        settings = wandb.Settings(
            console="off", silent=True, x_disable_stats=True, init_timeout=WANDB_INIT_TIMEOUT_S
        )
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "dflash", name=self.run_name, id=run_id,
            resume="allow", dir=str(self.out_dir), mode=mode, config=config, settings=settings,
        )  # fmt: skip
        if state.get("id"):
            self.run.config.update(config, allow_val_change=True)  # a resume may change settings
        return {"id": run_id}

    def metric(self, row: dict[str, Any]) -> None:
        kind = row.get("kind", "train")
        if kind not in self.kinds:
            # Each kind counts its own steps (regeneration's are conversations): wandb's own step
            # only ever grows, so rows of different kinds would otherwise be dropped.
            self.run.define_metric(f"{kind}/step")
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/step")
            self.kinds.add(kind)
        self.run.log({**metric_values(row), f"{kind}/step": int(row.get("step", 0))})

    def event(self, index: int, row: dict[str, Any]) -> None:
        self.run.summary["event"] = row.get("event", "")
        self.run.summary["event_text"] = f"{row.get('time')} {row.get('text')}"
        if row.get("event") in ALERT_EVENTS:
            import wandb

            level = wandb.AlertLevel.ERROR if row["event"] == "failed" else wandb.AlertLevel.WARN
            self.run.alert(title=f"{row.get('run')}: {row['event']}", text=str(row.get("text")), level=level)

    def end(self, outcome: str) -> None:
        self.run.summary["ended"] = outcome
        self.run.finish(exit_code=1 if outcome.startswith("crashed") else 0)


class MissingPackage(ImportError):
    """A package a tracker needs for what the run asks of it, with the reason in its own words."""


TRACKER_CLASSES = {"mlflow": MlflowTracker, "wandb": WandbTracker}
# The fields of each tracker's entry in trackers.json that name its run (strings, when present).
RUN_FIELDS = {"mlflow": ("store", "run_id"), "wandb": ("id",)}


def state_damage(name: str, state: Any) -> str | None:
    """What is wrong with one tracker's entry of trackers.json, or None."""
    if not isinstance(state, dict):
        return f"is {str(state)[:40]!r}, not an object"
    for field in RUN_FIELDS.get(name, ()):
        value = state.get(field)
        if field in state and not (isinstance(value, str) and value):
            return f"{field} is {str(value)[:40]!r}, not a name"
    return None


class Trackers:
    """The trackers of one run, fed from the training thread; each works on a thread of its own, so
    one that hangs holds neither a step nor the others."""

    def __init__(self, names: list[str], out_dir: Path, config: dict[str, Any], warn: Callable[[str], None]):
        self.out_dir, self.say = out_dir, warn
        self.closed = False  # after close: the run's log is closed, a late thread's words are dropped
        self.lock = threading.Lock()  # trackers.json, written by every tracker's thread
        self.unwritable = False
        self.state = self.read_state()
        run_name = os.environ.get("DFLASH_RUN_ID") or str(config["run"]["name"])
        self.workers = [
            TrackerWorker(self, TRACKER_CLASSES[name](out_dir, run_name), config)
            for name in names
            if name in TRACKER_CLASSES
        ]

    def metric(self, row: dict[str, Any]) -> None:
        for worker in self.workers:
            worker.submit(("metric", row))

    def warn(self, text: str) -> None:
        if not self.closed:
            self.say(text)

    def close(self, outcome: str, waiting: Callable[[str], None] | None = None) -> None:
        """Send what is left and end each tracker's run, waiting at most CLOSE_TIMEOUT_S in all.
        outcome: finished, stopped, or crashed: <the exception> (which the trackers are told).
        waiting(what): called once where the wait is longer than a moment (the run record notes it)."""
        outcome = redact(outcome)
        for worker in self.workers:
            worker.submit(("end", outcome))
        began = time.monotonic()
        self.join(began + min(QUIET_WAIT_S, CLOSE_TIMEOUT_S))
        busy = self.busy()
        if busy:
            names = ", ".join(busy)
            what = f"waiting at most {CLOSE_TIMEOUT_S:g}s for tracker(s) {names} to send what is left"
            self.warn(f"trackers: {what}")
            if waiting is not None:
                waiting(what)
            self.join(began + CLOSE_TIMEOUT_S)
        for worker in self.workers:
            if worker.thread.is_alive():
                self.warn(
                    f"tracker {worker.tracker.name}: still {worker.doing} after {CLOSE_TIMEOUT_S:g}s; the "
                    "run ends without it (what did not reach it is in metrics.jsonl and events.jsonl)"
                )
        self.closed = True

    def join(self, deadline: float) -> None:
        for worker in self.workers:
            worker.thread.join(max(0.0, deadline - time.monotonic()))

    def busy(self) -> list[str]:
        return [worker.tracker.name for worker in self.workers if worker.thread.is_alive()]

    def lost(self, name: str, what: str, exc: Exception) -> None:
        """The one warning line of a tracker that is left out from now on."""
        why = redact(f"{type(exc).__name__}: {exc}")
        self.warn(f"tracker {name}: {what} ({why}); the run goes on without it")

    def read_state(self) -> dict[str, Any]:
        try:
            state = json.loads((self.out_dir / TRACKERS_FILE).read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            self.warn(
                f"trackers: {TRACKERS_FILE} is unreadable ({type(exc).__name__}); new tracker runs begin"
            )
            return {}
        if not isinstance(state, dict):
            self.warn(
                f"trackers: {TRACKERS_FILE} holds {type(state).__name__}, not an object of tracker "
                "states; new tracker runs begin"
            )
            return {}
        return {name: self.checked(name, value) for name, value in state.items()}

    def checked(self, name: str, state: Any) -> Any:
        """One tracker's entry of trackers.json as its thread can use it: a damaged one is said
        once, with what happens now, and replaced (never written back as it was)."""
        if name not in TRACKER_CLASSES:
            return state  # another tracker's: kept as it is for a later run that reports to it
        damage = state_damage(name, state)
        if damage:
            self.warn(f"trackers: {TRACKERS_FILE}: {name} {damage}; a new {name} run begins")
            return {}
        sent = state.get("events_sent", 0)
        if isinstance(sent, bool) or not isinstance(sent, int) or sent < 0:
            self.warn(
                f"trackers: {TRACKERS_FILE}: {name} events_sent is {str(sent)[:40]!r}, not a count of "
                f"events; {name} is sent every event again from the first"
            )
            return {**state, "events_sent": 0}
        return state

    def save(self, name: str, state: dict[str, Any]) -> None:
        """One tracker's state into <out>/trackers.json, replaced whole (a crash mid-write leaves
        the previous one)."""
        with self.lock:
            self.state[name] = state
            path = self.out_dir / TRACKERS_FILE
            part = path.with_name(f".{TRACKERS_FILE}.part")
            try:
                part.write_text(json.dumps(self.state, indent=1) + "\n")
                os.replace(part, path)
            except OSError as exc:
                if not self.unwritable:
                    self.warn(
                        f"trackers: cannot write {path} ({exc.strerror}); a resume begins new tracker runs"
                    )
                self.unwritable = True


# One tracker's packages are imported at a time: two threads importing packages that share
# dependencies (mlflow's and wandb's both take protobuf, pydantic, requests) can each hold a module
# the other waits for, and CPython then hands one of them a partially initialized module.
PACKAGE_IMPORTS = threading.Lock()


def import_race(exc: Exception) -> bool:
    """A spurious failure of an import made beside another thread's: CPython 3.11's ast parse on two
    threads at once (gh-106905), or a module handed over partially initialized to break a cycle of
    import locks between threads."""
    text = str(exc)
    if isinstance(exc, SystemError):
        return "AST constructor recursion depth mismatch" in text
    return isinstance(exc, (AttributeError, ImportError)) and "partially initialized module" in text


class TrackerWorker:
    """One tracker's thread: its start, then the rows and events in order, then its end."""

    def __init__(self, owner: Trackers, tracker: Any, config: dict[str, Any]):
        self.owner, self.tracker, self.config = owner, tracker, config
        self.state = dict(owner.state.get(tracker.name) or {})
        self.queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        self.dead = self.dropped = False
        self.events_seen = -1  # the size of events.jsonl when last read
        # What a tracker still busy at the end was doing, for the line that says so.
        self.doing = "starting (no answer from its server yet)"
        self.thread = threading.Thread(target=self.work, name=f"tracker-{tracker.name}", daemon=True)
        self.thread.start()

    def submit(self, item: tuple) -> None:
        if self.dead:
            return
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            if not self.dropped:
                self.dropped = True
                self.owner.warn(
                    f"tracker {self.tracker.name}: {QUEUE_SIZE} rows behind; rows are left out until it "
                    "catches up"
                )

    def work(self) -> None:
        if not self.start():
            return
        while True:
            self.doing = "waiting for rows"
            kind, value = self.queue.get()
            self.doing = "sending (no answer from its server yet)"
            if kind == "metric" and not self.call("metric", value):
                return
            if not self.forward_events():
                return
            if kind == "end":
                self.call("end", value)
                return

    def start(self) -> bool:
        name = self.tracker.name
        sent = self.state.get("events_sent", 0)
        try:
            try:
                started = self.import_and_start()
            except (SystemError, AttributeError, ImportError) as exc:
                if not import_race(exc):
                    raise
                # The main thread imports beside this one (the target's load): rare, and nothing is
                # wrong, so once more.
                started = self.import_and_start()
            self.state = {**started, "events_sent": sent}
        except ImportError as exc:
            self.dead = True
            missing = str(exc) if isinstance(exc, MissingPackage) else f"the {name} package is missing"
            self.owner.warn(
                f"tracker {name}: {missing} (pip install {PACKAGES[name]}); the run goes on without it"
            )
            return False
        except Exception as exc:
            self.dead = True
            self.owner.lost(name, "cannot start", exc)
            return False
        self.owner.save(name, self.state)
        return True

    def import_and_start(self) -> dict:
        with PACKAGE_IMPORTS:
            self.tracker.load()
        return self.tracker.start(self.state, self.config)

    def call(self, method: str, *args: Any) -> bool:
        """One call on the tracker; one that fails is warned about once and the tracker left out."""
        try:
            getattr(self.tracker, method)(*args)
        except Exception as exc:
            self.dead = True
            self.owner.lost(self.tracker.name, f"{method} failed", exc)
            return False
        return True

    def forward_events(self) -> bool:
        """The lines of events.jsonl this tracker has not had yet (an earlier process's crash and
        restart reach it when the resumed one starts)."""
        try:
            size = (self.owner.out_dir / "events.jsonl").stat().st_size
        except OSError:
            return True
        if size == self.events_seen:
            return True
        self.events_seen = size
        rows = read_events(self.owner.out_dir)
        sent = int(self.state.get("events_sent", 0))
        for index, row in enumerate(rows[sent:], start=sent + 1):
            if not self.call("event", index, row):
                return False
            self.state["events_sent"] = index
        if len(rows) > sent:
            self.owner.save(self.tracker.name, dict(self.state))
        return True
