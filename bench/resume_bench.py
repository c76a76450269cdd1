"""Where a resume's read and build go, at a target's shape: the drafter drawn on the host then moved,
drawn on the device, and built from a checkpoint's weights; then a checkpoint of its weights and two
AdamW moments through the product's save_checkpoint, read back twice (with --drop-caches the
first read is cold: the machine's whole page cache dropped first, as root): its bytes read in one
stream, one SHA-256 over them, torch.load copying them out, and the product's loader (the pieces
read and hashed on several threads, then the payload mapped), each timed.

    python3 bench/resume_bench.py --shape 8b --device cuda --drop-caches   # a GPU machine: ~2 min, 38 GB RAM
    python3 bench/resume_bench.py --shape tiny                             # CPU: checks the harness only
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import Qwen3Config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.model.drafter import DFlashDrafter, DrafterShape
from trainer.run.checkpoint import (
    SEAL_BYTES,
    ViewReader,
    read_checkpoint_bytes,
    read_verified,
    save_checkpoint,
)

TARGETS = {  # (hidden, layers, heads, KV heads, head dim, intermediate, vocabulary)
    "8b": (4096, 36, 32, 8, 128, 12288, 151936),
    "tiny": (64, 6, 4, 2, 16, 192, 512),
}


def clock(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(TARGETS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dir", help="where the checkpoint is written (default: a temporary directory)")
    parser.add_argument("--drop-caches", action="store_true", help="drop the page cache first")
    args = parser.parse_args()
    device = torch.device(args.device)
    hidden, layers, heads, kv_heads, head_dim, intermediate, vocab = TARGETS[args.shape]
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim)  # fmt: skip
    shape = DrafterShape.from_target(config, 5, 5)
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} CPU threads, target {args.shape}")
    torch.zeros(1, device=device)  # the device's context, before any timing
    began = clock(device)
    drafter = DFlashDrafter(shape, None).to(device)
    print(f"drafter drawn on the host, then moved: {clock(device) - began:.2f} s", flush=True)
    began = clock(device)
    with torch.device(device):
        drafter = DFlashDrafter(shape, None)
    print(f"drafter drawn on {device}: {clock(device) - began:.2f} s", flush=True)
    weights = {name: value.cpu() for name, value in drafter.state_dict().items()}
    began = clock(device)
    with torch.device("meta"):
        built = DFlashDrafter(shape, None, initialize=False)
    built.to_empty(device=device).load_state_dict(weights)
    print(f"drafter built with a checkpoint's weights: {clock(device) - began:.2f} s", flush=True)
    del drafter, built
    state = {
        "drafter": weights,
        "exp_avg": {name: torch.randn_like(value) for name, value in weights.items()},
        "exp_avg_sq": {name: torch.rand_like(value) for name, value in weights.items()},
    }
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        began = time.perf_counter()
        path = save_checkpoint(Path(directory), 1, state)
        size = path.stat().st_size
        print(f"checkpoint {size / 2**30:.2f} GiB written in {time.perf_counter() - began:.1f} s", flush=True)
        del state
        cold = args.drop_caches and drop_caches()
        read_row(path, size, "cold" if cold else "just written", cold)
        read_row(path, size, "warm", False)
    return 0


def read_row(path: Path, size: int, attempt: str, cold: bool) -> None:
    """One stream's read, SHA-256 and copying unpack, then the product's loader; with `cold` the
    page cache is dropped before each, so that both read from the disk."""
    if cold:
        drop_caches()
    began = time.perf_counter()
    raw = read_checkpoint_bytes(path)
    read = time.perf_counter() - began
    payload = memoryview(raw)[:-SEAL_BYTES]
    began = time.perf_counter()
    hashlib.sha256(payload).hexdigest()
    hashed = time.perf_counter() - began
    began = time.perf_counter()
    with ViewReader(payload) as reader:
        torch.load(reader, map_location="cpu", weights_only=True)
    unpacked = time.perf_counter() - began
    del payload, raw
    if cold:
        drop_caches()
    began = time.perf_counter()
    loaded = read_verified(path)
    took = time.perf_counter() - began
    print(
        f"{attempt}: read {read:.1f} s ({size / 2**30 / max(read, 1e-9):.2f} GiB/s), one SHA-256 stream "
        f"{hashed:.1f} s, unpacked by copying {unpacked:.1f} s; the product's loader {took:.1f} s "
        f"({loaded.cost()})",
        flush=True,
    )


def drop_caches() -> bool:
    """The machine's whole page cache dropped (root only): True if it was."""
    command = "sync; echo 3 > /proc/sys/vm/drop_caches"
    return subprocess.run(command, shell=True, capture_output=True).returncode == 0


if __name__ == "__main__":
    sys.exit(main())
