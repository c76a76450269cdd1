"""The target's causal attention alone (its feature forward, no gradient), per kernel, side by side.

    python bench/target_attention.py                 # one H200: the 8b shape, its 8 rows, every kernel
    python bench/target_attention.py --shape tiny    # CPU: checks the harness only

The inputs are one target layer's queries, keys and values in a training step of the shape
(bench/trainer_bench.py): grouped-query heads, rows of seq_len tokens, full rows (one conversation
each) and packed rows (the chat mix packed by the trainer's best fit, positions restarting with each
conversation). Each kernel is compiled as the target's compiled forward compiles it (static shapes)
and timed with CUDA events. It prints ms per layer and per step (times the layers the target runs),
the TFLOP/s of the useful work (causal: half the score matrix, within each conversation), and how
far each kernel's output lies from the first one's.

Kernels: flex attention with the trainer's block mask (causal, or causal within each conversation),
with Inductor's tiles or named ones; SDPA with is_causal on cuDNN's kernel (its key heads repeated
up to the query heads, or taken grouped: `-gqa`) or on the flash kernel, and the trainer's own
causal attention as the target calls it (`product`), all for full rows only (is_causal knows no
conversations); varlen attention (the flash kernel over a flattened batch with cumulative
conversation offsets, causal), which serves both kinds of rows.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.drafter_attention import timed
from bench.trainer_bench import SHAPES, chat_lengths, target_layers_run
from trainer.data.rows import pack

FLEX_TILES = {
    "flex": {},
    "flex-tma": {"USE_TMA": True},
    "flex-128x64-w8s3": {"BLOCK_M": 128, "BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 3},
    "flex-128x128-w8s2": {"BLOCK_M": 128, "BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
}
KERNELS = [*FLEX_TILES, "sdpa-cudnn", "sdpa-cudnn-gqa", "sdpa-flash", "varlen", "product"]


def segment_ids(lengths_per_row: list[list[int]], seq_len: int) -> torch.Tensor:
    """[b, L] conversation index of every position (the padding at a row's end its own one)."""
    rows = []
    for lengths in lengths_per_row:
        ids = np.repeat(np.arange(len(lengths)), lengths)
        rows.append(np.concatenate([ids, np.full(seq_len - len(ids), len(lengths))]))
    return torch.as_tensor(np.stack(rows))


def packed_rows(shape, rows: int) -> list[list[int]]:
    """The first `rows` rows of the chat mix packed as the trainer packs them."""
    lengths = chat_lengths(shape, 64 * rows + 4096, seed=1)
    pieces, offsets = pack(lengths, shape.seq_len, seed=1)
    return [[int(lengths[p]) for p in pieces[offsets[r] : offsets[r + 1]]] for r in range(rows)]


def useful_flops(shape, conversations: list[list[int]]) -> float:
    """One layer's causal attention within each conversation: 4 d h (n^2 / 2) per conversation."""
    return 2 * shape.heads * shape.head_dim * sum(n * n for row in conversations for n in row)


def flex_kernel(options: dict, segments: torch.Tensor, device):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    segments = segments.to(device)

    def causal_within(b, h, q, kv):
        return (kv <= q) & (segments[b, q] == segments[b, kv])

    b, length = segments.shape
    mask = create_block_mask(causal_within, b, None, length, length, device=device)
    # On the CPU without Inductor, whose C++ code for flex attention does not build (harness check).
    backend = "inductor" if device.type == "cuda" else "eager"
    return torch.compile(
        lambda q, k, v: flex_attention(
            q, k, v, block_mask=mask, enable_gqa=True, kernel_options=options or None
        ),
        dynamic=False,
        backend=backend,
    )


def sdpa_kernel(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend.split("-")[0]]

    def attend(q, k, v):
        groups = q.shape[1] // k.shape[1]
        if backend == "cudnn":  # the key heads repeated up to the query heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        with sdpa_kernel(chosen):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
            )

    return torch.compile(attend, dynamic=False)


def product_kernel():
    """The trainer's causal attention (trainer.model.target.causal_attention) as the target calls it."""
    from trainer.model.target import causal_attention

    def attend(q, k, v):
        return causal_attention(None, q, k, v, None)[0].transpose(1, 2)

    return torch.compile(attend, dynamic=False)


def varlen_kernel(conversations: list[list[int]], seq_len: int, device):
    from torch.nn.attention.varlen import varlen_attn

    bounds = []
    for r, lengths in enumerate(conversations):
        edges = np.cumsum([0, *lengths])
        if edges[-1] < seq_len:
            edges = np.append(edges, seq_len)
        bounds.extend((r * seq_len + edges[:-1]).tolist())
    bounds.append(len(conversations) * seq_len)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest = int((cu[1:] - cu[:-1]).max())
    takes = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in takes else {"window_size": (-1, 0)}

    def attend(q, k, v):
        b, h, length, d = q.shape
        if "enable_gqa" in takes:
            causal["enable_gqa"] = True
        else:  # an older torch: the key heads repeated up to the query heads
            k, v = k.repeat_interleave(h // k.shape[1], dim=1), v.repeat_interleave(h // k.shape[1], dim=1)
        flat = [t.transpose(1, 2).reshape(b * length, t.shape[1], d) for t in (q, k, v)]
        out = varlen_attn(*flat, cu, cu, longest, longest, **causal)
        return out.reshape(b, length, h, d).transpose(1, 2)

    return torch.compile(attend, dynamic=False)


def build(name: str, rows: str, conversations, segments, seq_len, device):
    if name in FLEX_TILES:
        return flex_kernel(FLEX_TILES[name], segments, device)
    if name.startswith("sdpa-") or name == "product":
        if rows != "full":
            return None  # is_causal cannot keep conversations apart
        if name == "product":
            return product_kernel()
        return sdpa_kernel(name.removeprefix("sdpa-"))
    return varlen_kernel(conversations, seq_len, device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["8b", "small", "tiny"], default="8b")
    parser.add_argument("--batch", type=int, default=0, help="rows (default: the shape's)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated: {', '.join(KERNELS)}")
    parser.add_argument("--rows", default="full,packed", help="full, packed or both")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    names = [n.strip() for n in args.kernels.split(",") if n.strip()]
    if unknown := [n for n in names if n not in KERNELS]:
        parser.error(f"unknown kernel(s) {unknown}; known: {', '.join(KERNELS)}")
    device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = SHAPES[args.shape]
    batch, length = args.batch or shape.batch, shape.seq_len
    layers = target_layers_run(shape)
    generator = torch.Generator().manual_seed(0)

    def tensor(heads):
        return torch.randn(batch, heads, length, shape.head_dim, generator=generator).to(device, dtype)

    q, k, v = tensor(shape.heads), tensor(shape.kv_heads), tensor(shape.kv_heads)
    print(f"torch {torch.__version__}, {device}, shape {args.shape}: q {list(q.shape)}, k/v {list(k.shape)}, "
          f"{layers} target layers a step", flush=True)  # fmt: skip
    for rows in [r.strip() for r in args.rows.split(",") if r.strip()]:
        conversations = [[length]] * batch if rows == "full" else packed_rows(shape, batch)
        segments = segment_ids(conversations, length)
        flops = useful_flops(shape, conversations)
        count = sum(len(c) for c in conversations)
        print(
            f"\n{rows} rows: {count} conversations in {batch} rows; {flops / 1e12:.3f} TFLOP a layer",
            flush=True,
        )
        first = None
        for name in names:
            try:
                attend = build(name, rows, conversations, segments, length, device)
                if attend is None:
                    print(f"{name:20} (full rows only)", flush=True)
                    continue
                began = time.perf_counter()
                with torch.no_grad():
                    out = attend(q, k, v)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    compile_s = time.perf_counter() - began
                    ms = timed(lambda attend=attend: attend(q, k, v), args.repeats, device)
            except Exception as error:  # a kernel this device or torch cannot run: say so, go on
                print(
                    f"{name:20} failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}",
                    flush=True,
                )
                continue
            first = out.float() if first is None else first
            diff = (out.float() - first).abs().max().item()
            print(
                f"{name:20} {ms:7.3f} ms a layer  {ms * layers:7.2f} ms a step  "
                f"{flops / ms / 1e9:6.1f} TFLOP/s  compile {compile_s:5.1f} s  max |diff| {diff:.3g}",
                flush=True,
            )
            torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    sys.exit(main())
