"""The target-attention benchmark's harness on CPU: its kernels agree, and its conversation
bookkeeping (segments, useful FLOPs) is right. Figures come from GPU runs (docs/PERFORMANCE.md)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.target_attention import segment_ids, useful_flops  # noqa: E402
from bench.trainer_bench import SHAPES  # noqa: E402


@pytest.mark.unit
def test_segments_give_the_padding_its_own_conversation_and_flops_count_each_alone():
    segments = segment_ids([[3, 2], [5]], seq_len=6)
    assert torch.equal(segments, torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 1]]))
    shape = SHAPES["tiny"]
    assert useful_flops(shape, [[3, 2], [5]]) == 2 * shape.heads * shape.head_dim * (9 + 4 + 25)


@pytest.mark.slow
def test_flex_and_the_trainers_causal_attention_agree_on_full_rows():
    result = subprocess.run(
        [sys.executable, "bench/target_attention.py", "--shape", "tiny", "--kernels", "flex,product",
         "--rows", "full,packed", "--repeats", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    product = re.search(r"^product .* max \|diff\| (\S+)$", result.stdout, re.MULTILINE)
    assert product, result.stdout
    assert float(product.group(1)) < 1e-5, "float32 on the CPU: the same attention within rounding"
    assert "product              (full rows only)" in result.stdout, "packed rows are not causal rows"
