"""export.yml through the controller: a finished run's checkpoint exported on the target and fetched
to the controller, again without change, with the controller state lost, and refused on bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import is_our_trainer, make_controller, stop_leftovers
from safetensors.torch import load_file

from dflashctl import PlaybookFailed
from dflashctl.api import REPO

# The data as it is, not regenerated through the target first: the export does not depend on it.
SHORT_RUN = [
    "data.regenerate=false",
    "train.steps=20",
    "train.log_every=5",
    "train.eval_every=10",
    "train.checkpoint_every=10",
    "train.eval_prompts=4",
    "train.eval_max_new_tokens=16",
]


@pytest.mark.slow
def test_export_of_the_recorded_run_then_by_name_with_the_state_lost(state_dir: Path, tmp_path: Path) -> None:
    ctl = make_controller(state_dir, workspace_trainer_set=SHORT_RUN)
    try:
        record = ctl.launch("eager")
        # The target is this machine: wait for the recorded trainer to end, then ask status once.
        deadline = time.monotonic() + 600
        while is_our_trainer(record):
            assert time.monotonic() < deadline, "the short run did not finish in 600 s"
            time.sleep(0.2)
        status = ctl.status()
        assert status["state"] == "exited" and status["exit_status"] == 0, status

        exported = ctl.export()
        dest = state_dir / "exports" / record["run_id"] / "step_20"
        assert exported["dest"] == str(dest) and exported["run_id"] == record["run_id"]
        assert exported["step"] == 20 and exported["dtype"] == "bfloat16" and exported["fetched"] is True
        assert sorted(p.name for p in dest.iterdir()) == [
            "README.md",
            "config.json",
            "export.json",
            "model.safetensors",
        ]
        config = json.loads((dest / "config.json").read_text())
        assert config["architectures"] == ["DFlashDraftModel"] and "dflash_config" in config
        assert "fc.weight" in load_file(str(dest / "model.safetensors"))
        assert f"--speculative-draft-model-path {dest} " in exported["serve"]["sglang"]
        assert f'"model": "{dest}"' in exported["serve"]["vllm"]
        metrics = Path(record["out"]) / "metrics.jsonl"
        last_eval = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
        assert exported["tau"] == last_eval["tau"]

        assert exported["live"] is False
        assert exported["note"] == "Run eager is not training: this is its checkpoint of step 20."

        again = ctl.export(step=10, dtype="float32", dest=tmp_path / "chosen")
        assert again["step"] == 10 and (tmp_path / "chosen" / "model.safetensors").is_file()
        # Another step's export never replaces one: its own directory, or a refusal at an explicit dest.
        before = (dest / "model.safetensors").read_bytes()
        assert ctl.export(step=10)["dest"] == str(dest.parent / "step_10")
        assert (dest / "model.safetensors").read_bytes() == before
        with pytest.raises(PlaybookFailed, match="already holds the export of step 10 of run eager"):
            ctl.export(step=20, dest=tmp_path / "chosen")
        assert json.loads((tmp_path / "chosen" / "export.json").read_text())["step"] == 10

        # The controller's state lost: the recorded run is unknown, a run named explicitly still exports.
        shutil.rmtree(state_dir / "facts")
        with pytest.raises(PlaybookFailed, match="No run is recorded on ct200: pass -e run=NAME"):
            ctl.export()
        by_name = ctl.export(run="eager")
        assert by_name["step"] == 20 and by_name["run_id"] == "eager"
        assert (state_dir / "exports" / "eager" / "step_20" / "model.safetensors").is_file()

        command = ["export", "--run", "eager", "--step", "10", "--dest", str(tmp_path / "cli")]
        cli = subprocess.run(
            [sys.executable, "-m", "dflashctl", "--state-dir", str(state_dir), *command],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["step"] == 10 and (tmp_path / "cli" / "config.json").is_file()

        with pytest.raises(PlaybookFailed, match="no checkpoint of step 7 in"):
            ctl.export(run="eager", step=7)
        with pytest.raises(PlaybookFailed, match="runs/nographs is not a directory"):
            ctl.export(run="nographs")
        with pytest.raises(ValueError, match="step must be a checkpoint's step number"):
            ctl.export(run="eager", step=-1)
    finally:
        stop_leftovers(ctl, state_dir)
