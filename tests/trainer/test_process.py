"""The process topology on CPU: two gloo ranks under torchrun (through trainer.launch).

Lean on purpose (two shared cores): tiny shapes, no regeneration, compile mode none, every wait
bounded; every process a test starts is ended by its PID when the test fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .conftest import REPO, run_trainer

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc to find the ranks")

TINY = [
    "--seed=3",
    "--set=compile.mode=none",
    "--set=data.regenerate=false",
    "--set=train.batch_size=1",
    "--set=train.eval_prompts=1",
    "--set=train.eval_max_new_tokens=2",
    "--set=train.log_every=1",
    "--set=train.eval_every=0",
    "--set=parallel.step_timeout_s=60",
    "--set=parallel.shutdown_timeout_s=30",
]


def losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [row["loss"] for row in rows if row["kind"] == "train"]


def launch(*args: str, log: Path, options: tuple[str, ...] = (), env: dict | None = None) -> subprocess.Popen:
    """python -m trainer.launch OPTIONS -- ARGS, detached into its own session, output to log
    (`env`: added to this environment)."""
    with log.open("ab") as handle:
        return subprocess.Popen(
            [sys.executable, "-m", "trainer.launch", *options, "--", *args],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run exited ({proc.returncode}) before {what}")
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def ranks_of(pid: int) -> dict[int, int]:
    """Rank -> PID of torchrun's worker processes (its children with RANK in their environment)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    found = {}
    for child in children:
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                found[int(item[5:])] = child
    return found


def end(proc: subprocess.Popen) -> None:
    """Make sure a run this test started is gone (its whole session: torchrun and its ranks)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_two_processes_match_the_threaded_topology(embedded, cache_dir, tmp_path):
    """Same seed, same global batch (2 x 1): 2 gloo ranks reproduce 2 worker threads' losses."""
    common = [*TINY, "--steps=3", f"--set=data.cache_dir={cache_dir}", "--set=train.checkpoint_every=0"]
    threaded = run_trainer(
        "--run", "eager", *common, "--set=parallel.cpu_workers=2", "--out", str(tmp_path / "threaded")
    )
    assert threaded.returncode == 0, threaded.stderr
    assert "devices cpu, cpu" in threaded.stdout
    log = tmp_path / "process.log"
    proc = launch(
        "--run",
        "process",
        *common,
        "--set=parallel.cpu_workers=2",
        "--out",
        str(tmp_path / "process"),
        log=log,
    )
    try:
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        end(proc)
    text = log.read_text()
    assert "topology process, devices 2 process(es) (gloo)" in text
    assert text.count("done: step 3") == 1  # rank 0 alone writes
    ours, theirs = losses(tmp_path / "process"), losses(tmp_path / "threaded")
    assert len(ours) == len(theirs) == 3
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), (ours, theirs)


def test_sigterm_then_a_dead_rank_then_resume(embedded, cache_dir, tmp_path):
    """SIGTERM to torchrun: rank 0 checkpoints, ranks exit 0. A killed rank: the run stops within
    the bounded timeouts. Both times the last checkpoint resumes."""
    out = tmp_path / "out"
    common = [
        "--run",
        "process",
        *TINY,
        f"--set=data.cache_dir={cache_dir}",
        "--set=parallel.cpu_workers=2",
        "--set=train.checkpoint_every=2",
        "--out",
        str(out),
    ]
    log = tmp_path / "train.log"
    text = lambda: log.read_text() if log.exists() else ""  # noqa: E731

    proc = launch(*common, "--steps=400", log=log)
    try:
        wait_for(lambda: "checkpoint saved step 2 " in text(), 180, "the first checkpoint", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, text()[-3000:]  # every rank stopped cleanly
    finally:
        end(proc)
    assert "signal SIGTERM: checkpointing and exiting" in text(), text()[-3000:]
    stopped_at = int(text().split("stopped at step ")[1].split()[0])
    assert f"checkpoint saved step {stopped_at} " in text()
    # Every rank exited 0 (torchrun exits 0 only then), and nothing crashed on the way.
    assert "Root Cause" not in text() and "Traceback" not in text(), text()[-3000:]

    proc = launch(*common, "--steps=400", "--resume", log=log)
    try:
        wait_for(lambda: f"resumed from {out}/checkpoints" in text(), 180, "the resume", proc)
        assert f"at step {stopped_at}" in text().split("resumed from")[-1].splitlines()[0]
        next_checkpoint = stopped_at + 2 - stopped_at % 2
        wait_for(
            lambda: f"checkpoint saved step {next_checkpoint} " in text(),
            120,
            "a checkpoint after resume",
            proc,
        )
        ranks = ranks_of(proc.pid)
        assert set(ranks) == {0, 1}, ranks
        os.kill(ranks[1], signal.SIGKILL)
        started = time.monotonic()
        code = proc.wait(timeout=90)
        took = time.monotonic() - started
    finally:
        end(proc)
    assert code != 0
    assert took < 60, f"the run took {took:.0f}s to stop after a rank died"
    for pid in ranks.values():
        assert (
            not Path(f"/proc/{pid}").exists()
            or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]
        )

    from trainer.run.checkpoint import list_checkpoints

    last = list_checkpoints(out / "checkpoints")[-1][0]
    assert last >= next_checkpoint
    final = run_trainer_process(*common, f"--steps={last + 1}", "--resume", log=log)
    assert final == 0, text()[-3000:]
    assert f"at step {last}" in text().split("resumed from")[-1].splitlines()[0]
    assert f"done: step {last + 1}" in text()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def listening(port: int) -> bool:
    """Something listens on this TCP port, on any address (read from /proc, without connecting)."""
    rows = [
        row.split()
        for table in ("/proc/net/tcp", "/proc/net/tcp6")
        if Path(table).exists()
        for row in Path(table).read_text().splitlines()[1:]
    ]
    return any(row[1].endswith(f":{port:04X}") and row[3] == "0A" for row in rows)


def progress(text: str) -> list[str]:
    """The progress lines' global part (step, loss, lr): tok/s and eta are each host's own timing."""
    return [" ".join(line.split()[:6]) for line in text.splitlines() if line.startswith("step ")]


def test_two_hosts_without_shared_storage_resume_from_rank_0(embedded, cache_dir, tmp_path, monkeypatch):
    """Two "hosts" (one gloo rank each, a static rendezvous on loopback), each with its own --out:
    rank 0 alone writes files and host 1 logs the same progress; SIGTERM to host 1 stops both with
    rank 0's checkpoint; on --resume host 1 first receives that checkpoint from rank 0, later loads
    its own copy of one; the losses are those of an uninterrupted run. Nothing is shared but the
    rendezvous: not the output, not the cache."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the two "hosts" talk over loopback only
    outs = [tmp_path / "host0", tmp_path / "host1"]
    logs = [tmp_path / "host0.log", tmp_path / "host1.log"]
    # Host 1 builds the embedded target into a cache of its own, as a separate machine would.
    caches = [cache_dir, tmp_path / "host1-cache"]
    steps = 300  # enough that each SIGTERM comes mid-run (a tiny step takes milliseconds)
    common = [
        "--run",
        "process",
        *TINY,
        f"--steps={steps}",
        "--set=train.checkpoint_every=0",
        "--set=parallel.rendezvous_timeout_s=120",
        "--set=parallel.step_timeout_s=120",
    ]

    def run_both(*args: str, signal_host: int | None = None, after: str = "") -> list[str]:
        """Run both hosts (host 1 starts first: it waits for the rendezvous host 0 serves), and
        SIGTERM one of them once its log shows `after`. Returns what each log gained."""
        port = free_port()
        before = [log.read_text() if log.exists() else "" for log in logs]
        gained = lambda rank: logs[rank].read_text()[len(before[rank]) :]  # noqa: E731
        procs: dict[int, subprocess.Popen] = {}
        try:
            for rank in (1, 0):
                options = (
                    "--nnodes=2",
                    f"--node-rank={rank}",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    "--rdzv-id=two-hosts",
                )
                own = ["--out", str(outs[rank]), f"--set=data.cache_dir={caches[rank]}"]
                procs[rank] = launch(*common, *args, *own, log=logs[rank], options=options)
            if signal_host is not None:
                wait_for(lambda: after in gained(signal_host), 240, after, procs[signal_host])
                procs[signal_host].send_signal(signal.SIGTERM)
            codes = [procs[rank].wait(timeout=240) for rank in (0, 1)]
        finally:
            for proc in procs.values():
                end(proc)
        texts = [gained(0), gained(1)]
        assert codes == [0, 0], texts
        return texts

    first = run_both(signal_host=1, after="step 2/")
    assert "topology process, devices 2 process(es) (gloo), rank 0 on cpu" in first[0]
    assert "rank 1 on cpu" in first[1]
    assert progress(first[1]) == progress(first[0]) and len(progress(first[0])) >= 2, first
    stopped = int(first[0].split("stopped at step ")[1].split()[0])
    assert 2 <= stopped < steps, first[0]
    lead_checkpoint = outs[0] / "checkpoints" / f"step_{stopped:08d}.pt"
    assert f"checkpoint saved step {stopped} {lead_checkpoint}" in first[0]
    assert (
        f"checkpoint saved step {stopped} by rank 0 on {socket.gethostname()}: {lead_checkpoint}" in first[1]
    )
    assert f"stopped at step {stopped}" in first[1]
    assert sorted(p.name for p in outs[1].iterdir()) == [".run.json.reserve", "run.json"], (
        "host 1 writes no train.log, metrics or checkpoints: its run record (and room for its last write)"
    )

    second = run_both("--resume", signal_host=0, after=f"step {stopped + 1}/")
    assert f"resumed from {lead_checkpoint} at step {stopped}\n" in second[0]
    assert f"resumed from {lead_checkpoint} at step {stopped} (received from rank 0)" in second[1]
    assert progress(second[1]) == progress(second[0]), second
    assert sorted(p.name for p in outs[1].iterdir()) == [".run.json.reserve", "run.json"]
    again = int(second[0].split("stopped at step ")[1].split()[0])
    assert again > stopped

    # Host 1 holds rank 0's newest file now (as with shared storage): it loads its own copy.
    copy = outs[1] / "checkpoints" / f"step_{again:08d}.pt"
    copy.parent.mkdir(parents=True)
    shutil.copyfile(outs[0] / "checkpoints" / copy.name, copy)
    third = run_both("--resume")
    assert f"at step {again} (this host's copy {copy})" in third[1], third[1]
    assert f"done: step {steps}" in third[0] and f"done: step {steps}" in third[1]
    from trainer.run.runrecord import read_record

    # One stretch: the same shape every time (the hosts counted from torchrun's node ranks).
    for out in outs:  # each host's record (each host's status reads its own)
        stretches = read_record(out)["stretches"]
        assert [(s["from_step"], s["workers"], s["topology"], s["hosts"]) for s in stretches] == [
            (0, 2, "process", 2)
        ]

    reference = run_trainer(
        "--run",
        "eager",
        *TINY,
        f"--steps={steps}",
        f"--set=data.cache_dir={cache_dir}",
        "--set=train.checkpoint_every=0",
        "--set=parallel.cpu_workers=2",
        "--out",
        str(tmp_path / "reference"),
    )
    assert reference.returncode == 0, reference.stderr
    rows = [json.loads(line) for line in (outs[0] / "metrics.jsonl").read_text().splitlines()]
    by_step = {row["step"]: row["loss"] for row in rows if row["kind"] == "train"}  # the last per step
    assert sorted(by_step) == list(range(1, steps + 1))
    expected = losses(tmp_path / "reference")
    assert [by_step[step] for step in sorted(by_step)] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_sigterm_while_the_rendezvous_waits_ends_torchrun_at_once(tmp_path):
    """Node rank 0 of two, its peer never comes: torchrun waits in the rendezvous (in C++, where a
    Python signal handler would only run after parallel.rendezvous_timeout_s). SIGTERM ends it now."""
    port, log = free_port(), tmp_path / "alone.log"
    options = ("--nnodes=2", "--node-rank=0", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=alone")
    args = ["--run", "process", "--set=parallel.devices=cpu", "--set=parallel.rendezvous_timeout_s=300"]
    proc = launch(*args, "--out", str(tmp_path / "out"), log=log, options=options)
    try:
        wait_for(lambda: listening(port), 120, "the rendezvous to listen", proc)
        time.sleep(1)  # well inside the wait for the other host
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = proc.wait(timeout=60)
        took = time.monotonic() - started
    finally:
        end(proc)
    assert code == 128 + signal.SIGTERM, log.read_text()
    assert took < 10, f"torchrun took {took:.0f}s to end after SIGTERM"
    assert "torchrun: SIGTERM while no rank runs (rendezvous or exit barrier): exiting" in log.read_text()
    # Nothing ran: the output holds only the run record (and its reserve) and the events, which say so.
    listing = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert listing == [".run.json.reserve", "events.jsonl", "run.json"]
    from trainer.run.events import read_events

    assert [e["event"] for e in read_events(tmp_path / "out")] == ["start", "stop"]


def run_trainer_process(*args: str, log: Path) -> int:
    proc = launch(*args, log=log)
    try:
        return proc.wait(timeout=240)
    finally:
        end(proc)


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        (["--nnodes=2"], "--rdzv-endpoint"),
        (["--nnodes=2", "--rdzv-endpoint=127.0.0.1", "--rdzv-id=r"], "must be HOST:PORT"),
        (["--nnodes=2", "--rdzv-endpoint=127.0.0.1:65536", "--rdzv-id=r"], "port 1..65535"),
        (["--nnodes=2", "--node-rank=2", "--rdzv-endpoint=h:29400", "--rdzv-id=r"], "--node-rank 2"),
    ],
)
def test_launch_refuses_bad_input_before_starting(tmp_path, options, problem):
    result = subprocess.run(
        [sys.executable, "-m", "trainer.launch", *options, "--", "--run", "process", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert problem in result.stderr


def test_launch_command_per_topology(tmp_path):
    def dry(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "trainer.launch", "--dry-run", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    process = dry("--", "--run", "graphs", "--set=parallel.devices=cpu", "--set=parallel.cpu_workers=3")
    assert "-m trainer.torchrun --standalone --nproc-per-node=3" in process
    assert process.strip().endswith(
        "-m trainer -- --run graphs --set=parallel.devices=cpu --set=parallel.cpu_workers=3"
    )
    nodes = dry(
        "--nnodes=2",
        "--node-rank=1",
        "--rdzv-endpoint=127.0.0.1:29555",
        "--rdzv-id=r1",
        "--",
        "--run",
        "process",
    )
    # The static rendezvous keeps the node ranks (c10d would ignore them): rank 0 is on node rank 0.
    assert (
        "--nnodes=2 --node-rank=1 --rdzv-backend=static --rdzv-endpoint=127.0.0.1:29555 --rdzv-id=r1 "
        "--rdzv-conf=timeout=600 " in nodes
    )
    threaded = dry("--", "--run", "nographs")
    assert "-m trainer.supervise --max-restarts=0 --backoff-s=10 -m trainer -- --run nographs" in threaded
    assert "torch.distributed" not in threaded
    recovering = dry("--max-restarts=3", "--restart-backoff-s=2", "--", "--run", "process")
    assert "--max-restarts=3 --restart-backoff-s=2 " in recovering


def test_graphs_profile_process_only(tmp_path):
    ok = run_trainer("--run", "graphs", "--check", "--out", str(tmp_path / "o"), timeout=120)
    assert ok.returncode == 0 and ok.stdout.strip() == "ok: graphs", ok.stderr
    refused = run_trainer(
        "--run", "graphs", "--check", "--set=run.topology=threaded", "--out", str(tmp_path / "o"), timeout=120
    )
    assert refused.returncode == 2
    assert "compile.mode=reduce-overhead turns CUDA graphs on" in refused.stderr
    assert "run.topology=threaded" in refused.stderr


def test_torchrun_wrapper_drops_an_option_older_torchrun_lacks():
    from trainer.torchrun import without_option

    argv = [
        "--standalone",
        "--shutdown-timeout=120",
        "--nproc-per-node=2",
        "--shutdown-timeout",
        "5",
        "-m",
        "x",
    ]
    assert without_option(argv, "--shutdown-timeout") == ["--standalone", "--nproc-per-node=2", "-m", "x"]


def test_torchrun_restarts_a_killed_rank_and_the_losses_continue_exactly(embedded, cache_dir, tmp_path):
    """--max-restarts: torchrun's own restart, every rank resumes from rank 0's newest checkpoint."""
    common = [
        "--run",
        "process",
        *TINY,
        # Enough steps that the run is still training when a rank is killed after step 2.
        "--steps=60",
        f"--set=data.cache_dir={cache_dir}",
        "--set=parallel.cpu_workers=2",
        "--set=train.checkpoint_every=2",
    ]
    straight = launch(*common, "--out", str(tmp_path / "straight"), log=tmp_path / "straight.log")
    try:
        assert straight.wait(timeout=240) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    finally:
        end(straight)

    out, log = tmp_path / "recovered", tmp_path / "recovered.log"
    proc = launch(
        *common, "--out", str(out), log=log, options=("--max-restarts=2", "--restart-backoff-s=0.2")
    )
    try:
        wait_for(lambda: "checkpoint saved step 2 " in log.read_text(), 180, "the first checkpoint", proc)
        os.kill(ranks_of(proc.pid)[1], signal.SIGKILL)
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        end(proc)
    text = log.read_text()
    assert "restart 1/2 with --resume" in text and f"resumed from {out}/checkpoints" in text

    def by_step(run: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        return {row["step"]: row["loss"] for row in rows if row["kind"] == "train"}

    assert by_step(out) == by_step(tmp_path / "straight")
    from trainer.run.events import read_events

    events = read_events(out)
    assert [e["event"] for e in events] == ["start", "crash", "restart", "finish"], events
    assert events[1]["reason"].startswith("rank 1 killed by SIGKILL"), events[1]


def test_torchrun_never_restarts_a_stop_or_bad_input(embedded, cache_dir, tmp_path):
    """With restarts allowed: SIGTERM stops for good (every rank checkpoints, exit 0), and a rank
    that exits 2 (bad input) fails the run at once instead of failing again max-restarts times."""
    from trainer.run.events import read_events

    common = [*TINY, f"--set=data.cache_dir={cache_dir}", "--set=parallel.cpu_workers=2"]
    restarts = ("--max-restarts=3", "--restart-backoff-s=0.2")
    out, log = tmp_path / "stopped", tmp_path / "stopped.log"
    proc = launch("--run", "process", *common, "--steps=400", "--out", str(out), log=log, options=restarts)
    try:
        wait_for(lambda: "step 2/400" in log.read_text(), 180, "step 2", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log.read_text()[-3000:]
    finally:
        end(proc)
    assert log.read_text().count("run process: topology process") == 1
    assert [e["event"] for e in read_events(out)] == ["start", "stop"]

    out, log = tmp_path / "bad", tmp_path / "bad.log"
    bad = ["--set=data.train_file=/nonexistent/chat.jsonl", "--set=model.target_path=/nonexistent/target"]
    proc = launch("--run", "process", *common, *bad, "--out", str(out), log=log, options=restarts)
    try:
        assert proc.wait(timeout=180) != 0
    finally:
        end(proc)
    events = read_events(out)
    assert [e["event"] for e in events] == ["start", "failed"], events
    assert events[-1]["exit_status"] == 2 and events[-1]["reason"].startswith("bad input: rank ")
    assert "with --resume" not in log.read_text()
