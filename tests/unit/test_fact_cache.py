"""The fact cache plugin dflash.ct200.checked_jsonfile (a host file that is not a valid record is moved
aside, never deleted, and reads as uncached) and the filter repair_said (a repair is said as it went)."""

from __future__ import annotations

import json
import os

import pytest
from ansible_collections.dflash.ct200.plugins.cache import checked_jsonfile
from ansible_collections.dflash.ct200.plugins.filter.summary import repair_said

pytestmark = pytest.mark.unit

RECORD = {"run_id": "nographs-20261201T000000Z-42", "run": "nographs", "pid": 42, "start_time": 7}


def unconfigured_cache() -> checked_jsonfile.CacheModule:
    """The plugin without its constructor, which would make the configured cache directory."""
    return checked_jsonfile.CacheModule.__new__(checked_jsonfile.CacheModule)


def wrapped(facts) -> bytes:
    return json.dumps({"__payload__": json.dumps(facts)}).encode()


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (wrapped({"trainer_run": RECORD, "trainer_pid": 42}), None),
        (wrapped({}), None),
        (wrapped({"trainer_run": "garbage"}), "trainer_run is str, not a record"),
        (wrapped({"trainer_run": {**RECORD, "pid": "42"}}), "trainer_run.pid is str, not int"),
        (wrapped({"trainer_run": {**RECORD, "start_time": True}}), "trainer_run.start_time is bool, not int"),
        (wrapped({"trainer_run": RECORD, "trainer_pid": [1]}), "trainer_pid is list, not int"),
        (wrapped(["not", "a", "mapping"]), "its facts are list, not a mapping"),
        (json.dumps({"__payload__": "{not json"}).encode(), "its payload is not JSON"),
        (b"[1, 2]", "it is not a cache file of this Ansible version"),
        (os.urandom(64) + b"\xff", "cannot be read as JSON"),
    ],
    ids=[
        "valid", "empty", "wrong-type", "wrong-field", "bool-field", "wrong-pid", "list", "payload",
        "not-wrapped", "bytes",
    ],
)
def test_a_host_file_is_kept_only_when_it_is_a_valid_record(tmp_path, content, problem, capsys) -> None:
    cache = unconfigured_cache()
    path = tmp_path / "s1_ct200"
    path.write_bytes(content)
    if problem is None:
        assert cache._load(str(path)) == json.loads(content)
        assert [p.name for p in tmp_path.iterdir()] == ["s1_ct200"]
        return
    with pytest.raises(FileNotFoundError):  # what the base class reads as "not cached"
        cache._load(str(path))
    kept = [p for p in tmp_path.iterdir()]
    assert len(kept) == 1 and kept[0].name.startswith("s1_ct200.set-aside-"), "moved aside, never deleted"
    assert kept[0].read_bytes() == content
    said = capsys.readouterr()
    assert problem in said.err + said.out and "rebuilt from the target" in said.err + said.out


def test_a_directory_in_place_of_a_host_file_is_moved_aside(tmp_path) -> None:
    cache = unconfigured_cache()
    (tmp_path / "s1_ct200").mkdir()
    with pytest.raises(FileNotFoundError):
        cache._load(str(tmp_path / "s1_ct200"))
    assert [p.name.split(".")[0] for p in tmp_path.iterdir()] == ["s1_ct200"]
    assert not (tmp_path / "s1_ct200").exists()


def test_two_set_asides_in_one_second_keep_both(tmp_path) -> None:
    for content in (b"first", b"second"):
        (tmp_path / "s1_ct200").write_bytes(content)
        checked_jsonfile.set_aside(str(tmp_path / "s1_ct200"))
    assert sorted(p.read_bytes() for p in tmp_path.iterdir()) == [b"first", b"second"]


def test_a_repair_is_said_as_it_went() -> None:
    line = "the controller's cache had no run; the target holds run r (PID 4): cache and ledger repaired"
    assert repair_said(line, {}) == line
    assert repair_said(None, {"cache_error": "x"}) is None
    assert repair_said(line, {"cache_error": "the cache cannot be written"}) == (
        line.replace("cache and ledger repaired", "ledger repaired") + "; but the cache cannot be written"
    )
    both = repair_said(line, {"cache_error": "c", "ledger_error": "l"})
    assert "nothing kept on the controller; but c; but l" in both and "repaired" not in both
    ended = repair_said("run r has finished since: record and ledger updated", {"ledger_error": "l"})
    assert ended.endswith("cache updated; but l")


def test_two_commands_reading_the_same_bad_file_set_it_aside_once(tmp_path, capsys) -> None:
    """Two playbooks at once: the first moves the bad file aside, the second finds it gone (uncached)."""
    first, second = unconfigured_cache(), unconfigured_cache()
    path = tmp_path / "s1_ct200"
    path.write_bytes(b"\x00garbage")
    for cache in (first, second):
        with pytest.raises(FileNotFoundError):
            cache._load(str(path))
    assert len(list(tmp_path.iterdir())) == 1
    said = capsys.readouterr()
    assert (said.err + said.out).count("moved aside to") == 1
