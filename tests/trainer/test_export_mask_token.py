"""The export reads the mask token id from the tokenizer's files; it must be the id the trainer's
tokenizer gives (trainer.model.target.load_tokenizer), or None where the files do not say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from trainer.export import mask_token_id_in_files
from trainer.model.target import load_tokenizer

pytestmark = pytest.mark.unit  # quick: no playbook run, no training run (./dev.sh fast)

VOCAB = {"<unk>": 0, "a": 1, "b": 2, "[MASK]": 3}


def write_tokenizer(directory: Path, mask_token, added: list[str], config_extra: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(added)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", **(config_extra or {})}
    if mask_token is not None:
        config["mask_token"] = mask_token
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@pytest.mark.parametrize(
    ("mask_token", "added"),
    [
        ("<|mask|>", ["<|mask|>"]),  # an added special token (as the embedded target's)
        ({"__type": "AddedToken", "content": "<|mask|>"}, ["<|extra|>", "<|mask|>"]),  # written as an object
        ("[MASK]", []),  # a token of the vocabulary itself
        (None, []),  # no mask token at all: None both ways
    ],
)
def test_the_mask_token_id_read_from_the_files_is_the_tokenizers(tmp_path, mask_token, added):
    directory = write_tokenizer(tmp_path / "tokenizer", mask_token, added)
    assert mask_token_id_in_files(directory) == load_tokenizer(directory).mask_token_id


def test_files_that_do_not_say_leave_it_to_the_tokenizer(tmp_path):
    missing = tmp_path / "nothing"
    missing.mkdir()
    assert mask_token_id_in_files(missing) is None
    unknown = write_tokenizer(tmp_path / "unknown", "<|not-there|>", [])
    assert mask_token_id_in_files(unknown) is None
    broken = write_tokenizer(tmp_path / "broken", "<|mask|>", [])
    (broken / "tokenizer.json").write_text("{not json", encoding="utf-8")
    assert mask_token_id_in_files(broken) is None
