"""The embedded default: a tiny Qwen3 target, a tiny tokenizer and a small chat data set; and the
same at a real size, for machines without a real target's weights.

Built on first use under the cache directory (atomically: a temporary directory renamed into
place), then loaded back through the same code path as a real target. Nothing is downloaded.
The target is randomly initialised: the trainer regenerates the data with it, so the drafter
learns to imitate whatever this target answers, which is what DFlash training does at any size.

    python -m trainer.data.embedded --shape qwen3-8b --out DIR [--conversations N] [--device cuda]

writes DIR/target, a Hugging Face directory of a Qwen3-8B-shaped causal LM with random weights and
a tokenizer whose vocabulary is the model's (151,936 tokens, one word each), and with
--conversations N, DIR/chat.jsonl: N synthetic conversations of long-tailed lengths in that
vocabulary. `model.target_path: DIR/target` and `data.train_file: DIR/chat.jsonl` in the machine
config then run the real recipe (trainer/runs/qwen3-8b.yml) on any machine with a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
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
# Real sizes with random weights (the published configs' shapes; vocab_size is also the tokenizer's).
TARGET_SHAPES = {
    "qwen3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "vocab_size": 151936,
    },
    # The same layout, small enough for a CPU (8 layers: enough for the recipe's 5 context layers):
    # what the tests build through the same code.
    "qwen3-tiny": {
        **TARGET_SIZE,
        "num_hidden_layers": 8,
        "max_position_embeddings": 8192,
        "vocab_size": 4096,
    },
}
# The synthetic chat mix: lognormal turn lengths in tokens (median, sigma), capped; a share of
# conversations has a second exchange. Regeneration replaces the assistant turns anyway; their
# lengths here only shape the data file.
USER_TOKENS = (96, 1.1, 4096)
ASSISTANT_TOKENS = (256, 1.0, 4096)
SECOND_EXCHANGE_SHARE = 0.2
LM_HEAD_SCALE = 25.0


def embedded_dir(cache_dir: str | Path) -> Path:
    return Path(cache_dir).expanduser() / f"embedded-{EMBEDDED_VERSION}"


def _vocabulary(size: int = 0) -> list[str]:
    """The embedded vocabulary, filled up to `size` tokens with made-up words (w0, w1, ...)."""
    words = SPECIAL_TOKENS + ["user", "assistant", "system"] + WORDS + LETTERS + [str(n) for n in range(200)]
    if size and size < len(words):
        raise ValueError(f"a vocabulary of {size} tokens cannot hold the {len(words)} embedded ones")
    return words + [f"w{n}" for n in range(max(0, size - len(words)))]


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


def _build_tokenizer(directory: Path, size: int = 0) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(_vocabulary(size))}
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


def build_random_target(directory: Path, shape: str, device: str = "cpu", seed: int = 20261203) -> None:
    """A Hugging Face directory: a Qwen3 causal LM of `shape` with random weights (bfloat16, built
    on `device`, saved in shards) and a word-level tokenizer with exactly the model's vocabulary."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    sizes = dict(TARGET_SHAPES[shape])
    vocab_size = sizes.pop("vocab_size")
    _build_tokenizer(directory, vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    config = Qwen3Config(
        vocab_size=vocab_size,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        **sizes,
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            if device.startswith("cuda"):
                torch.cuda.manual_seed(seed)
            model = Qwen3ForCausalLM(config)
            with torch.no_grad():  # confident logits, as for the tiny target (argmax unchanged)
                model.lm_head.weight.mul_(LM_HEAD_SCALE)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    # A standalone command, never under torch.distributed: save_pretrained's shards and index suit it.
    model.save_pretrained(str(directory), max_shard_size="4GB")


def write_chat(path: Path, conversations: int, vocab_size: int, seed: int = 0) -> None:
    """`conversations` lines of synthetic chat in the words of a `vocab_size` vocabulary (one word is
    one token): lognormal turn lengths (USER_TOKENS, ASSISTANT_TOKENS), some with a second exchange."""
    import numpy as np

    rng = np.random.default_rng(seed)
    skipped = len(SPECIAL_TOKENS) + 3  # special tokens and role names never appear as content
    words = np.array(_vocabulary(vocab_size)[skipped:])

    def lengths(spec: tuple[int, float, int], count: int) -> np.ndarray:
        median, sigma, cap = spec
        return np.clip(rng.lognormal(math.log(median), sigma, count), 1, cap).astype(np.int64)

    def text(count: int) -> str:
        return " ".join(words[rng.integers(0, len(words), count)])

    with path.open("w") as handle:
        for first in range(0, conversations, 4096):
            n = min(4096, conversations - first)
            user, answer = lengths(USER_TOKENS, n), lengths(ASSISTANT_TOKENS, n)
            second = rng.random(n) < SECOND_EXCHANGE_SHARE
            for i in range(n):
                turns = [(user[i], answer[i])]
                if second[i]:
                    turns.append((user[i] // 4 + 1, answer[i] // 2 + 1))
                messages = [
                    {"role": role, "content": text(count)}
                    for asked, answered in turns
                    for role, count in (("user", asked), ("assistant", answered))
                ]
                handle.write(json.dumps({"messages": messages}) + "\n")


def build_sized(
    out: Path, shape: str, conversations: int, device: str, log=print
) -> tuple[Path, Path | None]:
    """Build (once) DIR/target and, with conversations, DIR/chat.jsonl; each written under a temporary
    name and renamed into place, so an interrupted build leaves nothing that looks finished."""
    out.mkdir(parents=True, exist_ok=True)
    target, data = out / "target", out / "chat.jsonl"
    if target.joinpath("config.json").exists():
        log(f"target: {target} exists; kept")
    else:
        staging = Path(tempfile.mkdtemp(prefix=".target-", dir=out))
        try:
            started = time.monotonic()
            build_random_target(staging, shape, device)
            staging.chmod(0o755)  # mkdtemp's 0700 would keep other users of the machine out
            os.replace(staging, target)
            log(f"target: {shape} with random weights in {target} ({time.monotonic() - started:.0f} s)")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    if not conversations:
        return target, None
    if data.exists():
        log(f"data: {data} exists; kept")
        return target, data
    partial = out / f".chat.{os.getpid()}.partial"
    try:
        started = time.monotonic()
        write_chat(partial, conversations, TARGET_SHAPES[shape]["vocab_size"])
        os.replace(partial, data)
    finally:
        partial.unlink(missing_ok=True)
    log(f"data: {conversations:,} conversations in {data} ({time.monotonic() - started:.0f} s)")
    return target, data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.data.embedded",
        description="Build a target of a real shape with random weights (and a synthetic chat set), "
        "for machines without the real weights.",
    )
    parser.add_argument("--shape", required=True, choices=sorted(TARGET_SHAPES))
    parser.add_argument("--out", required=True, help="directory for target/ and chat.jsonl")
    parser.add_argument("--conversations", type=int, default=0, help="synthetic conversations to write")
    parser.add_argument("--device", default="cpu", help="where the weights are drawn (cuda is much faster)")
    args = parser.parse_args(argv)
    if args.conversations < 0:
        print(f"error: --conversations must not be negative, got {args.conversations}", file=sys.stderr)
        return 2
    try:
        build_sized(Path(args.out).expanduser(), args.shape, args.conversations, args.device)
    except OSError as exc:
        print(f"error: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
