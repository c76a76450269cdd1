"""Drive the real-host path against the test node: start/stop it, run playbooks through ansible-runner.

Used by the pytest module next to it and by measure.py. The made-up API token secret lives only in
this process's environment (which ansible-runner passes on); runner env files are suppressed.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ansible_runner

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from dflashctl.api import Controller, PlaybookFailed, Settings, scrub_command_artifact  # noqa: E402

TESTNODE = REPO / "tests" / "testnode" / "testnode.py"
INVENTORY = REPO / "molecule" / "proxmox" / "inventory"
NEEDS = ("lxc-start", "lxc-attach", "debootstrap", "unshare")


def missing_requirements() -> str | None:
    """Why the test node cannot run here, or None."""
    if os.geteuid() != 0:
        return "the test node needs root (LXC containers, mount namespaces)"
    absent = [tool for tool in NEEDS if shutil.which(tool) is None]
    if not Path("/usr/sbin/sshd").exists():
        absent.append("sshd")
    if absent:
        return f"missing {', '.join(absent)}: apt-get install lxc debootstrap openssh-server"
    return None


@dataclass
class PlayResult:
    """One playbook run: ansible-runner's status and rc, the whole stdout, the task results."""

    status: str
    rc: int
    stdout: str
    seconds: float
    events: list[dict[str, Any]] = field(repr=False, default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "successful" and self.rc == 0

    def changed(self) -> int:
        stats = [e for e in self.events if e.get("event") == "playbook_on_stats"]
        return sum(stats[-1]["event_data"].get("changed", {}).values()) if stats else -1

    def stats_data(self) -> dict[str, Any]:
        """What the playbook published with set_stats (dflash_status, dflash_stop, ...)."""
        stats = [e for e in self.events if e.get("event") == "playbook_on_stats"]
        return stats[-1]["event_data"].get("artifact_data", {}) if stats else {}

    def failure_messages(self) -> list[str]:
        return [
            str(e["event_data"]["res"].get("msg", ""))
            for e in self.events
            if e.get("event") == "runner_on_failed" and not e["event_data"].get("ignore_errors")
        ]


@dataclass
class RealHostNode:
    """A started test node and everything the playbooks run against it leave behind."""

    state_dir: Path
    work_dir: Path
    token_secret: str
    info: dict[str, Any] = field(default_factory=dict)
    runs: int = 0

    @classmethod
    def start(cls, state_dir: Path, work_dir: Path) -> RealHostNode:
        secret = "made-up-" + secrets.token_hex(16)
        os.environ.update(
            PROXMOX_USER="root@pam",
            PROXMOX_TOKEN_ID="dflash",
            PROXMOX_TOKEN_SECRET=secret,
            TESTNODE_STATE=str(state_dir),
        )
        os.environ.pop("PROXMOX_PASSWORD", None)
        node = cls(state_dir=state_dir, work_dir=work_dir, token_secret=secret)
        node.testnode("start")
        node.info = json.loads((state_dir / "testnode.json").read_text())
        os.environ.update(
            PROXMOX_HOST=f"{node.info['api_host']}:{node.info['api_port']}",
            REQUESTS_CA_BUNDLE=node.info["cafile"],
            PROXMOX_VALIDATE_CERTS="true",
        )
        # ansible-runner runs ansible-playbook from PATH: the one next to this interpreter.
        os.environ["PATH"] = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
        # Controller state of these runs (fact cache, run ledger) stays in the test's folder.
        os.environ["ANSIBLE_CACHE_PLUGIN_CONNECTION"] = str(work_dir / "facts")
        os.environ["ANSIBLE_NOCOLOR"] = "1"
        return node

    def stop(self) -> None:
        self.testnode("stop")

    def testnode(self, *args: str) -> str:
        proc = subprocess.run(
            [sys.executable, str(TESTNODE), "--state-dir", str(self.state_dir), *args],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"testnode {' '.join(args)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
        return proc.stdout

    def commands_on_node(self) -> list[str]:
        """Commands of the CT's that reached the node's own shell (its tripwires caught them)."""
        sys.path.insert(0, str(TESTNODE.parent))
        from testnode import commands_on_node

        return commands_on_node(self.state_dir)

    def control(self, request: dict[str, Any]) -> Any:
        sys.path.insert(0, str(TESTNODE.parent))
        from testnode import control

        return control(self.state_dir, request)

    def api_state(self) -> dict[str, Any]:
        """The API's containers and the node's LXC containers (what a failure must leave alone)."""
        cts = self.control({"op": "state"})["cts"]
        lxc_dir = self.state_dir / "lxc"
        lxc = sorted(p.name for p in lxc_dir.iterdir()) if lxc_dir.exists() else []
        return {"cts": cts, "lxc": lxc}

    def pct(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run pct on the node over its sshd (the way the roles reach it)."""
        return self.node_shell(shlex.join(["pct", *args]))

    def node_shell(self, line: str) -> subprocess.CompletedProcess[str]:
        """One command line for the node's shell over its sshd, as proxmox_pct_remote sends it."""
        return subprocess.run(
            [
                "ssh",
                "-i",
                self.info["ssh_key"],
                "-p",
                str(self.info["ssh_port"]),
                "-o",
                "IdentitiesOnly=yes",
                "-o",
                f"UserKnownHostsFile={self.state_dir / 'known_hosts'}",
                "-o",
                "BatchMode=yes",
                f"root@{self.info['ssh_host']}",
                line,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def play(
        self,
        playbook: str,
        *cmdline: str,
        extravars: dict[str, Any] | None = None,
        env: dict[str, str | None] | None = None,
    ) -> PlayResult:
        """Run playbooks/<playbook> on the test inventory through dflashctl (ansible-runner), as the
        product does; env entries set (or, None, unset) variables of the controller for this run."""
        self.runs += 1
        settings = Settings(inventory=INVENTORY, state_dir=self.work_dir / "state", keep_artifacts=100)
        saved = {key: os.environ.get(key) for key in (env or {})}
        for key, value in (env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        started = time.monotonic()
        try:
            if cmdline:
                result = run_with_cmdline(settings, playbook, dict(extravars or {}), " ".join(cmdline))
            else:
                result = Controller(settings).run_playbook(playbook, dict(extravars or {}))
        except PlaybookFailed as failed:
            result = failed.result
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        seconds = time.monotonic() - started
        artifacts = Path(result.artifact_dir)
        stdout = (artifacts / "stdout").read_text() if (artifacts / "stdout").exists() else ""
        events = [json.loads(p.read_text()) for p in sorted((artifacts / "job_events").glob("*.json"))]
        return PlayResult(status=result.status, rc=result.rc, stdout=stdout, seconds=seconds, events=events)


def run_with_cmdline(settings: Settings, playbook: str, extravars: dict[str, Any], cmdline: str) -> Any:
    """dflashctl's run with extra ansible-playbook options (--check), which its API does not take."""
    from dflashctl.api import read_events

    private = settings.state_dir / "runner"
    private.mkdir(parents=True, exist_ok=True)
    runner = ansible_runner.run(
        private_data_dir=str(private),
        project_dir=str(settings.repo),
        playbook=str(settings.repo / "playbooks" / playbook),
        inventory=str(settings.inventory),
        extravars={"dflash_state_dir": str(settings.state_dir), **extravars},
        cmdline=cmdline,
        envvars={"ANSIBLE_CONFIG": str(settings.repo / "ansible.cfg")},
        fact_cache=str(settings.state_dir / "facts"),
        fact_cache_type="jsonfile",
        suppress_env_files=True,
        quiet=True,
    )
    scrub_command_artifact(Path(runner.config.artifact_dir))
    return read_events(playbook, runner)
