"""The drafter's flex attention alone, forward and backward, per kernel tiling, side by side.

    python bench/drafter_attention.py                      # one H200: the 8b shape, every tiling
    python bench/drafter_attention.py --autotune           # also Inductor's own search (slow)
    python bench/drafter_attention.py --shape tiny         # CPU: checks the harness only

The inputs are those of one drafter layer in a training step of the shape (bench/trainer_bench.py):
queries of num_anchors blocks of block_size positions, keys and values of the context and the
blocks, grouped-query heads, and the block mask the trainer builds (objective.FlexBlockMask) for
anchors drawn as the trainer draws them (sorted, from a fully supervised row). Each tiling is
compiled as the drafter's compiled layers compile flex attention (static shapes), then timed with
CUDA events: the forward alone, and forward plus backward. It prints ms per layer and per step
(times the drafter's layers), and how far each tiling's output and gradients lie from the first
tiling's (bf16 rounding differs with the tile order; float32 on CPU agrees closely).

The named tilings are Inductor's kernel_options for flex attention: BLOCK_M/BLOCK_N (forward tile,
queries x keys), BLOCK_M1/BLOCK_N1 (backward dK/dV pass), BLOCK_M2/BLOCK_N2 (backward dQ pass),
num_warps and num_stages (fwd_ and bwd_ prefixes give one pass its own), USE_TMA (Hopper's bulk
copy engine for the loads). `default` passes none and takes Inductor's choice for the device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.trainer_bench import SHAPES
from trainer.model.objective import FlexBlockMask, sample_anchors


def backward_tiles(m1: int, n1: int, warps: int, stages: int) -> dict:
    """The backward's tiles: dK/dV over m1 queries x n1 keys, dQ over n1 queries x m1 keys."""
    tiles = {"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": n1, "BLOCK_N2": m1}
    return {**tiles, "bwd_num_warps": warps, "bwd_num_stages": stages}


TILINGS = {
    "default": {},
    "tma": {"USE_TMA": True},
    "bwd-64x64-w4s3": backward_tiles(64, 64, 4, 3),
    "bwd-64x64-w4s4": backward_tiles(64, 64, 4, 4),
    "bwd-32x128-w4s3": backward_tiles(32, 128, 4, 3),
    "bwd-64x128-w8s2": backward_tiles(64, 128, 8, 2),
    "bwd-64x128-w4s3": backward_tiles(64, 128, 4, 3),
    "bwd-32x64-w4s3": backward_tiles(32, 64, 4, 3),
    "bwd-128x128-w8s2": backward_tiles(128, 128, 8, 2),
    "fwd-128x128-w8s2": {"BLOCK_M": 128, "BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "fwd-64x128-w4s3": {"BLOCK_M": 64, "BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "rows-safe": {"ROWS_GUARANTEED_SAFE": True},
    "fwd-64x64-bwd-32x64": {  # the fastest forward and backward together (max-autotune's pick)
        "BLOCK_M": 64,
        "BLOCK_N": 64,
        "fwd_num_warps": 4,
        "fwd_num_stages": 3,
        **backward_tiles(32, 64, 4, 3),
    },
}


def inputs(shape, device, dtype, seed: int = 0):
    """One drafter layer's q, k, v (as DrafterAttention hands them to flex attention) and its mask."""
    generator = torch.Generator().manual_seed(seed)
    context, queries = shape.seq_len, shape.anchors * shape.block
    loss_mask = torch.ones(shape.batch, context, dtype=torch.bool)
    anchors, _valid = sample_anchors(loss_mask, shape.anchors, generator)
    mask = FlexBlockMask(context, shape.block)(anchors.to(device))

    def tensor(heads, length):
        values = torch.randn(shape.batch, length, heads, shape.head_dim, generator=generator)
        values = values.to(device, dtype).transpose(1, 2)  # [b, h, L, d], as the layer hands them
        return values.requires_grad_(device.type == "cuda")

    q = tensor(shape.heads, queries)
    k, v = tensor(shape.kv_heads, context + queries), tensor(shape.kv_heads, context + queries)
    return q, k, v, mask


def compiled(options: dict, mode: str | None, device):
    """Compiled as the drafter's layers compile it; on the CPU without Inductor, whose C++ code for
    flex attention does not build in torch 2.13 (the harness check only)."""
    from torch.nn.attention.flex_attention import flex_attention

    def attend(q, k, v, mask):
        gqa = q.shape[1] != k.shape[1]
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=options or None)

    if device.type != "cuda":
        return torch.compile(attend, dynamic=False, backend="eager")
    return torch.compile(attend, dynamic=False, mode=mode)


def timed(fn, repeats: int, device) -> float:
    """Mean ms of fn over repeats, by CUDA events on the GPU, by the wall clock on the CPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats
    began = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - began) * 1000 / repeats


def measure(name, options, mode, q, k, v, mask, grad, repeats, device) -> dict:
    """One tiling's times. The backward runs on the GPU only (flex attention has none on the CPU)."""
    torch._dynamo.reset()
    attend = compiled(options, mode, device)
    train = device.type == "cuda"
    began = time.perf_counter()
    out = attend(q, k, v, mask)
    if train:
        out.backward(grad)
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - began
    grads = [t.grad.detach().float() for t in (q, k, v)] if train else []
    for t in (q, k, v):
        t.grad = None

    def forward():
        with torch.no_grad():
            attend(q, k, v, mask)

    def forward_backward():
        attend(q, k, v, mask).backward(grad)

    forward()
    fwd = timed(forward, repeats, device)
    both = timed(forward_backward, repeats, device) if train else float("nan")
    for t in (q, k, v):
        t.grad = None
    return {"name": name, "options": options, "mode": mode or "default", "compile_s": compile_s,
            "fwd_ms": fwd, "bwd_ms": both - fwd, "fwd_bwd_ms": both, "out": out.detach().float(),
            "grads": grads}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["8b", "small", "tiny"], default="8b")
    parser.add_argument("--tilings", default=",".join(TILINGS), help=f"comma-separated: {', '.join(TILINGS)}")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--autotune", action="store_true", help="also mode=max-autotune-no-cudagraphs")
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()
    names = [n.strip() for n in args.tilings.split(",") if n.strip()]
    unknown = [n for n in names if n not in TILINGS]
    if unknown:
        parser.error(f"unknown tiling(s) {unknown}; known: {', '.join(TILINGS)}")
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.shape]
    q, k, v, mask = inputs(shape, device, dtype)
    grad = torch.randn_like(q.detach())
    print(f"torch {torch.__version__}, {device}, shape {args.shape}: q {list(q.shape)}, k/v {list(k.shape)}, "
          f"{shape.drafter_layers} drafter layers; mask: {mask}".split("\n")[0], flush=True)  # fmt: skip
    runs = [(n, TILINGS[n], None) for n in names]
    if args.autotune:
        runs.append(("autotune", {}, "max-autotune-no-cudagraphs"))
    rows = []
    for name, options, mode in runs:
        try:
            row = measure(name, options, mode, q, k, v, mask, grad, args.repeats, device)
        except Exception as error:  # a tiling the device cannot run (shared memory, TMA): say so, go on
            print(f"{name:20} failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}", flush=True)
            continue
        if rows:
            first = rows[0]
            row["out_diff"] = (row["out"] - first["out"]).abs().max().item()
            diffs = [(a - b).abs().max().item() for a, b in zip(row["grads"], first["grads"], strict=True)]
            row["grad_diff"] = max(diffs, default=0.0)
        layers = shape.drafter_layers
        print(
            f"{name:20} fwd {row['fwd_ms']:7.3f} ms  bwd {row['bwd_ms']:7.3f} ms  a step ({layers} layers) "
            f"{row['fwd_bwd_ms'] * layers:7.2f} ms  compile {row['compile_s']:5.1f} s  "
            f"max |diff| out {row.get('out_diff', 0):.3g} grads {row.get('grad_diff', 0):.3g}",
            flush=True,
        )
        rows.append(row)
    if args.json:
        tensors = ("out", "grads")
        Path(args.json).write_text(
            json.dumps([{k: v for k, v in r.items() if k not in tensors} for r in rows])
        )
    key = "fwd_ms" if device.type != "cuda" else "fwd_bwd_ms"
    best = min(rows, key=lambda r: r[key]) if rows else None
    if best:
        base = rows[0][key]
        saved = (base - best[key]) * shape.drafter_layers
        print(f"fastest: {best['name']} {best[key]:.3f} ms a layer against {base:.3f} "
              f"({rows[0]['name']}): {saved:.2f} ms a step", flush=True)  # fmt: skip
    return 0 if rows else 1


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    sys.exit(main())
