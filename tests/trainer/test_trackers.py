"""log.report_to: [mlflow, wandb] on a real run, read back through MLflow's own client (from its
default SQLite store, and from a real `mlflow server` on loopback) and from wandb's offline run
files; a resume continues the same tracker runs; a tracker server that is down and a package that
is missing cost one warning each, and the run finishes."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import typing
import urllib.request
import weakref
from pathlib import Path

import pytest
import torch

from .conftest import REPO, run_trainer

pytestmark = pytest.mark.slow

SHORT = [
    "--set",
    "train.log_every=1",
    "--set",
    "train.eval_prompts=4",
    "--set",
    "train.eval_max_new_tokens=8",
]


# What would send these runs to a real server from a developer's machine.
TRACKER_ENV = ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME")


def supervised(out: Path, machine: Path, steps: int, *extra: str):
    """The trainer under its supervisor, as a launch runs it (which records the run's events),
    with no tracker credentials: MLflow's local store, wandb offline."""
    argv = [
        "--run",
        "eager",
        "--config",
        str(machine),
        "--out",
        str(out),
        "--steps",
        str(steps),
        *SHORT,
        *extra,
    ]
    env = {key: value for key, value in os.environ.items() if key not in TRACKER_ENV}
    return subprocess.run(
        [sys.executable, "-m", "trainer.supervise", "-m", "trainer", "--", *argv],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, cache_dir):
    """A run of 4 steps reporting to mlflow and wandb, then resumed to 6: (out, metrics rows)."""
    for name in ("mlflow", "wandb"):
        pytest.importorskip(name)
    base = tmp_path_factory.mktemp("tracked")
    machine = base / "machine.yml"
    machine.write_text(f"data:\n  cache_dir: {cache_dir}\nlog:\n  report_to: [mlflow, wandb]\n")
    out = base / "run"
    for steps, extra in ((4, ()), (6, ("--resume",))):
        result = supervised(out, machine, steps, *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "tracker mlflow:" not in result.stdout and "tracker wandb:" not in result.stdout, result.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, rows


def test_mlflow_store_holds_the_run_and_a_resume_continues_it(tracked, monkeypatch):
    from mlflow import MlflowClient

    out, rows = tracked
    assert not (out / "mlruns").exists()  # MLflow's default store, a database in the output
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    state = json.loads((out / "trackers.json").read_text())
    runs = client.search_runs([client.get_experiment_by_name("dflash").experiment_id])
    assert [run.info.run_id for run in runs] == [state["mlflow"]["run_id"]]  # one run, both starts
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["train.lr"] == "0.0006" and run.data.params["train.steps"] == "4"
    assert run.data.tags["resumed.train.steps"] == "6"
    assert run.data.params["log.report_to"] == "mlflow,wandb"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    losses = [(row["step"], row["loss"]) for row in rows if row["kind"] == "train"]
    assert [row[0] for row in losses] == [1, 2, 3, 4, 5, 6]
    assert [(m.step, pytest.approx(m.value, rel=1e-9)) for m in history] == losses
    taus = [(row["step"], row["tau"]) for row in rows if row["kind"] == "eval"]
    tau_history = client.get_metric_history(run.info.run_id, "eval/tau")
    assert [(m.step, pytest.approx(m.value, rel=1e-9)) for m in tau_history] == taus
    # The first start's events reach the tracker; the resumed process sends its own start and
    # the first one's finish (the supervisor writes the finish once this process has ended).
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    tags = {key: value for key, value in run.data.tags.items() if key.startswith("dflash.event.")}
    assert len(tags) == state["mlflow"]["events_sent"] == len(events) - 1  # all but the last finish
    assert [tags[f"dflash.event.{i:04d}"].split(" ", 1)[1] for i in range(1, len(tags) + 1)] == [
        event["text"] for event in events[:-1]
    ]
    assert run.data.tags["dflash.ended"] == "finished"


def wandb_records(path: Path):
    """The records of a .wandb file: wandb's LevelDB-style log (a 7-byte header, then 32 KiB
    blocks of chunks, each with a 7-byte header: CRC, length, type) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def test_wandb_offline_run_holds_the_run_and_a_resume_reuses_its_id(tracked):
    out, rows = tracked
    run_id = json.loads((out / "trackers.json").read_text())["wandb"]["id"]
    directories = sorted((out / "wandb").glob("offline-run-*"))
    assert len(directories) == 2 and all(d.name.endswith(f"-{run_id}") for d in directories)
    losses, configs = {}, []
    for directory in directories:
        for record in wandb_records(directory / f"run-{run_id}.wandb"):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                assert record.run.run_id == run_id
                configs.append({item.key: json.loads(item.value_json) for item in record.run.config.update})
            elif kind == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                if "train/loss" in items:
                    losses[items["train/step"]] = items["train/loss"]
    expected = {row["step"]: row["loss"] for row in rows if row["kind"] == "train"}
    assert losses == pytest.approx(expected, rel=1e-9)
    assert configs[0]["train"]["lr"] == 0.0006 and configs[0]["log"]["report_to"] == ["mlflow", "wandb"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again: nobody listens there


def test_a_tracker_down_and_a_package_missing_cost_one_warning_each(tmp_path, cache_dir):
    pytest.importorskip("mlflow")
    # A wandb that cannot be imported, first on the path.
    (tmp_path / "shadow").mkdir()
    (tmp_path / "shadow" / "wandb.py").write_text("raise ModuleNotFoundError(\"No module named 'wandb'\")\n")
    machine = tmp_path / "machine.yml"
    machine.write_text(f"data:\n  cache_dir: {cache_dir}\nlog:\n  report_to: [mlflow, wandb]\n")
    out = tmp_path / "run"
    uri = f"http://user:hunter2@127.0.0.1:{free_port()}"
    env = {
        "WANDB_API_KEY": "", "MLFLOW_TRACKING_URI": uri,
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "2",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "shadow"), os.environ.get("PYTHONPATH")])),
    }  # fmt: skip
    result = run_trainer(
        "--run", "eager", "--config", str(machine), "--out", str(out), "--steps", "2", *SHORT, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    log = (out / "train.log").read_text().splitlines()
    warnings = [line for line in log if line.startswith(("tracker", "trackers"))]
    assert len(warnings) == 2, warnings
    assert any(line.startswith("tracker mlflow: cannot start (") for line in warnings)
    assert (
        "tracker wandb: the wandb package is missing (pip install wandb==0.31.0); the run goes on without it"
        in warnings
    )
    assert log[-1].startswith("done: step 2")
    files = "".join(path.read_text() for path in out.iterdir() if path.is_file())
    assert "hunter2" not in result.stdout + result.stderr + files and uri not in files
    assert not (out / "trackers.json").exists()  # no tracker run began


def cuda_allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


class Watching:
    """A tracker that counts, when the run closes its trackers, the drafter replicas of this run
    still alive and the CUDA memory still allocated: the trainer gives them back before waiting for
    any tracker. `training`: the most CUDA memory allocated at a metric row, for comparison.
    `replicas`: the run's replicas, weakly (replicas other tests of the process left are not its)."""

    name = "mlflow"
    seen: typing.ClassVar[list] = []
    replicas: typing.ClassVar[weakref.WeakSet] = weakref.WeakSet()
    training = 0

    def __init__(self, out_dir, run_name):
        pass

    def load(self):
        pass  # a stand-in imports nothing

    def start(self, state, config):
        return {}

    def metric(self, row):
        Watching.training = max(Watching.training, cuda_allocated())

    def event(self, index, row):
        pass

    def end(self, outcome):
        gc.collect()
        Watching.seen.append((outcome, len(Watching.replicas), cuda_allocated()))


def released_at_the_end(tmp_path, cache_dir, monkeypatch, devices: str) -> list:
    from trainer.config import load_config
    from trainer.parallel.replica import Replica
    from trainer.run import trackers
    from trainer.run.train import train

    build = Replica.__init__

    def build_and_watch(replica, *args, **kwargs):
        build(replica, *args, **kwargs)
        Watching.replicas.add(replica)

    monkeypatch.setitem(trackers.TRACKER_CLASSES, "mlflow", Watching)
    monkeypatch.setattr(Replica, "__init__", build_and_watch)
    Watching.seen, Watching.training, Watching.replicas = [], 0, weakref.WeakSet()
    machine = tmp_path / "machine.yml"
    machine.write_text(f"data:\n  cache_dir: {cache_dir}\nlog:\n  report_to: [mlflow]\n")
    overrides = [
        "train.steps=2",
        "train.eval_prompts=2",
        "train.eval_max_new_tokens=4",
        f"parallel.devices={devices}",
    ]
    assert train(load_config("eager", str(machine), overrides), tmp_path / "run", resume=False) == 0
    return Watching.seen


def test_the_models_are_given_back_before_the_trackers_are_waited_for(tmp_path, cache_dir, monkeypatch):
    assert released_at_the_end(tmp_path, cache_dir, monkeypatch, "cpu") == [("finished", 0, 0)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")
def test_the_gpu_memory_is_given_back_before_the_trackers_are_waited_for(tmp_path, cache_dir, monkeypatch):
    torch.cuda.empty_cache()
    before = cuda_allocated()
    ((outcome, alive, after),) = released_at_the_end(tmp_path, cache_dir, monkeypatch, "cuda:0")
    figures = f"allocated before the run {before}, while training {Watching.training}, at the end {after}"
    assert (outcome, alive) == ("finished", 0)
    assert Watching.training > before and after <= before + (1 << 20), figures


def test_tracker_servers_that_are_down_cost_one_line_each_and_no_traceback(tmp_path, cache_dir):
    for name in ("mlflow", "wandb"):
        pytest.importorskip(name)
    machine = tmp_path / "machine.yml"
    machine.write_text(f"data:\n  cache_dir: {cache_dir}\nlog:\n  report_to: [mlflow, wandb]\n")
    out = tmp_path / "run"
    # MLflow's and wandb's own retry settings left as they are: the trainer bounds them.
    env = {key: value for key, value in os.environ.items() if not key.startswith(("MLFLOW_", "WANDB_"))}
    env |= {
        "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{free_port()}",
        "WANDB_BASE_URL": f"http://127.0.0.1:{free_port()}",
        "WANDB_API_KEY": "local-" + "0123456789abcdef" * 3,  # made up: nothing listens there
    }
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "--run", "eager", "--config", str(machine), "--out", str(out),
         "--steps", "2", *SHORT],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    log = (out / "train.log").read_text().splitlines()
    said = [line for line in log if line.startswith(("tracker", "trackers"))]
    mlflow = [line for line in said if line.startswith("tracker mlflow: cannot start (")]
    wandb = [line for line in said if line.startswith("tracker wandb: cannot start (")]
    assert len(mlflow) == len(wandb) == 1, said
    assert "Connection refused" in mlflow[0] and "the run goes on without it" in wandb[0]
    assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]
    assert any(line.startswith("done: step 2") for line in log)


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on 127.0.0.1 with a SQLite store of its own: its URI. Stopped by its PID (its
    own process group) when the test ends, also when it fails."""
    pytest.importorskip(
        "mlflow.server", reason="the full mlflow package (requirements-dev.txt) runs the server"
    )
    port = free_port()
    log = (tmp_path / "mlflow-server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "server-artifacts")],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        uri = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while not answers(f"{uri}/health"):
            assert server.poll() is None, (tmp_path / "mlflow-server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not answer within 180 s"
            time.sleep(0.5)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)  # the server and its workers: the group it leads
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)
        log.close()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def test_a_run_reports_to_a_real_mlflow_server(tmp_path, cache_dir, mlflow_server):
    from mlflow import MlflowClient

    machine = tmp_path / "machine.yml"
    machine.write_text(f"data:\n  cache_dir: {cache_dir}\nlog:\n  report_to: [mlflow]\n")
    out = tmp_path / "run"
    env = {"MLFLOW_TRACKING_URI": mlflow_server, "MLFLOW_EXPERIMENT_NAME": "served"}
    result = run_trainer(
        "--run", "eager", "--config", str(machine), "--out", str(out), "--steps", "2", *SHORT, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "tracker mlflow:" not in result.stdout, result.stdout  # (the end may be waited for aloud)
    assert not (out / "mlflow.db").exists() and not (out / "mlruns").exists()
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("served").experiment_id])
    assert run.info.run_id == json.loads((out / "trackers.json").read_text())["mlflow"]["run_id"]
    assert run.info.status == "FINISHED" and run.data.tags["dflash.ended"] == "finished"
    assert run.data.params["train.steps"] == "2" and run.data.params["log.report_to"] == "mlflow"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [(row["step"], row["loss"]) for row in rows if row["kind"] == "train"]
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [row[0] for row in losses] == [1, 2]
    assert [(m.step, pytest.approx(m.value, rel=1e-9)) for m in history] == losses
