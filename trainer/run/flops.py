"""The model FLOPs of a training step, and the utilisation they make of the GPUs (the progress
line's `mfu`, the metrics row's `tflops_per_gpu` and `mfu`).

Useful work only: the target's forward over conversations' tokens (its linear layers per token,
its attention within each conversation), and the drafter's forward and backward over the anchors
that hold a real block; padding, anchor slots left empty and attention across packed
conversations do not count. bench/trainer_bench.py counts with the same formulas, so its "useful
MFU" and the product's are one figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Dense bfloat16 peaks from the vendors' spec sheets, by a name in torch.cuda.get_device_name.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


@dataclass(frozen=True)
class FlopShape:
    """The sizes the count needs: the target's (the drafter's layers have the same), the layers of
    the target a step runs (up to the last one the drafter reads), and the training shape."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    target_layers_run: int
    drafter_layers: int
    context_layers: int
    block: int
    anchors: int
    seq_len: int

    @classmethod
    def of(cls, target_config, layer_ids: list[int], drafter, seq_len: int) -> FlopShape:
        """From the target's config, the target layers the drafter reads, and the drafter config."""
        text = getattr(target_config, "text_config", None) or target_config
        heads = text.num_attention_heads
        return cls(
            hidden=text.hidden_size, heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate=text.intermediate_size, vocab=text.vocab_size,
            target_layers_run=max(layer_ids) + 1, drafter_layers=drafter.num_layers,
            context_layers=len(layer_ids), block=drafter.block_size, anchors=drafter.num_anchors,
            seq_len=seq_len,
        )  # fmt: skip

    def per_row(self, mean_visible_keys: float) -> dict[str, float]:
        """One full row: the target's forward (every slot, causal attention over the row), the
        drafter's forward and backward with every anchor filled, each anchor's block seeing
        `mean_visible_keys` keys; and the target's linear FLOPs per token."""
        t, q = self.seq_len, self.anchors * self.block
        attention_width, kv_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h = self.hidden
        layer_params = 2 * h * attention_width + 2 * h * kv_width + 3 * h * self.intermediate
        target_params = self.target_layers_run * layer_params
        target = 2 * t * target_params + 2 * self.target_layers_run * attention_width * t * t
        fused_context = 4 * t * self.context_layers * self.hidden * self.hidden
        per_layer = (
            6 * q * (2 * self.hidden * attention_width + 3 * self.hidden * self.intermediate)
            + 6 * (t + q) * 2 * self.hidden * kv_width
            + 12 * attention_width * q * mean_visible_keys
        )
        head = 4 * self.anchors * (self.block - 1) * self.vocab * self.hidden
        drafter = fused_context + self.drafter_layers * per_layer + head
        return {"target": target, "drafter": drafter, "target_linear_per_token": 2 * target_params}

    def useful(self, real_tokens: int, squared_lengths: int, valid_anchors: int) -> float:
        """A batch's useful FLOPs: its conversations' tokens (squared_lengths: the sum of each
        conversation's length squared, for the attention) and its anchors with a real block."""
        row = self.per_row(self.mean_visible_keys())
        attention = 2 * self.target_layers_run * self.heads * self.head_dim * squared_lengths
        drafter = row["drafter"] * valid_anchors / self.anchors
        return row["target_linear_per_token"] * real_tokens + attention + drafter

    def mean_visible_keys(self) -> float:
        """Sorted anchors drawn uniformly from a row's positions see on average half the row before
        them, and their own block."""
        return (self.seq_len - 1) / 2 + self.block


def squared_conversation_lengths(position_ids: torch.Tensor, real: torch.Tensor) -> int:
    """The sum over a batch's conversations of their length squared. A conversation starts where
    its position is 0 (packed rows restart at every conversation; a padded row holds one)."""
    starts = ((position_ids == 0) & real).flatten().to(torch.int64)
    conversation = starts.cumsum(0)[real.flatten()]  # each real token's conversation, 1 the first
    lengths = torch.bincount(conversation)
    return int((lengths.to(torch.int64) ** 2).sum())


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bfloat16 peak, or None where it is not known (a CPU, another GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)
