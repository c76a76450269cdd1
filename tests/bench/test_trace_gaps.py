"""bench/trace_gaps.py: busy, idle, exposed and overlapped communication from a Chrome trace."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from trace_gaps import summarise

pytestmark = pytest.mark.unit


def kernel(name: str, start: float, dur: float, device: int = 0, stream: int = 7) -> dict:
    args = {"device": device, "stream": stream}
    return {"ph": "X", "cat": "kernel", "name": name, "ts": start, "dur": dur, "args": args}


def test_one_step_with_a_gap_an_overlap_and_an_exposed_all_reduce(tmp_path: Path) -> None:
    events = [
        kernel("gemm", 0, 4000),  # 0-4 ms compute
        kernel("ncclDevKernel_AllReduce", 3000, 2000, stream=9),  # 3-5 ms: 1 ms beside, 1 ms alone
        kernel("adam", 7000, 3000),  # a 2 ms gap before it, 7-10 ms
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99999},  # not a device event
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    text = summarise(trace, steps=1)
    assert "span 10.0 ms/step: busy 8.0 (80.0%), idle 2.0" in text
    assert "compute kernels 7.0 ms/step (union 7.0); NCCL 2.0: beside compute 1.0, alone 1.0" in text
    assert "gap 2.00 ms at +5.0 ms: after 'ncclDevKernel_AllReduce', before 'adam'" in text
