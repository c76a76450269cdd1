"""The DFlash drafter: a few Qwen3-style decoder layers over [fused target context | block].

- Context: hidden states of K target layers (spread evenly between layer 1 and n_target-3),
  concatenated, then Linear(K*H -> H, no bias) and RMSNorm.
- Every layer: queries from the block only; keys/values from [context | block]; the attention mask
  (objective.block_attention_mask) makes it non-causal inside a block and keeps blocks apart.
- The token embedding and LM head are the target's, shared and frozen (not part of the drafter's
  parameters or checkpoints).

The module is device-agnostic; attention goes through the single function ``attend`` so a later
backend (flex_attention, a prebuilt SDPA mask) changes one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DrafterShape:
    """Sizes of the drafter, taken from the target's config (hidden size, heads, head dim, ...)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_layers: int
    num_context_layers: int
    rms_eps: float
    rope_theta: float

    @classmethod
    def from_target(cls, target_config, num_layers: int, num_context_layers: int) -> DrafterShape:
        text = getattr(target_config, "text_config", None) or target_config
        heads = text.num_attention_heads
        rope_theta = getattr(text, "rope_theta", None)
        if rope_theta is None:
            rope_params = getattr(text, "rope_parameters", None) or {}
            rope_theta = rope_params.get("rope_theta", 1_000_000.0)
        return cls(
            hidden_size=text.hidden_size,
            num_heads=heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            intermediate_size=text.intermediate_size,
            num_layers=num_layers,
            num_context_layers=num_context_layers,
            rms_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
        )


def target_layer_ids(num_target_layers: int, num_context_layers: int) -> list[int]:
    """Target layers whose outputs form the context: evenly spread from 1 to n-3 (inclusive).

    Qwen3-8B (36 layers, 5 context layers): [1, 9, 17, 25, 33].
    """
    first, last = 1, num_target_layers - 3
    if last < first or num_context_layers > last - first + 1:
        raise ValueError(
            f"a target with {num_target_layers} layers has layers {first}..{last} to spread "
            f"{num_context_layers} context layers over; lower drafter.num_context_layers"
        )
    if num_context_layers == 1:
        return [first]
    step = (last - first) / (num_context_layers - 1)
    return [round(first + i * step) for i in range(num_context_layers)]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, return the input's dtype: under bf16 autocast the float32 weight
        # would otherwise promote every activation after a norm back to float32.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x).to(dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [..., head_dim] for integer positions [...] (rotate-half convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [b, heads, n, d]; cos/sin: [b, n, d]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed) -> torch.Tensor:
    """Masked attention. q: [b, h, Q, d]; k/v: [b, kv_h, K, d].

    `allowed` is a dense [b, Q, K] bool mask (SDPA) or a flex_attention BlockMask (objective.
    flex_block_mask), which skips the tiles the mask rules out. GQA: each group of h/kv_h query
    heads shares one key/value head.
    """
    if not isinstance(allowed, torch.Tensor):
        from torch.nn.attention.flex_attention import flex_attention

        dtype = v.dtype
        return flex_attention(
            q.to(dtype), k.to(dtype), v, block_mask=allowed, enable_gqa=q.shape[1] != k.shape[1]
        )
    groups = q.shape[1] // k.shape[1]
    if q.is_cuda and groups > 1:
        # With a mask, CUDA's memory-efficient SDPA kernel takes no enable_gqa: expand K/V instead
        # of falling back to the math kernel, which would materialise every score.
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        groups = 1
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=groups > 1)


class DrafterAttention(nn.Module):
    def __init__(self, shape: DrafterShape):
        super().__init__()
        self.shape = shape
        h, d = shape.hidden_size, shape.head_dim
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, shape.rms_eps)
        self.k_norm = RMSNorm(d, shape.rms_eps)

    def forward(
        self,
        block: torch.Tensor,  # [b, Q, H] normed block hidden states
        context: torch.Tensor,  # [b, L, H] fused target context
        rope_q: tuple[torch.Tensor, torch.Tensor],
        rope_kv: tuple[torch.Tensor, torch.Tensor],
        allowed: torch.Tensor,
    ) -> torch.Tensor:
        b, q_len, _ = block.shape
        d = self.shape.head_dim
        kv_input = torch.cat([context, block], dim=1)
        q = self.q_norm(self.q_proj(block).view(b, q_len, -1, d)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_input).view(b, kv_input.shape[1], -1, d)).transpose(1, 2)
        v = self.v_proj(kv_input).view(b, kv_input.shape[1], -1, d).transpose(1, 2)
        q = apply_rotary(q, *rope_q)
        k = apply_rotary(k, *rope_kv)
        out = attend(q, k, v, allowed)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, shape: DrafterShape):
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_eps)
        self.self_attn = DrafterAttention(shape)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_eps)
        self.mlp = SwiGLU(shape.hidden_size, shape.intermediate_size)

    def forward(self, hidden, context, rope_q, rope_kv, allowed):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), context, rope_q, rope_kv, allowed)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class SharedTargetParts:
    """The target's embedding and LM head, used by the drafter but frozen and not its parameters.

    Held outside nn.Module registration so they stay out of the drafter's state_dict and optimizer.
    """

    def __init__(self, embed: nn.Module, lm_head: nn.Module):
        self.embed = embed
        self.lm_head = lm_head


class DFlashDrafter(nn.Module):
    def __init__(self, shape: DrafterShape, shared: SharedTargetParts | None, initialize: bool = True):
        """initialize=False: no random weights (for weights loaded next, or only the names and
        shapes on the meta device; drawing them there still imports Dynamo, 1.5 s on a CPU)."""
        super().__init__()
        self.shape = shape
        self.shared = shared
        h = shape.hidden_size
        self.fc = nn.Linear(shape.num_context_layers * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, shape.rms_eps)
        self.layers = nn.ModuleList(DrafterLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(h, shape.rms_eps)
        if initialize:
            self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def rotary(
        self, block_positions: torch.Tensor, context_len: int, context_positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, ...]:
        """RoPE tables (q_cos, q_sin, kv_cos, kv_sin): block queries at anchor+k, keys/values at
        the context positions (each token's position in its conversation; None: 0..context_len-1)
        then the block positions. Computed outside the compiled region: they need no gradient,
        and trigonometry fused into every q/k kernel multiplies compile work."""
        b = block_positions.shape[0]
        if context_positions is None:
            ctx_positions = torch.arange(context_len, device=block_positions.device).expand(b, context_len)
        else:
            ctx_positions = context_positions.to(block_positions.device)
        q_cos, q_sin = rotary_cos_sin(block_positions, self.shape.head_dim, self.shape.rope_theta)
        kv_cos, kv_sin = rotary_cos_sin(
            torch.cat([ctx_positions, block_positions], dim=1), self.shape.head_dim, self.shape.rope_theta
        )
        return q_cos, q_sin, kv_cos, kv_sin

    def hidden(
        self,
        target_features: torch.Tensor,  # [b, L, K*H] concatenated target hidden states
        block_ids: torch.Tensor,  # [b, Q]
        block_positions: torch.Tensor,  # [b, Q]
        allowed: torch.Tensor,  # [b, Q, L+Q]
        context_positions: torch.Tensor | None = None,  # [b, L] positions in their conversations
    ) -> torch.Tensor:
        """Final-normed hidden states of the block positions, [b, Q, H]."""
        rope = self.rotary(block_positions, target_features.shape[1], context_positions)
        return self.hidden_with_rotary(target_features, block_ids, *rope, allowed)

    def hidden_with_rotary(self, target_features, block_ids, q_cos, q_sin, kv_cos, kv_sin, allowed):
        context = self.hidden_norm(self.fc(target_features))
        hidden = self.shared.embed(block_ids).to(context.dtype)  # the "noise embedding"
        for layer in self.layers:
            hidden = layer(hidden, context, (q_cos, q_sin), (kv_cos, kv_sin), allowed)
        return self.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # The shared head has the target's dtype (bf16 on GPUs); the drafter may be float32.
        return self.shared.lm_head(hidden.to(self.shared.lm_head.weight.dtype))


class FrozenHeadCrossEntropy(torch.autograd.Function):
    """Weighted cross-entropy sum through a frozen LM head, a chunk of positions at a time.

    The head is frozen, so the only gradient needed is the one of the hidden states:
    d/dh = (w * (softmax(h W^T) - onehot(label))) W. Each chunk's logits are made, turned into that
    gradient and dropped in the forward pass, so at most chunk x vocab logits exist at once (at a
    151936-token vocabulary and 8192 positions, the full float32 logits would be 5 GB, and their
    gradient as much again), and backward only scales the stored gradient. Labels equal to -100
    carry no loss.
    """

    @staticmethod
    def forward(ctx, hidden, head_weight, labels, weights, chunk: int, chunk_fn=None):
        chunk_fn = chunk_fn or loss_and_grad_of_chunk
        total = None
        grad_hidden = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            loss, grad = chunk_fn(hidden[part], head_weight, labels[part], weights[part])
            total = loss if total is None else total + loss
            grad_hidden[part] = grad
        ctx.save_for_backward(grad_hidden)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        (grad_hidden,) = ctx.saved_tensors
        return grad_hidden * grad_total.to(grad_hidden.dtype), None, None, None, None, None


def loss_and_grad_of_chunk(hidden, head_weight, labels, weights):
    """Weighted CE sum of one chunk of positions and its gradient with respect to `hidden`."""
    accumulate = torch.promote_types(head_weight.dtype, torch.float32)  # float32 at least
    weight = weights.to(accumulate) * (labels != -100)
    target = labels.clamp(min=0)
    # Written so that compiled, no float32 logits or gradient of them is ever stored (each would be
    # 1.2 GB a chunk of 2048 at a 151936-token vocabulary, written and read back): the logits stay
    # in the head's dtype (bf16 on GPUs), each reader widens them itself, and the label's -w is
    # subtracted where it falls rather than scattered into a stored gradient (the same arithmetic).
    logits = hidden.to(head_weight.dtype) @ head_weight.t()
    wide = logits.to(accumulate)
    log_norm = torch.logsumexp(wide, dim=-1)
    picked = logits.gather(1, target[:, None]).squeeze(1).to(accumulate)
    loss = ((log_norm - picked) * weight).sum()
    grad_logits = torch.exp(wide - log_norm[:, None]) * weight[:, None]
    is_label = torch.arange(logits.shape[1], device=logits.device)[None, :] == target[:, None]
    grad_logits = torch.where(is_label, grad_logits - weight[:, None], grad_logits)
    grad = (grad_logits.to(head_weight.dtype) @ head_weight).to(hidden.dtype)
    return loss, grad


def frozen_head_cross_entropy(
    hidden, head: nn.Module, labels, weights, chunk: int, chunk_fn=None
) -> torch.Tensor:
    """sum_i weights_i * CE(head(hidden_i), labels_i) over flattened positions (chunked, see above).

    A head with a bias or a trainable weight takes the plain path.
    """
    if getattr(head, "bias", None) is not None or head.weight.requires_grad:
        logits = head(hidden).float()
        per_token = F.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
        return (per_token * weights).sum()
    return FrozenHeadCrossEntropy.apply(hidden, head.weight, labels, weights, chunk, chunk_fn)


class DrafterObjective(nn.Module):
    """Training forward: weighted cross-entropy summed over supervised block positions.

    Returns the weighted loss *sum*; the coordinator divides by the global weight sum, so the
    result is exact whatever the split of the batch over workers. The attention mask is built here
    from the anchors, on their device: dense for SDPA, or a BlockMask for flex_attention.
    """

    def __init__(self, drafter: DFlashDrafter, attention: str = "sdpa", loss_chunk: int = 2048):
        super().__init__()
        self.drafter = drafter
        self.attention = attention
        self.loss_chunk = loss_chunk
        self.loss_chunk_fn = loss_and_grad_of_chunk  # replaced by its compiled form (regional compile)
        self.flex_mask = None  # one FlexBlockMask per shape, kept across steps (see its docstring)

    def forward(
        self, target_features, block_ids, block_positions, anchors, labels, weights,
        anchor_starts=None, context_positions=None,
    ):  # fmt: skip
        """anchor_starts and context_positions (objective.Blocks) keep each block inside its own
        conversation in a packed row; None: one conversation per row."""
        from .objective import FlexBlockMask, block_attention_mask

        context_len, block_size = target_features.shape[1], block_ids.shape[1] // anchors.shape[1]
        if self.attention == "flex":
            if self.flex_mask is None or (self.flex_mask.context_len, self.flex_mask.block_size) != (
                context_len,
                block_size,
            ):
                self.flex_mask = FlexBlockMask(context_len, block_size)
            allowed = self.flex_mask(anchors, anchor_starts)
        else:
            allowed = block_attention_mask(anchors, context_len, block_size, anchor_starts)
        hidden = self.drafter.hidden(target_features, block_ids, block_positions, allowed, context_positions)
        return frozen_head_cross_entropy(
            hidden.flatten(0, 1),
            self.drafter.shared.lm_head,
            labels.flatten(),
            weights.flatten(),
            self.loss_chunk,
            self.loss_chunk_fn,
        )
