"""A target of a real layout with random weights, and a synthetic chat set in its vocabulary: what
runs the recipe on a machine without the real weights (python -m trainer.data.embedded)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trainer.data.embedded import TARGET_SHAPES, build_sized, main

pytestmark = pytest.mark.unit


def test_target_and_tokenizer_share_one_vocabulary_and_the_chat_is_long_tailed(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    target, data = build_sized(tmp_path, "qwen3-tiny", 3000, "cpu", log=lambda _: None)
    config = AutoConfig.from_pretrained(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert len(tokenizer) == config.vocab_size == TARGET_SHAPES["qwen3-tiny"]["vocab_size"]
    assert tokenizer.mask_token_id is not None and tokenizer.eos_token_id is not None
    conversations = [json.loads(line)["messages"] for line in data.read_text().splitlines()]
    assert len(conversations) == 3000
    first = conversations[0][0]["content"]
    assert len(tokenizer.encode(first, add_special_tokens=False)) == len(first.split()), "a word is a token"
    answers = np.array([len(m[1]["content"].split()) for m in conversations])
    assert np.median(answers) < answers.mean() < np.percentile(answers, 95) / 2, "a long tail"
    assert any(len(m) == 4 for m in conversations), "some have a second exchange"


def test_a_second_build_keeps_what_is_there_and_bad_values_are_refused(tmp_path, capsys):
    assert main(["--shape", "qwen3-tiny", "--out", str(tmp_path), "--conversations", "10"]) == 0
    before = (tmp_path / "chat.jsonl").read_bytes()
    assert main(["--shape", "qwen3-tiny", "--out", str(tmp_path), "--conversations", "10"]) == 0
    assert "exists; kept" in capsys.readouterr().out and (tmp_path / "chat.jsonl").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.jsonl", "target"], "no leftovers"
    assert main(["--shape", "qwen3-tiny", "--out", str(tmp_path), "--conversations", "-1"]) == 2
    assert "--conversations must not be negative" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--shape", "qwen3-9000b", "--out", str(tmp_path)])
