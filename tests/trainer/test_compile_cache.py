"""The compile cache (trainer/model/compile_cache.py): a process that compiles saves what it
compiled, its traces included; a fresh process over the same directory loads it and says so; two
processes saving at once leave only whole bundles; another software stack gets a directory of its
own."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from trainer.model import compile_cache

from .conftest import REPO

COMPILE = """
import os, sys, torch
from pathlib import Path
from trainer.model import compile_cache

if os.environ.get("REFUSE_KEPT_TRACES"):  # torch failing to install what it loaded
    def refuse(self, backends):
        raise RuntimeError("kept traces refused by the test")
    torch._dynamo.package.CompilePackage.install = refuse
directory = Path(sys.argv[1])
with compile_cache.persisted(directory, print):
    step = compile_cache.keeping_traces(lambda x: (x * 2).sin() + 1, dynamic=False)
    print("result", step(torch.ones(8)).tolist() == ((torch.ones(8) * 2).sin() + 1).tolist())
    # Another module's function compiled as torch does, its traces not kept (as transformers' flex
    # attention is in a regeneration).
    other = {"torch": torch}
    exec("def other(x):\\n    return x.cos() * 3", other)
    torch.compile(other["other"], dynamic=False)(torch.ones(8))
print("bundles", len(list((directory / "mega").glob("*.bin"))))
"""


def compile_in_a_fresh_process(directory, env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", COMPILE, str(directory)], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(process: subprocess.Popen) -> str:
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    return output


def test_a_fresh_process_loads_what_the_first_compiled(tmp_path, monkeypatch):
    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "elsewhere")}
    directory = compile_cache.cache_directory(tmp_path / "compile")
    cold = finish(compile_in_a_fresh_process(directory, env))
    assert f"compile cache: cold (compiling into {directory})" in cold
    spent = re.search(r"compile cache: ([0-9.]+) s of ([0-9.]+) s in torch.compile", cold)
    assert spent and 0 < float(spent[1]) <= float(spent[2]), cold  # the block's time, most of it compiling
    assert "bundles 1" in cold
    # Two fresh processes at once, both over the saved cache: both warm, only whole bundles after.
    both = [compile_in_a_fresh_process(directory, env) for _ in range(2)]
    for output in map(finish, both):
        assert "compile cache: warm (" in output and f"artifacts loaded from {directory})" in output, output
        # torch's precompile: Dynamo's output was kept too, so the warm process traced nothing.
        assert "1 compiled function(s) loaded with their traces, not traced again" in output, output
    for bundle in (directory / "mega").glob("*.bin"):
        assert torch.compiler.load_cache_artifacts(bundle.read_bytes()) is not None
    assert not list((directory / "mega").glob(".*.tmp"))


def test_kept_traces_torch_cannot_load_are_traced_again_and_said(tmp_path):
    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "elsewhere")}
    directory = compile_cache.cache_directory(tmp_path / "compile")
    assert "result True" in finish(compile_in_a_fresh_process(directory, env))
    refused = finish(compile_in_a_fresh_process(directory, {**env, "REFUSE_KEPT_TRACES": "1"}))
    assert "result True" in refused
    said = "kept traces torch could not load, traced again (<lambda>: RuntimeError: kept traces refused by"
    assert said in refused, refused
    assert "loaded with their traces" not in refused


CHANGED_CODE = """
import os, sys, torch
from pathlib import Path
from trainer.model import compile_cache

directory, modules = Path(sys.argv[1]), Path(sys.argv[2])
modules.mkdir(exist_ok=True)
body = f"import torch\\n\\n\\ndef step(x):\\n    return (x * {os.environ['FACTOR']}).sin() + 1\\n"
(modules / "stepmod.py").write_text(body)
sys.path.insert(0, str(modules))
import stepmod
with compile_cache.persisted(directory, print):
    step = compile_cache.keeping_traces(stepmod.step, dynamic=False)
    print("result", torch.equal(step(torch.ones(8)), stepmod.step(torch.ones(8))))
"""


def test_kept_traces_of_code_changed_since_are_not_loaded(tmp_path):
    """A new version of the compiled function (the product upgraded, torch not) keeps its name and
    line, so torch finds the old version's traces: it must not run them. The answers are the new
    code's and the log says why it traced again."""
    directory = compile_cache.cache_directory(tmp_path / "compile")
    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "elsewhere")}
    outputs = []
    for factor, modules in (("2", "old"), ("3", "new")):
        command = [sys.executable, "-c", CHANGED_CODE, str(directory), str(tmp_path / modules)]
        run = subprocess.run(command, cwd=REPO, env={**env, "FACTOR": factor}, capture_output=True, text=True,
                             timeout=600, check=False)  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        outputs.append(run.stdout)
    assert all("result True" in output for output in outputs), outputs
    said = "kept traces torch could not load, traced again (step: RuntimeError: Source code changes"
    assert said in outputs[1], outputs[1]


def test_the_directory_names_the_software_stack():
    import transformers

    key = compile_cache.stack_key()
    assert torch.__version__.replace("+", "_") in key and transformers.__version__ in key
    assert f"py{sys.version_info.major}.{sys.version_info.minor}" in key
    assert "/" not in key


def test_an_unreadable_bundle_is_skipped_and_said(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))
    directory = tmp_path / "compile" / "stack"
    (directory / "mega").mkdir(parents=True)
    (directory / "mega" / "0123.bin").write_bytes(b"not a bundle")
    lines = []
    with compile_cache.persisted(directory, lines.append):
        pass
    assert lines[0] == f"compile cache: cold (compiling into {directory}; 1 unreadable bundle(s) skipped)"
    assert lines[1].startswith("compile cache: 0.0 s of ") and len(lines) == 2


def test_a_bundle_torch_cannot_make_costs_only_the_next_start(tmp_path, monkeypatch):
    """The work inside the block is done when torch fails to bundle what it compiled (a setting
    such as Dynamo's precompile can fail there): the log says the cache was not saved, nothing is
    raised, and no bundle is left half written."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "before"))

    def cannot_bundle():
        raise RuntimeError("cannot pickle 'CUDAGraph' object")

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", cannot_bundle)
    directory = tmp_path / "compile" / "stack"
    lines = []
    with compile_cache.persisted(directory, lines.append):
        done = True
    assert done and lines[-1] == (
        f"compile cache: not saved ({directory}: torch could not bundle it: cannot pickle 'CUDAGraph' object)"
    )
    assert list((directory / "mega").iterdir()) == []


NEW_INPUTS = """
import os, sys, torch
from pathlib import Path
from trainer.model import compile_cache

if os.environ.get("LEAVE_TORCH_COUNTING"):  # torch names a new trace's globals as the loaded ones
    compile_cache.number_after_loaded_names = lambda: None


def step(x, weight=None):
    return (x * 2 - 3).relu() + 1 if weight is None else x @ weight


directory = Path(sys.argv[1])
with compile_cache.persisted(directory, print):
    compiled = compile_cache.keeping_traces(step, dynamic=False)
    for size in map(int, sys.argv[2].split(",")):
        x = torch.arange(size, dtype=torch.float32)
        print("result", size, torch.equal(compiled(x), step(x)))
    if os.environ.get("BAD_INPUT"):  # the traced code's own error: raised as it is, not compiled again
        try:
            compiled(torch.ones(3, 4), torch.ones(5, 2))
        except Exception as exc:
            print("raised", type(exc).__name__)
"""


def run_inputs(directory, sizes: str, env) -> str:
    command = [sys.executable, "-c", NEW_INPUTS, str(directory), sizes]
    run = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def test_a_warm_process_meeting_an_input_its_traces_lack_compiles_it_and_keeps_what_it_loaded(tmp_path):
    """The first process keeps the traces of one shape; a fresh one loads them, meets that shape,
    a new one and the first again: every answer is the uncompiled one, the loaded traces stay in
    use, and an error of the traced code itself is raised as it is."""
    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "elsewhere")}
    directory = compile_cache.cache_directory(tmp_path / "compile")
    assert "result 8 True" in run_inputs(directory, "8", env)
    warm = run_inputs(directory, "8,16,8", {**env, "BAD_INPUT": "1"})
    assert warm.count("True") == 3 and "result 16 True" in warm, warm
    assert "1 compiled function(s) loaded with their traces, not traced again" in warm, warm
    assert "raised TorchRuntimeError" in warm and "compiled afresh" not in warm, warm


def test_loaded_traces_that_fail_torch_compile_on_a_new_input_give_way_to_a_fresh_compile_said_once(tmp_path):
    """Where torch fails all the same to trace a new input beside loaded traces (here its own clash
    of global names, the counter left where it starts), the call is compiled afresh without them:
    the answers are the uncompiled ones, and the log names the function, the input and why."""
    env = {**__import__("os").environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "elsewhere")}
    directory = compile_cache.cache_directory(tmp_path / "compile")
    run_inputs(directory, "8", env)
    warm = run_inputs(directory, "8,16,8,32", {**env, "LEAVE_TORCH_COUNTING": "1"})
    assert warm.count("True") == 4, warm
    said = "loaded traces that failed torch.compile on a new input, the function compiled afresh without them"
    assert f"{said} (step on inputs 16: AssertionError: " in warm, warm
    assert "already exists in scope" in warm or "step on inputs 16: AssertionError)" in warm, warm
    assert warm.count("step on inputs") == 1, warm


@pytest.mark.unit
def test_only_the_compile_machinery_s_own_failures_give_way_to_a_fresh_compile():
    from torch._dynamo.exc import TorchRuntimeError

    def raised(exc, filename):  # exc raised by code that sits in `filename`
        scope = {"exc": exc}
        exec(compile("def fail():\n    raise exc\n", filename, "exec"), scope)
        try:
            scope["fail"]()
        except BaseException as caught:
            return caught
        raise AssertionError("not raised")

    elsewhere = str(REPO / "trainer" / "step.py")
    torch_dynamo = compile_cache.COMPILER_PACKAGES[0] + "/utils.py"
    assert compile_cache.compile_machinery_failed(raised(AssertionError("name in scope"), torch_dynamo))
    assert not compile_cache.compile_machinery_failed(raised(ValueError("the traced code's"), elsewhere))
    assert not compile_cache.compile_machinery_failed(raised(torch.OutOfMemoryError("cuda"), torch_dynamo))
    assert not compile_cache.compile_machinery_failed(raised(TorchRuntimeError("shapes"), torch_dynamo))
