"""The embedded default: a tiny Qwen3 target, a tiny tokenizer and a small chat data set.

Built on first use under the cache directory (atomically: a temporary directory renamed into
place), then loaded back through the same code path as a real target. Nothing is downloaded.
The target is randomly initialised: the trainer regenerates the data with it, so the drafter
learns to imitate whatever this target answers, which is what DFlash training does at any size.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

EMBEDDED_VERSION = "v1"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<unk>"]
WORDS = [
    "count",
    "from",
    "to",
    "repeat",
    "reverse",
    "add",
    "plus",
    "is",
    "the",
    "sum",
    "of",
    "and",
    "then",
    "please",
    "list",
    "letters",
    "numbers",
    "say",
    "again",
    "twice",
    "after",
    "before",
    "next",
    "previous",
    "hello",
    "thanks",
    "ok",
    "done",
]
LETTERS = list("abcdefghijklmnopqrstuvwxyz")
TARGET_SIZE = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "initializer_range": 0.02,
}
CONVERSATIONS = 600
LM_HEAD_SCALE = 25.0


def embedded_dir(cache_dir: str | Path) -> Path:
    return Path(cache_dir).expanduser() / f"embedded-{EMBEDDED_VERSION}"


def _vocabulary() -> list[str]:
    return SPECIAL_TOKENS + ["user", "assistant", "system"] + WORDS + LETTERS + [str(n) for n in range(200)]


def _conversation(rng: random.Random) -> dict:
    task = rng.choice(["count", "repeat", "reverse", "add", "letters"])
    if task == "count":
        start = rng.randrange(0, 150)
        end = start + rng.randrange(4, 20)
        prompt, answer = f"count from {start} to {end}", " ".join(str(n) for n in range(start, end + 1))
    elif task == "repeat":
        items = rng.choices(LETTERS, k=rng.randrange(3, 8))
        prompt, answer = "repeat " + " ".join(items) + " twice", " ".join(items + items)
    elif task == "reverse":
        items = rng.choices(LETTERS, k=rng.randrange(3, 9))
        prompt, answer = "reverse " + " ".join(items), " ".join(reversed(items))
    elif task == "add":
        a, b = rng.randrange(0, 100), rng.randrange(0, 100)
        prompt, answer = f"add {a} and {b}", f"the sum of {a} and {b} is {a + b}"
    else:
        start = rng.randrange(0, 18)
        prompt = f"list letters from {LETTERS[start]}"
        answer = " ".join(LETTERS[start : start + rng.randrange(4, 9)])
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


def _build_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(_vocabulary())}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        mask_token="<|mask|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.save_pretrained(str(directory))


def _build_target(directory: Path, vocab_size: int, eos_id: int, pad_id: int) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
        **TARGET_SIZE,
    )
    # A fixed seed, independent of the training seed: the same embedded target everywhere.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(20261129)
        model = Qwen3ForCausalLM(config)
        # A trained LM's head gives confident logits; a 0.02-scale random head gives near-uniform
        # ones, and the drafter (which shares the frozen head) could then barely express a choice.
        # Scaling the head does not change any argmax, so the target's greedy answers stay the same.
        with torch.no_grad():
            model.lm_head.weight.mul_(LM_HEAD_SCALE)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    # Not model.save_pretrained: under torch.distributed it writes only on global rank 0, and in a
    # multi-host run the first rank of every other host builds its own host's cache.
    from safetensors.torch import save_file

    # What save_pretrained records about the weights, so the files are the same as before.
    model.config.architectures = [type(model).__name__]
    model.config.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    model.config.save_pretrained(str(directory))
    model.generation_config.save_pretrained(str(directory))
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _write_data(path: Path) -> None:
    rng = random.Random(7)
    with path.open("w") as handle:
        for _ in range(CONVERSATIONS):
            handle.write(json.dumps(_conversation(rng)) + "\n")


def ensure_embedded(cache_dir: str | Path) -> tuple[Path, Path]:
    """Build (once) and return (target directory, data file) of the embedded default."""
    root = embedded_dir(cache_dir)
    target, data = root / "target", root / "chat.jsonl"
    if target.joinpath("config.json").exists() and data.exists():
        return target, data
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".embedded-", dir=root.parent))
    try:
        (staging / "target").mkdir()
        _build_tokenizer(staging / "target")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(staging / "target"), local_files_only=True)
        _build_target(staging / "target", len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
        _write_data(staging / "chat.jsonl")
        if root.exists():  # a concurrent builder won, or a half-built leftover of an old version
            shutil.rmtree(staging)
            if target.joinpath("config.json").exists() and data.exists():
                return target, data
            raise RuntimeError(f"{root} exists but is incomplete; remove it to rebuild the embedded default")
        os.replace(staging, root)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target, data
