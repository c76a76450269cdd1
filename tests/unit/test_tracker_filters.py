"""dflash.ct200 tracker filters: the trackers a run reports to, their packages for the venv, and the
0600 file of their credentials that run.sh sources."""

from __future__ import annotations

import subprocess

import pytest
from ansible_collections.dflash.ct200.plugins.filter.trackers import (
    report_to,
    tracker_env_file,
    tracker_requirements,
)

pytestmark = pytest.mark.unit

PACKAGES = {
    "tensorboard": ["tensorboard==2.21.0"],
    "mlflow": ["mlflow-skinny==3.17.2"],
    "wandb": ["wandb==0.31.0"],
}


def test_the_trackers_of_a_resolved_log_section():
    assert report_to({"report_to": ["wandb", "mlflow"], "tensorboard": False}) == ["wandb", "mlflow"]
    assert report_to({"report_to": ["mlflow", "tensorboard"], "tensorboard": True}) == [
        "mlflow",
        "tensorboard",
    ]
    assert report_to({"report_to": [], "tensorboard": True}) == ["tensorboard"]
    assert report_to({}) == report_to(None) == []


def test_the_packages_of_the_chosen_trackers_once_each():
    already = ["torch==2.13.0", "tensorboard==2.21.0"]
    assert tracker_requirements(["tensorboard", "wandb", "mlflow", "wandb"], PACKAGES, already) == [
        "wandb==0.31.0",
        "mlflow-skinny==3.17.2",
    ]
    assert tracker_requirements([], PACKAGES, already) == []


def test_the_credentials_file_exports_exactly_the_values_set(tmp_path):
    env = {"WANDB_API_KEY": "k$y 'q\" `x`", "MLFLOW_TRACKING_URI": "", "MLFLOW_TRACKING_TOKEN": None}
    text = tracker_env_file(env)
    assert "MLFLOW_TRACKING_URI" not in text and "MLFLOW_TRACKING_TOKEN" not in text
    path = tmp_path / "tracker_env"
    path.write_text(text)
    shown = subprocess.run(["sh", "-c", '. "$1" && printf %s "$WANDB_API_KEY"', "sh", str(path)],
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert shown == env["WANDB_API_KEY"]
    assert tracker_env_file({"WANDB_API_KEY": "", "MLFLOW_TRACKING_URI": ""}) == ""
    with pytest.raises(ValueError, match="not a shell variable name"):
        tracker_env_file({"A B": "x"})
