"""dflash.ct200.workspace_sync: writes what differs, prunes what left the source, changes nothing
in check mode or on bad input."""

from __future__ import annotations

import base64
import os
import stat

from ansible_collections.dflash.ct200.plugins.modules import workspace_sync


def entry(path: str, content: bytes, mode: str = "0644") -> dict:
    return {"path": path, "content_b64": base64.b64encode(content).decode(), "mode": mode}


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_first_sync_writes_every_file_with_its_mode_and_creates_directories(tmp_path, run_module) -> None:
    files = [entry("run.sh", b"#!/bin/sh\n", "0750"), entry("trainer/a/b.py", b"x = 1\n")]
    result = run_module(workspace_sync.main, {"dest": str(tmp_path), "files": files, "dir_mode": "0700"})
    assert not result.failed and result.result["changed"]
    assert result.result["written"] == ["run.sh", "trainer/a/b.py"]
    assert (tmp_path / "run.sh").read_bytes() == b"#!/bin/sh\n"
    assert mode_of(tmp_path / "run.sh") == 0o750
    assert mode_of(tmp_path / "trainer/a/b.py") == 0o644
    assert mode_of(tmp_path / "trainer/a") == 0o700
    assert not [p for p in tmp_path.rglob(".sync-*")], "a temporary file was left behind"


def test_second_sync_of_the_same_files_changes_nothing(tmp_path, run_module) -> None:
    args = {"dest": str(tmp_path), "files": [entry("machine.yml", b"a: 1\n")], "prune": ["."]}
    run_module(workspace_sync.main, args)
    again = run_module(workspace_sync.main, args)
    assert again.result["changed"] is False
    assert again.result["written"] == [] and again.result["removed"] == []


def test_content_or_mode_drift_on_the_target_is_repaired(tmp_path, run_module) -> None:
    args = {"dest": str(tmp_path), "files": [entry("a.txt", b"one\n"), entry("b.txt", b"two\n")]}
    run_module(workspace_sync.main, args)
    (tmp_path / "a.txt").write_bytes(b"edited on the target\n")
    os.chmod(tmp_path / "b.txt", 0o600)
    result = run_module(workspace_sync.main, args)
    assert result.result["written"] == ["a.txt", "b.txt"]
    assert (tmp_path / "a.txt").read_bytes() == b"one\n"
    assert mode_of(tmp_path / "b.txt") == 0o644


def test_prune_removes_only_unlisted_files_below_the_pruned_directories(tmp_path, run_module) -> None:
    (tmp_path / "trainer/old").mkdir(parents=True)
    (tmp_path / "trainer/old/gone.py").write_text("")
    (tmp_path / "trainer/__pycache__").mkdir()
    (tmp_path / "trainer/__pycache__/kept.pyc").write_text("")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs/checkpoint.pt").write_text("not the trainer's source: never pruned")
    args = {"dest": str(tmp_path), "files": [entry("trainer/kept.py", b"")], "prune": ["trainer"]}
    result = run_module(workspace_sync.main, args)
    assert result.result["removed"] == ["trainer/old/gone.py"]
    assert not (tmp_path / "trainer/old/gone.py").exists()
    assert (tmp_path / "trainer/__pycache__/kept.pyc").exists()
    assert (tmp_path / "runs/checkpoint.pt").exists()


def test_check_mode_reports_what_would_change_and_changes_nothing(tmp_path, run_module) -> None:
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer/stale.py").write_text("stale")
    args = {"dest": str(tmp_path), "files": [entry("trainer/new.py", b"new")], "prune": ["trainer"]}
    result = run_module(workspace_sync.main, args, check_mode=True)
    assert result.result["changed"] is True
    assert result.result["written"] == ["trainer/new.py"]
    assert result.result["removed"] == ["trainer/stale.py"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["stale.py", "trainer"]


def test_a_path_leaving_the_destination_is_refused_before_anything_is_written(tmp_path, run_module) -> None:
    dest = tmp_path / "ws"
    for bad in ("../escape", "/etc/passwd", "a//b", "", "a/../../b"):
        files = [entry("first.txt", b"valid, listed before the bad one"), entry(bad, b"x")]
        result = run_module(workspace_sync.main, {"dest": str(dest), "files": files})
        assert result.failed, bad
        assert repr(bad) in result.result["msg"] and "relative path" in result.result["msg"]
        assert not dest.exists(), f"{bad!r}: something was written"
    assert not (tmp_path / "escape").exists()


def test_a_prune_entry_leaving_the_destination_is_refused(tmp_path, run_module) -> None:
    (tmp_path / "keep.txt").write_text("outside the workspace")
    dest = tmp_path / "ws"
    result = run_module(workspace_sync.main, {"dest": str(dest), "files": [], "prune": [".."]})
    assert result.failed and "prune entry '..'" in result.result["msg"]
    assert (tmp_path / "keep.txt").exists()


def test_a_file_that_cannot_be_written_fails_naming_it_leaving_no_temporary_file(
    tmp_path, run_module
) -> None:
    (tmp_path / "run.sh").write_text("a file where the sync needs a directory")
    files = [entry("a.txt", b"written first"), entry("run.sh/inner", b"x")]
    result = run_module(workspace_sync.main, {"dest": str(tmp_path), "files": files})
    assert result.failed
    assert "run.sh/inner" in result.result["msg"] and str(tmp_path) in result.result["msg"]
    assert result.result["written"] == ["a.txt"]
    assert (tmp_path / "run.sh").read_text() == "a file where the sync needs a directory"
    assert not [p for p in tmp_path.rglob(".sync-*")]
