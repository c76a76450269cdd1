"""The startup breakdown: where a start's time goes before its first step, adding up to the time
measured from the trainer's entry, in the log and in the run record."""

from __future__ import annotations

import os
import re
import time
from types import SimpleNamespace

import pytest

from trainer.run import runrecord
from trainer.run.startup import ORDER, StartupClock, describe
from trainer.run.train import Run

pytestmark = pytest.mark.unit

LINE = re.compile(  # the parts, then any clauses after a semicolon (graphs, torch.compile's time)
    r"^startup: ([0-9.]+) s from the trainer's start to the first step \((a start|a resume)\): "
    r"([^;]*)(?:; .*)?$"
)


def parts_of(line: str) -> tuple[float, str, dict[str, float]]:
    """(the total, start or resume, {part: seconds}) of a startup line."""
    match = LINE.match(line)
    assert match, line
    parts = dict(re.fullmatch(r"(.+) ([0-9.]+) s", item).groups() for item in match.group(3).split(", "))
    return float(match.group(1)), match.group(2), {name: float(seconds) for name, seconds in parts.items()}


def test_the_parts_and_other_add_up_to_the_time_since_the_entry():
    clock = StartupClock(began=100.0)
    clock.add("target load", 20.0)
    clock.add("compile and warm-up", 45.5)
    clock.add("target load", 1.0)  # a part met twice adds up
    breakdown = clock.breakdown(now=170.0)
    assert breakdown == {"target load": 21.0, "compile and warm-up": 45.5, "other": 3.5, "total": 70.0}
    assert list(breakdown)[:2] == ["target load", "compile and warm-up"], "in the order a start goes"


def test_a_part_is_timed_also_when_it_raises():
    clock = StartupClock(time.perf_counter())
    with pytest.raises(RuntimeError), clock.part("first step"):
        time.sleep(0.02)
        raise RuntimeError("the step failed")
    assert clock.seconds["first step"] >= 0.02


def test_an_unknown_part_is_refused_by_name():
    with pytest.raises(ValueError, match="no startup part 'warmup'; the parts are imports, config and"):
        StartupClock(0.0).add("warmup", 1.0)


def test_the_line_names_every_part_then_other_and_reads_back():
    breakdown = {"target load": 21.0, "first step": 1.62, "other": 3.5, "total": 26.12}
    line = describe(breakdown, resumed=True)
    total, kind, parts = parts_of(line)
    assert (total, kind) == (26.1, "a resume")
    assert parts == {"target load": 21.0, "first step": 1.6, "other": 3.5}
    assert set(ORDER) >= set(parts) - {"other"}


def test_the_parts_as_printed_add_up_to_the_total_as_printed():
    """Each part rounded alone would miss: ten parts of 0.34 s print 0.3 s each, 3.0 s of 3.4 s."""
    seconds = {name: 0.34 for name in ORDER[:10]}
    breakdown = {**seconds, "other": 0.0, "total": 3.4}
    total, _, parts = parts_of(describe(breakdown, resumed=False))
    assert total == 3.4
    assert round(sum(parts.values()) * 10) == 34
    assert all(abs(parts[name] - value) < 0.1 for name, value in breakdown.items() if name != "total")


def test_the_run_record_keeps_the_breakdown(tmp_path):
    runrecord.write_record(tmp_path, {"pid": os.getpid(), "state": "running"})
    lines: list[str] = []
    run = SimpleNamespace(
        startup=StartupClock(time.perf_counter() - 2.0), resumed=False, out_dir=tmp_path,
        out=SimpleNamespace(line=lines.append), world=SimpleNamespace(local_rank=0),
    )  # fmt: skip
    run.startup.add("target load", 1.5)
    Run.report_startup(run)
    Run.report_startup(run)  # once a start
    assert len(lines) == 1 and parts_of(lines[0])[1] == "a start"
    kept = runrecord.read_record(tmp_path)["startup"]
    assert kept["resumed"] is False and kept["seconds"]["target load"] == 1.5
    seconds = kept["seconds"]
    assert sum(v for k, v in seconds.items() if k != "total") == pytest.approx(seconds["total"], abs=0.02)


def test_a_resume_loads_the_target_while_it_reads_its_checkpoint(tmp_path, monkeypatch):
    """The target's load begins before the checkpoint read ends; a refused checkpoint leaves no
    load running behind it."""
    import threading

    import torch

    from trainer.config import load_config
    from trainer.parallel.topology import ThreadedWorld
    from trainer.run import train as train_module

    loading = threading.Event()
    seen: dict[str, object] = {}

    def slow_load(path, device, dtype):
        seen["target"] = (path, device, dtype)
        loading.set()
        time.sleep(0.2)
        return object()

    def read_checkpoint(cfg, out_dir, world):
        seen["overlapped"] = loading.wait(10)  # bounded: a load in line would never start
        raise train_module.BadInput("checkpoint refused")

    monkeypatch.setattr(train_module, "load_target", slow_load)
    monkeypatch.setattr(train_module, "find_resume_point", read_checkpoint)
    cfg = load_config("eager", None, [f"model.target_path={tmp_path / 'target'}"])
    place = train_module.Placement([torch.device("cpu")], ThreadedWorld(), 1, None)
    with pytest.raises(train_module.BadInput, match="checkpoint refused"):
        train_module.run_training(cfg, tmp_path / "out", True, place)
    assert seen["overlapped"] is True
    assert seen["target"] == (tmp_path / "target", torch.device("cpu"), cfg.model.dtype)
    assert not [t for t in threading.enumerate() if t.name == "target-load"]
    assert not (tmp_path / "out").exists(), "refused before anything was written"


def test_a_target_load_beside_the_resume_raises_its_error_where_the_target_is_needed(tmp_path, monkeypatch):
    import torch

    from trainer.run import train as train_module

    def failing(path, device, dtype):
        raise OSError(f"no model in {path}")

    monkeypatch.setattr(train_module, "load_target", failing)
    load = train_module.TargetLoad(tmp_path, torch.device("cpu"), "float32")
    assert load.result(tmp_path / "other", torch.device("cpu")) is None, "another target: loaded in line"
    with pytest.raises(OSError, match="no model in"):
        load.result(tmp_path, torch.device("cpu"))


def test_the_graphs_dynamo_compiled_in_a_part_are_counted_and_said():
    """A warm start whose first step still compiles says so: the part and how many graphs."""
    import torch

    clock = StartupClock(time.perf_counter())
    with clock.part("compile and warm-up"):
        compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
        compiled(torch.ones(3))
    with clock.part("state restore"):
        pass
    assert clock.graphs == {"compile and warm-up": 1}
    line = describe(clock.breakdown(), resumed=False, graphs=clock.graphs)
    assert line.endswith("; Dynamo compiled graphs (or took them from its cache): 1 in compile and warm-up")
    assert "Dynamo" not in describe(clock.breakdown(), resumed=False)


def test_a_part_s_time_in_torch_compile_and_in_dynamo_s_tracing_is_said():
    """Of a warm start's compile and warm-up, what the cache could save (torch.compile's time) and
    what it cannot (Dynamo's tracing of it) are said apart."""
    import torch

    clock = StartupClock(time.perf_counter())
    with clock.part("compile and warm-up"):
        compiled = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="aot_eager")
        compiled(torch.ones(3))
    with clock.part("state restore"):
        torch.ones(3).sin()
    assert list(clock.compiling) == ["compile and warm-up"], "a part that compiled nothing says nothing"
    total, tracing = clock.compiling["compile and warm-up"]
    assert 0 < tracing < total <= clock.seconds["compile and warm-up"]
    line = describe(clock.breakdown(), resumed=False, compiling={"compile and warm-up": (12.34, 2.06)})
    assert line.endswith(
        "; in torch.compile (tracing, and compiling or loading from the cache): "
        "12.3 s of compile and warm-up (Dynamo's tracing 2.1 s of it)"
    )
    quick = describe(clock.breakdown(), resumed=False, compiling={"first step": (0.01, 0.0)})
    assert "torch.compile" not in quick


def test_a_start_copies_the_weights_for_its_first_evaluation_on_a_thread_and_waits_for_them_once():
    """The copy runs beside the compile and warm-up; the first step's wait for it is a part of the
    breakdown; the weights are those the drafter had when the copy was asked for."""
    import threading

    import torch

    from trainer.run.train import FirstEvaluationWeights

    drafter = torch.nn.Linear(4, 3)
    before = {name: value.clone() for name, value in drafter.state_dict().items()}
    kept = FirstEvaluationWeights.of_start(None, drafter)
    assert kept is not None and kept.thread is not None and kept.thread.name == "first-weights"
    run = SimpleNamespace(first_weights=kept, startup=StartupClock(time.perf_counter()), models=None)
    weights = Run.weights_before_first_step(run)
    with torch.no_grad():
        drafter.weight.add_(1.0)  # the first step's update: the kept copy is not the drafter's memory
    assert all(torch.equal(weights[name], value) for name, value in before.items())
    assert "weights for the first evaluation" in run.startup.breakdown()
    assert run.first_weights is None and not [t for t in threading.enumerate() if t.name == "first-weights"]


def test_a_resume_without_a_step_0_evaluation_reads_its_checkpoint_s_weights_and_one_with_it_keeps_none():
    import torch

    from trainer.run.train import FirstEvaluationWeights

    drafter = torch.nn.Linear(4, 3)
    saved = {"weight": torch.ones(3, 4), "bias": torch.zeros(3)}
    unevaluated = SimpleNamespace(state={"tau0": -1.0, "drafter": saved})
    kept = FirstEvaluationWeights.of_start(unevaluated, drafter)
    assert kept is not None and kept.thread is None, "on the host already: no copy"
    assert kept.result() is saved
    assert (
        FirstEvaluationWeights.of_start(SimpleNamespace(state={"tau0": 1.4, "drafter": saved}), drafter)
        is None
    )


def test_a_failed_copy_of_the_first_evaluation_s_weights_is_raised_where_they_are_needed():
    from trainer.run.train import FirstEvaluationWeights

    class Broken:
        def state_dict(self):
            raise RuntimeError("CUDA error: an illegal memory access")

    kept = FirstEvaluationWeights(drafter=Broken())
    kept.wait()
    with pytest.raises(RuntimeError, match="illegal memory access"):
        kept.result()
