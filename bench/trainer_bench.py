"""Trainer throughput benchmark: the real Replica and threaded topology on a Qwen3-shaped target.

    python bench/trainer_bench.py --shape 8b --gpus 1 --settings eager,nographs,max-autotune-no-cudagraphs
    python bench/trainer_bench.py --shape small --gpus 2          # a quick run
    python bench/trainer_bench.py --shape tiny --gpus 1           # CPU: checks the harness only

Per setting it prints tokens/s (sequence tokens through the target and drafter), samples/s, model
FLOPs utilisation, peak GPU memory and the time to first step (building the drafter replicas,
compiling and warming up, and the first step). The target has random weights, built in memory from
its known config (the loading code path is not what is measured here). Settings run one after the
other in one process, so their figures are side by side; the target replicas are shared by them.

FLOPs counted per sample (matrix products only, the usual MFU convention; T context tokens,
Q = anchors x block query positions, H hidden, I intermediate, V vocab, h/kv heads of dim d,
K context layers, n_t target layers, P_t target parameters outside embedding and LM head):
  target forward (no autograd):  2 T P_t + 2 n_t h d T^2              (causal attention: half of T^2)
  drafter fc (weight grad only): 4 T K H^2
  drafter layers, each:          6 Q (2 H h d + 3 H I) + 6 (T + Q) (2 H kv d)  (q, o, MLP; k, v)
                                 + 12 h d S, S = sum over queries of the keys they may see
  LM head (frozen: fwd + input grad): 4 Q V H
MFU = counted FLOPs / time / (989 TFLOP/s dense bf16 per H200 on paper x GPUs); the column
"of 790" uses the ~790 TFLOP/s a large bf16 matmul reaches on that machine instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.config import load_config
from trainer.model import target_layer_ids
from trainer.replica import Replica
from trainer.topology import ThreadedTopology

PEAK_BF16_FLOPS = 989e12
MATMUL_BF16_FLOPS = 790e12


@dataclass(frozen=True)
class Shape:
    """Target config and the training shape."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    drafter_layers: int
    context_layers: int
    block: int
    anchors: int
    seq_len: int
    batch: int  # sequences per GPU per step


SHAPES = {
    # Qwen3-8B: hidden 4096, 36 layers, 32 heads, 8 KV heads, head dim 128, intermediate 12288.
    "8b": Shape(4096, 36, 32, 8, 128, 12288, 151936, 5, 5, 16, 512, 3072, 1),
    "small": Shape(1024, 12, 16, 8, 64, 3072, 32768, 2, 3, 16, 128, 1024, 4),
    "tiny": Shape(64, 6, 4, 2, 16, 192, 512, 2, 3, 8, 8, 64, 2),
}
SETTINGS = {
    # setting -> (run profile, --set overrides on top of it)
    "eager": ("eager", []),
    "nographs": ("nographs", []),
    "max-autotune-no-cudagraphs": ("nographs", ["compile.mode=max-autotune-no-cudagraphs"]),
}


def build_target(shape: Shape, device: torch.device, dtype: torch.dtype):
    """A Qwen3 causal LM of this shape with random weights, frozen, on the device."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=max(4096, shape.seq_len * 2),
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval().requires_grad_(False)
    return model


def flops_per_sample(shape: Shape, mean_visible_keys: float) -> dict[str, float]:
    s, t = shape, shape.seq_len
    q = s.anchors * s.block
    attn_width = s.heads * s.head_dim
    kv_width = s.kv_heads * s.head_dim
    target_params = s.layers * (
        2 * s.hidden * attn_width + 2 * s.hidden * kv_width + 3 * s.hidden * s.intermediate
    )
    target = 2 * t * target_params + 2 * s.layers * attn_width * t * t
    fc = 4 * t * s.context_layers * s.hidden * s.hidden
    per_layer = (
        6 * q * (2 * s.hidden * attn_width + 3 * s.hidden * s.intermediate)
        + 6 * (t + q) * 2 * s.hidden * kv_width
        + 12 * attn_width * q * mean_visible_keys
    )
    head = 4 * q * s.vocab * s.hidden
    return {"target": target, "drafter": fc + s.drafter_layers * per_layer + head}


def synchronize(devices: list[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def run_setting(name, shape, devices, targets, args, out_dir) -> dict:
    profile, overrides = SETTINGS[name]
    sets = [
        *overrides,
        f"train.batch_size={shape.batch}",
        f"train.seq_len={shape.seq_len}",
        f"train.steps={args.steps + 10}",
        f"drafter.num_layers={shape.drafter_layers}",
        f"drafter.num_context_layers={shape.context_layers}",
        f"drafter.block_size={shape.block}",
        f"drafter.num_anchors={shape.anchors}",
        f"model.dtype={'bfloat16' if devices[0].type == 'cuda' else 'float32'}",
        f"parallel.devices={','.join(map(str, devices))}",
        "parallel.cpu_threads=0",
    ]
    if args.attention:
        sets.append(f"drafter.attention={args.attention}")
    cfg = load_config(profile, sets=sets)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
    log_lines: list[str] = []

    def log(line: str) -> None:
        log_lines.append(line)
        print(f"  [{name}] {line}", flush=True)

    started = time.perf_counter()
    layer_ids = target_layer_ids(shape.layers, shape.context_layers)
    torch.manual_seed(0)
    replicas = [
        Replica(cfg, device, target, layer_ids, mask_id=shape.vocab - 1, rank=rank)
        for rank, (device, target) in enumerate(zip(devices, targets, strict=True))
    ]
    for replica in replicas[1:]:
        replica.drafter.load_state_dict(replicas[0].drafter.state_dict())
    topology = ThreadedTopology(replicas, cfg.parallel.step_timeout_s, log)
    generator = torch.Generator().manual_seed(1)
    global_batch = shape.batch * len(devices)

    def batch():
        ids = torch.randint(0, shape.vocab - 2, (global_batch, shape.seq_len), generator=generator)
        return ids, torch.ones_like(ids)

    try:
        topology.start(lambda: False)
        log(f"replicas built, compiled and warmed up after {time.perf_counter() - started:.1f}s")
        topology.step(*batch())
        synchronize(devices)
        first_step_s = time.perf_counter() - started
        log(f"first step done after {first_step_s:.1f}s")
        for _ in range(args.warmup):
            topology.step(*batch())
        synchronize(devices)
        batches = [batch() for _ in range(args.steps)]
        began = time.perf_counter()
        losses = [topology.step(*b)[0] for b in batches]
        synchronize(devices)
        step_s = (time.perf_counter() - began) / args.steps
        if args.profile and name == args.profile:
            profile_steps(topology, batch, devices, out_dir / f"trace_{name}.json")
    finally:
        topology.close()

    # Sorted anchors drawn uniformly from T positions see on average (T-1)/2 context keys + a block.
    visible = (shape.seq_len - 1) / 2 + shape.block
    flops = flops_per_sample(shape, visible)
    per_step = global_batch * (flops["target"] + flops["drafter"])
    peak = max((torch.cuda.max_memory_allocated(d) for d in devices if d.type == "cuda"), default=0)
    return {
        "setting": name,
        "gpus": len(devices),
        "step_s": step_s,
        "tokens_per_s": global_batch * shape.seq_len / step_s,
        "samples_per_s": global_batch / step_s,
        "tflops": per_step / step_s / 1e12,
        "mfu": per_step / step_s / (PEAK_BF16_FLOPS * len(devices)),
        "of_790": per_step / step_s / (MATMUL_BF16_FLOPS * len(devices)),
        "peak_gib": peak / 2**30,
        "first_step_s": first_step_s,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "compiled_lines": [line for line in log_lines if "compiling" in line],
    }


def profile_steps(topology, batch, devices, trace_path: Path) -> None:
    """Two profiled steps: the kernels' share of GPU time, and a trace to open in Perfetto."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if devices[0].type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            topology.step(*batch())
        synchronize(devices)
    sort = "cuda_time_total" if devices[0].type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70), flush=True)
    with contextlib.suppress(Exception):
        prof.export_chrome_trace(str(trace_path))


def format_row(r: dict) -> str:
    return (
        f"{r['setting']:28} {r['gpus']:>4} {r['step_s']:>8.3f} {r['tokens_per_s']:>9.0f} "
        f"{r['samples_per_s']:>9.2f} {r['tflops']:>8.1f} {r['mfu']:>6.1%} {r['of_790']:>6.1%} "
        f"{r['peak_gib']:>8.1f} {r['first_step_s']:>10.1f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--gpus", type=int, default=1, help="threaded workers, one per GPU (0: CPU)")
    parser.add_argument(
        "--settings", default=",".join(SETTINGS), help=f"comma-separated: {', '.join(SETTINGS)}"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per setting")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    parser.add_argument("--attention", choices=["auto", "sdpa", "flex"], default="", help="override")
    parser.add_argument("--profile", default="", help="profile two steps of this setting")
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()

    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {unknown}; known: {', '.join(SETTINGS)}")
    shape = SHAPES[args.shape]
    if args.gpus > 0:
        if torch.cuda.device_count() < args.gpus:
            parser.error(f"--gpus {args.gpus}: torch sees {torch.cuda.device_count()} CUDA device(s)")
        devices = [torch.device(f"cuda:{i}") for i in range(args.gpus)]
        dtype = torch.bfloat16
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        devices, dtype = [torch.device("cpu")], torch.float32
    out_dir = Path(os.environ.get("OUT", ".")).resolve()

    print(f"shape {args.shape}: {shape}", flush=True)
    print(f"torch {torch.__version__}, devices {', '.join(map(str, devices))}", flush=True)
    began = time.perf_counter()
    targets = [build_target(shape, device, dtype) for device in devices]
    synchronize(devices)
    print(f"targets built in {time.perf_counter() - began:.1f}s", flush=True)

    rows = []
    for name in settings:
        print(f"setting {name} ...", flush=True)
        rows.append(run_setting(name, shape, devices, targets, args, out_dir))
        print("  " + format_row(rows[-1]), flush=True)

    header = (
        f"{'setting':28} {'gpus':>4} {'step s':>8} {'tok/s':>9} {'samples/s':>9} {'TFLOP/s':>8} "
        f"{'MFU':>6} {'of 790':>6} {'peak GiB':>8} {'1st step s':>10}"
    )
    print("\n" + header)
    for r in rows:
        print(format_row(r))
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
