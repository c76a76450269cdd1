"""Drive the playbooks through ansible-runner and read their results from events."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from queue import Queue
from typing import Any

import ansible_runner

REPO = Path(__file__).resolve().parent.parent
RUN_NAME_HINT = "a run name is a string such as 'nographs' (see trainer/runs/)"


@dataclass(frozen=True)
class Settings:
    """Where the playbooks, the inventory and the controller state are.

    ``state_dir`` holds everything a run leaves on the controller: the fact cache (``facts/``),
    the run ledger (``runs.jsonl``), the runner's artifacts (``runner/``) and, on the local
    default inventory, the workspace the trainer runs in (``workspace/``).
    """

    repo: Path = REPO
    inventory: Path | None = None
    state_dir: Path | None = None
    extravars: Mapping[str, Any] = field(default_factory=dict)
    envvars: Mapping[str, str] = field(default_factory=dict)
    # Seconds for one playbook; None: no limit beyond the playbooks' own timeouts.
    timeout: int | None = None
    # ansible-playbook --limit: a host pattern (status or stop of some hosts; a threaded run on one
    # host of a larger group). A multi-host launch refuses a limit that leaves hosts of the run out.
    limit: str | None = None
    # Runner artifact directories kept under state_dir/runner/artifacts.
    keep_artifacts: int = 20

    def __post_init__(self) -> None:
        repo = Path(self.repo).resolve()
        object.__setattr__(self, "repo", repo)
        inventory = Path(self.inventory) if self.inventory else repo / "inventory" / "local"
        object.__setattr__(self, "inventory", inventory.resolve())
        state_dir = Path(self.state_dir) if self.state_dir else repo / ".state"
        # The runner keeps a per-run fact cache unless it is given an absolute path.
        object.__setattr__(self, "state_dir", state_dir.resolve())
        if not (repo / "playbooks" / "launch.yml").is_file():
            raise ValueError(f"{repo} has no playbooks/launch.yml: point Settings.repo at the checkout")
        if not self.inventory.exists():
            raise ValueError(
                f"inventory {self.inventory} does not exist (try {repo / 'inventory' / 'local'})"
            )
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError("timeout must be a positive number of seconds, or None")


@dataclass
class PlaybookResult:
    """What one playbook run reported, read from the runner's events."""

    playbook: str
    status: str
    rc: int
    stats: dict[str, Any]
    facts: dict[str, dict[str, Any]]
    failures: list[str]
    artifact_dir: str

    @property
    def ok(self) -> bool:
        return self.status == "successful" and self.rc == 0


class PlaybookFailed(RuntimeError):
    """A playbook failed; the message carries the failed tasks' own messages."""

    def __init__(self, result: PlaybookResult) -> None:
        self.result = result
        detail = "\n".join(result.failures) or f"status {result.status}, rc {result.rc}"
        super().__init__(f"{result.playbook} failed:\n{detail}\n(runner artifacts: {result.artifact_dir})")


class Controller:
    """Launch, status, stop and export of DFlash runs on the hosts of group ``trainers`` of an inventory.

    Every call covers every host of the group (one torchrun per host for a multi-host run). The
    plain methods return the first host's result (the only one on a one-host inventory such as
    the local default); the ``*_by_host`` methods return every host's, in inventory order.
    """

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()

    def launch(self, run: str, **extravars: Any) -> dict[str, Any]:
        """Run launch.yml for ``run``; return the (first host's) run record (run_id, pid, log, ...).

        Raises PlaybookFailed when the launch is refused or the trainer does not reach its first
        progress line; the ledger keeps the record of a trainer that was started.
        """
        return next(iter(self.launch_by_host(run, **extravars).values()))

    def launch_by_host(self, run: str, **extravars: Any) -> dict[str, dict[str, Any]]:
        """Run launch.yml for ``run``; return every host's run record, by host name."""
        if not isinstance(run, str):
            raise TypeError(RUN_NAME_HINT)
        result = self.run_playbook("launch.yml", {"run": run, **extravars})
        records = result.stats.get("dflash_launch_by_host") or {
            host: facts["trainer_run"] for host, facts in result.facts.items() if facts.get("trainer_run")
        }
        if not records:
            raise PlaybookFailed(result)
        return records

    def regen(self, run: str, **extravars: Any) -> dict[str, Any]:
        """Run regen.yml for ``run``: start the run's data preparation (the target regenerates its
        data set into the cache, no training) detached and recorded like a launch; return the
        (first host's) run record. status() then says ``regenerating`` with its progress."""
        return next(iter(self.regen_by_host(run, **extravars).values()))

    def regen_by_host(self, run: str, **extravars: Any) -> dict[str, dict[str, Any]]:
        """Run regen.yml for ``run``; return every host's run record, by host name."""
        if not isinstance(run, str):
            raise TypeError(RUN_NAME_HINT)
        result = self.run_playbook("regen.yml", {"run": run, **extravars})
        records = result.stats.get("dflash_launch_by_host") or {
            host: facts["trainer_run"] for host, facts in result.facts.items() if facts.get("trainer_run")
        }
        if not records:
            raise PlaybookFailed(result)
        return records

    def status(self, **extravars: Any) -> dict[str, Any]:
        """Run status.yml; return the (first host's) report: state, run, pid, last_progress, gpus, ..."""
        return self.run_playbook("status.yml", extravars).stats["dflash_status"]

    def status_by_host(self, **extravars: Any) -> dict[str, dict[str, Any]]:
        """Run status.yml; return every host's report, by host name."""
        return self.run_playbook("status.yml", extravars).stats["dflash_status_by_host"]

    def stop(self, **extravars: Any) -> dict[str, Any]:
        """Run stop.yml; return what happened (on the first host): state_before, checkpoint, killed, msg."""
        return self.run_playbook("stop.yml", extravars).stats["dflash_stop"]

    def stop_by_host(self, **extravars: Any) -> dict[str, dict[str, Any]]:
        """Run stop.yml; return what happened on every host, by host name."""
        return self.run_playbook("stop.yml", extravars).stats["dflash_stop_by_host"]

    def export(
        self,
        run: str | None = None,
        step: int | None = None,
        dest: str | Path | None = None,
        dtype: str | None = None,
        **extravars: Any,
    ) -> dict[str, Any]:
        """Run export.yml: the recorded run (or ``run``), its newest valid checkpoint (or ``step``),
        exported to the DFlash format on the first trainer host and fetched to ``dest`` (default
        <state_dir>/exports/<run_id>/step_<N>, one per step; an explicit ``dest`` holding another
        export is refused). Returns run, run_id, step, tau, dest, serve commands, live, note, ..."""
        if run is not None and not isinstance(run, str):
            raise TypeError(RUN_NAME_HINT)
        if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
            raise ValueError(f"step must be a checkpoint's step number (an integer from 0), got {step!r}")
        chosen = {
            "run": run,
            "step": step,
            "dest": str(Path(dest).absolute()) if dest else None,
            "dtype": dtype,
        }
        chosen = {key: value for key, value in chosen.items() if value is not None}
        return self.run_playbook("export.yml", {**chosen, **extravars}).stats["dflash_export"]

    def runs(self, run: str | None = None, **extravars: Any) -> list[dict[str, Any]]:
        """Run runs.yml; return every launch, newest first: run, run_id, host, state (running,
        regenerating, finished, stopped, failed, crashed, recovered), started, duration_s, step, total_steps,
        last_loss, best_tau, last_tau, tokens_per_s, restarts, exit_reason, in_ledger."""
        if run is not None:
            extravars = {"run": run, **extravars}
        return self.run_playbook("runs.yml", extravars).stats["dflash_runs"]

    def runs_table(self, run: str | None = None, **extravars: Any) -> list[str]:
        """Run runs.yml; return its table, one line per launch (what ansible-playbook prints)."""
        if run is not None:
            extravars = {"run": run, **extravars}
        return self.run_playbook("runs.yml", extravars).stats["dflash_summary"]

    def report(self, runs: list[str], **extravars: Any) -> dict[str, Any]:
        """Run report.yml for these runs; return {path, size, runs}: the PNG on the controller."""
        if isinstance(runs, str) or not runs:
            raise TypeError("runs is a list of run names, e.g. ['nographs', 'eager']")
        return self.run_playbook("report.yml", {"runs": ",".join(runs), **extravars}).stats["dflash_report"]

    def logs(self, lines: int = 20, follow: bool = False, **extravars: Any) -> Iterator[str]:
        """Run logs.yml and yield the log's lines as they come: the last ``lines`` lines, then with
        ``follow`` every new line until the trainer exits. The last line says how the run stands
        (``<host>: <run> ended: finished at step 150, tau 1.947``). Raises PlaybookFailed when
        logs.yml fails (no run recorded, bad options). Closing the generator early ends the
        playbook."""
        if not isinstance(lines, int) or isinstance(lines, bool) or lines < 0:
            raise ValueError(f"lines must be a whole number, got {lines!r}")
        queue: Queue[str | None] = Queue()

        in_log_task = threading.Event()

        def on_event(event: dict) -> bool:
            # The run_log action displays each log line on its own: `verbose` events of the runner
            # while its task runs (the other tasks and the summary after the recap are not the log).
            kind = event.get("event")
            if kind in ("playbook_on_task_start", "playbook_on_stats"):
                action = (event.get("event_data") or {}).get("task_action") or ""
                in_log_task.set() if action.endswith("run_log") else in_log_task.clear()
            elif kind == "verbose" and in_log_task.is_set():
                for line in (event.get("stdout") or "").splitlines():
                    if not line.startswith(("[WARNING]", "[DEPRECATION WARNING]", "[ERROR]")):
                        queue.put(line)
            return True

        def finished(_runner: Any) -> None:
            queue.put(None)

        abandoned = threading.Event()
        options = self.runner_options("logs.yml", {"lines": lines, "follow": bool(follow), **extravars})
        thread, runner = ansible_runner.run_async(
            **options, event_handler=on_event, finished_callback=finished, cancel_callback=abandoned.is_set
        )
        try:
            while (line := queue.get()) is not None:
                yield line
        finally:
            abandoned.set()  # the consumer stopped reading early: the runner ends the playbook
            thread.join(timeout=60)
        result = read_events("logs.yml", runner)
        scrub_command_artifact(Path(runner.config.artifact_dir))
        if not result.ok:
            raise PlaybookFailed(result)
        yield from result.stats.get("dflash_summary") or []

    def runner_options(self, playbook: str, extravars: Mapping[str, Any]) -> dict[str, Any]:
        settings = self.settings
        state = settings.state_dir
        private = state / "runner"
        private.mkdir(parents=True, exist_ok=True)
        env = {
            "ANSIBLE_CONFIG": str(settings.repo / "ansible.cfg"),
            # ansible-runner starts ansible-playbook from PATH: use the one next to this Python.
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
            # The fact cache: ansible.cfg's plugin (a jsonfile that sets bad content aside), here.
            "ANSIBLE_CACHE_PLUGIN": "dflash.ct200.checked_jsonfile",
            "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(state / "facts"),
            **settings.envvars,
        }
        return dict(
            private_data_dir=str(private),
            project_dir=str(settings.repo),
            playbook=str(settings.repo / "playbooks" / playbook),
            inventory=str(settings.inventory),
            extravars={"dflash_state_dir": str(state), **settings.extravars, **extravars},
            envvars=env,
            # Not "jsonfile": the runner would set ANSIBLE_CACHE_PLUGIN=jsonfile over ours (and
            # its get_fact_cache() reads nothing with ansible-core 2.19 anyway).
            fact_cache_type="dflash.ct200.checked_jsonfile",
            # Without this the runner writes extravars and env (secrets) under env/ on disk.
            suppress_env_files=True,
            rotate_artifacts=settings.keep_artifacts,
            timeout=settings.timeout,
            limit=settings.limit,
            quiet=True,
        )

    def run_playbook(self, playbook: str, extravars: Mapping[str, Any]) -> PlaybookResult:
        """Run one playbook of playbooks/ and return its result; raise PlaybookFailed on failure."""
        runner = ansible_runner.run(**self.runner_options(playbook, extravars))
        result = read_events(playbook, runner)
        scrub_command_artifact(Path(runner.config.artifact_dir))
        if not result.ok:
            raise PlaybookFailed(result)
        return result


# Environment variables whose values may stay in the runner's `command` artifact.
SAFE_ENV = {"PATH", "HOME", "LANG", "PWD", "ANSIBLE_CONFIG", "PYTHONUNBUFFERED"}


# Extra variables whose values are secrets (a notice URL may carry credentials; the trackers'
# credentials of log.report_to).
SECRET_EXTRAVARS = (
    "notify_url", "wandb_api_key", "mlflow_tracking_uri", "mlflow_tracking_token",
    "mlflow_tracking_username", "mlflow_tracking_password",
)  # fmt: skip


def redact_extravars(argument: str) -> str:
    """An `-e '{json}'` argument of the runner's command with the secret variables' values redacted."""
    if not argument.startswith("{"):
        return argument
    try:
        extravars = json.loads(argument)
    except ValueError:
        return argument
    if not isinstance(extravars, dict):
        return argument
    for key in SECRET_EXTRAVARS:
        if key in extravars:
            extravars[key] = "<redacted>"
    return json.dumps(extravars)


def scrub_command_artifact(artifact_dir: Path) -> None:
    """ansible-runner writes the whole environment and the extra variables into
    <artifact_dir>/command, even with suppress_env_files=True: keep the variable names, drop the
    values of the environment (tokens live there) and of secret extra variables (notify_url)."""
    path = artifact_dir / "command"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    env = data.get("env") or {}
    data["env"] = {key: (value if key in SAFE_ENV else "<redacted>") for key, value in env.items()}
    data["command"] = [redact_extravars(part) for part in data.get("command") or []]
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


def read_events(playbook: str, runner: Any) -> PlaybookResult:
    """Collect set_stats data, cacheable facts and failure messages from the runner's events."""
    stats: dict[str, Any] = {}
    facts: dict[str, dict[str, Any]] = {}
    failures: list[str] = []
    for event in runner.events:
        kind = event.get("event")
        data = event.get("event_data", {})
        res = data.get("res") or {}
        if kind == "runner_on_ok" and isinstance(res.get("ansible_facts"), dict):
            facts.setdefault(data.get("host", ""), {}).update(res["ansible_facts"])
        elif kind in ("runner_on_failed", "runner_on_unreachable") and not data.get("ignore_errors"):
            failures.append(f"{data.get('host')}: {data.get('task')}: {res.get('msg', res)}")
        elif kind == "playbook_on_stats":
            stats.update(data.get("artifact_data") or {})
    return PlaybookResult(
        playbook=playbook,
        status=runner.status,
        rc=runner.rc,
        stats=stats,
        facts=facts,
        failures=failures,
        artifact_dir=str(runner.config.artifact_dir),
    )
