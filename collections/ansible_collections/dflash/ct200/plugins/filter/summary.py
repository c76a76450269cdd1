# Copyright: contributors to the DFlash CT 200 project
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Filters that word what a playbook did for people: the launch, status and stop summaries (the
roles publish each host's launch, status or stop as data, these render the lines the run_summary
callback prints) and the `-i INVENTORY` options to repeat in the commands they suggest."""

from __future__ import annotations

import re
import shlex
import urllib.parse

PROXMOX_CONNECTION = "community.proxmox.proxmox_pct_remote"
LABEL_WIDTH = 9  # "run      ", "PID      ": a label column the eye can follow down


def _labelled(label: str, text) -> str:
    return f"{label:<{LABEL_WIDTH}}{text}"


def inventory_options(sources: list[str], repo_dir: str) -> str:
    """' -i SOURCE ...' for the commands shown, with SOURCE relative to the checkout where it lies
    inside it; '' where the inventory is the default one of ansible.cfg (inventory/local)."""
    sources = [str(source) for source in sources or []]
    repo_dir = str(repo_dir).rstrip("/")
    if ",".join(sources) == f"{repo_dir}/inventory/local":
        return ""
    inside = re.compile("^" + re.escape(repo_dir) + "/")
    return " -i " + " -i ".join(inside.sub("", source) for source in sources)


def follow_command(log: str, connection: str = "", user: str = "", host: str = "", vmid=None) -> str:
    """The command that follows a trainer's log from the controller: through the Proxmox node into
    the container where the inventory reaches it that way, else a plain tail."""
    prefix = ""
    if connection == PROXMOX_CONNECTION:
        prefix = f"ssh {user or 'root'}@{host} pct exec {vmid} -- "
    return f"{prefix}tail -f {shlex.quote(str(log))}"


def progress_text(launch: dict) -> str:
    if launch.get("matched") is None:
        return "not waited for progress"
    return f"first progress after {launch.get('waited_s')} s: {launch['matched']}"


def launch_summary(launches: list[dict], endpoint: str = "", inventory: str = "") -> list[str]:
    """The launch summary, one line each. `launches` holds each host's launch in inventory order:
    host, run, run_id, pid, log, follow (follow_command), and matched and waited_s where the wait
    saw the first progress line. One host: its run, PID, log and how to follow it; several: the run
    and its rendezvous `endpoint`, then a block per host. Then how to watch and stop it, with the
    `inventory` options (inventory_options)."""
    if not launches:
        return []
    first = launches[0]
    if len(launches) == 1:
        lines = [
            _labelled("run", f"{first['run']} ({first['run_id']}) on {first['host']}"),
            _labelled("PID", f"{first['pid']}  ({progress_text(first)})"),
            _labelled("log", first["log"]),
            _labelled("follow", first["follow"]),
        ]
    else:
        hosts = [launch["host"] for launch in launches]
        together = f"{first['run']} on {len(hosts)} hosts ({', '.join(hosts)}), rendezvous {endpoint}"
        lines = [_labelled("run", together)]
        for launch in launches:
            lines += [
                f"{launch['host']}: PID {launch['pid']} ({launch['run_id']}), {progress_text(launch)}",
                "  " + _labelled("log", launch["log"]),
                "  " + _labelled("follow", launch["follow"]),
            ]
    lines.append(_labelled("status", f"./dev.sh status{inventory}"))
    lines.append(_labelled("stop", f"./dev.sh stop{inventory}"))
    return lines


RECORDED_ENDS = ("finished", "stopped", "failed", "crashed")


def status_line(report: dict) -> str:
    """One line for a host's state in role run_status's report (state, run, pid, recorded_state,
    exit_status, exit_reason)."""
    state, run, pid = report.get("state"), report.get("run"), report.get("pid")
    if state == "running" and report.get("stage") == "regenerating":
        follows = "no training follows" if report.get("data_only") else "training follows"
        return f"regenerating: {run} as PID {pid} (the target regenerates its data; {follows})"
    if state == "running":
        ended = report.get("recorded_state")
        if ended in RECORDED_ENDS or report.get("stage") == "exiting":
            # The run record is written before the process ends: between the two it still runs
            # (waiting for its trackers, the record says so too).
            said = [f"its run record says {ended}"] if ended in RECORDED_ENDS else []
            said += [report["exiting"]] if report.get("exiting") else []
            return f"running: {run} as PID {pid}, exiting ({'; '.join(said) or 'its run has ended'})"
        return f"running: {run} as PID {pid}"
    if state == "exited":
        status = report.get("exit_status")
        status = "unknown" if status is None else status
        return (
            f"exited: {run} (PID {pid}, recorded {report.get('recorded_state')}), "
            f"exit status {status}: {report.get('exit_reason')}"
        )
    if state == "not_ours":
        return f"not ours: PID {pid} now belongs to another process; run {run} is gone"
    return "no run recorded"


def status_block(
    report: dict, host: str, curves: list[str] | None = None, gpu_lines: list[str] | None = None
) -> list[str]:
    """A host's lines of the status summary: the state, a repair of the controller's cache if
    any, the log, progress, newest checkpoint, tau, the `curves` (curve_lines) and the GPUs
    (`gpu_lines` as run_probe words them, else the note why none were read)."""
    lines = [f"{host}: {status_line(report)}"]
    if report.get("repaired"):
        lines.append("  " + _labelled("repaired", report["repaired"]))
    if report.get("log"):
        lines.append("  " + _labelled("log", report["log"]))
    lines.append("  " + _labelled("progress", report.get("last_progress") or "(no progress yet)"))
    checkpoint = report.get("last_checkpoint")
    if checkpoint:
        kept = checkpoint.get("kept") or []
        also = f" (kept: steps {', '.join(map(str, kept))})" if len(kept) > 1 else ""
        lines.append("  " + _labelled("ckpt", f"step {checkpoint['step']} {checkpoint['path']}{also}"))
    evaluation = report.get("last_eval")
    tau = f"{evaluation['tau']:.3f} at step {evaluation['step']}" if evaluation else "(no eval yet)"
    lines.append("  " + _labelled("tau", tau))
    lines += list(curves or [])
    if report.get("gpus"):
        lines += ["  " + line for line in gpu_lines or []]
    else:
        lines.append("  " + _labelled("gpus", report.get("gpu_note")))
    return lines


def stop_block(result: dict, host: str, record: dict | None, write: dict | None = None) -> list[str]:
    """A host's lines of the stop summary: what the stop did (trainer_stop's msg), a repair of the
    controller's cache if any, as it really went (`write`: the trainer_record action's result, see
    repair_said), and the run and log of the `record` stopped (or recorded)."""
    record = record or {}
    lines = [f"{host}: {result.get('msg')}"]
    if result.get("repair"):
        lines.append("  " + _labelled("repaired", repair_said(result["repair"], write)))
    if record.get("run_id"):
        lines.append("  " + _labelled("run", f"{record.get('run')} ({record['run_id']})"))
    else:
        lines.append("  " + _labelled("run", "none recorded"))
    lines.append("  " + _labelled("log", record.get("log") or "-"))
    return lines


def notice_url_problem(url) -> str:
    """What makes a notify_url unusable, in words that never quote it (it may hold credentials);
    '' where it is fine or not set. The trainer's own check (trainer/run/events.py) is the same."""
    if url is None or str(url) == "":
        return ""
    try:
        parts = urllib.parse.urlsplit(str(url))
        port = parts.port  # raises ValueError out of 0..65535 or not a number
    except ValueError:
        return "has a port that is not a number of 1..65535, or cannot be parsed"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "is not an http(s) URL with a host"
    if port == 0:
        return "has a port that is not a number of 1..65535, or cannot be parsed"
    if any(c.isspace() for c in str(url)):
        return "contains white space"
    return ""


def repair_said(line, write: dict | None = None) -> str | None:
    """A repair or update line as it really went: where the record could not be kept in the fact
    cache or the ledger (the trainer_record action's cache_error and ledger_error), the line says
    so instead of claiming the repair."""
    if not line:
        return line
    write = write if isinstance(write, dict) else {}
    cache_error, ledger_error = write.get("cache_error"), write.get("ledger_error")
    if cache_error and ledger_error:
        kept = "nothing kept on the controller"
    elif cache_error:
        kept = "ledger repaired"
    elif ledger_error:
        kept = "cache repaired"
    else:
        return line
    line = (
        str(line)
        .replace("cache and ledger repaired", kept)
        .replace("record and ledger updated", kept.replace("repaired", "updated"))
    )
    return "; but ".join([line, *(error for error in (cache_error, ledger_error) if error)])


class FilterModule:
    def filters(self):
        return {
            "inventory_options": inventory_options,
            "follow_command": follow_command,
            "launch_summary": launch_summary,
            "status_line": status_line,
            "status_block": status_block,
            "stop_block": stop_block,
            "repair_said": repair_said,
            "notice_url_problem": notice_url_problem,
        }
