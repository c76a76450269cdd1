"""dflash.ct200.run_config: the run resolved on the controller by the trainer's own config loader
(trainer/config.py, no torch): the shipped profiles, every problem of a profile, the machine config
and the overrides named (the machine config by the label the role gives it, never a temporary
file), and a source that is not the trainer package refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from ansible.errors import AnsibleLookupError, AnsibleRequiredOptionError
from ansible.plugins.loader import lookup_loader

TRAINER = Path(__file__).resolve().parents[2] / "trainer"


def lookup(*terms, **options) -> dict:
    options.setdefault("source", str(TRAINER))
    [result] = lookup_loader.get("dflash.ct200.run_config").run(list(terms), variables={}, **options)
    return result


def test_a_shipped_run_resolves_as_the_trainer_resolves_it() -> None:
    result = lookup("nographs")
    assert result["ok"] is True and result["problems"] == []
    profile = yaml.safe_load((TRAINER / "runs" / "nographs.yml").read_text())
    assert result["profile"] == str(TRAINER / "runs" / "nographs.yml")
    assert result["topology"] == profile["run"]["topology"] == result["config"]["run"]["topology"]
    assert result["log_name"] == profile["run"]["log_name"]
    assert result["steps"] == result["config"]["train"]["steps"]
    assert set(result["runs"]) == {path.stem for path in (TRAINER / "runs").glob("*.yml")}
    assert result["runs"]["nographs"] == profile["run"]["description"]


def test_overrides_and_the_machine_config_are_applied() -> None:
    result = lookup("nographs", sets=["train.steps=7"], machine={"model": {"dtype": "float32"}})
    assert result["ok"] is True, result["problems"]
    assert result["steps"] == 7 and result["config"]["model"]["dtype"] == "float32"


def test_every_problem_is_named_with_where_it_comes_from() -> None:
    result = lookup(
        "nographs",
        sets=["train.steps=-1", "train.bogus=1"],
        machine={"model": {"nope": 1}},
        machine_label="inventory variable dflash_machine",
    )
    assert result["ok"] is False and "config" not in result
    problems = result["problems"]
    assert len(problems) == 3
    assert problems[0].startswith(
        "machine config inventory variable dflash_machine: model.nope: unknown key"
    )
    assert problems[1].startswith("--set: train.bogus: unknown key (known: steps, ")
    assert problems[2] == "train.steps must be at least 1, got -1"
    assert not any("dflash-check-" in problem for problem in problems), "a temporary file is named"


@pytest.mark.parametrize("run", ["missing", "../nographs", "x;touch /tmp/marker", "", 5])
def test_an_unknown_or_malformed_run_name_is_one_problem_with_the_known_runs(run) -> None:
    result = lookup(run)
    assert result["ok"] is False and result["problems"] == [f"unknown run {run!r}"]
    assert "nographs" in result["runs"]


def test_a_profile_that_is_not_yaml_is_named_and_the_other_runs_still_listed(tmp_path) -> None:
    source = tmp_path / "trainer"
    (source / "runs").mkdir(parents=True)
    shutil.copy(TRAINER / "config.py", source / "config.py")
    shutil.copy(TRAINER / "runs" / "nographs.yml", source / "runs" / "nographs.yml")
    (source / "runs" / "broken.yml").write_text("run: {description: [unclosed\n")
    listing = lookup("nographs", source=str(source))
    assert listing["ok"] is True and listing["runs"]["broken"] == "(unreadable profile)"
    broken = lookup("broken", source=str(source))
    assert broken["ok"] is False
    assert broken["problems"][0].startswith(f"run profile {source / 'runs' / 'broken.yml'} cannot be read: ")


def test_a_source_that_is_not_the_trainer_package_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(AnsibleLookupError, match=r"config\.py does not exist: dflash_trainer_source must be"):
        lookup("nographs", source=str(tmp_path))


def test_the_source_option_is_required() -> None:
    with pytest.raises(AnsibleRequiredOptionError, match="Required config 'source'"):
        lookup_loader.get("dflash.ct200.run_config").run(["nographs"], variables={})
