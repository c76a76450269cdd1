"""dflash.ct200.run_history: per run output directory, the summary of metrics.jsonl, events.jsonl and
config.yml (written here by the trainer's own code: its config dump and its event log), the thinned
series, which launches still run; half-written or missing files read as far as they go."""

from __future__ import annotations

import json

import pytest
from ansible_collections.dflash.ct200.plugins.module_utils.trainer_proc import (
    config_steps,
    progress_line,
    run_steps,
)
from ansible_collections.dflash.ct200.plugins.modules import run_history

from trainer.config import config_from_dict, dump_config
from trainer.run.events import EventLog


def write_run(out, steps=40, train=(), evals=(), tail="") -> None:
    """An output directory as the trainer leaves it: config.yml, metrics.jsonl, events.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yml").write_text(dump_config(config_from_dict({"train": {"steps": steps}})))
    rows = [
        {"kind": "train", "step": s, "loss": loss, "lr": 1e-3, "tokens_per_s": tps} for s, loss, tps in train
    ]
    rows += [{"kind": "eval", "step": s, "tau": tau, "prompts": 8} for s, tau in evals]
    (out / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + tail)


def history(run_module, check_mode=False, **args) -> dict:
    result = run_module(run_history.main, args, check_mode=check_mode)
    assert not result.failed, result.result.get("msg")
    return result.result


def test_a_run_is_summarized_from_its_files(run_module, tmp_path) -> None:
    out = tmp_path / "runs" / "nographs"
    write_run(
        out,
        train=[(10, 4.0, 100.0), (20, 3.0, 200.0), (30, 2.0, 300.0), (20, 2.5, 250.0)],  # 20 again: resumed
        evals=[(10, 1.2), (30, 1.8), (20, 1.9)],
        tail='{"kind": "train", "step": 40, "lo',  # the line being written
    )
    log = EventLog(out, "nographs", run_id="nographs-a-1", notify_url="")
    log.record("start", "started")
    log.record("finish", "finished", exit_status=0)
    result = history(run_module, outs=[str(out)])
    assert result["changed"] is False
    (run,) = result["runs"]
    assert run["out"] == str(out) and run["name"] == "nographs" and run["total_steps"] == 40
    # Resumed at 20: the run is at step 20 (what status's progress line says), step 30 was a launch's
    # that is gone, as is its eval.
    assert run["last_step"] == 20 and run["last_loss"] == 2.5
    assert progress_line(str(out), 40).startswith("step 20/40 loss 2.5000")  # status's progress line agrees
    assert run["tokens_per_s"] == pytest.approx((100.0 + 250.0) / 2)  # the resumed row of step 20
    assert run["best_tau"] == 1.9 and run["last_tau"] == 1.9
    assert [event["event"] for event in run["events"]] == ["start", "finish"]
    assert run["events"][1]["run_id"] == "nographs-a-1" and run["events"][1]["exit_status"] == 0
    assert "series" not in run
    assert run["stretches"] == []  # no run record here


def test_the_run_records_stretches_are_returned_and_bad_ones_ignored(run_module, tmp_path) -> None:
    from trainer.run.runrecord import write_record

    out = tmp_path / "runs" / "process"
    write_run(out, train=[(10, 4.0, 100.0)])
    stretches = [{"from_step": 0, "workers": 2, "topology": "process", "hosts": 1}, 7]
    write_record(out, {"run": "process", "stretches": stretches})
    (run,) = history(run_module, outs=[str(out)])["runs"]
    assert run["stretches"] == stretches[:1]
    write_record(out, {"run": "process", "stretches": "garbage"})
    assert history(run_module, outs=[str(out)])["runs"][0]["stretches"] == []


def test_the_newest_start_says_how_it_ended_and_whether_it_trained_a_step(run_module, tmp_path) -> None:
    """The run record's metrics_from (where its start's rows of metrics.jsonl begin): a resume that
    ended before its first step trained nothing of its own; a row after it, and it did."""
    from trainer.run.runrecord import write_record

    out = tmp_path / "runs" / "nographs"
    write_run(out, train=[(10, 4.0, 100.0)], evals=[(10, 1.5)])
    size = (out / "metrics.jsonl").stat().st_size
    full = "disk full writing metrics.jsonl: No space left on device"
    record = {"run_id": "nographs-2", "state": "crashed", "exit_status": 1, "exit_reason": full}
    write_record(out, {**record, "metrics_from": size, "cmdline": ["python", "-m", "trainer", "--resume"]})
    (run,) = history(run_module, outs=[str(out)])["runs"]
    assert run["record"] == {**record, "data_only": False, "trained": False}
    with (out / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"kind": "train", "step": 11, "loss": 3.9}) + "\n")
    assert history(run_module, outs=[str(out)])["runs"][0]["record"]["trained"] is True
    write_record(out, {**record, "cmdline": ["python", "-m", "trainer", "--data-only"]})
    newest = history(run_module, outs=[str(out)])["runs"][0]["record"]
    assert newest["data_only"] is True and newest["trained"] is None, (
        "a record without metrics_from does not say"
    )


def test_points_return_the_series_thinned_keeping_the_last(run_module, tmp_path) -> None:
    out = tmp_path / "graphs"
    write_run(out, train=[(s, 10.0 - s / 10, 50.0) for s in range(1, 51)], evals=[(10, 1.1), (20, 1.4)])
    (run,) = history(run_module, outs=[str(out)], points=5)["runs"]
    train = run["series"]["train"]
    assert len(train) == 5 and train[0] == [1, 9.9, 50.0] and train[-1] == [50, 5.0, 50.0]
    assert [row[0] for row in train] == sorted(row[0] for row in train)
    assert run["series"]["eval"] == [[10, 1.1], [20, 1.4]]
    (everything,) = history(run_module, outs=[str(out)], points=100)["runs"]
    assert len(everything["series"]["train"]) == 50


def test_root_lists_every_run_directory_by_name_after_the_given_outs(run_module, tmp_path) -> None:
    root = tmp_path / "runs"
    for name in ("zeta", "alpha"):
        write_run(root / name)
    (root / "notes.txt").write_text("not a run")
    extra = tmp_path / "elsewhere" / "eager"
    write_run(extra)
    result = history(run_module, outs=[str(extra), str(tmp_path / "missing")], root=str(root))
    assert [run["name"] for run in result["runs"]] == ["eager", "alpha", "zeta"]
    assert history(run_module, root=str(tmp_path / "no-such-root"))["runs"] == []


def test_an_empty_output_directory_has_no_figures(run_module, tmp_path) -> None:
    out = tmp_path / "fresh"
    out.mkdir()
    (run,) = history(run_module, outs=[str(out)], points=10)["runs"]
    assert run["total_steps"] is None and run["last_step"] is None and run["tokens_per_s"] is None
    assert run["best_tau"] is None and run["events"] == []
    assert run["series"] == {"train": [], "eval": []}


def test_events_are_bounded_to_the_newest(run_module, tmp_path) -> None:
    out = tmp_path / "flaky"
    write_run(out)
    rows = [{"event": "restart", "n": n} for n in range(run_history.MAX_EVENTS + 50)]
    (out / "events.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + "[1, 2]\n")
    (run,) = history(run_module, outs=[str(out)])["runs"]
    assert len(run["events"]) == run_history.MAX_EVENTS and run["events"][-1]["n"] == len(rows) - 1


def test_alive_probes_the_given_launches_and_the_start_events(run_module, tmp_path, live_trainer) -> None:
    out = tmp_path / "nographs"
    write_run(out)
    # A start event written by this test's process: its identity, but not a trainer's command line.
    EventLog(out, "nographs", notify_url="").record("start", "started")
    mine = json.loads((out / "events.jsonl").read_text())["pid"]
    dead = {"pid": 2**22 + 11, "start_time": 5, "boot_id": "b", "run": "nographs"}
    broken = {"pid": "not-a-pid"}
    result = history(run_module, outs=[str(out)], live=[live_trainer.identity, dead, broken])
    assert result["alive"] == {
        str(mine): False,
        str(live_trainer.identity["pid"]): True,
        str(dead["pid"]): False,
    }
    live_trainer.process.kill()
    live_trainer.process.wait(timeout=10)
    after = history(run_module, live=[live_trainer.identity])
    assert after["alive"] == {str(live_trainer.identity["pid"]): False}


def test_check_mode_reads_the_same(run_module, tmp_path) -> None:
    out = tmp_path / "eager"
    write_run(out, train=[(1, 2.0, 10.0)], evals=[(1, 1.5)])
    assert history(run_module, check_mode=True, outs=[str(out)], points=3) == history(
        run_module, outs=[str(out)], points=3
    )


@pytest.mark.parametrize(
    ("args", "named"),
    [({"points": "many"}, "points"), ({"outs": ["/x"], "limit": 3}, "limit"), ({"live": ["pid"]}, "live")],
    ids=["points-not-int", "unknown-option", "live-not-dicts"],
)
def test_bad_arguments_fail_naming_the_option(run_module, args, named) -> None:
    result = run_module(run_history.main, args)
    assert result.failed and named in result.result["msg"]


def test_total_steps_is_the_train_section_s_own_and_none_without_a_config(tmp_path) -> None:
    assert config_steps(str(tmp_path / "no-such-dir")) is None
    (tmp_path / "config.yml").write_text("eval:\n  steps: 9\ntrain:\n  seed: 1\n  steps: 77\n")
    assert config_steps(str(tmp_path)) == 77
    (tmp_path / "config.yml").write_text("eval:\n  steps: 9\n")
    assert config_steps(str(tmp_path)) is None


def test_a_run_s_length_is_its_record_s_else_its_config_s(tmp_path) -> None:
    """What a resume continues to: the record's steps, else config.yml's (the record was lost)."""
    (tmp_path / "config.yml").write_text("train:\n  steps: 77\n")
    assert run_steps(str(tmp_path)) == 77
    (tmp_path / "run.json").write_text(json.dumps({"run_id": "a", "steps": 100000}))
    assert run_steps(str(tmp_path)) == 100000
    for junk in ("many", True, 0, None):  # a record of the wrong shape does not count
        (tmp_path / "run.json").write_text(json.dumps({"run_id": "a", "steps": junk}))
        assert run_steps(str(tmp_path)) == 77
