"""dflash.ct200.trainer_tree: the trainer's files and a content hash that changes with the content
and nothing else."""

from __future__ import annotations

import base64
import hashlib
import os

import pytest
from ansible.errors import AnsibleLookupError
from ansible.plugins.loader import lookup_loader
from ansible_collections.dflash.ct200.plugins.lookup.trainer_tree import walk


@pytest.fixture
def tree(tmp_path):
    root = tmp_path / "trainer"
    (root / "runs").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "train.py").write_text("print('train')\n")
    (root / "runs/nographs.yml").write_text("run: {}\n")
    (root / "launch.sh").write_text("#!/bin/sh\n")
    os.chmod(root / "launch.sh", 0o755)
    return root


def lookup(*terms, **options):
    return lookup_loader.get("dflash.ct200.trainer_tree").run(list(terms), variables={}, **options)


def test_lists_every_file_with_its_mode_and_content(tree) -> None:
    (result,) = lookup(str(tree))
    files = {item["path"]: item for item in result["files"]}
    assert sorted(files) == ["__init__.py", "launch.sh", "runs/nographs.yml", "train.py"]
    assert base64.b64decode(files["train.py"]["content_b64"]) == b"print('train')\n"
    assert files["launch.sh"]["mode"] == "0755" and files["train.py"]["mode"] == "0644"
    assert result["dirs"] == ["runs"]


def test_the_hash_is_sha256_over_each_relative_path_and_file_digest(tree) -> None:
    overall = hashlib.sha256()
    for rel in ("__init__.py", "launch.sh", "train.py", "runs/nographs.yml"):  # directory by directory
        overall.update(f"{rel}\0{hashlib.sha256((tree / rel).read_bytes()).hexdigest()}\n".encode())
    assert walk(str(tree))["hash"] == "sha256:" + overall.hexdigest()


def test_the_hash_follows_content_and_names_not_timestamps(tree) -> None:
    before = walk(str(tree))["hash"]
    os.utime(tree / "train.py", (1, 1))
    assert walk(str(tree))["hash"] == before
    (tree / "train.py").write_text("print('changed')\n")
    changed = walk(str(tree))["hash"]
    assert changed != before
    (tree / "train.py").rename(tree / "loop.py")
    assert walk(str(tree))["hash"] not in (before, changed)


def test_byte_code_caches_and_hidden_entries_are_left_out(tree) -> None:
    before = walk(str(tree))
    (tree / "__pycache__").mkdir()
    (tree / "__pycache__/train.cpython-311.pyc").write_bytes(b"\0")
    (tree / "stray.pyc").write_bytes(b"\0")
    (tree / ".hidden").write_text("x")
    (tree / ".git").mkdir()
    (tree / ".git/config").write_text("x")
    assert walk(str(tree)) == before


def test_prefix_goes_before_every_path_and_does_not_change_the_hash(tree) -> None:
    (plain,) = lookup(str(tree))
    (prefixed,) = lookup(str(tree), prefix="trainer/")
    assert [f["path"] for f in prefixed["files"]] == ["trainer/" + f["path"] for f in plain["files"]]
    assert prefixed["hash"] == plain["hash"]


def test_one_result_per_directory_given(tree, tmp_path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("a")
    results = lookup(str(tree), str(other))
    assert len(results) == 2 and [f["path"] for f in results[1]["files"]] == ["a.txt"]


def test_a_missing_directory_is_an_error_naming_it(tmp_path) -> None:
    missing = tmp_path / "no-such-trainer"
    with pytest.raises(AnsibleLookupError, match=f"{missing} is not a directory"):
        lookup(str(missing))
