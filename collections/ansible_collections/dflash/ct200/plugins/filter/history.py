# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters: the history of runs (the controller's ledger reconciled with what the targets hold),
as rows and as a one-screen table, and the runs a report draws."""

from __future__ import annotations

DOCUMENTATION = r"""
name: run_rows
short_description: The history of DFlash runs, reconciled with the targets
description:
  - C(run_rows) joins the ledger's launches (newest first) with each host's dflash.ct200.run_history
    result (events, metrics) into rows - run, run_id, host, state, started, duration, step, total,
    the worker count of each stretch of the run, last loss, best and last tau, tokens/s, exit
    reason. A launch's own events are those with its PID.
  - C(run_table) formats those rows as fixed-width lines for one screen.
  - C(report_runs) picks the named runs with metrics from every host's run_history result.
positional: hostvars, hosts
options:
  _input:
    description: The ledger's records.
    type: list
    required: true
"""

EXAMPLES = r"""
rows: "{{ ledger | dflash.ct200.run_rows(histories, probes) }}"
"""

RETURN = r"""
_value:
  description: The rows (run_rows), the lines (run_table) or {runs, missing, available} (report_runs).
  type: raw
"""

import datetime
import json

ENDINGS = {"finish": "finished", "stop": "stopped", "failed": "failed"}


def parse_time(text):
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except (TypeError, ValueError):
        return None


RECORD_ENDS = ("finished", "stopped", "failed", "crashed")


def state_of(
    record: dict, events: list[dict], alive: bool | None, target: dict | None = None
) -> tuple[str, str | None, str | None]:
    """(state, exit reason, end time) of one launch from its own events, else from its run record
    on the target (`target`: run_history's `record`, where it is this launch's), else the ledger's word."""
    restarts = [e for e in events if e.get("event") == "restart"]
    ending = next((e for e in reversed(events) if e.get("event") in ENDINGS), None)
    # The data stage's events (docs/DATA.md): reason regenerating, regenerated or stopped.
    regen = next((e for e in reversed(events) if e.get("event") == "regen"), None)
    if alive:
        if regen is not None and regen.get("reason") == "regenerating":
            return "regenerating", None, None
        return ("recovered" if restarts else "running"), None, None
    if ending is not None:
        state = ENDINGS[ending["event"]]
        if state == "finished" and restarts:
            state = "recovered"
        reason = ending.get("reason") or ending.get("text", "").split(": ", 1)[-1]
        if state == "recovered":
            reason = f"finished after {len(restarts)} restart(s)"
        if regen is not None and regen.get("reason") == "regenerated":
            reason = f"{reason}; {regen.get('text', '').split(': ', 1)[-1]}"
        return state, reason, ending.get("time")
    if alive is False and target and target.get("state") in RECORD_ENDS:
        # No end event of its own (a full disk took the events file, or it was killed before
        # its supervisor ran): the run record says how it ended, as status does.
        return target["state"], target.get("exit_reason"), None
    crash = next((e for e in reversed(events) if e.get("event") == "crash"), None)
    if crash is not None or (events and alive is False):
        return (
            "crashed",
            (crash or {}).get("reason") or "ended without a word (killed?)",
            (crash or {}).get("time"),
        )
    recorded = record.get("state") or "unknown"
    if recorded == "running" and alive is False:
        return "crashed", "no longer runs, nothing recorded how it ended", None
    return recorded, record.get("exit_reason"), None


def ledger_records(ledger) -> list[dict]:
    """The ledger as records: a list already, or the text of runs.jsonl (unreadable lines skipped)."""
    if isinstance(ledger, str):
        records = []
        for line in ledger.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        ledger = records
    return [record for record in ledger or [] if isinstance(record, dict) and record.get("run_id")]


def launches_only_on_targets(ledger: list[dict], histories) -> list[dict]:
    """Launches the targets' events know and the ledger does not (the controller's state was lost,
    or its write failed): one record per (host, PID), from its first event."""
    known = {(r.get("host"), str(r.get("pid"))) for r in ledger}
    found = {}
    for host, entries in (histories or {}).items():
        for entry in entries or []:
            for event in entry.get("events") or []:
                key = (host, str(event.get("pid")))
                if key in known or key in found or event.get("pid") is None:
                    continue
                found[key] = {
                    "run": event.get("run") or entry.get("name"),
                    "run_id": event.get("run_id"),
                    "host": host,
                    "pid": event.get("pid"),
                    "out": entry.get("out"),
                    "started_at": event.get("time"),
                    "state": "unknown",
                    "only_on_target": True,
                }
    return list(found.values())


END_EVENTS = ("finish", "stop", "failed", "crash")


def output_of(record: dict, histories) -> dict | None:
    """The history entry of the output a launch wrote: the one whose events hold its start (it
    follows an output that -e fresh=true moved aside to <out>.<UTC time>), else the one at the
    recorded path."""
    entries = (histories or {}).get(record.get("host") or "") or []
    pid, run_id = str(record.get("pid")), record.get("run_id")
    for entry in entries:
        for event in entry.get("events") or []:
            ours = str(event.get("pid")) == pid and event.get("run_id") in (None, run_id)
            if event.get("event") == "start" and ours:
                return entry
    return next((entry for entry in entries if entry.get("out") == record.get("out")), None)


def run_rows(ledger, histories, alive_by_host=None, run=None, now=None) -> list[dict]:
    """The launches, newest first: the ledger's (text or records) and those only the targets know.
    histories: {host: [run_history entries]}; alive_by_host: {host: {pid: bool}}; run: only this
    run's launches."""
    now = parse_time(now) or datetime.datetime.now(datetime.UTC)
    ledger = ledger_records(ledger)
    ledger = ledger + launches_only_on_targets(ledger, histories)
    rows = []
    for record in [r for r in ledger if not run or r.get("run") == run]:
        host = record.get("host") or ""
        entry = output_of(record, histories)
        pid = record.get("pid")
        events = [e for e in (entry or {}).get("events") or [] if str(e.get("pid")) == str(pid)]
        alive = ((alive_by_host or {}).get(host) or {}).get(str(pid))
        # The output's run record, where it is this launch's (its newest start).
        target = (entry or {}).get("record") or None
        if not target or target.get("run_id") != record.get("run_id"):
            target = None
        state, reason, ended = state_of(record, events, alive, target)
        started = parse_time(record.get("started_at"))
        finish = parse_time(ended) or (now if state in ("running", "recovered") and alive else None)
        # A later launch on the same output shares its metrics: they describe this launch only
        # when it is the newest launch of that output on that host.
        newest = entry is not None and not any(
            r is not record
            and r.get("host") == host
            and output_of(r, histories) is entry
            and (r.get("started_at") or "") > (record.get("started_at") or "")
            for r in ledger
        )
        # A start that trained no step of its own (a data-only regeneration, a resume that failed
        # before its first step) has none of the output's figures: they are an earlier start's.
        trained = not (target and (target.get("data_only") or target.get("trained") is False))
        metrics = entry if entry and newest and trained else {}
        # Without the metrics, the step and tau of the launch's own end; a start event's are where
        # it began (the previous launch's), nothing this launch reached.
        last_event = next((e for e in reversed(events) if e.get("event") in END_EVENTS), {})
        step = metrics.get("last_step", last_event.get("step"))
        if metrics:
            stretches = metrics.get("stretches") or []
        else:
            # An earlier start of the output: the stretch it ended in (none where it reached no step).
            stretches = stretch_at((entry or {}).get("stretches"), step if trained else None)
        rows.append(
            {
                "run": record.get("run"),
                "run_id": record.get("run_id"),
                "host": host,
                "pid": pid,
                "state": state,
                "started": record.get("started_at"),
                "duration_s": (finish - started).total_seconds() if started and finish else None,
                "step": step,
                "total_steps": metrics.get("total_steps"),
                # The run record's stretches (each start on another worker count or topology).
                "stretches": stretches,
                "last_loss": metrics.get("last_loss"),
                "best_tau": metrics.get("best_tau"),
                "last_tau": metrics.get("last_tau", last_event.get("tau")),
                "tokens_per_s": metrics.get("tokens_per_s"),
                "restarts": sum(1 for e in events if e.get("event") == "restart"),
                "exit_reason": reason,
                "in_ledger": not record.get("only_on_target", False),
                "ledger_restarts": record.get("restarts", 0),
                "restart_events": [
                    {key: e.get(key) for key in ("time", "step", "reason")}
                    for e in events
                    if e.get("event") == "restart"
                ],
            }
        )
    rows.sort(key=lambda row: row["started"] or "", reverse=True)
    return rows


def stretch_at(stretches, step) -> list[dict]:
    """[the stretch of the run that `step` lies in], or [] where the step or the stretches are unknown."""
    if not isinstance(step, int) or isinstance(step, bool):
        return []
    found = [
        s
        for s in stretches or []
        if isinstance(s, dict) and isinstance(s.get("from_step"), int) and s["from_step"] <= step
    ]
    return found[-1:]


def ledger_restarts(rows) -> list[dict]:
    """Ledger updates for launches whose restarts the ledger does not hold yet: {run_id, restarts,
    restart_events} (the time, step and reason of each restart, from the target's events)."""
    return [
        {"run_id": row["run_id"], "restarts": row["restarts"], "restart_events": row["restart_events"]}
        for row in rows or []
        if row.get("in_ledger") and row.get("restarts") and row.get("restarts") != row.get("ledger_restarts")
    ]


def clip(text: str, width: int) -> str:
    """At most `width` characters, cut at a word's end with an ellipsis, never inside a word."""
    if len(text) <= width:
        return text
    cut = text[: width - 1].rstrip()
    if " " in cut and not text[width - 1].isspace():
        cut = cut[: cut.rindex(" ")].rstrip(" ,;:")
    return cut + "…"


def duration(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def fixed(value, digits: int) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def workers_cell(stretches) -> str:
    """The worker count of each stretch of a run, oldest first: `2`, or `8>7` for a run that resumed
    on 7 workers; blank where nothing tells (a start that trained no step, a record without
    stretches): a dash would read as a count."""
    counts = [str(s.get("workers")) for s in stretches or [] if isinstance(s, dict)]
    counts = [count for count in counts if count.isdigit()]
    return ">".join(counts)


def run_table(rows, limit: int = 20) -> list[str]:
    """The rows as a table for one screen (newest first, at most `limit`, then how many more)."""
    header = (
        "RUN", "HOST", "STATE", "STARTED", "TIME", "STEP", "WORKERS", "LOSS", "TAU best/last", "TOK/S",
        "EXIT",
    )  # fmt: skip
    table = [header]
    for row in (rows or [])[:limit]:
        step = "-" if row.get("step") is None else str(row["step"])
        if row.get("total_steps"):
            step += f"/{row['total_steps']}"
        table.append(
            (
                row.get("run") or "-",
                row.get("host") or "-",
                row.get("state") or "-",
                (row.get("started") or "-").replace("T", " ").rstrip("Z"),
                duration(row.get("duration_s")),
                step,
                workers_cell(row.get("stretches")),
                fixed(row.get("last_loss"), 3),
                f"{fixed(row.get('best_tau'), 2)}/{fixed(row.get('last_tau'), 2)}",
                fixed(row.get("tokens_per_s"), 0),
                clip(row.get("exit_reason") or "", 60),
            )
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(header) - 1)]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=False)) + "  " + line[-1]
        for line in table
    ]
    if len(rows or []) > limit:
        lines.append(f"... and {len(rows) - limit} older run(s): -e run=NAME to see one run's launches")
    if not rows:
        lines.append("no runs recorded yet")
    return [line.rstrip() for line in lines]


def report_runs(histories, names) -> dict:
    """The named runs that have metrics, from every host's run_history entries ({host: [entry]};
    labelled host:name when there are several hosts), and the names found nowhere."""
    runs, found, available = [], set(), set()
    hosts = list(histories or {})
    for host in hosts:
        for entry in histories[host] or []:
            series = entry.get("series") or {}
            if not (series.get("train") or series.get("eval")):
                continue
            available.add(entry["name"])
            if entry["name"] in names:
                found.add(entry["name"])
                label = entry["name"] if len(hosts) == 1 else f"{host}:{entry['name']}"
                runs.append({"label": label, "series": series})
    order = {name: i for i, name in enumerate(names)}
    runs.sort(key=lambda run: order.get(run["label"].split(":")[-1], 0))
    return {"runs": runs, "missing": [n for n in names if n not in found], "available": sorted(available)}


class FilterModule:
    def filters(self):
        return {
            "ledger_records": ledger_records,
            "ledger_restarts": ledger_restarts,
            "run_rows": run_rows,
            "run_table": run_table,
            "report_runs": report_runs,
        }
