"""Bad values for a launch get one line naming the problem and the way out, before anything is touched:
no traceback, no ansible-playbook usage, no internal variable names, no dump of argument rules. Real
ansible-playbook and dev.sh, refused on the controller (nothing starts)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SECRET = "s3cr3t-made-up"

CASES = [
    (["-e", "resume=maybe"], 'resume must be true or false (got "maybe")'),
    (["-e", "fresh=2"], 'fresh must be true or false (got "2")'),
    (["-e", "steps=99999999999999999999"], "train.steps must be at most 1000000000"),
    (["-e", '{"workspace_trainer_set": ["train.lr=inf"]}'], "train.lr must be a finite number, got inf"),
    (
        ["-e", f"notify_url=http://hook:{SECRET}@127.0.0.1:99999/hooks"],
        "notify_url has a port that is not a number of 1..65535",
    ),
    (["-e", "notify_url=ftp://127.0.0.1/hooks"], "notify_url is not an http(s) URL with a host"),
]


def dev_sh(state: Path, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "ANSIBLE_CACHE_PLUGIN_CONNECTION": str(state / "facts"),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
    }
    return subprocess.run(
        [str(REPO / "dev.sh"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
@pytest.mark.parametrize(("options", "said"), CASES, ids=[c[1].split(" (")[0][:40] for c in CASES])
def test_a_bad_value_is_one_line_and_touches_nothing(tmp_path: Path, options: list[str], said: str) -> None:
    state = tmp_path / "state"
    result = dev_sh(state, "launch", "nographs", "-e", f"dflash_state_dir={state}", *options)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    errors = [line for line in output.splitlines() if line.startswith("[ERROR]")]
    assert len(errors) == 1 and said in errors[0], output
    for internal in ("Traceback", "preflight_resume", "Validation of arguments failed", "usage:", SECRET):
        assert internal not in output
    assert not (state / "workspace").exists() and not (state / "runs.jsonl").exists()


@pytest.mark.slow
def test_an_empty_run_name_is_named_not_ansible_usage(tmp_path: Path) -> None:
    result = dev_sh(tmp_path / "state", "launch", "")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: the run name is empty; pass one, e.g. ./dev.sh launch nographs (or none: nographs)"
    )
    assert "usage:" not in result.stdout + result.stderr
