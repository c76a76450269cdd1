"""No shipped run profile recompiles its way to Dynamo's limit: short CPU runs of every profile,
their whole output (stdout and stderr, what the run's log holds) read for Dynamo's warning and ours.

The evaluation at step 0 and at the end generates 24 tokens for 4 prompts, one verify step at a
time, so the drafter sees well over 8 context lengths: compiled code fed those shapes would reach
torch._dynamo's recompile limit (8) in every compiled profile.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from trainer.config import known_runs

from .conftest import REPO

pytestmark = pytest.mark.slow

SHORT = [
    "--steps=2",
    "--set=train.eval_prompts=4",
    "--set=train.eval_max_new_tokens=24",
    "--set=train.log_every=1",
    "--set=train.eval_every=0",
    "--set=train.checkpoint_every=0",
]


def run_profile(name: str, cache_dir, out) -> tuple[int, str]:
    """The profile through trainer.launch (torchrun for the process topology), in its own session."""
    args = ["--run", name, *SHORT, f"--set=data.cache_dir={cache_dir}", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer.launch", "--", *args],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return proc.returncode, output


# The profiles of the embedded target. The qwen3-8b recipe needs a real target and compiles with the
# nographs settings (trainer/runs/qwen3-8b.yml); its run on a GPU is scripts/gpu_recipe.sh's.
EMBEDDED_PROFILES = sorted(name for name in known_runs() if name != "qwen3-8b")


@pytest.mark.parametrize("name", EMBEDDED_PROFILES)
def test_no_profile_reaches_the_recompile_limit(name, embedded, cache_dir, tmp_path):
    code, log = run_profile(name, cache_dir, tmp_path / "run")
    assert code == 0, log[-3000:]
    assert "done: step 2, tau" in log
    assert log.count("eval step ") == 2
    assert "recompile_limit" not in log, log
    assert "warning: compiled function" not in log, log
