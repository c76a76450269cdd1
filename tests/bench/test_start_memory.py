"""The startup memory bench: where an allocation was made, and its refusal on a machine without CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from start_memory import origin  # noqa: E402


@pytest.mark.unit
def test_an_allocation_is_named_by_its_innermost_trainer_and_generated_frames():
    frames = [
        {"filename": "/venv/torch/_tensor.py", "line": 5, "name": "new"},
        {"filename": "/tmp/torchinductor_root/ab/cab.py", "line": 1477, "name": "call"},
        {"filename": "/repo/trainer/model/drafter.py", "line": 169, "name": "forward"},
        {"filename": "/repo/trainer/model/drafter.py", "line": 182, "name": "forward"},
        {"filename": "/repo/trainer/run/train.py", "line": 231, "name": "train_models"},
    ]
    assert (
        origin(frames) == "cab.py:1477:call <- model/drafter.py:169:forward <- model/drafter.py:182:forward"
    )
    assert origin(frames[:1]) == "_tensor.py:5:new"  # none of the trainer's: the innermost as it is
    assert origin([]).startswith("no frames")


@pytest.mark.slow
def test_without_cuda_it_says_so_and_runs_nothing():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the bench would start the trainer")
    result = subprocess.run(
        [sys.executable, "bench/start_memory.py", "--", "--run", "nographs"], cwd=REPO, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "no CUDA device here; run it on a GPU machine" in result.stderr
