"""How a run ended, read from its log (module_utils/trainer_proc.exit_from_log), also under torchrun,
whose failure report (some 40 lines) follows the trainer's own last words."""

from __future__ import annotations

from pathlib import Path

from ansible_collections.dflash.ct200.plugins.module_utils import trainer_proc


def torchrun_report(exitcode: int) -> list[str]:
    """The end of a torchrun log after a rank failed (as torch 2.13 writes it, shortened)."""
    return [
        "E1129 17:37:29.376000 21455 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
        f"(exitcode: {exitcode}) local_rank: 0 (pid: 21485) of binary: /venv/bin/python3",
        "Traceback (most recent call last):",
        '  File "/ws/trainer/torchrun.py", line 125, in <module>',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
        "trainer FAILED",
        "Root Cause (first observed failure):",
        "[0]:",
        "  rank      : 1 (local_rank: 0)",
        f"  exitcode  : {exitcode} (pid: 21485) ",
        "============================================================",
    ]


def test_bad_input_of_a_rank_under_torchrun_is_exit_status_2_with_its_message() -> None:
    lines = [
        "run process: topology process, devices 2 process(es) (gloo), rank 1 on cpu, ...",
        "error: data.train_file /nonexistent/chat.jsonl does not exist; give a JSONL chat file",
        *torchrun_report(2),
    ]
    verdict = trainer_proc.exit_from_log(lines)
    assert verdict["exit_status"] == 2
    assert verdict["exit_reason"] == (
        "bad input: data.train_file /nonexistent/chat.jsonl does not exist; give a JSONL chat file"
    )
    assert trainer_proc.describe_exit(verdict).startswith("2 (bad input: data.train_file")


def test_crashed_rank_under_torchrun_is_exit_status_1_with_its_error() -> None:
    lines = [
        "Traceback (most recent call last):",
        "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:14733.",
        *torchrun_report(1),
    ]
    verdict = trainer_proc.exit_from_log(lines)
    assert verdict["exit_status"] == 1
    assert "Connection closed by peer" in verdict["exit_reason"]


def test_rank_killed_without_last_words_takes_torchruns_exit_code() -> None:
    verdict = trainer_proc.exit_from_log(["step 3/100 loss 1.0", *torchrun_report(-9)])
    assert verdict == {
        "exit_status": -9,
        "exit_reason": "a rank killed by signal 9 (torchrun's report in the log)",
    }


def test_plain_trainer_logs_read_as_before() -> None:
    assert trainer_proc.exit_from_log(["checkpoint saved step 5 /x", "stopped at step 5"])["exit_status"] == 0
    assert trainer_proc.exit_from_log(["done: step 9, tau 1.00 (step 0: 1.00)"])["exit_status"] == 0
    assert trainer_proc.exit_from_log(["error: bad"])["exit_status"] == 2
    unknown = trainer_proc.exit_from_log(["step 1/9 loss 1.0"])
    assert unknown["exit_status"] is None
    assert trainer_proc.describe_exit(unknown) == "unknown (the log does not say)"


def test_tau_of_a_host_without_metrics_comes_from_its_log(tmp_path: Path) -> None:
    """A host other than rank 0's has no metrics.jsonl; its log has the evaluation lines."""
    log = tmp_path / "train_process.log"
    lines = ["eval step 0 tau 1.000 prompts 16", "step 50/150 loss 2.1", "eval step 50 tau 1.719 prompts 16"]
    log.write_text("\n".join([*lines, "step 51/150 loss 2.0"]) + "\n")
    assert trainer_proc.last_tau_in_log(str(log)) == {"kind": "eval", "step": 50, "tau": 1.719, "prompts": 16}
    log.write_text("step 1/150 loss 9.0\n")
    assert trainer_proc.last_tau_in_log(str(log)) is None


def test_a_full_disk_or_an_unsaved_checkpoint_in_the_log_is_a_crash_not_bad_input() -> None:
    line = "error: disk full writing /w/runs/r/checkpoints: No space left on device; the last intact ..."
    verdict = trainer_proc.exit_from_log(["step 3/100 loss 1.0", line])
    assert verdict["exit_status"] == 1 and verdict["exit_reason"].startswith("crashed: disk full writing")
    assert trainer_proc.exit_from_log(["error: train.lr must be positive"])["exit_status"] == 2
    unsaved = "error: cannot save the checkpoint of step 1 in /w/r/checkpoints: No space left on device; ..."
    verdict = trainer_proc.exit_from_log(["signal SIGTERM: checkpointing and exiting", unsaved])
    assert verdict == {"exit_status": 1, "exit_reason": "crashed: " + unsaved[len("error: ") :]}
    said = "the loss is nan at step 4 (train.lr 0.5); ..."
    assert trainer_proc.exit_from_log([f"error: diverged: {said}"]) == {
        "exit_status": 2,
        "exit_reason": f"diverged: {said}",
    }


def test_every_error_line_the_trainer_ends_with_status_1_reads_as_a_crash_in_its_log() -> None:
    """The lines as the trainer itself words them (a run record lost or unwritten leaves the log
    alone to tell): a regeneration worker that failed, a worker out of GPU memory (the hint the
    trainer prints after its traceback), a worker's traceback's head, the data stage's full disk."""
    import torch

    from trainer.data.chat import DiskFull
    from trainer.data.regen_worker import RegenWorkerFailed
    from trainer.parallel.topology import out_of_memory_hint

    worker = RegenWorkerFailed("cuda:1", 4242, "RuntimeError: CUDA error", "/w/cache/regenerated/abc")
    trace = "Traceback (most recent call last):\ntorch.OutOfMemoryError: CUDA out of memory."
    hint = out_of_memory_hint(torch.device("cuda:0"), trace, 8)
    store = DiskFull("disk full writing the token store under /w/cache (No space left on device); ...")
    for message in (str(worker), hint, str(store)):
        verdict = trainer_proc.exit_from_log(["step 3/100 loss 1.0", f"error: {message}"])
        assert verdict == {"exit_status": 1, "exit_reason": f"crashed: {message}"}
    head = ["error: worker 0 failed; the run stopped. Its traceback:", "Traceback (most recent call last):"]
    assert trainer_proc.exit_from_log(head)["exit_status"] == 1
    assert trainer_proc.exit_from_log(["error: data.train_file is missing"])["exit_status"] == 2
