"""dflash.ct200.run_report: the runs' curves rendered into one PNG (real matplotlib), written whole
or not at all; bad runs, a dest that is not a PNG, no matplotlib and an unwritable place refused
with a message; check mode writes nothing."""

from __future__ import annotations

import sys

import pytest
from ansible_collections.dflash.ct200.plugins.modules import run_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

RUNS = [
    {
        "label": "nographs",
        "series": {"train": [[1, 9.0, 100.0], [2, 5.0, None], [3, None, 120.0]], "eval": [[2, 1.4]]},
    },
    {"label": "ct200:eager", "series": {"train": [], "eval": [[1, 1.1], [3, 1.7]]}},
]


def test_the_report_is_a_png_in_a_directory_made_for_it(run_module, tmp_path) -> None:
    dest = tmp_path / "reports" / "new" / "report.png"
    result = run_module(run_report.main, {"runs": RUNS, "dest": str(dest), "title": "two runs"})
    assert not result.failed, result.result.get("msg")
    assert result.result["changed"] is True and result.result["path"] == str(dest)
    assert dest.read_bytes().startswith(PNG_MAGIC)
    assert result.result["size"] == dest.stat().st_size > 1000
    assert dest.stat().st_mode & 0o777 == 0o644
    assert [path.name for path in dest.parent.iterdir()] == ["report.png"]  # no temporary file left


def test_an_existing_report_is_replaced(run_module, tmp_path) -> None:
    dest = tmp_path / "report.png"
    dest.write_bytes(b"an older report")
    result = run_module(run_report.main, {"runs": RUNS[:1], "dest": str(dest)})
    assert not result.failed, result.result.get("msg")
    assert dest.read_bytes().startswith(PNG_MAGIC)


def test_check_mode_writes_nothing(run_module, tmp_path) -> None:
    dest = tmp_path / "reports" / "report.png"
    result = run_module(run_report.main, {"runs": RUNS, "dest": str(dest)}, check_mode=True)
    assert not result.failed and result.result == {**result.result, "changed": True, "size": 0}
    assert not dest.parent.exists()


@pytest.mark.parametrize(
    "runs",
    [[], [{"series": {}}], [{"label": "a", "series": [[1, 2.0, 3.0]]}], [RUNS[0], {"label": "b"}]],
    ids=["empty", "no-label", "series-not-a-dict", "one-bad-among-good"],
)
def test_runs_must_be_labelled_series(run_module, tmp_path, runs) -> None:
    dest = tmp_path / "report.png"
    result = run_module(run_report.main, {"runs": runs, "dest": str(dest)})
    assert result.failed
    assert result.result["msg"] == "run_report: runs must be a non-empty list of {label, series} entries"
    assert not dest.exists()


def test_dest_must_be_a_png(run_module, tmp_path) -> None:
    dest = tmp_path / "report.svg"
    result = run_module(run_report.main, {"runs": RUNS, "dest": str(dest)})
    assert result.failed and result.result["msg"] == f"run_report: dest {dest} must end in .png"
    assert not dest.exists()


def test_runs_and_dest_are_required(run_module, tmp_path) -> None:
    result = run_module(run_report.main, {"runs": RUNS})
    assert result.failed and "dest" in result.result["msg"]
    result = run_module(run_report.main, {"dest": str(tmp_path / "r.png")})
    assert result.failed and "runs" in result.result["msg"]


def test_without_matplotlib_it_says_how_to_install_it(run_module, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    result = run_module(run_report.main, {"runs": RUNS, "dest": str(tmp_path / "report.png")})
    assert result.failed and "pip install -r requirements.txt" in result.result["msg"]


def test_a_dest_it_cannot_write_fails_naming_it(run_module, tmp_path) -> None:
    blocker = tmp_path / "reports"
    blocker.write_text("a file where the directory should be")
    dest = blocker / "report.png"
    result = run_module(run_report.main, {"runs": RUNS, "dest": str(dest)})
    assert result.failed and result.result["msg"].startswith(f"cannot write the report {dest}: ")
    assert blocker.read_text() == "a file where the directory should be"
