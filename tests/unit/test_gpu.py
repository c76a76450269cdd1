"""module_utils/gpu.py: nvidia-smi's CSV read into GPUs, and the busy/idle judgement, on the real
output of an H200 (tests/orchestration/fakes/reference) and on the cases a container adds."""

from __future__ import annotations

from pathlib import Path

import pytest
from ansible_collections.dflash.ct200.plugins.module_utils import gpu

REFERENCE = Path(__file__).resolve().parents[1] / "orchestration/fakes/reference"
UUID = "GPU-7590547c-d9a8-b760-1c4e-93ce4dbbbac8"  # the H200 of the reference files


class FakeModule:
    """What gpu.py uses of AnsibleModule: get_bin_path and run_command, answered from a table."""

    def __init__(
        self, answers: dict[str, tuple[int, str, str]] | None, binary: str | None = "/usr/bin/nvidia-smi"
    ):
        self.answers = answers or {}
        self.binary = binary
        self.commands: list[list[str]] = []

    def get_bin_path(self, name: str):
        assert name == "nvidia-smi"
        return self.binary

    def run_command(self, argv: list[str]):
        self.commands.append(argv)
        return self.answers[argv[1]]


def smi(usage: str, apps: str, uuids: str = f"0, {UUID}\n") -> FakeModule:
    return FakeModule(
        {
            gpu.QUERY_USAGE[0]: (0, usage, ""),
            gpu.QUERY_UUID[0]: (0, uuids, ""),
            gpu.QUERY_APPS[0]: (0, apps, ""),
        }
    )


def reference(name: str) -> str:
    return (REFERENCE / name).read_text()


def test_an_idle_h200_is_idle() -> None:
    report = gpu.gpu_report(smi(reference("query-gpu.idle.csv"), reference("query-apps.idle.csv")), 1024, 5)
    assert report["available"] is True and report["problems"] == []
    assert report["gpus"] == [
        {"index": 0, "uuid": UUID, "memory_used_mib": 0, "utilization_pct": 0, "apps": []}
    ]
    assert report["lines"] == ["GPU 0: 0 MiB used, 0 % utilization, no processes"]


def test_a_busy_h200_is_busy_by_memory_utilization_and_process() -> None:
    report = gpu.gpu_report(smi(reference("query-gpu.busy.csv"), reference("query-apps.busy.csv")), 1024, 5)
    assert report["problems"] == [
        "GPU 0 is busy: 21363 MiB used (limit 1024 MiB); 100 % utilization (limit 5 %); "
        "process 425 python3 holding 21354 MiB"
    ]
    assert report["lines"] == ["GPU 0: 21363 MiB used, 100 % utilization, 425 python3"]


def test_the_commands_are_the_documented_queries() -> None:
    module = smi(reference("query-gpu.idle.csv"), "")
    gpu.gpu_report(module, 1024, 5)
    assert module.commands == [
        ["/usr/bin/nvidia-smi", *gpu.QUERY_UUID],
        ["/usr/bin/nvidia-smi", *gpu.QUERY_USAGE],
        ["/usr/bin/nvidia-smi", *gpu.QUERY_APPS],
    ]
    assert gpu.QUERY_USAGE == [
        "--query-gpu=index,memory.used,utilization.gpu",
        "--format=csv,noheader,nounits",
    ]


@pytest.mark.parametrize(
    ("memory", "utilization", "busy"),
    [(1024, 5, False), (1025, 0, True), (0, 6, True), (1024, 6, True)],
)
def test_thresholds_are_limits_not_exceeded(memory: int, utilization: int, busy: bool) -> None:
    report = gpu.gpu_report(smi(f"0, {memory}, {utilization}\n", ""), 1024, 5)
    assert bool(report["problems"]) is busy


def test_a_process_alone_makes_a_gpu_busy_and_a_nameless_one_is_explained() -> None:
    """In a container, the apps list shows host PIDs, often without a name."""
    report = gpu.gpu_report(smi("0, 3, 0\n", f"98765, {UUID}, [N/A], 500\n"), 1024, 5)
    assert report["problems"] == [
        "GPU 0 is busy: process 98765 unnamed process (a host PID, seen from a container?) holding 500 MiB"
    ]
    assert report["lines"] == ["GPU 0: 3 MiB used, 0 % utilization, 98765 (no name)"]


def test_unknown_values_are_not_judged_and_show_as_question_marks() -> None:
    report = gpu.gpu_report(smi("0, [N/A], [Not Supported]\n", ""), 1024, 5)
    assert report["problems"] == []
    assert report["lines"] == ["GPU 0: ? MiB used, ? % utilization, no processes"]


def test_an_unknown_memory_figure_of_a_process_is_not_printed_as_none() -> None:
    report = gpu.gpu_report(smi("0, 0, 0\n", f"425, {UUID}, python3, [N/A]\n"), 1024, 5)
    assert report["problems"] == ["GPU 0 is busy: process 425 python3 holding ? MiB"]


def test_a_process_on_a_gpu_this_container_cannot_see_is_still_reported() -> None:
    report = gpu.gpu_report(smi("0, 0, 0\n", "77, GPU-other, python3, 900\n"), 1024, 5)
    assert report["problems"] == ["GPU GPU-other is busy: process 77 python3 holding 900 MiB"]


def test_several_gpus_are_judged_each() -> None:
    uuids = "0, GPU-a\n1, GPU-b\n"
    report = gpu.gpu_report(smi("0, 0, 0\n1, 40000, 99\n", "12, GPU-b, python3, 39000\n", uuids), 1024, 5)
    assert len(report["problems"]) == 1 and report["problems"][0].startswith("GPU 1 is busy: 40000 MiB used")


def test_no_nvidia_smi_is_a_note_not_an_error() -> None:
    report = gpu.gpu_report(FakeModule(None, binary=None), 1024, 5)
    assert report == {
        "available": False,
        "gpus": [],
        "problems": [],
        "lines": [],
        "note": "nvidia-smi not found on PATH",
    }


def test_a_failing_nvidia_smi_is_a_note_quoting_its_error() -> None:
    failing = (9, "", "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n")
    module = FakeModule({gpu.QUERY_UUID[0]: failing})
    report = gpu.gpu_report(module, 1024, 5)
    assert report["available"] is False
    assert "exited 9" in report["note"] and "couldn't communicate with the NVIDIA driver" in report["note"]


def test_a_malformed_line_is_a_note_naming_it() -> None:
    report = gpu.gpu_report(smi("0, 12\n", ""), 1024, 5)
    assert report["available"] is False and report["note"] == "unexpected nvidia-smi line: 0, 12"


def test_no_gpu_listed_is_a_note() -> None:
    report = gpu.gpu_report(smi("", "", ""), 1024, 5)
    assert report["available"] is False and report["note"] == "nvidia-smi lists no GPU"
