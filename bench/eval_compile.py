"""Evaluation (tau) with a compiled drafter: run eagerly, or pad to a few shapes, side by side.

    python bench/eval_compile.py                                   # CPU, the tiny shape
    python bench/eval_compile.py --device cuda --shape 8b          # one GPU, the Qwen3-8B shape

The drafter's layers are compiled as the nographs profile compiles them for training (regional,
default mode, static shapes). Then, per way, a fresh compile and evaluations of the same drafter
on the same prompts, one and then --repeats more (the first pays the compiles; the fastest of
the others is the steady state):
- eager: what the trainer does, compiled code run uncompiled (torch.compiler.set_stance
  "force_eager") while evaluating;
- buckets: context padded to a power of two (64, 128, ...) and the batch to the prompt count, so
  the compiled layers see a few shapes;
- per-shape: the compiled layers fed every shape as it comes (what evaluation did before: one
  recompile per new shape until Dynamo's recompile limit, then eager).
Printed side by side: seconds of the first evaluation and of the fastest later one, compiles
(Dynamo's records), and tau (equal in every way, or the comparison means nothing). From an empty
Inductor cache by default (`--cache warm`: the one earlier runs on this machine filled). The
target has random weights and the prompts are random tokens; a random drafter gains about one
token per verify step, the most verify steps (and so the most shapes) per generated token.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_bench import SHAPES, build_target

from trainer.config import CompileConfig
from trainer.model.drafter import DFlashDrafter, DrafterShape, target_layer_ids
from trainer.model.evaluate import acceptance_length, speculative_generate
from trainer.model.target import shared_parts

WAYS = ("eager", "buckets", "per-shape")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts (train.eval_prompts)")
    parser.add_argument("--prompt-len", type=int, default=96)
    parser.add_argument("--max-new-tokens", type=int, default=32, help="train.eval_max_new_tokens")
    parser.add_argument("--ways", default=",".join(WAYS), help=f"comma-separated, of {', '.join(WAYS)}")
    parser.add_argument(
        "--cache",
        default="cold",
        choices=["cold", "warm"],
        help="cold: a new Inductor cache directory per way (default); warm: the one earlier runs filled",
    )
    parser.add_argument("--repeats", type=int, default=3, help="evaluations after the first (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU (trainer default 1)")
    return parser.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compile_count() -> int:
    from torch._dynamo.utils import get_compilation_metrics

    return len(get_compilation_metrics())


def measure(way: str, drafter, target, prompts, layers, shape, args, device) -> dict:
    if args.cache == "cold":
        # Inductor keeps compiled code on disk across processes; a fresh directory per way makes
        # the first evaluation pay its compiles as a run on a new machine does.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="eval-compile-bench-")
    torch._dynamo.reset()
    from torch._dynamo.utils import clear_compilation_metrics

    clear_compilation_metrics()
    compile_cfg = CompileConfig(mode="default", dynamic=False)
    settings = {"dynamic": False, "fullgraph": False, "options": compile_cfg.inductor_options()}
    for layer in drafter.layers:
        layer.compile(**settings)
    mask_id, eos = shape.vocab - 1, -1
    times, tau = [], None
    for _ in range(1 + args.repeats):
        synchronize(device)
        started = time.perf_counter()
        if way == "per-shape":  # the compiled layers as they are, fed every shape
            drafter.eval()
            _, per_step = speculative_generate(
                drafter, target, prompts, layers, shape.block, mask_id, args.max_new_tokens, eos, device
            )
            steps = [n for row in per_step for n in row]
            tau = sum(steps) / len(steps)
        else:
            tau = acceptance_length(
                drafter,
                target,
                prompts,
                layers,
                shape.block,
                mask_id,
                args.max_new_tokens,
                eos,
                device,
                pad_buckets=way == "buckets",
            )
        synchronize(device)
        times.append(time.perf_counter() - started)
    for layer in drafter.layers:
        layer._compiled_call_impl = None  # undo Module.compile for the next way
    # The fastest of the later evaluations: on a shared machine the others include other load.
    return {
        "way": way,
        "first_s": times[0],
        "then_s": min(times[1:]),
        "compiles": compile_count(),
        "tau": tau,
    }


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = build_target(shape, device, dtype)
    layers = target_layer_ids(shape.layers, shape.context_layers)
    torch.manual_seed(0)
    drafter_shape = DrafterShape.from_target(target.config, shape.drafter_layers, len(layers))
    drafter = DFlashDrafter(drafter_shape, shared_parts(target)).to(device=device, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, shape.vocab - 1, (args.prompt_len - 7 * i % 23,), generator=generator).tolist()
        for i in range(args.prompts)
    ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {args.threads} thread(s)"
    print(
        f"torch {torch.__version__}, {name}, shape {args.shape}, "
        f"{args.prompts} prompts of ~{args.prompt_len} tokens, {args.cache} Inductor cache, "
        f"{args.max_new_tokens} new tokens, block {shape.block}",
        flush=True,
    )
    rows = []
    for way in args.ways.split(","):
        with contextlib.redirect_stderr(sys.stdout):
            rows.append(measure(way, drafter, target, prompts, layers, shape, args, device))
        print(f"  {way}: done", flush=True)
    print(f"{'way':<10} {'first s':>9} {'then s':>9} {'compiles':>9} {'tau':>7}")
    for row in rows:
        print(
            f"{row['way']:<10} {row['first_s']:>9.2f} {row['then_s']:>9.2f} "
            f"{row['compiles']:>9} {row['tau']:>7.3f}"
        )
    if len({round(row["tau"], 3) for row in rows}) > 1:
        print("note: tau differs between ways (numerics of padded shapes); compare the times with care")
    return 0


if __name__ == "__main__":
    sys.exit(main())
