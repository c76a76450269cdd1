"""Our recompile warning: a compiled function fed changing shapes is named in the run's log."""

from __future__ import annotations

import torch

from trainer.run.recompiles import RecompileWatch


def doubled(x):
    return x * 2


def test_warns_once_naming_the_function_and_the_reason():
    torch._dynamo.reset()
    watch = RecompileWatch(bound=2)
    compiled = torch.compile(doubled, dynamic=False, backend="eager")
    for length in (1, 2, 3):  # two recompiles: within the bound
        compiled(torch.ones(length))
    assert watch.poll() == []
    compiled(torch.ones(4))
    warnings = watch.poll()
    assert len(warnings) == 1
    assert warnings[0].startswith("warning: compiled function doubled (")
    assert "test_recompiles.py" in warnings[0] and "recompiled 3 times (more than 2)" in warnings[0]
    assert "size mismatch at index 0. expected 3, actual 4" in warnings[0]
    compiled(torch.ones(5))
    assert watch.poll() == []  # once per function


def test_static_shapes_raise_no_warning():
    torch._dynamo.reset()
    watch = RecompileWatch(bound=0)
    compiled = torch.compile(doubled, dynamic=False, backend="eager")
    for _ in range(5):
        compiled(torch.ones(3))
    assert watch.poll() == []
