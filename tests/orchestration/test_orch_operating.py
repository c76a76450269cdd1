"""Operating runs through the real playbooks: logs that follow, recovery after a crash with its
notices, on the local default inventory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import REPO, ledger, make_controller, stop_leftovers

from dflashctl import PlaybookFailed

SECRET = "made-up-t0ken"
# Tiny CPU runs without torch.compile and without regenerating the data through the target (what
# these tests look at is the same either way; the compiled launch of the default, data stage
# included, is test_orch_flow.py's test_launch_status_stop, and the data stage through the
# playbooks test_orch_regen.py's).
TINY = [
    "compile.mode=none",
    "data.regenerate=false",
    "train.log_every=2",
    "train.eval_prompts=4",
    "train.eval_max_new_tokens=8",
    "train.eval_every=0",
]


def cli_env(state_dir: Path) -> dict[str, str]:
    """ansible-playbook as a user runs it, with this test's fact cache."""
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(state_dir / "facts"),
    }


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def train_rows(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [row for row in map(json.loads, path.read_text().splitlines()) if row["kind"] == "train"]


@pytest.mark.slow
def test_logs_follow_ends_by_itself_when_the_trainer_exits(state_dir: Path) -> None:
    ctl = make_controller(
        state_dir, workspace_trainer_set=[*TINY, "train.steps=80", "train.checkpoint_every=40"]
    )
    try:
        with pytest.raises(PlaybookFailed, match="No run is recorded for ct200"):
            list(ctl.logs())
        record = ctl.launch("nographs")
        lines = list(ctl.logs(lines=3))
        assert 1 <= len(lines) <= 4 and lines[-1].startswith("ct200: nographs ")

        started = time.monotonic()
        followed = []
        for line in ctl.logs(lines=2, follow=True):
            followed.append((time.monotonic() - started, line))
        text = [line for _, line in followed]
        assert text[-1] == "ct200: nographs ended: finished at step 80, tau " + text[-1].split("tau ")[1]
        assert "done: step 80" in text[-2]
        # Lines came while the trainer ran, not all at once at the end.
        progress = [(t, line) for t, line in followed if line.startswith("step ")]
        assert len(progress) >= 3 and progress[-1][0] - progress[0][0] > 1.0, followed
        steps = [int(line.split()[1].split("/")[0]) for _, line in progress]
        assert steps == sorted(steps) and len(set(steps)) == len(steps), steps  # no line twice
        assert (
            not Path(f"/proc/{record['pid']}/cmdline").exists()
            or not Path(f"/proc/{record['pid']}/cmdline").read_bytes()
        )

        # The playbook itself, as a user types it.
        shown = subprocess.run(
            [
                str(Path(sys.executable).parent / "ansible-playbook"),
                "playbooks/logs.yml",
                "-e",
                f"dflash_state_dir={state_dir}",
                "-e",
                "lines=4",
                "-e",
                "follow=true",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env=cli_env(state_dir),
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert (
            "done: step 80" in shown.stdout and " ct200: nographs ended: finished at step 80" in shown.stdout
        )
        refused = subprocess.run(
            [
                str(Path(sys.executable).parent / "ansible-playbook"),
                "playbooks/logs.yml",
                "-e",
                f"dflash_state_dir={state_dir}",
                "-e",
                "lines=many",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env=cli_env(state_dir),
        )
        assert refused.returncode != 0 and "lines must be a whole number (got many)" in refused.stdout
    finally:
        stop_leftovers(ctl, state_dir)


class Receiver:
    def __init__(self):
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def run_events(events: list[str]) -> list[str]:
    """The events of the training itself: the data stage's two (its start and its end, right after
    the run's start) come only when the data was not prepared yet."""
    stage = events.count("regen")
    assert stage in (0, 2) and events[1 : 1 + stage] == ["regen"] * stage, events
    return [event for event in events if event != "regen"]


@pytest.mark.slow
def test_a_crashed_trainer_recovers_and_notices_arrive(state_dir: Path) -> None:
    receiver = Receiver()
    url = f"http://hook:{SECRET}@127.0.0.1:{receiver.port}/hooks/{SECRET}"
    ctl = make_controller(
        state_dir,
        workspace_trainer_set=[*TINY, "train.steps=60", "train.checkpoint_every=10"],
        recover_max_restarts=1,
        recover_backoff_s=1,
        notify_url=url,
        wandb_api_key=f"key-{SECRET}",
        mlflow_tracking_password=f"it's {SECRET}",
    )
    try:
        record = ctl.launch("nographs")
        out = Path(record["out"])
        run_sh = state_dir / "workspace" / "run.sh"
        assert SECRET not in run_sh.read_text() and "--max-restarts=1" in run_sh.read_text()
        url_file = state_dir / "workspace" / "notify_url"
        assert url_file.read_text().strip() == url and (url_file.stat().st_mode & 0o777) == 0o600
        # The trackers' credentials: kept the same way, and what run.sh exports from there.
        tracker_env = state_dir / "workspace" / "tracker_env"
        assert (tracker_env.stat().st_mode & 0o777) == 0o600 and "tracker_env" in run_sh.read_text()
        exported = subprocess.run(
            ["sh", "-c", '. "$1" && echo "$WANDB_API_KEY|$MLFLOW_TRACKING_PASSWORD"', "sh", str(tracker_env)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert exported == f"key-{SECRET}|it's {SECRET}\n"

        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and max([r["step"] for r in train_rows(out)], default=0) < 12:
            time.sleep(0.2)
        (trainer,) = children(record["pid"])
        os.kill(trainer, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not any(n["event"] == "finish" for n in receiver.received):
            time.sleep(0.5)
        assert run_events([n["event"] for n in receiver.received]) == ["start", "crash", "restart", "finish"]
        assert {n["run_id"] for n in receiver.received} == {record["run_id"]}
        (crash,) = [n for n in receiver.received if n["event"] == "crash"]
        assert crash["text"].endswith("crashed (killed by SIGKILL)")
        assert max(r["step"] for r in train_rows(out)) == 60

        status = ctl.status()
        assert status["state"] == "exited"
        assert status["restarts"] == 1, status
        assert run_events([e["event"] for e in status["events"]]) == ["start", "crash", "restart", "finish"]
        (row,) = ctl.runs()
        assert row["state"] == "recovered" and row["restarts"] == 1 and row["step"] == 60
        (recorded,) = ledger(state_dir)
        assert recorded["restarts"] == 1 and recorded["restart_events"][0]["reason"] == "killed by SIGKILL"
        # Nothing of the URL in the controller's files: ledger, facts, runner artifacts.
        for path in state_dir.rglob("*"):
            if path.is_file() and path not in (url_file, tracker_env) and "workspace" not in path.parts:
                assert SECRET not in path.read_text(errors="replace"), path
        for path in (out / "events.jsonl", Path(record["log"])):
            assert SECRET not in path.read_text()
    finally:
        stop_leftovers(ctl, state_dir)
        receiver.close()


def wait_until(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.slow
def test_history_of_runs_with_different_endings_curves_and_a_report(state_dir: Path) -> None:
    ctl = make_controller(state_dir)
    try:
        with pytest.raises(PlaybookFailed):
            ctl.launch("nographs", workspace_trainer_set=[*TINY, "data.train_file=/nonexistent/chat.jsonl"])

        # Killed outright (the recorded PID, by SIGKILL): nothing could record how it ended.
        killed = ctl.launch(
            "eager", workspace_trainer_set=[*TINY, "train.steps=100000", "train.checkpoint_every=0"]
        )
        os.kill(killed["pid"], signal.SIGKILL)
        wait_until(lambda: not any(children(killed["pid"])), 30, "the trainer to die with its supervisor")

        finished = ctl.launch(
            "eager", workspace_trainer_set=[*TINY, "train.steps=30", "train.checkpoint_every=0"]
        )
        assert list(ctl.logs(follow=True))[-1].startswith("ct200: eager ended: finished at step 30")

        ctl.launch(
            "nographs", workspace_trainer_set=[*TINY, "train.steps=100000", "train.checkpoint_every=0"]
        )
        wait_until(lambda: len(train_rows(state_dir / "workspace/runs/nographs")) >= 4, 120, "step 8")
        summary = ctl.run_playbook("status.yml", {}).stats["dflash_summary"]
        loss_line = next(line for line in summary if line.startswith("  loss     "))
        assert set(loss_line.split()[1]) <= set("▁▂▃▄▅▆▇█") and "/100000" in loss_line
        assert any(line.startswith("  tau/eval ") for line in summary)
        ctl.stop()

        rows = ctl.runs()
        assert [(r["run"], r["state"]) for r in rows] == [
            ("nographs", "stopped"),
            ("eager", "finished"),
            ("eager", "crashed"),
            ("nographs", "failed"),
        ], rows
        assert rows[1]["run_id"] == finished["run_id"] and rows[2]["run_id"] == killed["run_id"]
        assert rows[1]["step"] == 30 and rows[1]["total_steps"] == 30 and rows[1]["last_tau"] >= 1.0
        assert rows[1]["tokens_per_s"] > 0 and rows[1]["last_loss"] > 0 and rows[1]["duration_s"] > 0
        assert "bad input" in rows[3]["exit_reason"]
        table = ctl.runs_table()
        assert table[0].startswith("RUN") and len(table) == 5
        assert [r["run"] for r in ctl.runs(run="eager")] == ["eager", "eager"]

        # The controller's ledger lost: the targets still know every launch and how it ended.
        (state_dir / "runs.jsonl").rename(state_dir / "runs.jsonl.lost")
        remembered = ctl.runs()
        assert [(r["run"], r["state"], r["in_ledger"]) for r in remembered] == [
            (r["run"], r["state"], False) for r in rows
        ], remembered
        (state_dir / "runs.jsonl.lost").rename(state_dir / "runs.jsonl")

        report = ctl.report(["nographs", "eager"])
        path = Path(report["path"])
        assert path.parent == state_dir / "reports" and path.suffix == ".png"
        assert report["runs"] == ["nographs", "eager"]
        assert 20_000 < path.stat().st_size < 2_000_000
        assert png_size(path) == (900, 1000)
        with pytest.raises(PlaybookFailed, match="No metrics for graphs"):
            ctl.report(["nographs", "graphs"])
    finally:
        stop_leftovers(ctl, state_dir)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extravars", "message"),
    [
        (
            {"recover_max_restarts": "three"},
            "recover_max_restarts must be a whole number (0: never restart), got three",
        ),
        (
            {"recover_max_restarts": -1},
            "recover_max_restarts must be a whole number (0: never restart), got -1",
        ),
        ({"recover_backoff_s": "soon"}, "recover_backoff_s a number of seconds, got soon"),
    ],
)
def test_bad_recovery_settings_are_refused_before_anything_starts(
    state_dir: Path, extravars, message
) -> None:
    ctl = make_controller(state_dir, **extravars)
    try:
        with pytest.raises(PlaybookFailed) as failure:
            ctl.launch("nographs")
        assert message in str(failure.value)
        assert not (state_dir / "runs.jsonl").exists() and not (state_dir / "workspace" / "run.sh").exists()
    finally:
        stop_leftovers(ctl, state_dir)
