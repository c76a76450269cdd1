"""One replica of the training state on one device: target, drafter, compiled objective, optimizer.

Independent of how workers are started: the threaded topology drives one Replica per worker thread;
the process topology (torchrun) will drive one per process through the same methods.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from .config import Config
from .model import DFlashDrafter, DrafterObjective, DrafterShape
from .objective import build_blocks, sample_anchors
from .target import shared_parts, target_features


@dataclass
class StepResult:
    loss_sum: float
    weight_sum: float
    tokens: int


def lr_lambda(total_steps: int, warmup_frac: float):
    """Linear warmup over warmup_frac of the steps, then cosine decay to zero."""
    warmup = max(1, round(total_steps * warmup_frac)) if warmup_frac > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


class Replica:
    def __init__(
        self, cfg: Config, device: torch.device, target, layer_ids: list[int], mask_id: int, rank: int
    ):
        self.cfg = cfg
        self.device = device
        self.target = target
        self.layer_ids = layer_ids
        self.mask_id = mask_id
        self.rank = rank
        shape = DrafterShape.from_target(target.config, cfg.drafter.num_layers, len(layer_ids))
        self.drafter = DFlashDrafter(shape, shared_parts(target)).to(device)
        self.objective = DrafterObjective(self.drafter)
        self.forward = self.objective
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=(0.9, 0.95)
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(cfg.train.steps, cfg.train.warmup_frac)
        )
        # Per-worker anchor sampling stream; its state is saved in every checkpoint.
        self.anchor_generator = torch.Generator().manual_seed(cfg.train.seed * 1000 + rank + 1)
        self.autocast_dtype = torch.bfloat16 if cfg.model.dtype == "bfloat16" else None

    def compile(self) -> None:
        """Wrap the objective with torch.compile per the config (a no-op for mode none)."""
        c = self.cfg.compile
        if c.mode == "none":
            return
        self.forward = torch.compile(
            self.objective, dynamic=c.dynamic, fullgraph=c.fullgraph, options=c.inductor_options()
        )

    def warm_up(self) -> None:
        """One forward/backward on a batch of the real shapes (compiles now), leaving no trace."""
        t = self.cfg.train
        ids = torch.zeros(t.batch_size, t.seq_len, dtype=torch.long)
        mask = torch.ones_like(ids)
        self.compute(ids, mask, torch.Generator().manual_seed(0))
        self.optimizer.zero_grad(set_to_none=True)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def compute(
        self, input_ids: torch.Tensor, loss_mask: torch.Tensor, generator: torch.Generator | None = None
    ) -> StepResult:
        """Forward and backward of the weighted loss sum on this shard; gradients accumulate."""
        d = self.cfg.drafter
        anchors, valid = sample_anchors(loss_mask, d.num_anchors, generator or self.anchor_generator)
        blocks = build_blocks(input_ids, loss_mask, anchors, valid, d.block_size, self.mask_id, d.gamma)
        blocks = blocks.to(self.device)
        features = target_features(self.target, input_ids.to(self.device), self.layer_ids)
        with self._autocast():
            loss_sum = self.forward(
                features.to(self.drafter.fc.weight.dtype),
                blocks.block_ids,
                self.drafter.rotary(blocks.block_positions, input_ids.shape[1]),
                blocks.attention_mask,
                blocks.labels,
                blocks.weights,
            )
        loss_sum.backward()
        return StepResult(float(loss_sum.detach()), float(blocks.weights.sum()), input_ids.numel())

    def apply_update(self) -> float:
        """Clip, step the optimizer and the schedule, clear gradients. Returns the gradient norm."""
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.grad_clip or float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)
