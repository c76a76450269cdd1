"""One replica of the training state on one device: target, drafter, compiled objective, optimizer.

Independent of how workers are started: the threaded topology drives one Replica per worker thread;
the process topology (torchrun) drives one per rank, its objective wrapped in DDP, through the same
methods.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import Config
from ..model.drafter import DFlashDrafter, DrafterObjective, DrafterShape
from ..model.objective import build_blocks, sample_anchors
from ..model.target import FeatureReader, attend_with, shared_parts

if TYPE_CHECKING:
    from .sharding import OptimizerShard


@dataclass
class StepResult:
    loss_sum: torch.Tensor
    """On the replica's device: reading it waits for the step, so callers read it only to log."""
    weight_sum: float
    tokens: int


class StepLoss:
    """A step's mean loss over the global batch, read from the device(s) only when asked: reading
    it waits for the step, and the threaded topology's workers queue the next step before that."""

    def __init__(self, loss_sums: list[torch.Tensor], weight_sum: float):
        self.loss_sums = loss_sums
        self.weight_sum = weight_sum

    def __float__(self) -> float:
        return sum(float(loss) for loss in self.loss_sums) / max(self.weight_sum, 1e-12)


def lr_lambda(total_steps: int, warmup_frac: float):
    """Linear warmup over warmup_frac of the steps, then cosine decay to zero."""
    warmup = max(1, round(total_steps * warmup_frac)) if warmup_frac > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def clip_gradients(
    optimizer: torch.optim.Optimizer, params, norm: torch.Tensor, max_norm: float, divisor: float = 1.0
) -> None:
    """Scale the gradients by min(1, max_norm / (norm + 1e-6)), as clip_grad_norm_ does; `norm` is
    that of the gradients divided by `divisor`, which a fused update divides them by too. A fused
    AdamW takes the whole factor as its grad_scale (it divides each gradient by it as it reads it),
    which saves a pass over every gradient for each: ~2 ms a step each for the 1B parameters of a
    Qwen3-8B drafter. Unfused, the gradients must already be divided (divisor 1)."""
    if optimizer.defaults.get("fused"):
        optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0) * divisor
    else:
        assert divisor == 1.0, "an unfused update takes gradients already divided"
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


def scale_gradients(params: list[torch.nn.Parameter], scale: float) -> None:
    for param in params:
        if param.grad is not None:
            param.grad.mul_(scale)


def resolve_attention(choice: str, device: torch.device, compile_mode: str) -> str:
    """flex_attention only pays compiled on CUDA (eager, it materialises every score); else SDPA."""
    if choice != "auto":
        return choice
    return "flex" if device.type == "cuda" and compile_mode != "none" else "sdpa"


def warm_up_positions(rows: int, length: int, packed: bool) -> torch.Tensor:
    """The warm-up batch's position ids: rows laid out as the run's. Packed rows hold several
    conversations, and the attention then takes another path than in a row of one: transformers
    finds the packing from position ids that restart and builds another mask (flex attention: its
    own kernel), so a warm-up on rows of one conversation left the first step of every start to
    compile that path. Here each packed row holds two."""
    if not packed:
        return torch.arange(length).expand(rows, length)
    second = length // 2
    return torch.cat([torch.arange(length - second), torch.arange(second)]).expand(rows, length)


class Replica:
    def __init__(
        self,
        cfg: Config,
        device: torch.device,
        target,
        layer_ids: list[int],
        mask_id: int,
        rank: int,
        copy_of: Replica | None = None,
        weights: dict | None = None,
    ):
        self.cfg = cfg
        self.device = device
        self.target = target
        self.layer_ids = layer_ids
        self.features = FeatureReader(target, layer_ids)
        """The target's forward up to the last layer the drafter reads (compiled by compile())."""
        self.read_features = self.features
        self.mask_id = mask_id
        self.rank = rank
        shape = DrafterShape.from_target(target.config, cfg.drafter.num_layers, len(layer_ids))
        if copy_of is None and weights is None:
            # Drawn on the device itself: on the CPU the ~1B parameters of an 8B target's drafter
            # took about 16 s to draw (each nn.Linear's own initialisation, then ours) and move.
            with torch.device(device):
                self.drafter = DFlashDrafter(shape, shared_parts(target))
        else:
            # Another worker's replica (the first one's weights) or a resumed run's (the
            # checkpoint's): no random initialisation, the weights are copied in.
            with torch.device("meta"):
                drafter = DFlashDrafter(shape, shared_parts(target), initialize=False)
            self.drafter = drafter.to_empty(device=device)
            self.drafter.load_state_dict(copy_of.drafter.state_dict() if copy_of is not None else weights)
        self.attention = resolve_attention(cfg.drafter.attention, device, cfg.compile.mode)
        self.objective = DrafterObjective(self.drafter, self.attention, cfg.drafter.loss_chunk)
        self.module: torch.nn.Module = self.objective
        """What the step calls: the objective, or a wrapper around it (DDP in the process topology)."""
        self.forward = self.module
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.shard: OptimizerShard | None = None
        """The slices this replica updates when the optimizer is sharded (threaded topology)."""
        self._build_optimizer(self.params)
        # Per-worker anchor sampling stream; its state is saved in every checkpoint.
        self.anchor_generator = torch.Generator().manual_seed(cfg.train.seed * 1000 + rank + 1)
        self.autocast_dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else None
        self.grad_buffer: torch.Tensor | None = None
        """One flat tensor the gradients are views of (threaded exchange): zeroed, never dropped."""

    def _build_optimizer(self, params: list[torch.nn.Parameter]) -> None:
        # fused: one kernel for the whole update on CUDA (the foreach default takes ~8% of a step
        # at the Qwen3-8B shape); CPU keeps the default implementation.
        self.optimizer = torch.optim.AdamW(
            params,
            lr=self.cfg.train.lr,
            weight_decay=self.cfg.train.weight_decay,
            betas=(0.9, 0.95),
            fused=self.device.type == "cuda",
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(self.cfg.train.steps, self.cfg.train.warmup_frac)
        )

    def use_shard(self, shard: OptimizerShard) -> None:
        """Update only this shard of the parameters: a new optimizer and schedule over its slices
        (before any step; the unsharded state is empty then)."""
        self.shard = shard
        self._build_optimizer(shard.params)

    def wrap(self, wrapper: Callable[[torch.nn.Module], torch.nn.Module]) -> None:
        """Put a wrapper around the objective (DDP in the process topology); before compile()."""
        self.module = wrapper(self.objective)
        self.forward = self.module

    def compile(self) -> None:
        """Wrap the objective (or its wrapper) with torch.compile per the config (none: no-op)."""
        c = self.cfg.compile
        if c.mode == "none":
            return
        settings = {"dynamic": c.dynamic, "fullgraph": c.fullgraph, "options": c.inductor_options()}
        t = self.cfg.train
        attend_with(self.target, c.target_attention_of(self.device.type, t.seq_len, t.packing))
        if c.compiles_target(self.device.type):
            target_options = {**settings["options"], "triton.cudagraphs": False}
            if c.scope == "layers":
                self.features.compile_layers(dynamic=c.dynamic, options=target_options)
            else:
                self.read_features = torch.compile(self.features, dynamic=c.dynamic, options=target_options)
        if c.scope == "objective":
            self.forward = torch.compile(self.module, **settings)
            return
        # Regional compilation: every layer runs the same code, so Dynamo compiles it once (per
        # device) and the other layers reuse it; the loss compiles one chunk, reused per chunk.
        # Whatever wraps the objective (DDP) stays eager around the compiled layers.
        for layer in self.drafter.layers:
            layer.compile(**settings)
        self.objective.loss_chunk_fn = torch.compile(self.objective.loss_chunk_fn, **settings)
        self.forward = self.module

    def warm_up(self) -> None:
        """One forward/backward on a batch of the real shapes and layout (compiles now), leaving no
        trace."""
        t = self.cfg.train
        ids = torch.zeros(t.batch_size, t.seq_len, dtype=torch.long)
        mask = torch.ones_like(ids)
        positions = warm_up_positions(t.batch_size, t.seq_len, t.packing)
        self.compute(ids, mask, torch.Generator().manual_seed(0), position_ids=positions)
        for param in self.params:
            param.grad = None

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def compute(
        self,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        generator: torch.Generator | None = None,
        loss_scale: Callable[[float], float] | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> StepResult:
        """Forward and backward of the weighted loss sum on this shard; gradients accumulate.

        position_ids: each token's position in its conversation (restarting at 0 with every
        conversation of a packed row); None: one conversation per row.

        loss_scale, given this shard's weight sum before the forward, returns the factor the loss
        is multiplied by before backward (the process topology all-reduces the weight sums there
        and returns 1: its DDP hook applies 1 / global weight sum to the summed gradients).
        """
        d = self.cfg.drafter
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        generator = generator or self.anchor_generator
        anchors, valid = sample_anchors(loss_mask, d.num_anchors, generator, position_ids)
        blocks = build_blocks(
            input_ids, loss_mask, anchors, valid, d.block_size, self.mask_id, d.gamma, position_ids
        )
        weight_sum = float(blocks.weights.sum())
        scale = 1.0 if loss_scale is None else loss_scale(weight_sum)
        blocks = blocks.to(self.device)
        # Packed rows: the position ids tell the target where each conversation starts. Padded
        # rows keep the plain causal path (passing even 0..L-1 costs 2.7x on the CPU, measured).
        target_positions = blocks.context_positions if self.cfg.train.packing else None
        with torch.no_grad():
            features = self.read_features(input_ids.to(self.device), target_positions)
        if self.shard is not None:
            # Here, not before the target's forward: the gather of the last update overlaps it.
            self.shard.wait_for_parameters()
        if self.cfg.compile.uses_cudagraphs:
            # A new step: outputs of the previous replay may be overwritten from here on.
            torch.compiler.cudagraph_mark_step_begin()
        with self._autocast():
            loss_sum = self.forward(
                # Under autocast the drafter's fc reads them in its dtype: a float32 copy first would
                # be written, then read to be cast back (the same values, two passes on the device).
                features.to(self.autocast_dtype or self.drafter.fc.weight.dtype),
                blocks.block_ids,
                blocks.block_positions,
                blocks.anchors,
                blocks.labels,
                blocks.weights,
                blocks.anchor_starts,
                blocks.context_positions,
            )
        (loss_sum * scale if scale != 1.0 else loss_sum).backward()
        return StepResult(loss_sum.detach(), weight_sum, input_ids.numel())

    def apply_update(self, weight_sum: float | None = None) -> torch.Tensor:
        """Clip, step the optimizer and the schedule, clear gradients. Returns the gradient norm as
        a tensor: reading it waits for the device, so the caller reads it only when it needs it.
        Sharded: the norm is the global one, and the update is shared with the other replicas.

        weight_sum: the gradients are still those of the loss sum (one worker, nothing exchanged)
        and the update is that of the sum divided by it: within a fused AdamW's grad_scale, else
        by a pass over the gradients first."""
        max_norm = self.cfg.train.grad_clip or float("inf")
        divisor = 1.0 if weight_sum is None else max(weight_sum, 1e-12)
        if divisor != 1.0 and not self.optimizer.defaults.get("fused"):
            scale_gradients(self.params, 1.0 / divisor)
            divisor = 1.0
        if self.shard is None:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        else:
            norm = self.shard.global_norm()
        if divisor != 1.0:
            norm = norm / divisor
        params = self.shard.params if self.shard else self.params
        clip_gradients(self.optimizer, params, norm, max_norm, divisor)
        self.optimizer.step()
        self.scheduler.step()
        if self.grad_buffer is not None:
            self.grad_buffer.zero_()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        if self.shard is not None:
            self.shard.share_update()
        return norm.detach()
