"""The stand-in nvidia-smi answers the preflight's queries exactly as the real one did on an H200."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import BUSY, FAKES, IDLE

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)
REFERENCE = FAKES / "reference"
USAGE = ["--query-gpu=index,memory.used,utilization.gpu", "--format=csv,noheader,nounits"]
APPS = ["--query-compute-apps=pid,gpu_uuid,process_name,used_memory", "--format=csv,noheader,nounits"]
HEADER = [
    "--query-gpu=index,uuid,name,memory.total,memory.used,utilization.gpu,driver_version",
    "--format=csv",
]


def standin(tmp_path: Path, state: dict, args: list[str]) -> str:
    state_file = tmp_path / "state.json"
    state_file.write_text(json.dumps(state), encoding="utf-8")
    done = subprocess.run(
        [str(FAKES / "nvidia-smi"), *args],
        env={"NVIDIA_SMI_STANDIN_STATE": str(state_file), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


@pytest.mark.parametrize(
    ("state", "args", "reference"),
    [
        (BUSY, USAGE, "query-gpu.busy.csv"),
        (BUSY, APPS, "query-apps.busy.csv"),
        (IDLE, USAGE, "query-gpu.idle.csv"),
        (IDLE, APPS, "query-apps.idle.csv"),
        (
            IDLE,
            ["--query-gpu=index,memory.used,utilization.gpu", "--format=csv,noheader"],
            "query-gpu.idle.units.csv",
        ),
        (IDLE, HEADER, "query-gpu.header.csv"),
    ],
)
def test_standin_matches_the_real_output(
    tmp_path: Path, state: dict, args: list[str], reference: str
) -> None:
    assert standin(tmp_path, state, args) == (REFERENCE / reference).read_text(encoding="utf-8")
