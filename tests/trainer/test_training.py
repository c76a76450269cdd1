"""Real training runs on CPU: it learns, it stops on SIGTERM with a checkpoint, it resumes exactly,
and a failing worker stops the run."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from trainer.cli import main

from .conftest import REPO, run_trainer
from .test_startup import parts_of

pytestmark = pytest.mark.slow

FAST = ["--set", "train.eval_prompts=4", "--set", "train.eval_max_new_tokens=12"]


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_short_run_learns(tmp_path, cache_dir):
    out = tmp_path / "run"
    result = run_trainer(
        "--run",
        "eager",
        "--out",
        str(out),
        "--steps",
        "120",
        "--set",
        f"data.cache_dir={cache_dir}",
        "--set",
        "train.log_every=20",
        "--set",
        "train.eval_every=60",
        "--set",
        "train.checkpoint_every=60",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    progress = [line for line in lines if re.match(r"^step \d+/\d+ ", line)]
    # The first step (a launch waits for a progress line), then every log_every steps.
    steps = ["1/120", "20/120", "40/120", "60/120", "80/120", "100/120", "120/120"]
    assert [line.split()[1] for line in progress] == steps
    assert re.match(
        r"^step 20/120 loss [0-9.]+ lr [0-9.e+-]+ tok/s \d+ padding \d+% anchors \d+% eta \d+:\d\d:\d\d$",
        progress[1],
    )
    evals_printed = [line for line in lines if re.match(r"^eval step \d+ tau [0-9.]+", line)]
    assert evals_printed[0].startswith("eval step 0 ")
    # The step-0 evaluation (of the step-0 weights) comes after the first progress line.
    assert lines.index(progress[0]) < lines.index(evals_printed[0])
    assert re.match(
        r"^checkpoint saved step 120 ", [line for line in lines if "checkpoint saved" in line][-1]
    )
    assert re.match(r"^done: step 120, tau [0-9.]+ \(step 0: [0-9.]+\)$", lines[-1])

    rows = metrics(out)
    evals = [row for row in rows if row["kind"] == "eval"]
    train_rows = [row for row in rows if row["kind"] == "train"]
    assert [row["step"] for row in evals] == [0, 60, 120]
    assert [row["step"] for row in train_rows] == [20, 40, 60, 80, 100, 120]  # step 1: a line, no row
    assert {"step", "loss", "lr", "tokens_per_s", "elapsed_s"} <= set(train_rows[0])
    # tok/s counts conversations' tokens only: padding and unfilled anchor slots are reported apart.
    first = train_rows[0]
    assert 0 < first["padding_share"] < 1 and 0 < first["valid_anchor_share"] <= 1
    assert first["tokens_per_s"] == pytest.approx(first["row_tokens_per_s"] * (1 - first["padding_share"]))
    tau0, tau_end = evals[0]["tau"], evals[-1]["tau"]
    assert tau0 < 1.3  # an untrained drafter barely helps
    assert tau_end > tau0 + 0.5, (tau0, tau_end)  # it learned to imitate the target
    assert train_rows[-1]["loss"] < train_rows[0]["loss"]
    assert (out / "config.yml").is_file() and (out / "train.log").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000060.pt", "step_00000120.pt"]
    assert (out / "train.log").read_text().splitlines() == lines


def _losses(out: Path) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in metrics(out) if row["kind"] == "train"}


def test_sigterm_then_resume_equals_uninterrupted_run(tmp_path, cache_dir):
    """Packed rows of about four conversations; the 24 steps go past the end of an epoch."""
    common = [
        "--run",
        "eager",
        "--steps",
        "24",
        "--seed",
        "3",
        "--set",
        f"data.cache_dir={cache_dir}",
        "--set",
        "train.seq_len=320",
        "--set",
        "train.log_every=1",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.checkpoint_every=0",
        *FAST,
    ]
    straight = tmp_path / "straight"
    launched = time.monotonic()
    result = run_trainer(*common, "--out", str(straight))
    wall = time.monotonic() - launched
    assert result.returncode == 0, result.stderr
    packed = re.search(
        r"^data: (\d+) training conversations in (\d+) rows of 320 tokens \(packed", result.stdout, re.M
    )
    conversations, rows = int(packed.group(1)), int(packed.group(2))
    assert rows < conversations / 2 and rows < 24 * 8  # several conversations a row; past an epoch

    interrupted = tmp_path / "interrupted"
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer", *common, "--out", str(interrupted)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            if (interrupted / "metrics.jsonl").exists() and len(_losses(interrupted)) >= 8:
                break
            time.sleep(0.1)
        assert process.poll() is None, "the run ended before it could be interrupted"
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        stdout, stderr = process.communicate(timeout=30)
        assert time.monotonic() - sent < 30
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert "signal SIGTERM: checkpointing and exiting" in stdout
    stopped_at = int(re.search(r"^stopped at step (\d+)$", stdout, re.M).group(1))
    assert 8 <= stopped_at < 24
    assert f"checkpoint saved step {stopped_at} " in stdout

    refused = run_trainer(*common, "--out", str(interrupted))
    assert refused.returncode == 2 and "--resume" in refused.stderr

    resumed = run_trainer(*common, "--out", str(interrupted), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert (
        f"resumed from {interrupted / 'checkpoints' / f'step_{stopped_at:08d}.pt'} at step {stopped_at}"
        in (resumed.stdout)
    )
    expected = _losses(straight)
    assert len(expected) == 24
    assert _losses(interrupted) == expected  # bit-for-bit the same losses at every step

    # Each start says where its time went before its first step; the parts add up to the total.
    for output, kind in ((result.stdout, "a start"), (resumed.stdout, "a resume")):
        total, said, parts = parts_of(next(x for x in output.splitlines() if x.startswith("startup: ")))
        assert said == kind and total < wall
        assert sum(parts.values()) == pytest.approx(total, rel=0.05)
        assert parts["imports"] > 0 and parts["target load"] > 0 and parts["first step"] > 0
        assert "config and machine check" in parts
        assert parts["other"] < 0.2 * total, parts
    assert "checkpoint read" in parts and "state restore" in parts


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_a_kill_9_after_a_background_checkpoint_resumes_bit_exact(tmp_path, cache_dir, embedded, writer):
    """The periodic checkpoints are written in the background while training goes on (by a thread
    of the trainer, or by a process of its own); one of them, resumed after a kill -9, gives the
    uninterrupted run's losses bit for bit. The target is a configured one: the resume loads it
    while it reads the checkpoint."""
    target, data = embedded
    common = [
        "--run", "eager", "--steps", "16", "--seed", "5", "--set", f"data.cache_dir={cache_dir}",
        "--set", f"model.target_path={target}", "--set", f"data.train_file={data}",
        "--set", "train.log_every=1", "--set", "train.eval_every=0", "--set", "train.checkpoint_every=4",
        "--set", "train.keep_checkpoints=0", "--set", f"train.checkpoint_writer={writer}", *FAST,
    ]  # fmt: skip
    straight = tmp_path / "straight"
    result = run_trainer(*common, "--out", str(straight))
    assert result.returncode == 0, result.stderr
    cost = r"^checkpoint step 4: training paused [0-9.]+ s; [0-9.]+ GiB written in "
    assert re.search(cost, result.stdout, re.M)

    killed = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "trainer", *common, "--out", str(killed)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        log = killed / "train.log"
        while time.monotonic() < deadline and process.poll() is None:
            if log.exists() and "checkpoint saved step 8 " in log.read_text():
                break
            time.sleep(0.05)
        assert process.poll() is None, "the run ended before it could be killed"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    saved = max(int(path.name[5:13]) for path in (killed / "checkpoints").glob("step_*.pt"))
    assert 8 <= saved < 16

    resumed = run_trainer(*common, "--out", str(killed), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert f"at step {saved}" in resumed.stdout
    assert _losses(killed) == _losses(straight)  # the last row of each step: bit for bit
    _, said, parts = parts_of(next(x for x in resumed.stdout.splitlines() if x.startswith("startup: ")))
    assert said == "a resume" and "checkpoint read" in parts and "target load" in parts


def test_worker_failure_stops_the_run(tmp_path, cache_dir, monkeypatch, capsys):
    from trainer.parallel.replica import Replica

    real_compute = Replica.compute
    calls = {"n": 0}

    def failing_compute(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # the warm-up is call 1; fail in the third training step
            raise RuntimeError("injected failure in a worker")
        return real_compute(self, *args, **kwargs)

    monkeypatch.setattr(Replica, "compute", failing_compute)
    before = {t.name for t in threading.enumerate()}
    started = time.monotonic()
    code = main(
        [
            "--run",
            "eager",
            "--out",
            str(tmp_path / "out"),
            "--steps",
            "10",
            "--set",
            f"data.cache_dir={cache_dir}",
            *FAST,
        ]
    )
    captured = capsys.readouterr()
    assert code == 1
    assert "error: worker 0 failed" in captured.err
    assert "Traceback" in captured.err and "RuntimeError: injected failure in a worker" in captured.err
    assert time.monotonic() - started < 120
    leftover = [t for t in threading.enumerate() if t.name.startswith("worker-") and t.is_alive()]
    assert leftover == [] and {t.name for t in threading.enumerate()} <= before | {"MainThread"}


def test_a_stop_during_the_warm_up_waits_for_the_first_weights_copy(tmp_path, cache_dir, monkeypatch, capsys):
    """SIGTERM while the workers warm up and the host copy of the first evaluation's weights is still
    on its thread: the run stops before training with nothing to checkpoint, and it returns only
    after the copy has ended, so nothing of the run goes on behind its end."""
    import trainer.run.train as train
    from trainer.parallel.replica import Replica
    from trainer.parallel.topology import ThreadedTopology

    gave_up, events = threading.Event(), []
    real_copy, real_compute, real_wait_ready = train.host_copy, Replica.compute, ThreadedTopology.wait_ready

    def slow_copy(drafter):
        if threading.current_thread().name != "first-weights":
            return real_copy(drafter)
        gave_up.wait(timeout=60)
        time.sleep(0.5)  # the stop goes on meanwhile: it must wait for this copy
        weights = real_copy(drafter)
        events.append("copy ended")
        return weights

    def stop_in_warm_up(self, *args, **kwargs):
        if not gave_up.is_set():
            os.kill(os.getpid(), signal.SIGTERM)  # what ./dev.sh stop sends
            gave_up.wait(timeout=60)  # the warm-up goes on until the run has seen the stop
        return real_compute(self, *args, **kwargs)

    def wait_ready(self, should_stop):
        ready = real_wait_ready(self, should_stop)
        if not ready:
            gave_up.set()
        return ready

    monkeypatch.setattr(train, "host_copy", slow_copy)
    monkeypatch.setattr(Replica, "compute", stop_in_warm_up)
    monkeypatch.setattr(ThreadedTopology, "wait_ready", wait_ready)
    out = tmp_path / "out"
    code = main(
        ["--run", "eager", "--out", str(out), "--steps", "10", "--set", f"data.cache_dir={cache_dir}"]
    )
    events.append("run returned")
    said = capsys.readouterr().out
    assert code == 0
    assert "signal SIGTERM: checkpointing and exiting" in said and "nothing to checkpoint yet" in said, said
    assert gave_up.is_set() and events == ["copy ended", "run returned"]
    assert not [t for t in threading.enumerate() if t.name == "first-weights"]
    assert "stopped at step 0" in said and list(out.glob("checkpoints/step_*.pt")) == []


def test_compiled_run_says_it_compiles_each_worker_and_ends_with_done(tmp_path, cache_dir):
    out = tmp_path / "run"
    result = run_trainer(
        "--run",
        "nographs",
        "--out",
        str(out),
        "--steps",
        "3",
        "--set",
        f"data.cache_dir={cache_dir}",
        *FAST,
        timeout=500,
    )
    assert result.returncode == 0, result.stderr
    assert "drafter on cpu: compiling forward (cudagraphs=False)" in result.stdout.splitlines()
    assert result.stdout.splitlines()[-1].startswith("done: step 3, tau ")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_threaded_run_on_every_gpu(tmp_path, cache_dir):
    import torch

    out = tmp_path / "run"
    result = run_trainer(
        "--run",
        "nographs",
        "--out",
        str(out),
        "--steps",
        "5",
        "--set",
        "parallel.devices=auto",
        "--set",
        f"data.cache_dir={cache_dir}",
        *FAST,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr
    for index in range(torch.cuda.device_count()):
        assert f"drafter on cuda:{index}: compiling forward (cudagraphs=False)" in result.stdout
    assert result.stdout.splitlines()[-1].startswith("done: step 5, tau ")


TWO_CPU_WORKERS = [
    "--run=eager", "--seed=3", "--steps=8", "--set=data.regenerate=false", "--set=train.batch_size=2",
    "--set=train.eval_prompts=1", "--set=train.eval_max_new_tokens=2", "--set=train.log_every=1",
    "--set=train.eval_every=0", "--set=train.checkpoint_every=0", "--set=parallel.devices=cpu",
    "--set=parallel.cpu_workers=2",
]  # fmt: skip
SHARDED = "--set=parallel.shard_optimizer=true"


def _stop_after_step(monkeypatch, stop_at: int) -> None:
    """SIGTERM to this process (as a stop request) right after training step `stop_at`."""
    import trainer.run.train

    real_step, steps = trainer.run.train.train_step, []

    def step_then_stop(topology, loader):
        result = real_step(topology, loader)
        steps.append(len(steps) + 1)
        if len(steps) == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    monkeypatch.setattr(trainer.run.train, "train_step", step_then_stop)


def test_sharded_optimizer_gives_the_losses_of_the_unsharded_one(tmp_path, cache_dir):
    common = [*TWO_CPU_WORKERS, f"--set=data.cache_dir={cache_dir}"]
    assert main([*common, "--out", str(tmp_path / "unsharded")]) == 0
    assert main([*common, SHARDED, "--out", str(tmp_path / "sharded")]) == 0
    want, got = _losses(tmp_path / "unsharded"), _losses(tmp_path / "sharded")
    assert len(got) == len(want) == 8
    assert got[1] == want[1]  # the first step starts from the same weights
    # The global gradient norm is summed in another order: clipping differs in the last bits.
    assert list(got.values()) == pytest.approx(list(want.values()), rel=1e-5)


def test_sharded_run_stops_and_resumes_exactly_sharded_or_not(tmp_path, cache_dir, monkeypatch, capsys):
    common = [*TWO_CPU_WORKERS, f"--set=data.cache_dir={cache_dir}"]
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    assert main([*common, SHARDED, "--out", str(straight)]) == 0
    with monkeypatch.context() as patch:
        _stop_after_step(patch, 3)
        assert main([*common, SHARDED, "--out", str(interrupted)]) == 0
    assert "stopped at step 3" in capsys.readouterr().out
    assert [p.name for p in (interrupted / "checkpoints").iterdir()] == ["step_00000003.pt"]
    unsharded = tmp_path / "unsharded"
    shutil.copytree(interrupted, unsharded)
    assert main([*common, SHARDED, "--out", str(interrupted), "--resume"]) == 0
    assert main([*common, "--out", str(unsharded), "--resume"]) == 0  # the same checkpoint
    said = capsys.readouterr().out
    assert "resumed from" in said
    # where the read's time went, after each resume line
    read = r"checkpoint read: step_00000003\.pt, [\d.]+ GiB read and checksummed in [\d.]+ s on \d+ threads, "
    assert len(re.findall(read, said)) == 2, said[-3000:]
    want = _losses(straight)
    assert _losses(interrupted) == want  # bit-for-bit the same losses at every step
    resumed_unsharded = _losses(unsharded)
    assert resumed_unsharded.keys() == want.keys() and resumed_unsharded[4] == pytest.approx(
        want[4], rel=1e-6
    )
    assert list(resumed_unsharded.values()) == pytest.approx(list(want.values()), rel=1e-5)


ANSWERED = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}'
UNANSWERED = '{"messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ([ANSWERED, "{oops"], r'chat\.jsonl:2: not JSON .*; every line must be one \{"messages": '),
        ([UNANSWERED], r'chat\.jsonl: no conversation with an assistant turn; expected one \{"messages": '),
    ],
)  # fmt: skip
def test_bad_training_data_is_one_line_naming_the_file_and_exit_2(tmp_path, cache_dir, embedded, lines, said):
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    result = run_trainer(
        "--run", "eager", "--out", str(out), "--set", f"data.cache_dir={cache_dir}",
        "--set", f"data.train_file={data}", "--set", f"model.target_path={embedded[0]}", *FAST, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert re.search(said, result.stderr), result.stderr
    assert "Traceback" not in result.stderr
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())


def test_a_resumed_run_stopped_before_training_stays_at_its_checkpoint_s_step(
    tmp_path, cache_dir, monkeypatch
):
    """A stop while the data is prepared (the token store's build, a regeneration) on a resumed run:
    the record says the step the run is at (its checkpoint's), not 0."""
    import trainer.run.train
    from trainer.run import runrecord

    out = tmp_path / "resumed"
    args = ["--run", "eager", "--seed", "5", "--set", f"data.cache_dir={cache_dir}", "--set",
            "train.eval_every=0", "--set", "train.checkpoint_every=4", *FAST, "--out", str(out)]  # fmt: skip
    first = run_trainer(*args, "--steps", "4")
    assert first.returncode == 0, first.stderr
    runrecord.write_record(out, {"run": "eager", "run_id": "eager-2", "pid": os.getpid(), "state": "running"})
    monkeypatch.setattr(trainer.run.train, "load_data", lambda *_args: None)  # a stop came meanwhile
    assert main([*args, "--steps", "8", "--resume"]) == 0
    record = runrecord.read_record(out)
    assert (record["state"], record["exit_reason"]) == ("stopped", "stopped at step 4, before training began")


def test_a_run_resumed_on_data_prepared_again_trains_on_and_says_so(tmp_path, cache_dir, embedded):
    """The data file changed under a checkpoint (or a newer version prepared the data again): the
    resume goes on from the same share of its epoch on the new rows, and its line says so."""
    data = tmp_path / "chat.jsonl"
    shutil.copy(embedded[1], data)
    out = tmp_path / "out"
    args = ["--run", "eager", "--seed", "5", "--set", f"data.cache_dir={cache_dir}", "--set",
            f"data.train_file={data}", "--set", f"model.target_path={embedded[0]}", "--set",
            "train.eval_every=0", "--set", "train.checkpoint_every=4",
            *FAST, "--out", str(out)]  # fmt: skip
    first = run_trainer(*args, "--steps", "4")
    assert first.returncode == 0, first.stderr
    lines = embedded[1].read_text().splitlines()
    data.write_text("\n".join(lines + lines[: len(lines) // 2]) + "\n")  # half as many again
    resumed = run_trainer(*args, "--steps", "8", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    said = next(line for line in resumed.stdout.splitlines() if "resumed from" in line)
    assert "the data is not the one the checkpoint trained on" in said, said
    assert [row["step"] for row in metrics(out) if "loss" in row][-1] == 8


def test_drafter_weights_evaluates_earlier_weights_and_gives_back_its_own_bit_for_bit():
    from trainer.run.train import drafter_weights, host_copy

    drafter = torch.nn.Linear(4, 3)
    earlier = host_copy(drafter)
    with torch.no_grad():
        drafter.weight.add_(1.0)
    own = host_copy(drafter)
    weight = drafter.weight
    with drafter_weights(drafter, earlier):
        assert torch.equal(drafter.weight, earlier["weight"]) and drafter.weight is weight  # in place
    assert torch.equal(drafter.weight, own["weight"])
    with pytest.raises(RuntimeError, match="stopped"), drafter_weights(drafter, earlier):
        raise RuntimeError("stopped")
    assert torch.equal(drafter.weight, own["weight"]) and torch.equal(drafter.bias, own["bias"])


def test_a_stop_during_the_step_0_evaluation_checkpoints_the_first_step_s_weights(
    tmp_path, cache_dir, monkeypatch, capsys
):
    """The step-0 evaluation runs on the step-0 weights after the first step: a stop during it
    checkpoints step 1 with the weights step 1 made (those a run that goes on checkpoints at step
    1), not step 0's."""
    import trainer.run.train
    from trainer.run.checkpoint import list_checkpoints, load_checkpoint

    args = ["--run", "eager", "--seed", "3", "--steps", "6", "--set", f"data.cache_dir={cache_dir}",
            "--set", "train.eval_every=0", "--set", "train.keep_checkpoints=0", *FAST]  # fmt: skip
    evaluated = []

    def evaluation(tau):
        def acceptance_length(drafter, *_args, **_kwargs):
            evaluated.append({name: value.clone() for name, value in drafter.state_dict().items()})
            return tau

        return acceptance_length

    monkeypatch.setattr(trainer.run.train, "acceptance_length", evaluation(1.0))
    assert main([*args, "--set", "train.checkpoint_every=1", "--out", str(tmp_path / "on")]) == 0
    monkeypatch.setattr(trainer.run.train, "acceptance_length", evaluation(None))  # a stop came
    assert main([*args, "--set", "train.checkpoint_every=0", "--out", str(tmp_path / "stopped")]) == 0
    [(step, path)] = list_checkpoints(tmp_path / "stopped" / "checkpoints")
    assert step == 1
    stopped = load_checkpoint(path)
    want = load_checkpoint(list_checkpoints(tmp_path / "on" / "checkpoints")[0][1])
    assert want["step"] == 1 and stopped["tau0"] == -1.0  # not evaluated: a resume evaluates at its step
    step_0 = evaluated[-1]  # what the stopped run's evaluation saw: the step-0 weights, same seed
    assert all(torch.equal(step_0[name], value) for name, value in evaluated[0].items())
    assert not torch.equal(stopped["drafter"]["fc.weight"], step_0["fc.weight"])  # trained since
    for name, value in want["drafter"].items():
        assert torch.equal(stopped["drafter"][name], value), name
    # Its resume evaluates step 1's weights in step 0's stead, after its first step's progress line
    # (what launch.yml waits for), and says so at the end.
    monkeypatch.setattr(trainer.run.train, "acceptance_length", evaluation(1.25))
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "stopped"), "--resume"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "done: step 6, tau 1.25 (step 1: 1.25)" in lines
    assert lines.index("eval step 1 tau 1.250 prompts 4") > next(
        index for index, line in enumerate(lines) if line.startswith("step 2/6 ")
    )
    for name, value in stopped["drafter"].items():  # evaluated: the resumed step's weights
        assert torch.equal(evaluated[-2][name], value), name
