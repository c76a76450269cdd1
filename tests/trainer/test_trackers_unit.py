"""log.report_to: the list setting, and the tracker thread's promises (one warning, never a held
step, a bounded end), with stand-in trackers instead of MLflow and wandb."""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys
import threading
import time
import typing

import pytest

from trainer.config import ConfigError, load_config
from trainer.run import trackers as trackers_module
from trainer.run.trackers import Trackers, flat_config, metric_values, redact

pytestmark = pytest.mark.unit


def test_report_to_from_the_command_line_is_a_list_of_names():
    cfg = load_config("eager", None, ["log.report_to=mlflow, wandb,mlflow"])
    assert cfg.log.report_to == ["mlflow", "wandb"]
    assert load_config("eager", None, ["log.report_to="]).log.report_to == []


def test_report_to_from_a_machine_config_is_a_yaml_list(tmp_path):
    machine = tmp_path / "machine.yml"
    machine.write_text("log:\n  report_to: [wandb, tensorboard]\n")
    assert load_config("eager", str(machine)).log.trackers() == ["tensorboard", "wandb"]
    machine.write_text("log:\n  report_to: [wandb, 3]\n")
    with pytest.raises(ConfigError) as caught:
        load_config("eager", str(machine))
    assert caught.value.problems == [
        f"machine config {machine}: log.report_to: expected a list of names (YAML [a, b]; a,b after "
        "--set), got ['wandb', 3]"
    ]


def test_an_unknown_tracker_is_refused_with_the_known_ones():
    with pytest.raises(ConfigError) as caught:
        load_config("eager", None, ["log.report_to=mlflow,comet"])
    assert caught.value.problems == [
        "log.report_to: unknown tracker(s) 'comet' (known: tensorboard, mlflow, wandb)"
    ]


def test_log_tensorboard_true_still_means_tensorboard():
    cfg = load_config("eager", None, ["log.tensorboard=true", "log.report_to=mlflow"])
    assert cfg.log.trackers() == ["tensorboard", "mlflow"]


def test_what_the_trackers_receive():
    assert flat_config({"train": {"lr": 6e-4}, "log": {"report_to": ["mlflow", "wandb"]}}) == {
        "train.lr": "0.0006",
        "log.report_to": "mlflow,wandb",
    }
    row = {"kind": "eval", "step": 4, "tau": 1.5, "prompts": 4, "note": "x", "flag": True}
    assert metric_values(row) == {"eval/tau": 1.5, "eval/prompts": 4.0}


def test_a_warning_never_quotes_a_secret(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", "s3cr3t-token")
    text = "ConnectionError: https://bob:pw@mlflow.example.invalid/api failed, token s3cr3t-token\nmore"
    assert redact(text) == (
        "ConnectionError: https://<credentials>@mlflow.example.invalid/api failed, "
        "token <MLFLOW_TRACKING_TOKEN>"
    )


class StandIn:
    """A tracker that records its calls; `hold` blocks its metric calls, `fail_on` raises."""

    name = "mlflow"
    calls: typing.ClassVar[list] = []
    hold = threading.Event()
    fail_on: str | None = None

    def __init__(self, out_dir, run_name):
        self.calls = StandIn.calls  # this test's list, even when an earlier test's thread goes on

    def load(self):
        pass  # a stand-in imports nothing

    def call(self, what, *args):
        if what == self.fail_on:
            raise ConnectionError("http://user:pw@127.0.0.1:9/ refused")
        self.calls.append((what, *args))

    def start(self, state, config):
        self.call("start", dict(state))
        return {"run_id": state.get("run_id", "r1")}

    def metric(self, row):
        if not StandIn.hold.wait(30):
            raise TimeoutError
        self.call("metric", row["step"])

    def event(self, index, row):
        self.call("event", index, row["event"])

    def end(self, outcome):
        self.call("end", outcome)


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setitem(trackers_module.TRACKER_CLASSES, "mlflow", StandIn)
    StandIn.calls, StandIn.fail_on = [], None
    StandIn.hold.set()
    yield StandIn
    StandIn.hold.set()


def open_trackers(out_dir, lines):
    return Trackers(["tensorboard", "mlflow"], out_dir, {"run": {"name": "eager"}}, lines.append)


def test_a_slow_tracker_never_holds_a_step_and_the_end_is_bounded(tmp_path, stand_in, monkeypatch):
    monkeypatch.setattr(trackers_module, "CLOSE_TIMEOUT_S", 0.5)
    stand_in.hold.clear()
    lines: list[str] = []
    trackers = open_trackers(tmp_path, lines)
    began = time.monotonic()
    for step in range(50):
        trackers.metric({"kind": "train", "step": step, "loss": 1.0})
    assert time.monotonic() - began < 0.5
    waits: list[str] = []
    trackers.close("finished", waiting=waits.append)
    assert time.monotonic() - began < 2.0
    said = "waiting at most 0.5s for tracker(s) mlflow to send what is left"
    assert waits == [said]
    assert lines == [
        f"trackers: {said}",
        "tracker mlflow: still sending (no answer from its server yet) after 0.5s; the run ends without "
        "it (what did not reach it is in metrics.jsonl and events.jsonl)",
    ]


def test_events_go_once_and_a_resume_continues_the_same_tracker_run(tmp_path, stand_in):
    events = tmp_path / "events.jsonl"
    events.write_text(json.dumps({"event": "start", "text": "eager on vm: started"}) + "\n")
    lines: list[str] = []
    trackers = open_trackers(tmp_path, lines)
    trackers.metric({"kind": "train", "step": 1, "loss": 1.0})
    trackers.close("crashed")
    assert stand_in.calls == [("start", {}), ("metric", 1), ("event", 1, "start"), ("end", "crashed")]
    assert json.loads((tmp_path / "trackers.json").read_text()) == {
        "mlflow": {"run_id": "r1", "events_sent": 1}
    }
    with events.open("a") as handle:
        for name in ("crash", "restart"):
            handle.write(json.dumps({"event": name, "text": name}) + "\n")
    stand_in.calls = []
    trackers = open_trackers(tmp_path, lines)
    trackers.close("finished")
    assert stand_in.calls == [
        ("start", {"run_id": "r1", "events_sent": 1}), ("event", 2, "crash"), ("event", 3, "restart"),
        ("end", "finished"),
    ]  # fmt: skip
    assert lines == []


def test_a_failing_tracker_costs_one_warning_without_its_credentials(tmp_path, stand_in):
    stand_in.fail_on = "metric"
    lines: list[str] = []
    trackers = open_trackers(tmp_path, lines)
    for step in range(5):
        trackers.metric({"kind": "train", "step": step, "loss": 1.0})
    trackers.close("finished")
    assert lines == [
        "tracker mlflow: metric failed (ConnectionError: http://<credentials>@127.0.0.1:9/ refused); "
        "the run goes on without it"
    ]
    assert ("end", "finished") not in stand_in.calls


def test_an_unwritable_tracker_state_costs_one_warning(tmp_path, stand_in):
    (tmp_path / "trackers.json").mkdir()  # neither readable nor replaceable as a file
    lines: list[str] = []
    trackers = open_trackers(tmp_path, lines)
    (tmp_path / "events.jsonl").write_text(json.dumps({"event": "start", "text": "started"}) + "\n")
    trackers.metric({"kind": "train", "step": 1, "loss": 1.0})
    trackers.close("finished")
    assert len(lines) == 2, lines
    assert lines[0].startswith("trackers: trackers.json is unreadable (IsADirectoryError)")
    assert lines[1].startswith(f"trackers: cannot write {tmp_path / 'trackers.json'} (")
    assert ("end", "finished") in stand_in.calls


class Hanging(StandIn):
    """A tracker whose start does not come back (a server that accepts and never answers)."""

    name = "wandb"
    release = threading.Event()

    def start(self, state, config):
        Hanging.release.wait(30)
        return {}


def test_a_hanging_tracker_holds_up_no_other(tmp_path, stand_in, monkeypatch):
    monkeypatch.setitem(trackers_module.TRACKER_CLASSES, "wandb", Hanging)
    monkeypatch.setattr(trackers_module, "CLOSE_TIMEOUT_S", 0.5)
    Hanging.release.clear()
    lines: list[str] = []
    trackers = Trackers(["mlflow", "wandb"], tmp_path, {"run": {"name": "eager"}}, lines.append)
    try:
        trackers.metric({"kind": "train", "step": 1, "loss": 1.0})
        trackers.close("finished")
    finally:
        Hanging.release.set()
    assert stand_in.calls == [("start", {}), ("metric", 1), ("end", "finished")]
    assert lines == [
        "trackers: waiting at most 0.5s for tracker(s) wandb to send what is left",
        "tracker wandb: still starting (no answer from its server yet) after 0.5s; the run ends without "
        "it (what did not reach it is in metrics.jsonl and events.jsonl)",
    ]


def test_trackers_that_end_at_once_are_not_waited_for_aloud(tmp_path, stand_in):
    lines: list[str] = []
    waits: list[str] = []
    open_trackers(tmp_path, lines).close("finished", waiting=waits.append)
    assert (lines, waits) == ([], [])
    assert stand_in.calls[-1] == ("end", "finished")


def test_a_tracker_that_fails_after_the_end_says_nothing_into_the_closed_log(tmp_path, stand_in, monkeypatch):
    """The run's log is closed after the trackers' wait: a thread still busy then never writes to it."""
    from trainer.run.sinks import FileOutput

    monkeypatch.setattr(trackers_module, "CLOSE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(trackers_module, "QUIET_WAIT_S", 0.1, raising=False)
    stand_in.hold.clear()
    stand_in.fail_on = "metric"
    out = FileOutput(tmp_path, load_config("eager", None, ["log.report_to=mlflow"]))
    worker = out.trackers.workers[0]
    out.metric({"kind": "train", "step": 1, "loss": 1.0})
    out.close()
    errors: list = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    stand_in.hold.set()  # the held call now fails, after the log was closed
    worker.thread.join(5)
    assert not worker.thread.is_alive()
    assert errors == []
    log = (tmp_path / "train.log").read_text()
    assert "still sending" in log and "metric failed" not in log


def test_the_run_output_tells_the_trackers_how_the_trainer_ended(tmp_path, stand_in):
    from trainer.run.sinks import FileOutput

    cfg = load_config("eager", None, ["log.report_to=mlflow"])
    for stopped, error, told in (
        (False, None, "finished"),
        (True, None, "stopped"),
        (
            False,
            ValueError("boom at http://u:secret@h/"),
            "crashed: ValueError: boom at http://<credentials>@h/",
        ),
    ):
        stand_in.calls.clear()
        out = FileOutput(tmp_path, cfg)
        try:
            try:
                if error is not None:
                    raise error
            finally:
                out.close(stopped=stopped)
        except ValueError:
            pass
        assert stand_in.calls[-1] == ("end", told)


def test_a_tracker_entry_of_the_wrong_type_is_said_once_and_a_new_tracker_run_begins(tmp_path, stand_in):
    (tmp_path / "trackers.json").write_text(json.dumps({"mlflow": [1, 2], "wandb": {"id": "keep1234"}}))
    lines: list[str] = []
    trackers = open_trackers(tmp_path, lines)
    trackers.metric({"kind": "train", "step": 1, "loss": 1.0})
    trackers.close("finished")
    assert lines == ["trackers: trackers.json: mlflow is '[1, 2]', not an object; a new mlflow run begins"]
    assert stand_in.calls == [("start", {}), ("metric", 1), ("end", "finished")]
    # The damaged entry is not written back; another tracker's entry is kept.
    assert json.loads((tmp_path / "trackers.json").read_text()) == {
        "mlflow": {"run_id": "r1", "events_sent": 0},
        "wandb": {"id": "keep1234"},
    }


def test_a_run_id_of_the_wrong_type_begins_a_new_tracker_run(tmp_path, stand_in):
    (tmp_path / "trackers.json").write_text(json.dumps({"mlflow": {"run_id": 7, "events_sent": 2}}))
    lines: list[str] = []
    open_trackers(tmp_path, lines).close("finished")
    assert lines == ["trackers: trackers.json: mlflow run_id is '7', not a name; a new mlflow run begins"]
    assert stand_in.calls[0] == ("start", {})


@pytest.mark.parametrize("sent", ["x", -3, 1.5, True, None])
def test_a_bad_count_of_sent_events_sends_them_again_and_is_not_written_back(tmp_path, stand_in, sent):
    (tmp_path / "trackers.json").write_text(json.dumps({"mlflow": {"run_id": "r1", "events_sent": sent}}))
    (tmp_path / "events.jsonl").write_text(
        "".join(json.dumps({"event": name, "text": name}) + "\n" for name in ("start", "crash"))
    )
    lines: list[str] = []
    trackers = open_trackers(tmp_path, lines)
    trackers.metric({"kind": "train", "step": 1, "loss": 1.0})
    trackers.close("finished")
    assert lines == [
        f"trackers: trackers.json: mlflow events_sent is {str(sent)!r}, not a count of events; mlflow is "
        "sent every event again from the first"
    ]
    # The tracker's thread lived on: every event, then its end.
    assert stand_in.calls == [
        ("start", {"run_id": "r1", "events_sent": 0}), ("metric", 1), ("event", 1, "start"),
        ("event", 2, "crash"), ("end", "finished"),
    ]  # fmt: skip
    assert json.loads((tmp_path / "trackers.json").read_text()) == {
        "mlflow": {"run_id": "r1", "events_sent": 2}
    }


def test_a_long_error_keeps_its_cause_at_the_end():
    text = "MlflowException: API request to http://127.0.0.1:9/api failed with exception " + "x" * 400
    said = redact(text + " [Errno 111] Connection refused")
    assert said.startswith("MlflowException: API request to") and said.endswith(
        "[Errno 111] Connection refused"
    )
    assert len(said) < 310


def test_while_the_run_waits_for_its_trackers_its_record_says_exiting(tmp_path, stand_in, monkeypatch):
    from trainer.run import runrecord
    from trainer.run.sinks import FileOutput

    monkeypatch.setattr(trackers_module, "CLOSE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(trackers_module, "QUIET_WAIT_S", 0.1)
    runrecord.write_record(
        tmp_path, {"run": "eager", "run_id": "eager-1", "pid": os.getpid(), "state": "finished"}
    )
    out = FileOutput(tmp_path, load_config("eager", None, ["log.report_to=mlflow"]))
    stand_in.hold.clear()
    out.metric({"kind": "train", "step": 1, "loss": 1.0})
    out.close()
    record = runrecord.read_record(tmp_path)
    waiting = "waiting at most 0.3s for tracker(s) mlflow to send what is left"
    assert (record["state"], record["stage"], record["exiting"]) == ("finished", "exiting", waiting)
    assert f"trackers: {waiting}" in (tmp_path / "train.log").read_text()


def test_a_database_store_without_sqlalchemy_is_one_line_naming_what_to_install(tmp_path, monkeypatch):
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "sqlalchemy" else found(name)
    )
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    lines: list[str] = []
    Trackers(["mlflow"], tmp_path, {"run": {"name": "eager"}}, lines.append).close("finished")
    assert lines == [
        "tracker mlflow: MLflow's sqlite store needs SQLAlchemy and alembic, which are missing (pip install "
        "mlflow-skinny==3.17.2 sqlalchemy==2.1.9 alembic==1.20.1); the run goes on without it"
    ]


def test_the_workspace_installs_what_the_trackers_name_and_the_tests_pin_it():
    import yaml

    root = pathlib.Path(__file__).resolve().parents[2]
    defaults = yaml.safe_load((root / "roles/workspace/defaults/main.yml").read_text())
    packages = defaults["workspace_tracker_packages"]
    assert {name: " ".join(packages[name]) for name in ("mlflow", "wandb")} == trackers_module.PACKAGES
    pinned = (root / "requirements-dev.txt").read_text().split()
    assert all(package in pinned for package in " ".join(trackers_module.PACKAGES.values()).split())


def test_mlflow_s_default_store_is_a_database_in_the_output_and_a_legacy_file_store_is_kept(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # restored after: the legacy store sets it
    tracker = trackers_module.MlflowTracker(tmp_path, "eager")
    assert tracker.store_uri() == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    (tmp_path / "mlruns").mkdir()  # written by an earlier version: a resume continues its run there
    assert tracker.store_uri() == str(tmp_path / "mlruns")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert tracker.store_uri() == "http://127.0.0.1:5000"


AST_RACE = SystemError("AST constructor recursion depth mismatch (before=210, after=316)")
LOCK_CYCLE = AttributeError(
    "partially initialized module 'wandb' has no attribute 'errors' (most likely due to a circular import)"
)


class RacingOnce:
    """A tracker whose first starts fail as CPython does when another thread imports at the same time."""

    name = "wandb"
    failures = 1
    error: Exception = AST_RACE

    def __init__(self, out_dir, run_name):
        self.starts = 0

    def load(self):
        pass  # a stand-in imports nothing

    def start(self, state, config):
        self.starts += 1
        if self.starts <= RacingOnce.failures:
            raise RacingOnce.error
        return {"run_id": "r1"}

    def metric(self, row):
        pass

    def end(self, outcome):
        pass


def started_alone(tmp_path, monkeypatch, tracker_class) -> tuple:
    """The tracker wandb as `tracker_class`, started and closed alone: (the tracker, the run's lines)."""
    monkeypatch.setitem(trackers_module.TRACKER_CLASSES, "wandb", tracker_class)
    lines: list[str] = []
    trackers = Trackers(["wandb"], tmp_path, {"run": {"name": "eager"}}, lines.append)
    trackers.close("finished")
    return trackers.workers[0].tracker, lines


@pytest.mark.parametrize("error", [AST_RACE, LOCK_CYCLE], ids=["ast-parse", "import-lock-cycle"])
@pytest.mark.parametrize(("failures", "started"), [(1, True), (2, False)])
def test_a_start_failing_on_an_import_race_is_tried_once_more(
    tmp_path, monkeypatch, failures, started, error
):
    monkeypatch.setattr(RacingOnce, "failures", failures)
    monkeypatch.setattr(RacingOnce, "error", error)
    tracker, lines = started_alone(tmp_path, monkeypatch, RacingOnce)
    assert tracker.starts == 2
    if started:
        assert lines == [] and json.loads((tmp_path / "trackers.json").read_text())["wandb"]["run_id"] == "r1"
    else:
        said = f"{type(error).__name__}: {error}"
        assert lines == [f"tracker wandb: cannot start ({said}); the run goes on without it"]


def test_trackers_import_their_packages_one_at_a_time(tmp_path, monkeypatch):
    """Two packages imported on two threads at once can each wait for a module the other holds."""
    log = tmp_path / "imports.log"
    for package in ("slow_tracker_a", "slow_tracker_b"):
        (tmp_path / f"{package}.py").write_text(
            f"import time\nwith open({str(log)!r}, 'a') as f:\n    f.write('enter {package}\\n')\n"
            f"time.sleep(0.3)\nwith open({str(log)!r}, 'a') as f:\n    f.write('leave {package}\\n')\n"
        )
    monkeypatch.syspath_prepend(str(tmp_path))

    def tracker_class(name, package):
        def load(self):
            importlib.import_module(package)

        return type(name, (RacingOnce,), {"name": name, "load": load, "start": lambda *_: {}})

    monkeypatch.setitem(trackers_module.TRACKER_CLASSES, "mlflow", tracker_class("mlflow", "slow_tracker_a"))
    monkeypatch.setitem(trackers_module.TRACKER_CLASSES, "wandb", tracker_class("wandb", "slow_tracker_b"))
    lines: list[str] = []
    try:
        Trackers(["mlflow", "wandb"], tmp_path, {"run": {"name": "eager"}}, lines.append).close("finished")
    finally:
        for package in ("slow_tracker_a", "slow_tracker_b"):
            sys.modules.pop(package, None)
    events = log.read_text().split("\n")[:-1]
    assert lines == [] and len(events) == 4
    entered_left = [event.split() for event in events]  # each package left before the next entered
    assert [kind for kind, _ in entered_left] == ["enter", "leave", "enter", "leave"], events
    assert entered_left[0][1] == entered_left[1][1] and entered_left[2][1] == entered_left[3][1], events


def test_a_missing_package_is_said_as_missing_not_tried_again(tmp_path, monkeypatch):
    def load(self):
        import no_such_tracker_package  # noqa: F401

    tracker, lines = started_alone(tmp_path, monkeypatch, type("wandb", (RacingOnce,), {"load": load}))
    assert tracker.starts == 0
    assert lines == [
        "tracker wandb: the wandb package is missing (pip install wandb==0.31.0); the run goes on without it"
    ]


def test_another_system_error_at_the_start_is_not_tried_again(tmp_path, monkeypatch):
    class Broken(RacingOnce):
        def start(self, state, config):
            self.starts += 1
            raise SystemError("error return without exception set")

    tracker, lines = started_alone(tmp_path, monkeypatch, Broken)
    assert tracker.starts == 1
    assert lines == [
        "tracker wandb: cannot start (SystemError: error return without exception set); the run goes on "
        "without it"
    ]
