"""Trainer throughput benchmark: the real Replica and topologies on a Qwen3-shaped target.

    python bench/trainer_bench.py --shape 8b --gpus 1 --settings eager,nographs,max-autotune-no-cudagraphs
    python bench/trainer_bench.py --shape 8b --gpus 1 --settings nographs,process-nographs,process-graphs
    python bench/trainer_bench.py --shape small --gpus 2          # a quick run
    python bench/trainer_bench.py --shape tiny --gpus 0           # CPU: checks the harness only
    python bench/trainer_bench.py --shape 8b --gpus 1,2 --cold --settings nographs,process-nographs
                                  # scaling: each setting on 1 and 2 GPUs, cold compile caches
    python bench/trainer_bench.py --shape 8b --gpus 1 --settings nographs --lengths full,chat
                                  # real chat lengths: padded and packed rows side by side
    python bench/trainer_bench.py --shape 8b --gpus 1 --settings nographs --batch 1,2,4
                                  # rows per step: 1, 2 and 4 rows a GPU side by side

Length mixes (`--lengths`, default full): `full` is every row one conversation of seq_len tokens,
all supervised (the figures measured before packing existed); `chat` is a long-tailed mix, run
three times: `chat-padded` (one conversation per row), `chat-packed` (the trainer's own best-fit
packing, position ids restarting per conversation; the shape's anchors a row, shared by the row's
conversations) and `chat-packed-per-conversation` (the same rows with the shape's anchors times the
mean conversations per packed row, so each conversation gets about as many anchor blocks as it
would padded: `drafter.num_anchors` set to that for the row); conversation lengths lognormal with
a median of a quarter of seq_len (sigma 1), capped at seq_len, at least 8 tokens; the last 60 % of
each conversation's tokens supervised (the answer). After the table a line gives, for each packed
row, the time of one epoch of the chat mix against the padded one at the same anchor blocks per
conversation (valid anchor blocks per second, padded over packed; the goal is at most 0.7x).

Per setting it prints tokens/s (real tokens: a conversation's, not padding, through the target and
drafter), samples/s (rows), model FLOPs utilisation (raw: every slot of every row and every anchor
slot, as before; useful: only the target's work on real tokens, attention within each conversation,
and the drafter's on valid anchors), the padding share, the share of valid anchors, peak GPU
memory and the time to first step (building the drafter replicas, compiling and warming up, and
the first step). The target has random weights, built in memory from
its known config (the loading code path is not what is measured here). Settings run one after the
other, so their figures are side by side. Threaded settings run in this process (one worker thread
per GPU, the target replicas shared by them); process settings (`process-...`) run the process
topology: this program starts torchrun with one rank per GPU (one on CPU), each rank builds its own
target and runs the same steps on its shard of the same global batch under DDP, and rank 0 hands its
row back. Time to first step is measured the same way in both: from building the drafter replica(s)
to the end of the first step (start-up, compile, warm-up and the step); a process row also gives the
ranks' whole start (interpreter, imports, target, process group) in its log.

`--gpus 1,2` runs every setting at each GPU count and ends with a scaling table: tokens/s and time
to first step at N GPUs against the same setting at the first count (weak scaling: the same
sequences per GPU per step). `--cold` runs every row in a fresh process with empty Inductor and
Triton caches, so time to first step includes the whole compile in every row alike.

FLOPs counted per sample (matrix products only, the usual MFU convention; T context tokens,
Q = anchors x block query positions, H hidden, I intermediate, V vocab, h/kv heads of dim d,
K context layers, n_t target layers the drafter needs (up to the last one it reads, as the trainer
runs them), P_t their parameters):
  target forward (no autograd):  2 T P_t + 2 n_t h d T^2              (causal attention: half of T^2)
  drafter fc (weight grad only): 4 T K H^2
  drafter layers, each:          6 Q (2 H h d + 3 H I) + 6 (T + Q) (2 H kv d)  (q, o, MLP; k, v)
                                 + 12 h d S, S = sum over queries of the keys they may see
  LM head (frozen: fwd + input grad): 4 Q' V H, Q' = anchors x (block - 1), the positions scored
                                 (the head also runs over each block's position 0, its given anchor,
                                 which has no label: work done, not counted)
MFU = counted FLOPs / time / (989 TFLOP/s dense bf16 per H200 on paper x GPUs); the column
"of 790" uses the ~790 TFLOP/s a large bf16 matmul reaches on that machine instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from trainer.config import load_config
from trainer.data.embedded import TARGET_SHAPES
from trainer.data.rows import pack, valid_anchor_count
from trainer.model.drafter import target_layer_ids
from trainer.parallel.replica import Replica
from trainer.parallel.topology import ThreadedTopology
from trainer.run.flops import FlopShape

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


def recipe_shape(run: str = "qwen3-8b", target: str = "qwen3-8b") -> Shape:
    """What the product trains: the run profile's rows, drafter and anchors, over a target of the
    layout `python -m trainer.data.embedded --shape` builds (one source for both)."""
    cfg = load_config(run, sets=["model.target_path=-", "data.train_file=-"])
    t, d = TARGET_SHAPES[target], cfg.drafter
    return Shape(
        t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"], t["num_key_value_heads"],
        t["head_dim"], t["intermediate_size"], t["vocab_size"], d.num_layers, d.num_context_layers,
        d.block_size, d.num_anchors, cfg.train.seq_len, cfg.train.batch_size,
    )  # fmt: skip


SHAPES = {
    # The qwen3-8b recipe (trainer/runs/qwen3-8b.yml) over Qwen3-8B's layout: hidden 4096, 36 layers,
    # 32 heads, 8 KV heads, head dim 128, intermediate 12288; rows of 3,072 tokens, 8 a GPU per step
    # (82.8 GiB at the peak on an H200; docs/PERFORMANCE.md gives 1, 2 and 4 rows too).
    "8b": recipe_shape(),
    "small": Shape(1024, 12, 16, 8, 64, 3072, 32768, 2, 3, 16, 128, 1024, 4),
    "tiny": Shape(64, 6, 4, 2, 16, 192, 512, 2, 3, 8, 8, 64, 2),
}
SETTINGS = {
    # setting -> (run profile, --set overrides on top of it); the profile sets the topology.
    "eager": ("eager", []),
    "nographs": ("nographs", []),
    "max-autotune-no-cudagraphs": ("nographs", ["compile.mode=max-autotune-no-cudagraphs"]),
    "process-nographs": ("process", []),
    "process-graphs": ("graphs", []),
    # One compiled graph (and CUDA graph) for the whole objective instead of one per region.
    "process-graphs-objective": ("graphs", ["compile.scope=objective"]),
    # One gradient bucket larger than the gradients: the exchange starts after the whole backward
    # (no overlap), to see what the overlap is worth.
    "nographs-one-bucket": ("nographs", ["parallel.bucket_mb=1000000"]),
    "process-nographs-bucket25": ("process", ["parallel.bucket_mb=25"]),  # DDP's default size
    # Each GPU updates only its slice of the parameters (reduce-scatter, sharded AdamW, all-gather).
    "nographs-sharded": ("nographs", ["parallel.shard_optimizer=true"]),
    # The levers of one GPU's step, each turned off alone, and all of them together ("before"):
    # the target's forward eager, the target run through all its layers, AdamW's foreach update.
    "nographs-eager-target": ("nographs", ["compile.target=off"]),
    "nographs-all-layers": ("nographs", [], ("all_layers",)),
    "nographs-foreach": ("nographs", [], ("foreach",)),
    "nographs-before": ("nographs", ["compile.target=off"], ("all_layers", "foreach")),
    # The compiled target with SDPA over transformers' explicit mask instead of flex attention.
    "nographs-target-sdpa": ("nographs", ["compile.target_attention=sdpa"]),
    # The compiled target on flex attention whatever the rows (auto: cuDNN's causal kernel for rows
    # of one conversation each).
    "nographs-target-flex": ("nographs", ["compile.target_attention=flex"]),
    # The loss as it was before 2026-12-02: float32 logits and their gradient stored per chunk.
    "nographs-stored-logits": ("nographs", [], ("stored_logits",)),
}
DEFAULT_SETTINGS = ("eager", "nographs", "max-autotune-no-cudagraphs")
CHAT_MIXES = ("chat-padded", "chat-packed", "chat-packed-per-conversation")
PROCESS_PROFILES = ("process", "graphs")  # run profiles whose run.topology is process


def stored_logits_loss(hidden, head_weight, labels, weights):
    """The loss chunk before 2026-12-02 (drafter.loss_and_grad_of_chunk): compiled, its float32 logits
    and their gradient are written out and read back (the scatter needs a stored tensor)."""
    accumulate = torch.promote_types(head_weight.dtype, torch.float32)
    weight = weights.to(accumulate) * (labels != -100)
    target = labels.clamp(min=0)
    logits = (hidden.to(head_weight.dtype) @ head_weight.t()).to(accumulate)
    log_norm = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, target[:, None]).squeeze(1)
    loss = ((log_norm - picked) * weight).sum()
    grad_logits = torch.exp(logits - log_norm[:, None]) * weight[:, None]
    grad_logits = grad_logits.scatter_add(1, target[:, None], -weight[:, None])
    return loss, (grad_logits.to(head_weight.dtype) @ head_weight).to(hidden.dtype)


def bench_patches(name: str) -> contextlib.ExitStack:
    """The code changes a setting measures without them (third element of its SETTINGS entry)."""
    from unittest import mock

    import trainer.model.drafter
    import trainer.model.target

    target_module, adamw = trainer.model.target, torch.optim.AdamW

    def whole_target(target, _last_layer):
        return target.base_model

    def foreach_adamw(*args, **kwargs):
        return adamw(*args, **{**kwargs, "fused": False})

    stack = contextlib.ExitStack()
    entry = SETTINGS[name]
    for patch in entry[2] if len(entry) > 2 else ():
        if patch == "all_layers":  # the target runs every layer, not only those the drafter reads
            stack.enter_context(mock.patch.object(target_module, "layers_up_to", whole_target))
        elif patch == "foreach":  # AdamW's multi-tensor update instead of the fused kernel
            stack.enter_context(mock.patch.object(torch.optim, "AdamW", foreach_adamw))
        elif patch == "stored_logits":
            stack.enter_context(
                mock.patch.object(trainer.model.drafter, "loss_and_grad_of_chunk", stored_logits_loss)
            )
    return stack


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
    torch.manual_seed(1234)  # the same weights in every process, so settings are comparable
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval().requires_grad_(False)
    return model


def target_layers_run(shape: Shape) -> int:
    """The target layers a step needs: up to the last one the drafter reads (the rest are skipped)."""
    return target_layer_ids(shape.layers, shape.context_layers)[-1] + 1


def flop_shape(shape: Shape) -> FlopShape:
    """The product's FLOP count (trainer/run/flops.py) of this shape: one figure for both."""
    return FlopShape(
        hidden=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        intermediate=shape.intermediate, vocab=shape.vocab, target_layers_run=target_layers_run(shape),
        drafter_layers=shape.drafter_layers, context_layers=shape.context_layers, block=shape.block,
        anchors=shape.anchors, seq_len=shape.seq_len,
    )  # fmt: skip


def synchronize(devices: list[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def setting_config(name: str, shape: Shape, devices: list[torch.device], args):
    profile, overrides = SETTINGS[name][:2]
    sets = [
        *overrides,
        f"train.batch_size={shape.batch}",
        f"train.seq_len={shape.seq_len}",
        # As the trainer: position ids reach the target only for packed rows.
        f"train.packing={str(getattr(args, 'mix', 'full').startswith('chat-packed')).lower()}",
        f"train.steps={args.steps + args.warmup + 10}",
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
    return load_config(profile, sets=sets + args.sets)


def mix_shape(mix: str, shape: Shape) -> Shape:
    """chat-packed-per-conversation: packed rows with as many anchor slots as the row's
    conversations would have padded (the shape's anchors times the mean conversations per packed
    row, a multiple of 8), so a conversation gets about as many blocks packed as padded."""
    if mix != "chat-packed-per-conversation":
        return shape
    pieces, row_offsets = pack(chat_lengths(shape, 4096, seed=1), shape.seq_len, seed=1)
    per_row = len(pieces) / (len(row_offsets) - 1)
    return dataclasses.replace(shape, anchors=max(8, round(shape.anchors * per_row / 8) * 8))


def chat_lengths(shape: Shape, count: int, seed: int) -> np.ndarray:
    """The chat mix: lognormal conversation lengths, median a quarter of seq_len (sigma 1), capped
    at seq_len, at least 8 tokens."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(shape.seq_len / 4), 1.0, count), 8, shape.seq_len).astype(np.int64)


class Batches:
    """The bench's batches for one length mix, with what each holds:
    full: every row one conversation of seq_len tokens, all supervised (the rows measured so far);
    chat-padded: one chat-mix conversation per row, padded; chat-packed: chat-mix conversations
    packed by the trainer's own best fit. A chat conversation's last 60 % of tokens are supervised
    (the answer), and its position ids start at 0."""

    def __init__(self, mix: str, shape: Shape, global_batch: int):
        self.mix, self.shape, self.global_batch = mix, shape, global_batch
        self.generator = torch.Generator().manual_seed(1)
        self.lengths = chat_lengths(shape, 64 * global_batch + 4096, seed=1)
        if mix.startswith("chat-packed"):
            self.pieces, self.row_offsets = pack(self.lengths, shape.seq_len, seed=1)
        else:
            self.pieces, self.row_offsets = np.arange(len(self.lengths)), np.arange(len(self.lengths) + 1)
        self.next_row = 0
        self.lengths_of: dict[int, list[int]] = {}  # a batch's conversation lengths, by id(input ids)

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t = self.global_batch, self.shape.seq_len
        ids = torch.randint(0, self.shape.vocab - 2, (b, t), generator=self.generator)
        if self.mix == "full":
            return ids, torch.ones_like(ids), torch.arange(t).expand(b, t)
        mask, positions = torch.zeros_like(ids), torch.arange(t).repeat(b, 1)
        lengths = self.lengths_of[id(ids)] = []
        for slot in range(b):
            row = self.next_row % (len(self.row_offsets) - 1)
            self.next_row += 1
            filled = 0
            for piece in self.pieces[self.row_offsets[row] : self.row_offsets[row + 1]]:
                length = int(self.lengths[piece])
                lengths.append(length)
                mask[slot, filled + int(length * 0.4) : filled + length] = 1
                positions[slot, filled : filled + length] = torch.arange(length)
                filled += length
            if self.mix.startswith("chat-packed"):
                positions[slot, filled:] = torch.arange(t - filled)
        return ids, mask, positions

    def useful(self, batch) -> dict[str, float]:
        """Useful work in a batch: real tokens, valid anchors, and the FLOPs of both models counted
        over real tokens (target: linear layers per token, attention per conversation) and valid
        anchors only (drafter)."""
        _, mask, positions = batch
        s = self.shape
        lengths = [s.seq_len] * positions.shape[0] if self.mix == "full" else self.lengths_of[id(batch[0])]
        real_tokens = sum(lengths)
        valid = valid_anchor_count(mask, positions, s.anchors)
        useful = flop_shape(s).useful(real_tokens, sum(x * x for x in lengths), valid)
        return {"real_tokens": real_tokens, "valid_anchors": valid, "flops": useful}


def measure(name, shape, topology, devices, global_batch, started, log, args, out_dir) -> dict:
    """Warm the topology up, take the first step, then time args.steps steps: the setting's row.
    `started` is when building the replicas began (the start of "time to first step")."""
    batch = Batches(getattr(args, "mix", "full"), shape, global_batch)

    topology.launch()
    if not topology.wait_ready(lambda: False):
        raise RuntimeError("the workers stopped before they were ready")
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
    losses = [float(loss) for loss in losses]  # after the clock: reading one waits for its step
    step_s = (time.perf_counter() - began) / args.steps
    if args.profile and name == args.profile:
        label = name if batch.mix == "full" else f"{name}_{batch.mix}"
        profile_steps(topology, batch, devices, out_dir / f"trace_{label}.json")

    counted = flop_shape(shape)
    flops = counted.per_row(counted.mean_visible_keys())
    per_step = global_batch * (flops["target"] + flops["drafter"])
    gpus = global_batch // shape.batch if devices[0].type == "cuda" else 0
    peak = max((torch.cuda.max_memory_allocated(d) for d in devices if d.type == "cuda"), default=0)
    useful = [batch.useful(b) for b in batches]
    real_tokens = sum(u["real_tokens"] for u in useful) / len(useful)
    valid_anchors = sum(u["valid_anchors"] for u in useful) / len(useful)
    useful_flops = sum(u["flops"] for u in useful) / len(useful)
    return {
        "setting": name if batch.mix == "full" else f"{name} {batch.mix}",
        "mix": batch.mix,
        "anchors": shape.anchors,
        "gpus": gpus,
        "step_s": step_s,
        "tokens_per_s": real_tokens / step_s,
        "row_tokens_per_s": global_batch * shape.seq_len / step_s,
        "padding_share": 1 - real_tokens / (global_batch * shape.seq_len),
        "valid_anchor_share": valid_anchors / (global_batch * shape.anchors),
        "valid_blocks_per_s": valid_anchors / step_s,
        "useful_mfu": useful_flops / step_s / (PEAK_BF16_FLOPS * max(gpus, 1)),
        "samples_per_s": global_batch / step_s,
        "tflops": per_step / step_s / 1e12,
        "mfu": per_step / step_s / (PEAK_BF16_FLOPS * max(gpus, 1)),
        "of_790": per_step / step_s / (MATMUL_BF16_FLOPS * max(gpus, 1)),
        "peak_gib": peak / 2**30,
        "first_step_s": first_step_s,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def run_threaded(name, shape, devices, targets, args, out_dir) -> dict:
    """A threaded setting in this process: one worker thread per device, the targets shared."""
    cfg = setting_config(name, shape, devices, args)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def log(line: str) -> None:
        print(f"  [{name}] {line}", flush=True)

    started = time.perf_counter()
    layer_ids = target_layer_ids(shape.layers, shape.context_layers)
    torch.manual_seed(0)
    replicas: list[Replica] = []
    # The patches stay for the whole row, so that one may replace a function called at every step.
    with bench_patches(name):
        for rank, (device, target) in enumerate(zip(devices, targets, strict=True)):
            # The targets are shared by every row; a row whose target attention is flex switches them
            # (Replica.compile), so each row starts from the attention the target was built with.
            target.set_attn_implementation("sdpa")
            first = replicas[0] if replicas else None
            replicas.append(Replica(cfg, device, target, layer_ids, shape.vocab - 1, rank, copy_of=first))
        topology = ThreadedTopology(replicas, cfg.parallel.step_timeout_s, log)
        try:
            global_batch = shape.batch * len(devices)
            return measure(name, shape, topology, devices, global_batch, started, log, args, out_dir)
        finally:
            topology.close()
            release(replicas, devices, log)


def release(replicas: list[Replica], devices: list[torch.device], log) -> None:
    """Free a setting's replicas before the next one, so each row's peak memory is its own:
    Dynamo's caches hold the compiled modules, hence their parameters, until reset."""
    replicas.clear()
    torch._dynamo.reset()
    gc.collect()
    for device in devices:
        if device.type == "cuda":
            torch.cuda.empty_cache()
            log(f"left in use after the setting: {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB")


def run_process(name, shape, gpus, args, out_dir, env) -> dict:
    """A process setting: torchrun starts one rank per GPU (one on CPU) running this program with
    --worker; rank 0 writes its row to a file, read back here."""
    nproc = max(gpus, 1)
    row_file = out_dir / f".bench_row_{name}_{gpus}.json"
    row_file.unlink(missing_ok=True)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "--max-restarts=0", __file__, "--worker", name, "--worker-row", str(row_file), "--mix", args.mix,
        "--shape", args.shape, "--gpus", str(gpus), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--profile", args.profile, "--batch", str(args.batch),
    ]  # fmt: skip
    if args.attention:
        command += ["--attention", args.attention]
    for setting in args.sets:
        command += ["--set", setting]
    began = time.perf_counter()
    result = subprocess.run(command, check=False, env=env)
    if result.returncode != 0 or not row_file.exists():
        raise RuntimeError(f"setting {name}: torchrun exited {result.returncode} without a row")
    row = json.loads(row_file.read_text())
    row_file.unlink()
    row["process_wall_s"] = time.perf_counter() - began
    return row


def worker(name: str, shape: Shape, args, out_dir: Path, row_file: Path) -> int:
    """One rank of a process setting (started by run_process through torchrun)."""
    from trainer.parallel.process import ProcessTopology, ProcessWorld

    rank_began = time.perf_counter()
    devices = [torch.device(f"cuda:{i}") for i in range(args.gpus)] or [torch.device("cpu")]
    cfg = setting_config(name, shape, devices, args)
    world = ProcessWorld(devices, cfg.parallel.step_timeout_s)

    def log(line: str) -> None:
        if world.is_lead:
            print(f"  [{name}] {line}", flush=True)

    try:
        device = world.device
        if device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
        target = build_target(shape, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        synchronize([device])
        built_s = time.perf_counter() - rank_began
        log(f"{world.world_size} rank(s) ({world.backend}); target built {built_s:.1f}s after rank start")
        started = time.perf_counter()
        torch.manual_seed(0)
        layer_ids = target_layer_ids(shape.layers, shape.context_layers)
        with bench_patches(name):  # for the whole row, as in the threaded rows
            replica = Replica(cfg, device, target, layer_ids, mask_id=shape.vocab - 1, rank=world.rank)
            topology = ProcessTopology(replica, world, log)
            global_batch = shape.batch * world.world_size
            row = measure(name, shape, topology, [device], global_batch, started, log, args, out_dir)
        peaks = world.gather(row["peak_gib"])
        row["peak_gib"] = max(peaks)
        if device.type == "cpu":
            row["gpus"] = 0
        whole = started - rank_began + row["first_step_s"]
        log(f"rank start (interpreter, imports, target, process group) to first step: {whole:.1f}s")
        if world.is_lead:
            row_file.write_text(json.dumps(row))
        return 0
    finally:
        world.close()


def profile_steps(topology, batch, devices, trace_path: Path) -> None:
    """Two profiled steps: the kernels' share of GPU time, and a trace to open in Perfetto."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if devices[0].type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(2):
            topology.step(*batch())
        synchronize(devices)
    sort = "cuda_time_total" if devices[0].type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=70), flush=True)
    try:
        prof.export_chrome_trace(str(trace_path))
        if devices[0].type == "cuda":
            from trace_gaps import summarise

            print(f"where the time went ({len(devices)} GPU(s), {trace_path.name}):", flush=True)
            print(summarise(trace_path, steps=2), flush=True)
    except Exception as error:  # a benchmark's figures stand without the trace
        print(f"trace not written or read: {error!r}", flush=True)


def format_row(r: dict) -> str:
    return (
        f"{r['setting']:40} {r['gpus']:>4} {r['step_s']:>8.3f} {r['tokens_per_s']:>9.0f} "
        f"{r['samples_per_s']:>9.2f} {r['tflops']:>8.1f} {r['mfu']:>6.1%} {r['useful_mfu']:>6.1%} "
        f"{r['of_790']:>6.1%} {r['padding_share']:>5.0%} {r['valid_anchor_share']:>7.0%} "
        f"{r['peak_gib']:>8.1f} {r['first_step_s']:>10.1f}"
    )


def print_lengths(rows: list[dict]) -> None:
    """Time for one epoch of the chat mix, packed against padded, at the same anchor blocks per
    conversation: the padded epoch trains some number of valid blocks; packed rows train the same
    number in that count / (valid blocks per second)."""
    padded = {(r["setting"].rsplit(" ", 1)[0], r["gpus"]): r for r in rows if r["mix"] == "chat-padded"}
    for r in rows:
        base = padded.get((r["setting"].rsplit(" ", 1)[0], r["gpus"]))
        if r["mix"].startswith("chat-packed") and base:
            ratio = base["valid_blocks_per_s"] / r["valid_blocks_per_s"]
            print(
                f"{r['setting']} ({r['anchors']} anchors a row): an epoch of the chat mix takes {ratio:.2f}x "
                f"the padded one at the same anchor blocks per conversation (goal: at most 0.7x); real tok/s "
                f"{r['tokens_per_s']:.0f} "
                f"vs {base['tokens_per_s']:.0f}; useful MFU {r['useful_mfu']:.1%} vs {base['useful_mfu']:.1%}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument(
        "--gpus", default="1", help="threaded workers or torchrun ranks: a count (0: CPU) or counts, e.g. 1,2"
    )
    parser.add_argument(
        "--cold", action="store_true", help="every row in a fresh process, empty compile caches"
    )
    parser.add_argument(
        "--settings", default=",".join(DEFAULT_SETTINGS), help=f"comma-separated: {', '.join(SETTINGS)}"
    )
    parser.add_argument("--steps", type=int, default=10, help="timed steps per setting")
    parser.add_argument(
        "--batch", default="0", help="rows per GPU per step, or counts such as 1,4 (0: the shape's own)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps after the first")
    parser.add_argument("--attention", choices=["auto", "sdpa", "flex"], default="", help="override")
    parser.add_argument("--profile", default="", help="profile two steps of this setting")
    parser.add_argument(
        "--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
        help="a trainer setting for every setting (after its own), e.g. compile.mode=none",
    )  # fmt: skip
    parser.add_argument(
        "--lengths", default="full",
        help="length mixes, comma-separated: full (every row one seq_len conversation), chat (a "
        "long-tailed mix, run padded and packed side by side; see Batches)",
    )  # fmt: skip
    parser.add_argument("--json", default="", help="write the rows here (rewritten after each setting)")
    parser.add_argument("--mix", default="full", help=argparse.SUPPRESS)  # a torchrun rank's mix
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)  # a torchrun rank (run_process)
    parser.add_argument("--worker-row", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()

    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    unknown = [s for s in settings + ([args.worker] if args.worker else []) if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {unknown}; known: {', '.join(SETTINGS)}")
    try:
        gpu_counts = [int(g) for g in str(args.gpus).split(",") if g.strip()]
    except ValueError:
        parser.error(f"--gpus takes counts separated by commas (0: CPU), got {args.gpus!r}")
    if not gpu_counts or min(gpu_counts) < 0 or (0 in gpu_counts and len(gpu_counts) > 1):
        parser.error(f"--gpus must be 0 (CPU) or GPU counts such as 1,2, got {args.gpus!r}")
    if max(gpu_counts) > 0 and torch.cuda.device_count() < max(gpu_counts):
        parser.error(f"--gpus {args.gpus}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    try:
        batches = [int(b) for b in str(args.batch).split(",") if b.strip()]
    except ValueError:
        parser.error(f"--batch takes row counts separated by commas, got {args.batch!r}")
    if not batches or min(batches) < 0:
        parser.error(f"--batch takes row counts such as 1,4 (0: the shape's own), got {args.batch!r}")
    shape = SHAPES[args.shape]
    if args.worker and batches[0]:
        shape = dataclasses.replace(shape, batch=batches[0])
    out_dir = Path(os.environ.get("OUT", ".")).resolve()
    if args.worker:
        args.gpus = gpu_counts[0]
        return worker(args.worker, mix_shape(args.mix, shape), args, out_dir, Path(args.worker_row))

    print(f"shape {args.shape}: {shape}", flush=True)
    print(f"torch {torch.__version__}, {torch.cuda.device_count()} CUDA device(s)", flush=True)
    targets = []
    if not args.cold and any(SETTINGS[name][0] not in PROCESS_PROFILES for name in settings):
        began = time.perf_counter()
        targets = [build_target(shape, device, dtype_of(device)) for device in devices_for(max(gpu_counts))]
        synchronize(devices_for(max(gpu_counts)))
        print(f"targets built in {time.perf_counter() - began:.1f}s", flush=True)

    mixes = []
    for mix in (m.strip() for m in args.lengths.split(",") if m.strip()):
        if mix not in ("full", "chat", *CHAT_MIXES):
            parser.error(f"--lengths takes full and chat, got {mix!r}")
        mixes += list(CHAT_MIXES) if mix == "chat" else [mix]
    rows = []
    runs = ((g, b, n, m) for g in gpu_counts for b in batches for n in settings for m in mixes)
    for gpus, args.batch, name, args.mix in runs:
        if args.mix:  # every row
            shape = dataclasses.replace(SHAPES[args.shape], batch=args.batch or SHAPES[args.shape].batch)
            print(
                f"setting {name} ({args.mix}) on {gpus or 'CPU'} {'GPU(s)' if gpus else ''} ...", flush=True
            )
            if args.cold:
                rows.append(run_isolated(name, gpus, args, out_dir))
            elif SETTINGS[name][0] in PROCESS_PROFILES:
                rows.append(run_process(name, mix_shape(args.mix, shape), gpus, args, out_dir, os.environ))
            else:
                devices = devices_for(gpus)
                row_shape = mix_shape(args.mix, shape)
                rows.append(run_threaded(name, row_shape, devices, targets[: len(devices)], args, out_dir))
            if len(batches) > 1:
                rows[-1]["setting"] += f" batch {shape.batch}"
            print("  " + format_row(rows[-1]), flush=True)
            if args.json:  # after every row: a run cut short keeps the rows it finished
                Path(args.json).write_text(json.dumps({"shape": args.shape, "rows": rows}, indent=1))

    header = (
        f"{'setting':40} {'gpus':>4} {'step s':>8} {'tok/s':>9} {'samples/s':>9} {'TFLOP/s':>8} "
        f"{'MFU':>6} {'useful':>6} {'of 790':>6} {'pad':>5} {'anchors':>7} {'peak GiB':>8} {'1st step s':>10}"
    )
    print("\n" + header)
    for r in rows:
        print(format_row(r))
    print_lengths(rows)
    if len(gpu_counts) > 1:
        print_scaling(rows, gpu_counts)
    return 0


def devices_for(gpus: int) -> list[torch.device]:
    return [torch.device(f"cuda:{i}") for i in range(gpus)] if gpus else [torch.device("cpu")]


def dtype_of(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        return torch.bfloat16
    return torch.float32


def cold_environment(out_dir: Path, label: str) -> dict[str, str]:
    """This environment with new, empty Inductor and Triton caches (a cold compile)."""
    caches = Path(tempfile.mkdtemp(prefix=f"bench_cache_{label}_", dir=out_dir))
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(caches / "inductor")
    env["TRITON_CACHE_DIR"] = str(caches / "triton")
    return env


def run_isolated(name: str, gpus: int, args, out_dir: Path) -> dict:
    """One row in a fresh process with empty compile caches; its row comes back through a file."""
    env = cold_environment(out_dir, f"{name}_{gpus}")
    if SETTINGS[name][0] in PROCESS_PROFILES:
        return run_process(name, SHAPES[args.shape], gpus, args, out_dir, env)
    row_file = out_dir / f".bench_row_{name}_{gpus}.json"
    command = [
        sys.executable, __file__, "--shape", args.shape, "--gpus", str(gpus), "--settings", name,
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--profile", args.profile,
        "--json", str(row_file), "--batch", str(args.batch), "--lengths", args.mix,
    ]  # fmt: skip
    if args.attention:
        command += ["--attention", args.attention]
    for setting in args.sets:
        command += ["--set", setting]
    result = subprocess.run(command, check=False, env=env)
    if result.returncode != 0 or not row_file.exists():
        raise RuntimeError(f"setting {name} on {gpus} GPU(s) exited {result.returncode} without a row")
    row = json.loads(row_file.read_text())["rows"][0]
    row_file.unlink()
    return row


def print_scaling(rows: list[dict], gpu_counts: list[int]) -> None:
    """Each setting at every GPU count against the same setting at the first count."""
    base_count = gpu_counts[0]
    print(f"\nscaling against {base_count} GPU(s), same sequences per GPU per step:")
    columns = f"{'tok/s':>9} {'x tok/s':>8} {'per GPU':>8} {'1st step s':>10} {'x 1st':>6}"
    print(f"{'setting':28} {'gpus':>4} {columns}")
    base = {r["setting"]: r for r in rows if r["gpus"] == base_count}
    for r in rows:
        b = base.get(r["setting"])
        if b is None:
            continue
        speedup = r["tokens_per_s"] / b["tokens_per_s"]
        print(
            f"{r['setting']:28} {r['gpus']:>4} {r['tokens_per_s']:>9.0f} {speedup:>7.3f}x "
            f"{speedup * base_count / max(r['gpus'], 1):>7.1%} {r['first_step_s']:>10.1f} "
            f"{r['first_step_s'] / b['first_step_s']:>5.2f}x"
        )


if __name__ == "__main__":
    raise SystemExit(main())
