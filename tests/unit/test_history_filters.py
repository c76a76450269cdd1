"""The history's rows and table (filter dflash.ct200.run_rows / run_table) and the status
sparklines (dflash.ct200.sparkline / curve_lines), from ledger records and target events: the
filters imported as the Python modules they are, through the collection loader."""

from __future__ import annotations

import json

from ansible_collections.dflash.ct200.plugins.filter import curves, history


def record(run: str, pid: int, started: str, state: str = "running") -> dict:
    return {
        "run": run,
        "run_id": f"{run}-{started.replace('-', '').replace(':', '')}-{pid}",
        "host": "ct200",
        "pid": pid,
        "out": f"/ws/runs/{run}",
        "started_at": started,
        "state": state,
    }


def event(kind: str, pid: int, time: str, **fields) -> dict:
    return {"event": kind, "pid": pid, "time": time, "run": fields.pop("run", "x"), **fields}


def entry(name: str, events: list[dict], **summary) -> dict:
    return {"out": f"/ws/runs/{name}", "name": name, "events": events, **summary}


def test_every_ending_gets_its_state_and_reason_newest_first():
    ledger = [
        record("eager", 10, "2026-01-01T10:00:00Z", "running"),
        record("nographs", 20, "2026-01-01T11:00:00Z", "stopped"),
        record("process", 30, "2026-01-01T12:00:00Z", "running"),
        record("graphs", 40, "2026-01-01T13:00:00Z", "failed"),
        record("long", 50, "2026-01-01T14:00:00Z", "running"),
        record("flaky", 60, "2026-01-01T15:00:00Z", "running"),
    ]
    histories = {
        "ct200": [
            entry(
                "eager",
                [
                    event("start", 10, "2026-01-01T10:00:01Z"),
                    event("finish", 10, "2026-01-01T10:30:01Z", step=150),
                ],
                last_step=150,
                total_steps=150,
                last_loss=1.5,
                best_tau=1.95,
                last_tau=1.9,
                tokens_per_s=1000.0,
            ),
            entry(
                "nographs",
                [
                    event("start", 20, "t"),
                    event("stop", 20, "2026-01-01T11:05:00Z", text="x: stopped by SIGTERM"),
                ],
            ),
            entry("process", [event("start", 30, "2026-01-01T12:00:01Z")], last_step=40),
            entry(
                "graphs", [event("failed", 40, "2026-01-01T13:00:02Z", reason="bad input: data.train_file")]
            ),
            entry("long", [event("start", 50, "2026-01-01T14:00:01Z")]),
            entry(
                "flaky",
                [
                    event("start", 60, "2026-01-01T15:00:01Z"),
                    event("crash", 60, "2026-01-01T15:01:00Z", reason="killed by SIGKILL"),
                    event("restart", 60, "2026-01-01T15:01:10Z"),
                    event("finish", 60, "2026-01-01T15:10:00Z"),
                ],
            ),
        ]
    }
    alive = {"ct200": {"10": False, "20": False, "30": False, "40": False, "50": True, "60": False}}
    rows = history.run_rows(ledger, histories, alive, None, "2026-01-01T14:30:00Z")
    assert [(r["run"], r["state"]) for r in rows] == [
        ("flaky", "recovered"),
        ("long", "running"),
        ("graphs", "failed"),
        ("process", "crashed"),
        ("nographs", "stopped"),
        ("eager", "finished"),
    ]
    by_run = {r["run"]: r for r in rows}
    assert by_run["eager"]["duration_s"] == 1801 and by_run["eager"]["best_tau"] == 1.95
    assert by_run["graphs"]["exit_reason"] == "bad input: data.train_file"
    assert by_run["process"]["exit_reason"] == "ended without a word (killed?)"
    assert (
        by_run["flaky"]["restarts"] == 1 and by_run["flaky"]["exit_reason"] == "finished after 1 restart(s)"
    )
    assert by_run["long"]["duration_s"] == 1800  # still running: up to now
    assert [r["run"] for r in history.run_rows(ledger, histories, alive, "eager")] == ["eager"]

    table = history.run_table(rows, 4)
    assert table[0].split()[:3] == ["RUN", "HOST", "STATE"]
    assert table[-1].startswith("... and 2 older run(s)")
    assert len(table) == 6
    assert "150/150" not in "\n".join(table)  # eager is among the older rows left out
    assert "150/150" in "\n".join(history.run_table(rows))


def test_a_lost_ledger_still_lists_what_the_target_remembers():
    histories = {
        "ct200": [
            entry(
                "nographs",
                [
                    event("start", 77, "2026-01-02T09:00:00Z", run="nographs", run_id="nographs-a-77"),
                    event("finish", 77, "2026-01-02T09:10:00Z", run="nographs", run_id="nographs-a-77"),
                ],
                last_step=150,
            )
        ]
    }
    (row,) = history.run_rows("", histories, {})
    assert row["run_id"] == "nographs-a-77" and row["state"] == "finished" and row["in_ledger"] is False
    assert row["duration_s"] == 600
    assert history.run_table([]) == [
        "RUN  HOST  STATE  STARTED  TIME  STEP  WORKERS  LOSS  TAU best/last  TOK/S  EXIT",
        "no runs recorded yet",
    ]


def test_ledger_text_with_a_broken_line():
    text = "\n".join([json.dumps(record("eager", 1, "2026-01-01T00:00:00Z")), "{broken", ""])
    assert [r["run"] for r in history.ledger_records(text)] == ["eager"]


def test_sparkline_and_status_lines():
    assert curves.sparkline([1, 2, 3, 4, 5, 6, 7, 8]) == "▁▂▃▄▅▆▇█"
    assert curves.sparkline([3, 3, 3]) == "▅▅▅"
    assert curves.sparkline([]) == "" and curves.sparkline([None, "x"]) == ""
    assert len(curves.sparkline(list(range(1000)), 30)) == 30
    lines = curves.curve_lines(
        {
            "series": {"train": [[1, 9.0, 1], [2, 5.0, 1], [3, 1.0, 1]], "eval": [[0, 1.0], [3, 1.5]]},
            "last_loss": 1.0,
            "last_step": 3,
            "total_steps": 10,
            "last_tau": 1.5,
            "best_tau": 1.5,
            "events": [
                event("restart", 5, "T", step=2, reason="killed by SIGKILL"),
                event("restart", 4, "T"),
            ],
        },
        pid=5,
    )
    assert lines == [
        "  loss     █▅▁ 1.0000 at step 3/10",
        "  tau/eval ▁█ last 1.500, best 1.500 (2 evaluations)",
        "  restarts 1 (last at T, step 2: killed by SIGKILL)",
    ]


def test_restarts_the_ledger_lacks_become_updates_and_nothing_else():
    rows = [
        {
            "run_id": "a-1",
            "in_ledger": True,
            "restarts": 2,
            "ledger_restarts": 1,
            "restart_events": ["e1", "e2"],
        },
        {"run_id": "b-2", "in_ledger": True, "restarts": 1, "ledger_restarts": 1, "restart_events": ["e"]},
        {"run_id": "c-3", "in_ledger": False, "restarts": 3, "restart_events": ["e"]},
        {"run_id": "d-4", "in_ledger": True, "restarts": 0, "restart_events": []},
    ]
    assert history.ledger_restarts(rows) == [{"run_id": "a-1", "restarts": 2, "restart_events": ["e1", "e2"]}]
    assert history.ledger_restarts(None) == []


def test_report_runs_picks_named_runs_with_metrics_in_the_asked_order():
    series = {"train": [[1, 2.0, 100.0]], "eval": []}
    histories = {
        "ct200": [
            entry("eager", [], series=series),
            entry("graphs", [], series=series),
            entry("empty", [], series={"train": [], "eval": []}),
        ]
    }
    picked = history.report_runs(histories, ["graphs", "eager", "empty", "nowhere"])
    assert [run["label"] for run in picked["runs"]] == ["graphs", "eager"]
    assert picked["missing"] == ["empty", "nowhere"] and picked["available"] == ["eager", "graphs"]
    two_hosts = history.report_runs({"a": [entry("eager", [], series=series)], "b": []}, ["eager"])
    assert [run["label"] for run in two_hosts["runs"]] == ["a:eager"]


def test_the_filters_are_published_under_their_names():
    assert set(history.FilterModule().filters()) == {
        "ledger_records",
        "ledger_restarts",
        "run_rows",
        "run_table",
        "report_runs",
    }
    assert curves.FilterModule().filters() == {
        "sparkline": curves.sparkline,
        "curve_lines": curves.curve_lines,
    }


def test_a_run_whose_output_was_moved_aside_keeps_its_figures():
    """-e fresh=true moves the earlier output to <out>.<UTC time>: its launch's row follows it there."""
    earlier = record("nographs", 10, "2026-01-01T10:00:00Z", "stopped")
    later = record("nographs", 20, "2026-01-01T11:00:00Z", "running")
    moved_events = [
        event("start", 10, "2026-01-01T10:00:01Z", run_id=earlier["run_id"]),
        event("stop", 10, "2026-01-01T10:30:00Z", step=77),
    ]
    figures = {"last_step": 77, "total_steps": 100000, "last_loss": 2.5, "best_tau": 1.4, "last_tau": 1.3}
    current_events = [event("start", 20, "2026-01-01T11:00:01Z", run_id=later["run_id"])]
    histories = {
        "ct200": [
            entry("nographs.20260101T105959Z", moved_events, **figures),
            entry("nographs", current_events, last_step=3),
        ]
    }
    rows = history.run_rows([earlier, later], histories, {"ct200": {"10": False, "20": True}}, None,
                            "2026-01-01T11:10:00Z")  # fmt: skip
    by_pid = {r["pid"]: r for r in rows}
    assert by_pid[10]["state"] == "stopped"
    assert (by_pid[10]["step"], by_pid[10]["total_steps"], by_pid[10]["last_loss"]) == (77, 100000, 2.5)
    assert (by_pid[10]["best_tau"], by_pid[10]["last_tau"]) == (1.4, 1.3)
    assert by_pid[20]["step"] == 3 and by_pid[20]["last_loss"] is None


def test_a_launch_regenerating_its_data_says_so_and_its_end_names_the_data():
    ledger = [record("prep", 70, "2026-01-02T10:00:00Z"), record("busy", 80, "2026-01-02T11:00:00Z")]
    histories = {
        "ct200": [
            entry(
                "prep",
                [
                    event("start", 70, "2026-01-02T10:00:01Z"),
                    event(
                        "regen",
                        70,
                        "2026-01-02T10:00:09Z",
                        reason="regenerating",
                        text="prep on h: regenerating",
                    ),
                    event(
                        "regen",
                        70,
                        "2026-01-02T10:40:00Z",
                        reason="regenerated",
                        text="prep on h: regenerated 800,000 conversations",
                    ),
                    event("finish", 70, "2026-01-02T10:40:01Z", text="prep on h: finished"),
                ],
            ),
            entry(
                "busy",
                [
                    event("start", 80, "2026-01-02T11:00:01Z"),
                    event(
                        "regen",
                        80,
                        "2026-01-02T11:00:09Z",
                        reason="regenerating",
                        text="busy on h: regenerating",
                    ),
                ],
            ),
        ]
    }
    rows = {
        row["run"]: row for row in history.run_rows(ledger, histories, {"ct200": {"70": False, "80": True}})
    }
    assert rows["busy"]["state"] == "regenerating"
    assert rows["prep"]["state"] == "finished"
    assert rows["prep"]["exit_reason"] == "finished; regenerated 800,000 conversations"


def test_the_worker_count_of_each_stretch_in_runs_and_status():
    """A run that resumed on another shape: the table's WORKERS cell and status's workers line."""
    stretches = [
        {"from_step": 0, "workers": 8, "topology": "process", "hosts": 2},
        {"from_step": 400, "workers": 7, "topology": "process", "hosts": 1},
        {"from_step": 900, "workers": 1, "topology": "threaded", "hosts": 1},
        "garbage",
        {"from_step": 950},  # no worker count: left out
    ]
    ledger = [record("long", 10, "2026-01-01T10:00:00Z", "stopped")]
    events = [event("start", 10, "2026-01-01T10:00:01Z"), event("stop", 10, "2026-01-01T11:00:00Z")]
    histories = {"ct200": [entry("long", events, stretches=stretches, last_step=950)]}
    rows = history.run_rows(ledger, histories, {"ct200": {"10": False}})
    assert rows[0]["stretches"] == stretches
    table = history.run_table(rows)
    at = table[0].index("WORKERS")
    assert table[1][at:].split()[0] == "8>7>1"
    # Without stretches in the record: blank, not a dash that reads as a count.
    unknown = history.run_table(history.run_rows(ledger, {"ct200": [entry("long", events)]}))
    assert unknown[1][at : at + len("WORKERS")].strip() == ""
    lines = curves.curve_lines({"stretches": stretches}, pid=10)
    assert lines == [
        "  workers  8 torchrun ranks on 2 hosts from step 0, 7 torchrun ranks from step 400, "
        "1 worker thread from step 900"
    ]
    assert curves.curve_lines({"stretches": "garbage"}) == []


def test_a_killed_launch_with_a_later_one_shows_no_step_or_tau_it_never_reached():
    killed = record("nographs", 70, "2026-01-01T16:00:00Z")
    later = record("nographs", 80, "2026-01-01T17:00:00Z")
    histories = {
        "ct200": [
            entry(
                "nographs",
                [
                    event("start", 70, "2026-01-01T16:00:01Z", step=60, tau=1.7),  # the previous launch's
                    event("start", 80, "2026-01-01T17:00:01Z", step=60, tau=1.7),
                    event(
                        "stop", 80, "2026-01-01T17:10:00Z", step=136, tau=1.9, text="x: stopped by SIGTERM"
                    ),
                ],
                last_step=136,
                last_tau=1.9,
            )
        ]
    }
    rows = history.run_rows([killed, later], histories, {"ct200": {"70": False, "80": False}})
    by_pid = {row["pid"]: row for row in rows}
    assert (by_pid[70]["state"], by_pid[70]["step"], by_pid[70]["last_tau"]) == ("crashed", None, None)
    assert (by_pid[80]["step"], by_pid[80]["last_tau"]) == (136, 1.9)


def test_the_exit_column_is_cut_at_a_word_never_inside_one():
    reason = "bad input: --resume: the checkpoint was trained with a different setup (train.seq_len 512)"
    row = {"run": "r", "host": "h", "state": "failed", "exit_reason": reason}
    exit_cell = history.run_table([row])[1].split("failed", 1)[1].strip().split("  ")[-1].strip()
    assert len(exit_cell) <= 60 and exit_cell.endswith("…")
    assert reason.startswith(exit_cell[:-1]) and reason[len(exit_cell) - 1] == " "
    assert history.clip("short reason", 60) == "short reason"


def test_a_start_that_trained_no_step_shows_its_own_end_not_an_earlier_start_s_figures():
    """A resume that ended on a full disk before its first step, its events lost with the disk, and
    then a regeneration refused at its start: each row says its own state and reason from the run
    record, with none of the training launch's step, loss, tau or workers; the training launch
    keeps its own end's step and the worker count of the stretch it ended in."""
    stretches = [{"from_step": 0, "workers": 2, "topology": "threaded", "hosts": 1}]
    figures = {"last_step": 40, "total_steps": 60, "last_loss": 3.1, "best_tau": 1.7, "last_tau": 1.6}
    trained = record("nographs", 10, "2026-01-01T10:00:00Z", "stopped")
    resumed = record("nographs", 20, "2026-01-01T11:00:00Z", "failed")  # the ledger's word at launch
    full = "disk full writing /ws/runs/nographs/metrics.jsonl: No space left on device"
    events = [
        event("start", 10, "2026-01-01T10:00:01Z"),
        event("stop", 10, "2026-01-01T10:30:00Z", step=40, tau=1.6, text="x: stopped by SIGTERM"),
    ]
    target = {"run_id": resumed["run_id"], "state": "crashed", "exit_reason": full, "trained": False}
    histories = {"ct200": [entry("nographs", events, stretches=stretches, record=target, **figures)]}
    rows = history.run_rows([trained, resumed], histories, {"ct200": {"10": False, "20": False}})
    assert [row["pid"] for row in rows] == [20, 10]
    assert rows[0]["state"] == "crashed" and rows[0]["exit_reason"] == full
    assert [rows[0][key] for key in ("step", "last_loss", "best_tau", "last_tau", "stretches")] == [
        None, None, None, None, []
    ]  # fmt: skip
    assert rows[1]["step"] == 40 and rows[1]["last_tau"] == 1.6 and rows[1]["stretches"] == stretches
    table = history.run_table(rows)
    at = table[0].index("WORKERS")
    assert table[1][at : at + len("WORKERS")].strip() == "" and table[2][at:].split()[0] == "2"

    regen = record("nographs", 30, "2026-01-01T12:00:00Z", "failed")
    refused = "bad input: chat.jsonl:3: longer than train.seq_len=1000"
    target = {"run_id": regen["run_id"], "state": "failed", "exit_reason": refused, "data_only": True}
    histories = {"ct200": [entry("nographs", events, stretches=stretches, record=target, **figures)]}
    row = history.run_rows([trained, regen], histories, {"ct200": {"10": False, "30": False}})[0]
    assert row["pid"] == 30
    assert row["state"] == "failed" and row["exit_reason"] == refused
    assert (
        row["step"] is None
        and row["last_loss"] is None
        and row["last_tau"] is None
        and row["stretches"] == []
    )


def test_one_evaluation_is_said_in_the_singular():
    lines = curves.curve_lines({"series": {"eval": [[0, 1.0]]}, "last_tau": 1.0, "best_tau": 1.0})
    assert lines[0].endswith(" last 1.000, best 1.000 (1 evaluation)")
