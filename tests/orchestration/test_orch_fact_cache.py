"""The controller's fact cache is only a cache: whatever is in the file ansible-core 2.19 actually
reads (`facts/s1_<host>`) - JSON of the wrong types, random bytes, a directory - or a file where the
cache directory should be, is moved aside with one line, the record is rebuilt from the target,
and status and stop go on. Real playbooks (dflashctl over ansible-runner), the real trainer on CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import ENDLESS_TINY_RUN, is_our_trainer, make_controller, stop_leftovers

from dflashctl import Controller, PlaybookFailed, Settings


def host_file(state_dir: Path) -> Path:
    """The file ansible-core 2.19 reads for host ct200: its cache schema prefixes the host name."""
    return state_dir / "facts" / "s1_ct200"


def damage(state_dir: Path, kind: str) -> None:
    facts, cached = state_dir / "facts", host_file(state_dir)
    if kind == "wrong_types":
        garbage = {"trainer_run": "garbage", "trainer_pid": 7}
        cached.write_text(json.dumps({"__payload__": json.dumps(garbage)}))
    elif kind == "wrong_field_type":
        payload = json.loads(json.loads(cached.read_text())["__payload__"])
        payload["trainer_run"]["pid"] = "not a pid"
        cached.write_text(json.dumps({"__payload__": json.dumps(payload)}))
    elif kind == "bytes":
        cached.write_bytes(os.urandom(256))
    elif kind == "directory":
        cached.unlink()
        cached.mkdir()
    elif kind == "file_for_the_directory":
        facts.rename(state_dir / "facts-before")  # keeps what earlier damages set aside, to count
        facts.write_text("a file where the fact cache directory should be\n")


def set_aside(state_dir: Path) -> list[Path]:
    """Everything moved aside so far (the last damage moves the whole directory, earlier ones inside)."""
    return sorted(state_dir.rglob("*set-aside-*"))


@pytest.mark.slow
def test_a_cache_of_any_wrong_shape_is_set_aside_and_never_blocks_status_or_stop(state_dir: Path) -> None:
    ctl = make_controller(state_dir, workspace_trainer_set=ENDLESS_TINY_RUN)
    try:
        record = ctl.launch("nographs")
        assert json.loads(json.loads(host_file(state_dir).read_text())["__payload__"])["trainer_run"][
            "run_id"
        ] == record["run_id"], "the test damages the file the cache really is"
        kinds = ["wrong_types", "wrong_field_type", "bytes", "directory", "file_for_the_directory"]
        for count, kind in enumerate(kinds, start=1):
            damage(state_dir, kind)
            result = ctl.run_playbook("status.yml", {})
            status = result.stats["dflash_status"]
            assert status["state"] == "running" and status["pid"] == record["pid"], kind
            stdout = (Path(result.artifact_dir) / "stdout").read_text()
            assert stdout.count("moved aside to") == 1, (kind, stdout)
            assert "Validation of arguments failed" not in stdout and "Traceback" not in stdout
            assert len(set_aside(state_dir)) == count, "moved aside, never deleted"
            rebuilt = json.loads(json.loads(host_file(state_dir).read_text())["__payload__"])
            assert rebuilt["trainer_run"]["run_id"] == record["run_id"], f"{kind}: rebuilt from the target"

        # A cache that cannot be written at all (its directory would be under a file): the repair
        # is said as what it is - the ledger repaired, the cache not - and stop still works.
        blocker = state_dir / "blocker"
        blocker.write_text("a file\n")
        blocked = Controller(
            Settings(state_dir=state_dir, envvars={"ANSIBLE_CACHE_PLUGIN_CONNECTION": str(blocker / "facts")},
                     extravars={"workspace_trainer_set": ENDLESS_TINY_RUN}, timeout=900)
        )  # fmt: skip
        status = blocked.status()
        assert status["state"] == "running" and status["pid"] == record["pid"]
        assert "cache and ledger repaired" not in status["repaired"], status["repaired"]
        assert "ledger repaired; but the controller's fact cache cannot be used" in status["repaired"]

        # A launch with a cache of the wrong shape is refused for what it is: the live trainer.
        damage(state_dir, "wrong_types")
        with pytest.raises(PlaybookFailed, match=f"as PID {record['pid']} "):
            ctl.launch("nographs")

        damage(state_dir, "wrong_types")
        stopped = ctl.stop()
        assert stopped["state_before"] == "running" and not is_our_trainer(record)
    finally:
        stop_leftovers(ctl, state_dir)
