"""Notices: each run event POSTed as JSON to a loopback server this test starts; a URL that refuses
connections changes nothing about the run; the URL's credentials never reach a log or a file."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from trainer.run.events import NOTICE_FIELDS, post_notice, read_events

from .test_supervise import children, common, finish, launch, losses, wait_for

SECRET = "s3cr3t-made-up"


class Receiver:
    """A loopback HTTP server that keeps every POSTed JSON body and its Authorization header."""

    def __init__(self):
        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((self.path, self.headers.get("Authorization"), json.loads(body)))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    server = Receiver()
    yield server
    server.close()


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed again when the block ends: connections are refused


def url_file(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "notify_url"
    path.write_text(url + "\n")
    path.chmod(0o600)
    return path


def test_post_notice_sends_credentials_as_basic_auth_and_never_quotes_them(receiver):
    url = f"http://hook:{SECRET}@127.0.0.1:{receiver.port}/hooks/{SECRET}?token={SECRET}"
    assert post_notice(url, {"event": "start"}) is None
    path, auth, body = receiver.received[0]
    assert path == f"/hooks/{SECRET}?token={SECRET}" and body == {"event": "start"}
    assert base64.b64decode(auth.removeprefix("Basic ")).decode() == f"hook:{SECRET}"

    refused = post_notice(f"http://hook:{SECRET}@127.0.0.1:{closed_port()}/hooks/{SECRET}", {}, timeout=2)
    assert refused and "refused" in refused.lower() and SECRET not in refused
    assert post_notice(f"ftp://127.0.0.1/{SECRET}", {}) == "the notice URL is not an http(s) URL"


@pytest.mark.slow
def test_notices_arrive_in_order_with_the_right_fields(tmp_path, cache_dir, receiver, monkeypatch):
    url = f"http://hook:{SECRET}@127.0.0.1:{receiver.port}/hooks/{SECRET}"
    monkeypatch.setenv("DFLASH_NOTIFY_URL_FILE", str(url_file(tmp_path, url)))
    out, log = tmp_path / "out", tmp_path / "run.log"
    supervisor = launch(log, 1, [*common(cache_dir, steps=8), "--out", str(out)])
    try:
        wait_for(
            lambda: (out / "metrics.jsonl").exists() and len(losses(out)) >= 5, 240, "step 5", supervisor
        )
        subprocess.run(["kill", "-KILL", str(children(supervisor.pid)[0])], check=True)
        assert supervisor.wait(timeout=300) == 0, log.read_text()
    finally:
        finish(supervisor)
    notices = [body for _, _, body in receiver.received]
    run_id = json.loads((out / "run.json").read_text())["run_id"]  # the run record's
    # The data stage's start and end come first when the session's cache lacked the regenerated data.
    assert [n["event"] for n in notices] in (
        ["start", "crash", "restart", "finish"],
        ["start", "regen", "regen", "crash", "restart", "finish"],
    )
    for notice in notices:
        assert set(notice) == set(NOTICE_FIELDS)
        assert notice["run"] == "eager" and notice["run_id"] == run_id
        assert notice["host"] == socket.gethostname()
        assert notice["text"].startswith(f"eager on {socket.gethostname()}: ")
    crash = next(n for n in notices if n["event"] == "crash")
    assert crash["exit_status"] == -9 and crash["step"] >= 5
    assert crash["text"].endswith("crashed (killed by SIGKILL)")
    assert notices[-1]["exit_status"] == 0 and notices[-1]["step"] == 8 and notices[-1]["tau"] > 0
    assert [e["event"] for e in read_events(out)] == [n["event"] for n in notices]
    for written in (log, out / "events.jsonl", out / "train.log"):
        assert SECRET not in written.read_text()


@pytest.mark.slow
@pytest.mark.unit
@pytest.mark.parametrize(
    ("url", "why"),
    [
        (f"http://hook:{SECRET}@127.0.0.1:99999/hooks", "the notice URL is not valid (port out of range)"),
        ("http://127.0.0.1:99999/hooks", "the notice URL is not valid (port out of range)"),
        (f"http://[::1/{SECRET}", "the notice URL is not valid (cannot be parsed)"),
    ],
)
def test_a_notice_url_that_cannot_be_used_is_a_reason_not_a_crash(url, why):
    """A port of 99999 crashed the supervisor at its start notice; now it is one reason in the log."""
    assert post_notice(url, {"event": "start"}) == why


def test_a_notice_url_that_refuses_connections_changes_nothing(tmp_path, cache_dir, monkeypatch):
    straight = tmp_path / "straight"
    result = launch(tmp_path / "straight.log", 0, [*common(cache_dir, steps=6), "--out", str(straight)])
    assert result.wait(timeout=300) == 0
    url = f"http://hook:{SECRET}@127.0.0.1:{closed_port()}/hooks/{SECRET}"
    monkeypatch.setenv("DFLASH_NOTIFY_URL_FILE", str(url_file(tmp_path, url)))
    out, log = tmp_path / "out", tmp_path / "run.log"
    supervisor = launch(log, 0, [*common(cache_dir, steps=6), "--out", str(out)])
    try:
        assert supervisor.wait(timeout=300) == 0, log.read_text()
    finally:
        finish(supervisor)
    text = log.read_text()
    assert "notice: the start notice was not delivered (ConnectionRefusedError" in text
    assert "notice: the finish notice was not delivered" in text
    assert SECRET not in text and "127.0.0.1" not in text
    assert losses(out) == losses(straight)
    assert [e["event"] for e in read_events(out)] == ["start", "finish"]
