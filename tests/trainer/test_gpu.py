"""GPU paths: compiled flex_attention objective against the eager dense one, in a worker thread."""

import threading

import pytest
import torch

from trainer.model.drafter import DFlashDrafter, DrafterObjective, DrafterShape, SharedTargetParts
from trainer.model.objective import build_blocks, sample_anchors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present"),
]


def _objective(attention: str) -> DrafterObjective:
    torch.manual_seed(0)
    vocab, hidden = 512, 128
    shape = DrafterShape(hidden, 4, 2, 32, 256, 2, 2, 1e-6, 1e6)
    shared = SharedTargetParts(
        torch.nn.Embedding(vocab, hidden).cuda().requires_grad_(False),
        torch.nn.Linear(hidden, vocab, bias=False).cuda().requires_grad_(False),
    )
    return DrafterObjective(DFlashDrafter(shape, shared).cuda(), attention, loss_chunk=100)


def test_compiled_flex_objective_matches_eager_sdpa_in_a_worker_thread():
    seq_len, anchors_per_row = 256, 16
    ids = torch.randint(0, 500, (2, seq_len))
    anchors, valid = sample_anchors(torch.ones_like(ids), anchors_per_row, torch.Generator().manual_seed(0))
    blocks = build_blocks(ids, torch.ones_like(ids), anchors, valid, 16, 511, 7.0).to("cuda")
    features = torch.randn(2, seq_len, 2 * 128, device="cuda")
    inputs = (
        features,
        blocks.block_ids,
        blocks.block_positions,
        blocks.anchors,
        blocks.labels,
        blocks.weights,
    )

    reference = _objective("sdpa")
    expected = reference(*inputs)
    expected.backward()

    flex = _objective("flex")
    compiled = torch.compile(flex, dynamic=False)
    result: dict = {}

    def worker():  # the threaded topology compiles and runs in a plain worker thread
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = compiled(*inputs)
            loss.backward()
            result["loss"] = loss.detach()
        except BaseException as exc:  # reported below with its traceback
            result["error"] = exc

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(600)
    assert not thread.is_alive(), "compiled step did not finish"
    if "error" in result:
        raise result["error"]
    assert torch.allclose(result["loss"].float(), expected.float(), rtol=2e-2)
    for mine, theirs in zip(flex.parameters(), reference.parameters(), strict=True):
        relative = (mine.grad - theirs.grad).norm() / theirs.grad.norm()
        assert relative < 5e-2, f"gradient differs by {relative:.3g}"


def test_regional_compile_does_not_recompile_across_steps():
    from torch._dynamo.utils import counters

    objective = _objective("flex")
    for layer in objective.drafter.layers:
        layer.compile(dynamic=False)
    objective.loss_chunk_fn = torch.compile(objective.loss_chunk_fn, dynamic=False)
    graphs_after = []
    for step in range(3):  # new anchors (and a new BlockMask) every step, same shapes
        ids = torch.randint(0, 500, (2, 256))
        anchors, valid = sample_anchors(torch.ones_like(ids), 16, torch.Generator().manual_seed(step))
        blocks = build_blocks(ids, torch.ones_like(ids), anchors, valid, 16, 511, 7.0).to("cuda")
        features = torch.randn(2, 256, 2 * 128, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = objective(
                features,
                blocks.block_ids,
                blocks.block_positions,
                blocks.anchors,
                blocks.labels,
                blocks.weights,
            )
        loss.backward()
        graphs_after.append(counters["stats"]["unique_graphs"])
    assert graphs_after[0] > 0
    assert graphs_after[2] == graphs_after[0], f"recompiled: unique graphs per step {graphs_after}"


def test_compiled_target_features_with_flex_equal_sdpa_in_packed_rows():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.model.target import FeatureReader

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, attn_implementation="sdpa",
    )  # fmt: skip
    target = Qwen3ForCausalLM(config).cuda().eval()
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    # Row 0 one conversation; row 1 three packed ones (positions restart at 0).
    positions = torch.stack([torch.arange(256), torch.cat([torch.arange(n) for n in (100, 60, 96)])]).cuda()
    with torch.no_grad():
        expected = FeatureReader(target, [1, 2])(ids, positions)
        target.set_attn_implementation("flex_attention")
        compiled = torch.compile(FeatureReader(target, [1, 2]), dynamic=False)
        features = compiled(ids, positions)
    assert torch.allclose(features, expected, atol=1e-4, rtol=1e-4), (features - expected).abs().max()


def test_compiled_target_features_with_causal_attention_equal_its_own_in_bfloat16():
    """Rows of one conversation each: cuDNN's causal kernel (no mask) reads the features the
    target's own SDPA does, within bfloat16 rounding."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.model.target import FeatureReader, attend_with

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, attn_implementation="sdpa",
    )  # fmt: skip
    target = Qwen3ForCausalLM(config).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 512, (2, 256), device="cuda")
    with torch.no_grad():
        expected = FeatureReader(target, [1, 2])(ids).float()
        attend_with(target, "causal")
        compiled = torch.compile(FeatureReader(target, [1, 2]), dynamic=False)
        features = compiled(ids).float()
    assert torch.allclose(features, expected, atol=0.05, rtol=0.02), (features - expected).abs().max()
