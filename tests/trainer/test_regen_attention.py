"""The static engine's batching and its decoding attention: every prompt in exactly one batch
within the KV budget, few compiled shapes for a long-tailed data set, and a chosen decoding
attention giving plain greedy `generate`'s answers in float32 (flex attention on CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.trainer.test_regen import NEW_TOKENS, settings
from trainer.data.chat import ChatFormat
from trainer.data.regen import compiled_rows, rows_per_batch, static_batches, static_generate, widths_for
from trainer.model.target import load_target, load_tokenizer

pytestmark = pytest.mark.unit


def long_tailed_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[7] * max(1, min(4000, int(rng.lognormvariate(4.8, 0.9)))) for _ in range(count)]


def test_every_prompt_is_in_one_batch_within_the_kv_budget_and_few_shapes_compile():
    prompts = long_tailed_prompts(20_000)
    budget = settings(batch_size=256, batch_tokens=131_072, min_width=64, max_new_tokens=256)
    seen, shapes = [], set()
    for width, chunk in static_batches(prompts, budget):
        assert all(len(prompts[i]) <= width for i in chunk)
        rows = rows_per_batch(width, budget)
        assert len(chunk) <= rows <= budget.batch_size
        assert rows == 1 or rows * (width + budget.max_new_tokens) <= budget.batch_tokens
        filled = compiled_rows(len(chunk), width, budget)
        assert filled & (filled - 1) == 0 and len(chunk) <= filled <= rows
        shapes.add((filled, width))
        seen += chunk
    assert sorted(seen) == list(range(len(prompts)))
    widths = {width for _, width in shapes}
    assert widths == {64, 128, 256, 512, 1024, 2048, 4096}
    assert len(shapes) <= 2 * len(widths)  # a full batch and a last one per width at most


def test_flex_attention_prefills_at_least_128_tokens_and_other_attentions_any_width():
    prompts = long_tailed_prompts(2_000)
    narrow = settings(batch_size=256, batch_tokens=131_072, min_width=64, max_new_tokens=256)
    flex_widths = {width for width, _ in static_batches(prompts, widths_for(narrow, "flex_attention"))}
    assert min(flex_widths) == 128
    for attention in (None, "sdpa", "eager"):
        assert widths_for(narrow, attention) == narrow
        assert min(width for width, _ in static_batches(prompts, widths_for(narrow, attention))) == 64
    wide = settings(min_width=256)
    assert widths_for(wide, "flex_attention") == wide


def decode(target, chat, pad_id, prompts, attention=None):
    seen = []
    hook = target.register_forward_pre_hook(lambda *_: seen.append(target.config._attn_implementation))
    try:
        changes = {"attention": attention} if attention else {}
        answers = static_generate(
            target, prompts, settings(batch_size=4, **changes), chat, pad_id, lambda: False
        )
    finally:
        hook.remove()
    return answers, seen


def check_attention_gives_plain_answers(target, chat, pad_id, attention):
    prompts = [[chat.end_id + 5] * 6, list(range(100, 130)), list(range(200, 211))]
    plain, _ = decode(target, chat, pad_id, prompts)
    own = target.config._attn_implementation
    answers, seen = decode(target, chat, pad_id, prompts, attention)
    assert seen and set(seen) == {attention}
    assert target.config._attn_implementation == own
    assert answers == plain and all(len(answer) <= NEW_TOKENS for answer in answers)
    with torch.no_grad():
        reference = target.generate(
            input_ids=torch.tensor([prompts[1]], device=target.device), max_new_tokens=NEW_TOKENS,
            do_sample=False, eos_token_id=chat.end_id, pad_token_id=chat.end_id,
        )[0, len(prompts[1]) :].tolist()  # fmt: skip
    assert answers[1] == (
        reference[: reference.index(chat.end_id)] if chat.end_id in reference else reference
    )


def test_a_chosen_attention_decodes_and_the_target_keeps_its_own_after(embedded):
    """On CPU with eager attention (flex attention's CPU code generation fails to compile some of
    these shapes in this torch): the mechanism, and the same answers as plain greedy `generate`."""
    target_path, _ = embedded
    tokenizer = load_tokenizer(target_path)
    target = load_target(target_path, "cpu", "float32")
    check_attention_gives_plain_answers(target, ChatFormat(tokenizer), tokenizer.pad_token_id, "eager")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="flex attention's decode is checked on CUDA; no GPU here"
)
def test_flex_attention_decodes_plain_greedys_answers_in_float32_on_cuda(embedded):
    target_path, _ = embedded
    tokenizer = load_tokenizer(target_path)
    target = load_target(target_path, "cuda", "float32")
    check_attention_gives_plain_answers(
        target, ChatFormat(tokenizer), tokenizer.pad_token_id, "flex_attention"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decode step's CUDA graph needs CUDA; no GPU")
def test_the_compiled_step_s_cuda_graph_gives_every_batch_of_its_shape_the_uncompiled_answers(embedded):
    """On CUDA the whole compiled step is recorded once a shape as a CUDA graph of our own and
    replayed for every later step and batch of the shape: each batch (another of the same shape,
    another shape between, the first shape again) gets the uncompiled loop's answers, on flex
    attention as the regeneration decodes (widths from 128 there)."""
    from tests.trainer.test_regen import batches_of_two_shapes
    from trainer.data.decode import StaticDecoder
    from trainer.model.target import attention_of

    target_path, _ = embedded
    tokenizer = load_tokenizer(target_path)
    target = load_target(target_path, "cuda", "float32")
    tiny = (target, tokenizer, ChatFormat(tokenizer))
    with attention_of(target, "flex_attention"):
        uncompiled, compiled = StaticDecoder(target, compiled=False), StaticDecoder(target, compiled=True)
        graphs = []
        for ids, mask in batches_of_two_shapes(tiny, widths=(128, 256)):
            ids, mask = ids.cuda(), mask.cuda()
            expected = uncompiled.decode(ids, mask, 24, -1)
            assert torch.equal(compiled.decode(ids, mask, 24, -1), expected)
            graphs.append(compiled.steps.graph)
    assert all(graphs) and graphs[1] is graphs[0] and graphs[2] is not graphs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the step's kept traces on CUDA need a GPU; no GPU")
def test_a_warm_process_meeting_a_shape_its_compile_cache_lacks_decodes_it_with_the_uncompiled_answers():
    """The regeneration's decode step as a GPU compiles it (the whole step, flex attention, CUDA
    graphs of our own): a cold process keeps the traces of one shape in a compile cache; a fresh
    process over it meets that shape, a new one and the first again (the next data set, a resumed
    regeneration): it loads what the cache holds, compiles what it lacks, and every batch gets the
    uncompiled loop's answers."""
    import re
    import subprocess
    import sys

    from .conftest import REPO

    result = subprocess.run(
        [
            sys.executable, "bench/decode_compile_bench.py", "--layers", "2", "--shapes", "2x128",
            "--warm-shapes", "2x128,4x256,2x128", "--new-tokens", "8", "--attention", "flex_attention",
            "--scopes", "step", "--dynamic", "static",
        ],
        cwd=REPO, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    line = r"^step +static +(cold|warm) +(\dx\d+): first batch .* answers equal"
    equal = re.findall(line, result.stdout, re.MULTILINE)
    expected = [("cold", "2x128"), ("warm", "2x128"), ("warm", "4x256"), ("warm", "2x128")]
    assert equal == expected, result.stdout
    assert "1 compiled function(s) loaded with their traces" in result.stdout, result.stdout
