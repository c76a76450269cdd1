"""Checkpoint write: the product's writer (the state copied into host buffers kept from the last
checkpoint, then torch.save streamed to disk, its pieces hashed on two threads) against the same
writer hashing in line, and the disk's own rate for as many bytes, side by side; on a GPU also the
copy into fresh pinned buffers (a run's first checkpoint), into reused pageable ones, and torch.save
straight from the device. Then a load in a fresh process each way: the product's (the pieces read
and hashed on several threads, the payload mapped) and a checkpoint of format 1 (the file's bytes
read, one SHA-256 stream beside the unpacking, which copies the tensors out), time and peak memory
(VmHWM: this process's own, from its exec on). Last, what a checkpoint costs a training loop (a
stand-in: a matmul and small operations on --device, the result read every step): through the
product's CheckpointWriter in the background (train.async_checkpoints, the default; on a thread, and
by a writer process: train.checkpoint_writer) and in line, the loop's pause, the write's own time,
and the loop's step time while the write runs beside it against without one.

    python bench/checkpoint_bench.py [--gib 1.5] [--repeats 2] [--dir DIR] [--device cuda] [--no-load]
        [--no-pause | --pause-only]

The state is float32 tensors of 64 Mi elements (a drafter's weights and moments are of that order:
12.6 GB at the Qwen3-8B recipe's shape), on --device. After one write to warm up, the variants take
turns going first (a write right after another is often faster or slower than one after a pause),
so that spreads over the rows.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.run import checkpoint
from trainer.run.checkpoint_process import SharedStaging, WriterProcess


def raw_write(directory: Path, size: int) -> float:
    """The same bytes written and fsync'ed, no serializing or hashing: the disk's bound."""
    block = bytes(64 << 20)
    began = time.monotonic()
    with (directory / "raw").open("wb") as handle:
        for _ in range(size // len(block)):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    took = time.monotonic() - began
    (directory / "raw").unlink()
    return took


def load_in_this_process(path: str) -> None:
    """One load of `path` (of either format), then its time and this process's peak RSS as one line."""
    began = time.monotonic()
    state = checkpoint.load_checkpoint(Path(path))
    took = time.monotonic() - began
    assert state["weights"]
    status = Path("/proc/self/status").read_text().splitlines()
    peak_kib = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    print(f"{took:.2f} {int(peak_kib) / 2**20:.2f}")


def format_1_copy(path: Path) -> Path:
    """The same payload as a checkpoint of format 1 wrote it: a header with one SHA-256, then the payload."""
    raw = path.read_bytes()[: -checkpoint.SEAL_BYTES]
    legacy = path.with_name("format1.pt")
    header = checkpoint.LEGACY_MAGIC + hashlib.sha256(raw).hexdigest().encode() + b"\n"
    legacy.write_bytes(header + str(len(raw)).zfill(checkpoint.DIGITS).encode() + b"\n" + raw)
    return legacy


def load_rows(directory: Path, state: dict, repeats: int) -> None:
    path = checkpoint.save_checkpoint(directory, 1, {"weights": [t.cpu() for t in state["weights"]]})
    size = path.stat().st_size / 1e9
    legacy = format_1_copy(path)
    rows = (("the product", path), ("format 1", legacy))
    for name, file in rows:
        child = [sys.executable, __file__, "--load-child", str(file)]
        runs = []
        for _ in range(repeats):
            runs.append(subprocess.run(child, check=True, capture_output=True, text=True).stdout.split())
        seconds = statistics.median(float(took) for took, _ in runs)
        peak = max(float(rss) for _, rss in runs)
        label = f"load, {name}"
        ratio = f"{peak / size:.1f}x the file"
        print(f"{label:>24}: median {seconds:6.2f} s, peak memory {peak:.2f} GiB ({ratio})")
    path.unlink()
    legacy.unlink()


def pause_rows(directory: Path, state: dict, device: str, repeats: int) -> None:
    """The stand-in loop's pause per checkpoint, the write's time and the loop's step time beside
    the write: the CheckpointWriter in the background (on a thread of this process, and by a writer
    process of its own) and in line (medians over `repeats`). The stand-in step is a matmul and 400
    small operations, each launched from Python, as a training step's kernels are: a write that holds
    this interpreter's lock delays them."""
    side = 2048 if device != "cpu" else 512
    a = torch.randn(side, side, device=device)
    small = torch.ones(64, device=device)

    def step() -> float:
        began = time.perf_counter()
        b = small
        for _ in range(200):
            b = b * 1.0001 + 0.0001
        float((a @ a).sum() + b.sum())  # read back, as the loop reads a loss
        return time.perf_counter() - began

    alone = statistics.median(step() for _ in range(50))
    writers = {
        "background write, a thread": lambda: (thread_writer(True), None),
        "background write, a process": process_writer,
        "write in line": lambda: (thread_writer(False), None),
    }
    for name, make in writers.items():
        writer, process = make()
        paused, written, beside = [], [], []
        try:
            for repeat in range(repeats + 1):  # the first one fills the staging's buffers: not counted
                writer.start(directory, repeat, state, time.perf_counter())
                during = []
                while writer.in_flight and len(during) < 100_000:
                    during.append(step())
                outcome = writer.wait()
                outcome.path.unlink()
                if repeat:
                    paused.append(outcome.paused_s)
                    written.append(outcome.write_s)
                    beside.extend(during)
        finally:
            if process is not None:
                process.stop()
        step_beside = "none ran"
        if beside:
            median = statistics.median(beside)
            step_beside = f"{median * 1e3:.1f} ms, {median / alone:.3f}x"
        print(
            f"{name:>36}: training paused median {statistics.median(paused):6.2f} s, the write "
            f"{statistics.median(written):6.2f} s; a step beside the write {step_beside} "
            f"({len(beside)} steps), alone {alone * 1e3:.1f} ms"
        )


def thread_writer(background: bool) -> checkpoint.CheckpointWriter:
    return checkpoint.CheckpointWriter(checkpoint.HostStaging(host_too=True), background)


def process_writer():
    staging = SharedStaging(host_too=True)
    process = WriterProcess(staging)
    return checkpoint.CheckpointWriter(staging, True, process.save), process


def write_variants(state: dict, device: str) -> dict:
    """name -> (repeat -> (the host staging to copy through or None, the writer's hashing threads)).
    The reused stagings copy once here (a run's first checkpoint); on a CPU the state is on the
    host already and staging copies nothing."""
    overlapped, in_line = checkpoint.WRITE_HASH_THREADS, 0
    kept = checkpoint.HostStaging(pin=True)
    kept.to_host(state)
    variants = {
        "the product (pinned staging, reused)": lambda repeat: (kept, overlapped),
        "hash in line": lambda repeat: (kept, in_line),
    }
    if device != "cpu":
        pageable = checkpoint.HostStaging(pin=False)
        pageable.to_host(state)
        variants |= {
            "pinned staging, fresh buffers": lambda repeat: (checkpoint.HostStaging(), overlapped),
            "pageable staging, reused": lambda repeat: (pageable, overlapped),
            "torch.save from the device": lambda repeat: (None, overlapped),
        }
    return variants


def main() -> int:
    if sys.argv[1:2] == ["--load-child"]:
        load_in_this_process(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/checkpoint-bench")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-load", action="store_true", help="no load rows")
    parser.add_argument("--no-pause", action="store_true", help="no rows of a training loop's pause")
    parser.add_argument("--pause-only", action="store_true", help="only the rows of a training loop's pause")
    args = parser.parse_args()
    tensors = max(1, round(args.gib * 2**30 / (4 * 2**26)))
    state = {"weights": [torch.randn(2**26, device=args.device) for _ in range(tensors)]}
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    if args.pause_only:
        print(f"torch {torch.__version__}, {tensors} tensors on {args.device}")
        try:
            checkpoint.save_checkpoint(directory, 0, state).unlink()  # a first write warms the file system
            pause_rows(directory, state, args.device, args.repeats)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return 0
    variants = write_variants(state, args.device)
    rows: dict[str, list[float]] = {name: [] for name in [*variants, "disk alone"]}
    copies: dict[str, list[float]] = {name: [] for name in variants}
    size = 0
    overlapped = checkpoint.WRITE_HASH_THREADS
    try:
        checkpoint.save_checkpoint(directory, 0, state).unlink()  # a first write warms the file system
        for repeat in range(args.repeats):
            # Each variant goes first in every other repeat: the write after another differs.
            for name in list(variants) if repeat % 2 == 0 else list(variants)[::-1]:
                staging, overlap = variants[name](repeat)
                checkpoint.WRITE_HASH_THREADS = overlap
                began = time.monotonic()
                staged = staging.to_host(state) if staging else state
                copies[name].append(time.monotonic() - began)
                path = checkpoint.save_checkpoint(directory, repeat, staged)
                rows[name].append(time.monotonic() - began)
                checkpoint.WRITE_HASH_THREADS = overlapped
                size = path.stat().st_size
                path.unlink()
            rows["disk alone"].append(raw_write(directory, size))
        where = f"{tensors} tensors on {args.device}"
        print(f"torch {torch.__version__}, {where}, checkpoint {size / 1e9:.2f} GB")
        for name, times in rows.items():
            median = statistics.median(times)
            runs = ", ".join(f"{took:.2f}" for took in times)
            copied = f"; the host copy {statistics.median(copies[name]):.2f} s" if copies.get(name) else ""
            print(f"{name:>36}: median {median:6.2f} s ({size / 1e9 / median:.2f} GB/s){copied}, runs {runs}")
        if not args.no_pause:
            pause_rows(directory, state, args.device, args.repeats)
        if not args.no_load:
            load_rows(directory, state, args.repeats)
    finally:
        checkpoint.WRITE_HASH_THREADS = overlapped
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
