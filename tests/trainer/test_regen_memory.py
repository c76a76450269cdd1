"""The regeneration's batches sized to the GPU's free memory at the Qwen3-8B shape, with made-up
free-memory figures: the KV cache and the prefill's peak counted, data.regen_batch_tokens a cap,
and a card where the target leaves too little room refused in one line naming the figures."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.trainer.test_regen import settings
from trainer.data.chat import DataError
from trainer.data.embedded import TARGET_SHAPES
from trainer.data.regen import (
    GIB,
    MEMORY_MARGIN,
    MEMORY_RESERVE,
    kv_cache_bytes,
    logits_row_bytes,
    memory_tokens,
    prefill_peak_bytes,
    rows_per_batch,
    static_batches,
)

pytestmark = pytest.mark.unit

BF16 = torch.bfloat16
# What the Qwen3-8B target leaves free on a card: its weights (8.19 B parameters, 2 or 4 bytes each)
# and the CUDA context (about 0.5 GiB) out of what the card offers.
PARAMETERS = 8_190_000_000
TARGET_AND_CONTEXT = PARAMETERS * BF16.itemsize + GIB // 2
H100_80GB = 79.6 * GIB
CT200_96GB = 94.5 * GIB


@pytest.fixture(scope="module")
def config():
    from transformers import Qwen3Config

    return Qwen3Config(**TARGET_SHAPES["qwen3-8b"])


def defaults(**changes):
    """The recipe's regeneration settings (data.regen_* defaults; widths from 128 on flex attention)."""
    recipe = {"batch_size": 512, "batch_tokens": 262_144, "max_new_tokens": 64, "min_width": 128}
    return settings(**{**recipe, **changes})


def peak(config, rows: int, width: int, new: int, dtype=BF16) -> int:
    return kv_cache_bytes(config, rows, width + new, dtype) + prefill_peak_bytes(config, rows, width, dtype)


def test_the_8b_shape_s_kv_cache_and_prefill_add_up_as_its_tensors_do(config):
    # 36 layers x 8 KV heads x 128 dims x keys and values x 2 bytes.
    assert kv_cache_bytes(config, 1, 1, BF16) == 147_456
    assert kv_cache_bytes(config, 128, 1088, BF16) == 128 * 1088 * 147_456  # ~19.1 GiB
    # A prompt token: the MLP's gate, activation and up (3 x 12,288 x 2 bytes) and the residual
    # stream's and a norm's copies (4,096 x (4 x 2 + 2 x 4)); the last position's logits only.
    assert prefill_peak_bytes(config, 1, 1, BF16) == 3 * 12_288 * 2 + 4096 * 16 + 151_936 * 8
    grown = prefill_peak_bytes(config, 128, 1024, BF16) - prefill_peak_bytes(config, 128, 512, BF16)
    assert grown == 128 * 512 * (3 * 12_288 * 2 + 4096 * 16)  # linear in prompt tokens, no vocabulary term


@pytest.mark.parametrize(
    ("card", "dtype"),
    [(H100_80GB, BF16), (CT200_96GB, BF16), (H100_80GB, torch.float32), (CT200_96GB, torch.float32)],
    ids=["h100-80gb-bf16", "ct200-96gb-bf16", "h100-80gb-float32", "ct200-96gb-float32"],
)
def test_every_batch_of_the_defaults_fits_the_card_with_its_prefill(config, card, dtype):
    free = int(card - PARAMETERS * dtype.itemsize - GIB // 2)
    limit = memory_tokens(config, dtype, free, defaults(), widest=4096)
    sized = dataclasses.replace(defaults(), memory_tokens=limit)
    held_back = free * MEMORY_MARGIN + MEMORY_RESERVE
    for width in (128, 256, 512, 1024, 2048, 4096):
        rows = rows_per_batch(width, sized)
        assert rows * (width + 64) <= min(limit, 262_144)
        assert peak(config, rows, width, 64, dtype) + held_back <= free, (width, rows)
    # A long-tailed set's batches: every one within the card.
    prompts = [[7] * n for n in (100, 130, 300, 700, 1000, 1000, 2000, 4000)] * 64
    for width, chunk in static_batches(prompts, sized):
        assert peak(config, len(chunk), width, 64, dtype) + held_back <= free


def test_the_batches_that_ran_out_of_memory_on_an_80_gb_card_are_no_longer_planned(config):
    """128 prompts of 1,024 tokens, sized by data.regen_batch_tokens alone, need more than an H100
    80 GB holds beside a float32 target (the config's default model.dtype); sized to the card, that
    batch and the one of 512 prompts of 128 tokens are halved, and leave the margin free."""
    free = int(H100_80GB - PARAMETERS * 4 - GIB // 2)
    f32 = torch.float32
    assert rows_per_batch(1024, defaults()) == 128 and rows_per_batch(128, defaults()) == 512
    assert peak(config, 128, 1024, 64, f32) > free
    sized = dataclasses.replace(defaults(), memory_tokens=memory_tokens(config, f32, free, defaults(), 4096))
    assert rows_per_batch(1024, sized) == 64 and rows_per_batch(128, sized) == 256
    held_back = free * MEMORY_MARGIN + MEMORY_RESERVE
    assert peak(config, 64, 1024, 64, f32) + held_back < free
    assert peak(config, 256, 128, 64, f32) + held_back < free


def test_the_user_cap_stays_where_the_card_holds_more(config):
    free = int(CT200_96GB - TARGET_AND_CONTEXT)
    small_cap = defaults(batch_tokens=32_768)
    sized = dataclasses.replace(small_cap, memory_tokens=memory_tokens(config, BF16, free, small_cap, 4096))
    assert sized.memory_tokens > 32_768 and sized.token_limit == 32_768
    assert rows_per_batch(1024, sized) == 16  # 16 x 1,088 within 32,768


def test_a_smaller_card_gets_smaller_batches(config):
    limits = [
        memory_tokens(config, BF16, int(card - TARGET_AND_CONTEXT), defaults(), 4096)
        for card in (CT200_96GB, H100_80GB, 40 * GIB)
    ]
    assert limits[0] > limits[1] > limits[2] > 0
    rows = [rows_per_batch(1024, dataclasses.replace(defaults(), memory_tokens=limit)) for limit in limits]
    assert rows[0] >= rows[1] >= rows[2] and rows[2] < 128


def test_a_card_the_target_leaves_little_room_on_is_refused_naming_the_figures_and_the_way_out(config):
    free = 3 * GIB  # another process holds the rest
    with pytest.raises(DataError) as refused:
        memory_tokens(config, BF16, free, defaults(), widest=4096, device="cuda:0")
    message = str(refused.value)
    assert message.startswith("cuda:0 has 3.0 GiB free with the target loaded: too little to regenerate one ")
    assert "prompt of 4,096 tokens and 64 new, which needs " in message
    need = (kv_cache_bytes(config, 1, 4160, BF16) + prefill_peak_bytes(config, 1, 4096, BF16)) / GIB
    assert f"needs {need:.2f} GiB" in message
    logits = 512 * logits_row_bytes(config)
    assert f"beside {(free * MEMORY_MARGIN + MEMORY_RESERVE + logits) / GIB:.1f} GiB held back" in message
    assert "Free the GPU of other processes (nvidia-smi lists them), lower data.regen_batch_size" in message
    assert message.endswith("or regenerate on a card with more memory; the finished shards are kept")


def test_a_gpu_s_batches_are_sized_to_its_free_memory_now_and_a_cpu_s_are_not(monkeypatch):
    """sized_to_device reads the device's free memory (made up here), the target's dtype and the
    shard's widest prompt; the out-of-memory line then names both limits."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from trainer.data import regen

    tiny = Qwen3ForCausalLM(Qwen3Config(**TARGET_SHAPES["qwen3-tiny"]))
    per_token = kv_cache_bytes(tiny.config, 1, 1, torch.float32) + regen.prefill_token_bytes(
        tiny.config, torch.float32
    )
    chosen = defaults(batch_size=8)
    monkeypatch.setattr(regen, "usable_bytes", lambda device: 3 * GIB)
    prompts = [[7] * 300, [7] * 20]
    sized = regen.sized_to_device(tiny, torch.device("cuda", 0), chosen, prompts)
    held_back = int(3 * GIB * MEMORY_MARGIN) + MEMORY_RESERVE + 8 * logits_row_bytes(tiny.config)
    assert sized.memory_tokens == (3 * GIB - held_back) // per_token
    assert regen.sized_to_device(tiny, torch.device("cpu"), chosen, prompts) == chosen
    line = regen.out_of_memory("cuda:0", 4, 512, dataclasses.replace(chosen, memory_tokens=20_000))
    assert (
        "data.regen_batch_tokens is 262,144, the device's free memory 20,000, data.regen_batch_size 8" in line
    )
    assert "Lower data.regen_batch_tokens (e.g. to 10,000)" in line
    monkeypatch.setattr(regen, "usable_bytes", lambda device: 2 * GIB)  # the reserve alone
    with pytest.raises(DataError, match=r"^cuda:0 has 2.0 GiB free .* one prompt of 512 tokens and 64 new"):
        regen.sized_to_device(tiny, torch.device("cuda", 0), chosen, prompts)
