"""The regeneration bench with answers that end at given lengths (--answer-lengths), on the CPU (tiny
shape): every answer equals plain greedy generate's with the same forced ending, and the share of
row-steps used is what the lengths and the static engine's batches imply."""

from __future__ import annotations

import contextlib
import io
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import regen_bench  # noqa: E402
from bench.regen_bench import drawn_answer_lengths, make_prompts  # noqa: E402
from bench.trainer_bench import SHAPES  # noqa: E402
from trainer.data.decode import STOP_CHECK_EVERY  # noqa: E402
from trainer.data.regen import RegenSettings, static_batches  # noqa: E402

PROMPTS, CAP = 12, 16


def bench(tmp_path: Path, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "bench/regen_bench.py", "--shape", "tiny", "--rows", "static",
         "--prompts", str(PROMPTS), "--new-tokens", str(CAP), "--passes", "1",
         "--compile-cache", str(tmp_path), *args],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def refused(*args: str) -> str:
    """The bench refusing these arguments as it reads them, before it loads anything: exit status 2;
    its stderr. Its own argument reading, in this process (a fresh one costs seconds of imports)."""
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr):
        patch.setattr(sys, "argv", ["bench/regen_bench.py", *args])
        with pytest.raises(SystemExit) as exited:
            regen_bench.parse_args()
    assert exited.value.code == 2, stderr.getvalue()
    return stderr.getvalue()


def expected_row_steps_share(lengths: list[int]) -> float:
    """Answer tokens over rows x steps: each batch of the engine (its layout at the bench's settings,
    24-token median prompts, 64-token widths) decodes until every row has said its end token, which it
    sees at the first check (every STOP_CHECK_EVERY tokens) after it, or to the cap."""
    prompts = make_prompts(PROMPTS, 24, SHAPES["tiny"].vocab)
    settings = RegenSettings(max_new_tokens=CAP, min_width=64)
    answered = row_steps = 0
    for _, rows in static_batches(prompts, settings):
        longest = max(lengths[i] for i in rows)
        steps = min(CAP, STOP_CHECK_EVERY * math.ceil((longest + 1) / STOP_CHECK_EVERY))
        answered += sum(min(lengths[i], CAP) for i in rows)
        row_steps += steps * len(rows)
    return 100 * answered / row_steps


@pytest.mark.slow
@pytest.mark.parametrize(
    ("spec", "lengths"),
    [
        ("lognormal:6:40", drawn_answer_lengths("lognormal", 6, 40, PROMPTS)),
        (f"fixed:{CAP}", [CAP] * PROMPTS),
    ],
    ids=["long-tailed", "equal-at-the-cap"],
)
def test_answers_end_at_their_lengths_and_row_steps_used_is_what_they_imply(tmp_path, spec, lengths):
    out = bench(tmp_path, "--answer-lengths", spec)
    equal = re.search(r"^ +answers equal: (\d+)/(\d+)$", out, re.MULTILINE)
    assert equal and int(equal[1]) == int(equal[2]) == PROMPTS, out
    used = re.search(r"^ +row-steps used: ([\d.]+) %", out, re.MULTILINE)
    assert used, out
    assert float(used[1]) == pytest.approx(expected_row_steps_share(lengths), abs=0.05), out
    tokens = re.search(r"^static B\d+ pass 1 +\d+ prompts +[\d.]+ s +(\d+) tokens", out, re.MULTILINE)
    assert tokens and int(tokens[1]) == sum(min(n, CAP) for n in lengths), out  # answer tokens only
    # Steps traced with the forced ending are kept apart from those without (a loaded one would not end).
    assert f"compiling into {tmp_path}/answer-lengths/" in out, out
    if spec.startswith("fixed"):
        assert float(used[1]) == 100.0
    else:
        assert float(used[1]) < 100.0


@pytest.mark.unit
def test_file_lengths_without_a_chat_file_are_refused_naming_the_way_out() -> None:
    stderr = refused("--answer-lengths", "file", "--rows", "static")
    assert "--answer-lengths file needs --chat and --target" in stderr


@pytest.mark.unit
@pytest.mark.parametrize("spec", ["lognormal:6", "lognormal:50:10", "fixed:0", "uniform:5", "lognormal:a:b"])
def test_bad_answer_lengths_are_refused_naming_the_forms(spec) -> None:
    assert "file, lognormal:MEDIAN:CAP or fixed:N" in refused("--answer-lengths", spec, "--rows", "static")


@pytest.mark.slow
def test_continuous_batching_tuned_ends_each_request_at_its_length(tmp_path):
    """The continuous row through transformers' manager, a --cb-* setting given: each request's own
    cap ends its answer, and every answer is plain greedy generate's."""
    lengths = drawn_answer_lengths("lognormal", 6, 40, 8)
    out = bench(tmp_path, "--rows", "continuous", "--prompts", "8", "--answer-lengths", "lognormal:6:40",
                "--cb-block-size", "32")  # fmt: skip
    assert re.search(r"^ +answers equal: 8/8$", out, re.MULTILINE), out
    tokens = re.search(r"^continuous \(tuned\) +8 prompts +[\d.]+ s +(\d+) tokens", out, re.MULTILINE)
    assert tokens and int(tokens[1]) == sum(min(n, CAP) for n in lengths), out


@pytest.mark.slow
def test_the_paged_row_says_where_its_loop_went_and_profiles_the_iterations_asked_for(tmp_path):
    out = bench(tmp_path, "--rows", "paged", "--answer-lengths", "lognormal:6:40", "--slots", "4",
                "--profile-iterations", "2:3")  # fmt: skip
    loop = re.findall(r"^ +the loop's ([\d.]+) s: decode inputs .* a decode step ([\d.]+) ms", out, re.M)
    assert len(loop) == 2 and all(float(ms) > 0 for _, ms in loop), out  # both passes
    assert re.search(r"^ +profiled iterations 2-4: [\d.]+ s; decode inputs", out, re.MULTILINE), out
    assert "aten::" in out, out  # the profiler's table
    assert re.search(r"^ +answers equal: (\d+)/\1$", out, re.MULTILINE), out  # each against `generate`


@pytest.mark.slow
def test_the_paged_row_s_narrower_tail_steps_use_more_of_their_slot_steps_with_the_same_answers(tmp_path):
    out = bench(tmp_path, "--rows", "paged", "--answer-lengths", "lognormal:6:40", "--slots", "8",
                "--tail-slots", "4/2,none")  # fmt: skip
    row = r"^paged S8 T(\S+) .* pass 2.*\n +(\d+) decode steps \((.*?)\).*?, (\d+)% of slot-steps"
    rows = re.findall(row, out, re.MULTILINE)
    by_tail = {tail: (int(steps), widths, int(share)) for tail, steps, widths, share in rows}
    assert set(by_tail) == {"4/2", "none"}, out
    assert by_tail["4/2"][0] == by_tail["none"][0], out  # the same decode steps
    assert "of 2 slots" in by_tail["4/2"][1] and by_tail["4/2"][2] > by_tail["none"][2], out
    assert len(re.findall(r"^ +answers equal: (\d+)/\1$", out, re.MULTILINE)) == 2, out


@pytest.mark.slow
def test_the_paged_row_runs_each_slot_count_with_its_own_pool_side_by_side_with_the_same_answers(tmp_path):
    """--slots 4,8:POOL: a row each; a pool of 3 usable pages of 64 holds at most 3 sequences of up
    to 64 tokens, so 8 slots in it decode no more rows at once than 4 would (more steps than 8 slots
    in the default pool), every answer equal `generate`'s either way."""
    out = bench(tmp_path, "--rows", "paged", "--answer-lengths", "lognormal:6:40", "--slots", "4,8:256,8",
                "--tail-slots", "none")  # fmt: skip
    row = r"^paged S(\S+) T.* pass 2 .*\n +(\d+) decode steps"
    steps = {name: int(count) for name, count in re.findall(row, out, re.MULTILINE)}
    assert set(steps) == {"4", "8/256", "8"}, out
    assert steps["8/256"] > steps["8"] and steps["4"] > steps["8"], out
    assert len(re.findall(r"^ +answers equal: (\d+)/\1$", out, re.MULTILINE)) == 3, out


@pytest.mark.unit
@pytest.mark.parametrize("slots", ["x", "8:", "8:y", "0", "8:0"])
def test_bad_slots_are_refused_naming_the_form(slots) -> None:
    assert "argument --slots: " in refused("--slots", slots, "--rows", "paged")


@pytest.mark.unit
@pytest.mark.parametrize("window", ["3", "a:2", "-1:2", "2:0"])
def test_a_bad_profile_window_is_refused_naming_the_form(window) -> None:
    assert "FIRST:COUNT" in refused("--profile-iterations", window, "--rows", "paged")
