"""The fast paths against the plain ones: the chunked frozen-head loss and flex_attention's mask."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from trainer.model.drafter import attend, frozen_head_cross_entropy
from trainer.model.objective import IGNORE, block_attention_mask, flex_block_mask

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)


def test_chunked_frozen_head_loss_matches_plain_cross_entropy_and_its_gradient():
    torch.manual_seed(0)
    positions, hidden_size, vocab = 37, 16, 53
    head = torch.nn.Linear(hidden_size, vocab, bias=False).double().requires_grad_(False)
    labels = torch.randint(0, vocab, (positions,))
    labels[::5] = IGNORE
    weights = torch.rand(positions, dtype=torch.float64)
    hidden = torch.randn(positions, hidden_size, dtype=torch.float64, requires_grad=True)

    plain = (F.cross_entropy(head(hidden), labels, ignore_index=IGNORE, reduction="none") * weights).sum()
    (plain_grad,) = torch.autograd.grad(plain, hidden)

    fused_hidden = hidden.detach().clone().requires_grad_(True)
    fused = frozen_head_cross_entropy(fused_hidden, head, labels, weights, chunk=8)  # 5 chunks, last short
    (2.0 * fused).backward()  # an upstream factor must scale the stored gradient

    assert torch.allclose(fused, plain, rtol=1e-10)
    assert torch.allclose(fused_hidden.grad, 2.0 * plain_grad, rtol=1e-8, atol=1e-12)
    assert fused_hidden.grad[::5].abs().sum() == 0  # ignored positions get no gradient


def test_flex_block_mask_gives_the_same_attention_as_the_dense_mask():
    torch.manual_seed(0)
    batch, heads, kv_heads, head_dim, context_len, block_size = 2, 4, 2, 8, 40, 4
    anchors = torch.tensor([[3, 17, 30, 0], [5, 6, 38, 39]])  # row 0 ends with a padded anchor
    queries = anchors.shape[1] * block_size
    q = torch.randn(batch, heads, queries, head_dim)
    k = torch.randn(batch, kv_heads, context_len + queries, head_dim)
    v = torch.randn(batch, kv_heads, context_len + queries, head_dim)

    dense = attend(q, k, v, block_attention_mask(anchors, context_len, block_size))
    flex = attend(q, k, v, flex_block_mask(anchors, context_len, block_size))

    assert torch.allclose(flex, dense, atol=1e-5)


def test_drafter_logits_take_the_dtype_of_a_bf16_target_head():
    # On a GPU the target (and so the shared head) is bf16 while the drafter's weights are float32:
    # evaluation calls logits() outside autocast, so the drafter must hand the head its own dtype.
    from trainer.model.drafter import DFlashDrafter, DrafterShape, SharedTargetParts

    shape = DrafterShape(32, 4, 2, 8, 64, 1, 2, 1e-6, 1e4)
    shared = SharedTargetParts(
        torch.nn.Embedding(50, 32).to(torch.bfloat16), torch.nn.Linear(32, 50, bias=False).to(torch.bfloat16)
    )
    drafter = DFlashDrafter(shape, shared)
    logits = drafter.logits(torch.randn(1, 4, 32))
    assert logits.dtype == torch.bfloat16
    assert logits.shape == (1, 4, 50)


@pytest.mark.parametrize("max_norm", [0.05, 1e9])
def test_fused_adamw_clips_through_its_grad_scale_as_clip_grad_norm_does(max_norm):
    """The fused optimizer's clipping (the factor handed to AdamW as grad_scale) gives the update
    of clip_grad_norm_ then AdamW, clipped (max_norm 0.05) or not (1e9)."""
    from trainer.parallel.replica import clip_gradients

    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator) for shape in [(7, 5), (5,), (3, 7)]]
    grads = [torch.randn(p.shape, generator=generator) for p in start]

    def updated(fused: bool) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer = torch.optim.AdamW(params, lr=0.1, betas=(0.9, 0.95), fused=fused)
        for step in range(3):
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad * (step + 1)
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            if fused:
                clip_gradients(optimizer, params, norm, max_norm)
            else:
                torch.nn.utils.clip_grad_norm_(params, max_norm)
            optimizer.step()
        return [p.detach() for p in params]

    for fused, reference in zip(updated(True), updated(False), strict=True):
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.002, 1e9])
def test_one_workers_update_divides_by_the_weight_sum_within_the_fused_adamw(max_norm):
    """One worker hands the update the gradient of the loss sum and its weight: a fused AdamW
    divides by the weight within its grad_scale, an unfused one after a pass over the gradients;
    both give the update (and the norm) of gradients divided first, clipped, then AdamW. AdamW's
    eps is as large as the divided gradients, so that an update off by the weight would show (the
    update is nearly blind to a gradient's scale otherwise)."""
    from trainer.parallel.replica import Replica

    generator = torch.Generator().manual_seed(0)
    start = [torch.randn(shape, generator=generator) for shape in [(7, 5), (5,), (3, 7)]]
    grads = [torch.randn(p.shape, generator=generator) * 0.04 for p in start]
    weight_sum = 37.0

    def updated(fused: bool, divided_first: bool) -> tuple[list[torch.Tensor], list[float]]:
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer = torch.optim.AdamW(params, lr=0.1, betas=(0.9, 0.95), eps=1e-3, fused=fused)
        replica = SimpleNamespace(
            cfg=SimpleNamespace(train=SimpleNamespace(grad_clip=max_norm)), params=params, shard=None,
            optimizer=optimizer, scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
            grad_buffer=None,
        )  # fmt: skip
        norms = []
        for step in range(3):
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad * (step + 1) / (weight_sum if divided_first else 1.0)
            weight = None if divided_first else weight_sum
            norms.append(float(Replica.apply_update(replica, weight_sum=weight)))
        return [p.detach() for p in params], norms

    reference, reference_norms = updated(fused=False, divided_first=True)
    for fused in (True, False):
        params, norms = updated(fused=fused, divided_first=False)
        for param, expected in zip(params, reference, strict=True):
            torch.testing.assert_close(param, expected, rtol=1e-5, atol=1e-6)
        assert norms == pytest.approx(reference_norms, rel=1e-6)
    assert reference_norms[0] > 0.002  # large enough for max_norm 0.002 to clip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loss_chunk_subtracts_the_labels_weight_as_a_scatter_would_to_the_bit(dtype):
    """The chunk's gradient subtracts -w where the label falls instead of scattering it into a
    stored gradient: the same IEEE operations, so the same bits, in the head's dtype or float32."""
    from trainer.model.drafter import loss_and_grad_of_chunk

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 32, generator=generator).to(dtype)
    head = torch.randn(1000, 32, generator=generator).to(dtype)
    labels = torch.randint(0, 1000, (64,), generator=generator)
    labels[3] = IGNORE
    weights = torch.rand(64, generator=generator)

    accumulate = torch.promote_types(dtype, torch.float32)
    weight = weights.to(accumulate) * (labels != IGNORE)
    target = labels.clamp(min=0)
    logits = (hidden @ head.t()).to(accumulate)
    log_norm = torch.logsumexp(logits, dim=-1)
    loss = ((log_norm - logits.gather(1, target[:, None]).squeeze(1)) * weight).sum()
    scattered = (torch.exp(logits - log_norm[:, None]) * weight[:, None]).scatter_add(
        1, target[:, None], -weight[:, None]
    )
    grad = (scattered.to(dtype) @ head).to(dtype)

    chunk_loss, chunk_grad = loss_and_grad_of_chunk(hidden, head, labels, weights)
    assert torch.equal(chunk_loss, loss)
    assert torch.equal(chunk_grad, grad)
